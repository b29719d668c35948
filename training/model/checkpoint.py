"""A fit's checkpoint: the state at the end of each stage, and within an exact L-BFGS stage
(the exact finish, an exact fit) after an iteration once ``fitting.CHECKPOINT_SECONDS`` have
passed since the last save, so that a killed fit resumes where it was.

A fit runs in stages (``training.model.fitting``). What the rest of the fit needs is written
to ``DIRECTORY/fit-rank{R}.npz`` (one file per process under torchrun), atomically (a
temporary file, fsynced, renamed over the last one):

    theta       float64 (P,)   the map the fit keeps so far (its parameters)
    torch_rng   uint8          torch's generator state after the stage
    meta        str (0-d)      JSON: the fingerprint, numpy's generator state, and the
                               fit's state but the map (``fitting.FitState``: the stages
                               done, their records, the history, the counts, K;
                               mid-stage, the stage's iteration, loss and checks)
    resume_*    float64        mid-stage only: the iterate (P,), its gradient (P,) and
                               L-BFGS's curvature pairs s, y (m, P)

A fit started with the same checkpoint directory reads it after its preparation: it skips
the stages done and goes on from the kept map with both generators as they were, or, in an
exact L-BFGS stage, from the saved iterate with L-BFGS's pairs and the stage's checks as
they were. So on the same machine it ends with the map an uninterrupted fit ends with (the
stages are deterministic: no rule of ``training.model.fitting`` but the budget reads the
clock). A stage on candidate sets interrupted half-way runs again from its start: its
sets and their search are not saved.

Each save first renames the last one to ``fit-rank{R}.previous.npz``. Under torchrun every
rank saves at the same iterations (rank 0's clock decides), so a rank killed between the
ranks' writes leaves the others one save ahead; a restarted world resumes from the newest
point every rank holds (``fitting.StagedFit._resume``), or starts over when there is none.

The fingerprint is a SHA-256 of the prepared training rows (standardised, float32), their
labels, the validation rows, the estimator's parameters (but those that only change what
is shown: ``DISPLAY_PARAMS``) and the package's version: a
checkpoint of other data or options is refused with a ValueError that says so, never
silently used.
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from dataclasses import asdict
from pathlib import Path

import numpy as np
import scipy.sparse as sparse
import torch

from training.model import sparse_input
from training.model.fitting import FitState, Snapshot, StageRecord, StageResume
from training.state_file import digest_array, read_state, write_npz_atomically, wrong_arrays

FORMAT = "nca-knn-fit-checkpoint/2"
# a mid-stage state's arrays (StageResume's theta, g, pairs_s, pairs_y), members of their own
RESUME_ARRAYS = ("resume_theta", "resume_g", "resume_pairs_s", "resume_pairs_y")
# parameters that change what a fit shows, not what it computes: a fit resumed in a terminal
# after one run into a log (or the other way round) is the same fit
DISPLAY_PARAMS = frozenset({"verbose", "progress", "callback"})


def fingerprint(X: np.ndarray, y: np.ndarray, X_val, y_val, params: dict, version: str) -> str:
    """SHA-256 of what decides a fit: the prepared rows X (N, D) and labels y (N,), the
    validation rows and labels (or None), the parameters (callables by their type, module and
    qualified name: two lambdas, or two instances of one class, look alike; the estimator
    adds its plan, ``training.model.plan.FitPlan.describe()``)."""
    digest = hashlib.sha256()
    for array in (X, y, X_val, y_val):
        if sparse.issparse(array):  # a sparse X: its shape, index arrays and values
            digest.update(b"csr")
            for part in sparse_input.fingerprint_parts(array):
                digest.update(np.ascontiguousarray(part).tobytes())
            continue
        digest_array(digest, array)
    described = {
        name: (_callable_name(value) if callable(value) else repr(value))
        for name, value in sorted(params.items())
        if name not in DISPLAY_PARAMS
    }
    digest.update(json.dumps(described, sort_keys=True).encode())
    digest.update(version.encode())
    return digest.hexdigest()


def _callable_name(value) -> str:
    """A callable's type, module and qualified name (a partial's, its function's)."""
    function = getattr(value, "func", value)
    where = f"{getattr(function, '__module__', '')}.{getattr(function, '__qualname__', '')}"
    return f"{type(value).__name__} {where}"


class FitCheckpoint:
    """The checkpoint of one fit in ``directory`` (rank ``rank``'s file), for the fit whose
    :func:`fingerprint` is ``key``."""

    def __init__(self, directory: str | os.PathLike, key: str, rank: int = 0):
        self.directory = Path(directory)
        self.path = self.directory / f"fit-rank{rank}.npz"
        # the save before the last (under torchrun a rank killed between the ranks' writes
        # leaves the others one save ahead: they go back to it)
        self.previous_path = self.directory / f"fit-rank{rank}.previous.npz"
        self.key = key
        self.failed: str | None = None  # why a save failed: the fit then goes on without

    def load(
        self, rng: np.random.Generator, stage_limits: list[int], previous: bool = False
    ) -> FitState | None:
        """The fit's state saved (``previous``: the save before it), with both generators
        set as they were (``rng`` and torch's), or None when there is none. ValueError when
        it is not a checkpoint, is another fit's, or holds counts that no fit of the plan
        reaches (``stage_limits``: each stage's max_iter; :func:`miscounted`)."""
        path = self.previous_path if previous else self.path
        if not path.exists() and not previous:  # killed between the two renames of a save
            path = self.previous_path
        if not path.exists():
            return None
        meta, arrays = read_state(
            path, "fit checkpoint", FORMAT, self.remedy, required=("theta", "torch_rng")
        )
        theta, torch_rng = arrays.pop("theta"), arrays.pop("torch_rng")
        arrays = {name: arrays[name] for name in RESUME_ARRAYS if name in arrays}
        if meta.get("fingerprint") != self.key:
            raise ValueError(
                f"checkpoint {path} is of another fit (other data or options): "
                f"{self.remedy}, or give the same data and options"
            )
        wrong = wrong_arrays({"theta": theta}, ("theta",))
        if wrong is None and arrays:  # mid-stage: the iterate, its gradient and the pairs
            wrong = wrong_arrays(arrays, RESUME_ARRAYS[:2], RESUME_ARRAYS[2:])
        if wrong is not None:  # the fingerprint matched: the file was changed after the save
            raise self._unusable(path, wrong)
        try:
            rng.bit_generator.state = meta["rng"]
            torch.set_rng_state(torch.from_numpy(np.asarray(torch_rng, dtype=np.uint8)))
            state = dict(meta["state"])
            kept = Snapshot(np.array(theta, dtype=np.float64), **state.pop("kept"))
            records = [StageRecord(**record) for record in state.pop("records")]
            resume = state.pop("resume")
            if resume is not None:  # mid-stage: its arrays are members of their own
                for name in RESUME_ARRAYS:
                    resume[name.removeprefix("resume_")] = np.asarray(arrays[name], np.float64)
                resume = StageResume(**resume)
            loaded = FitState(kept=kept, records=records, resume=resume, **state)
            wrong = miscounted(loaded, stage_limits)
        except (TypeError, KeyError, ValueError, RuntimeError) as exc:
            raise self._unusable(path, f"its state does not read back ({exc})") from None
        if wrong is not None:  # the fingerprint matched: the file was changed after the save
            raise self._unusable(path, wrong)
        return loaded

    @property
    def remedy(self) -> str:
        """What to remove to start over: the fit's own files, not the directory (a
        ``--checkpoint-dir`` the user gave keeps their other files)."""
        return f"remove the fit-rank*.npz files from {self.directory} to start over"

    def _unusable(self, path: Path, why: str) -> ValueError:
        return ValueError(f"checkpoint {path}: {why}; {self.remedy}")

    def save(self, state: FitState, rng: np.random.Generator) -> None:
        """Write the fit's ``state`` and the generators, atomically. A disk that refuses it
        (full, read-only, the file-size limit) costs the checkpoint, not the fit: one
        RuntimeWarning, and no later save is tried."""
        if self.failed is not None:
            return
        saved = asdict(state)
        saved["kept"].pop("theta")
        arrays = {"theta": np.asarray(state.kept.theta, dtype=np.float64)}
        if saved["resume"] is not None:
            for name in RESUME_ARRAYS:
                arrays[name] = saved["resume"].pop(name.removeprefix("resume_"))
        meta = {
            "format": FORMAT,
            "fingerprint": self.key,
            "rng": rng.bit_generator.state,
            "state": saved,
        }
        text = json.dumps(meta, default=_plain)
        try:
            self._write(text, arrays)
        except OSError as exc:
            self.failed = f"{exc.strerror or exc}"
            warnings.warn(
                f"cannot write the fit's checkpoint {self.path}: {self.failed}; the fit goes "
                "on without one (a killed fit would start over)",
                RuntimeWarning,
                stacklevel=3,
            )

    def _write(self, text: str, arrays: dict[str, np.ndarray]) -> None:
        if self.path.exists():  # the last save becomes the previous one
            os.replace(self.path, self.previous_path)
        torch_rng = torch.get_rng_state().numpy()
        write_npz_atomically(self.path, {"torch_rng": torch_rng, "meta": np.array(text), **arrays})


def miscounted(state: FitState, stage_limits: list[int]) -> str | None:
    """What in a loaded state no fit of the plan reaches (None: nothing): a save is made
    after each stage (its record appended) and mid-stage after an iteration, so

        0 <= stages_done <= stages, one record per stage done,
        0 <= a stage's iterations <= its max_iter (the running stage's in ``resume``),
        the fit's iterations = the stages' sum = its history's records,
        0 <= the kept map's iteration <= the fit's iterations."""
    n_stages, done = len(stage_limits), state.stages_done
    if not 0 <= done <= n_stages or len(state.records) != done:
        return (
            f"it says {done} stages done with {len(state.records)} records, where the plan "
            f"has {n_stages} stages"
        )
    stages = [(record.stage, record.iterations) for record in state.records]
    if state.resume is not None:
        if state.resume.index != done or done == n_stages:
            return f"its running stage is stage {state.resume.index}, after {done} done"
        stages.append((f"stage {done}", state.resume.iteration))
    for (name, iterations), limit in zip(stages, stage_limits, strict=False):
        if not 0 <= iterations <= limit:
            return f"its {name} ran {iterations} iterations, outside [0, {limit}]"
    counts = (state.iterations, sum(i for _, i in stages), len(state.history))
    if len(set(counts)) != 1 or state.evaluations < 0:
        return (
            f"its counts disagree ({counts[0]} iterations, {counts[1]} in its stages, "
            f"{counts[2]} history records, {state.evaluations} evaluations)"
        )
    if not 0 <= state.kept.iteration <= state.iterations:
        return f"its kept map is from iteration {state.kept.iteration}, of {state.iterations}"
    return None


def _plain(value):
    """JSON for numpy scalars and arrays in a history record."""
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")
