"""A fit's checkpoint: the state at the end of each stage, so that a killed fit resumes.

A fit runs in stages (``training.model.fitting``). When a stage ends, what the rest of the
fit needs from it is written to ``DIRECTORY/fit-rank{R}.npz`` (one file per process under
torchrun), atomically (a temporary file, fsynced, renamed over the last one):

    theta       float64 (P,)   the map the stage kept (its parameters)
    torch_rng   uint8          torch's generator state after the stage
    meta        str (0-d)      JSON: the fingerprint, the number of stages done, the stage
                               records, the fit's result so far without theta, the first
                               stage's history, K at its end, numpy's generator state

A fit started with the same checkpoint directory reads it after its preparation: it skips
the stages done and goes on from the kept map with both generators as they were, so on the
same machine it ends with the map an uninterrupted fit ends with (the stages are
deterministic: ``training.optim.stages`` reads no clock). A stage interrupted half-way is
run again from its start.

The fingerprint is a SHA-256 of the prepared training rows (standardised, float32), their
labels, the validation rows, the estimator's parameters (but those that only change what
is shown: ``DISPLAY_PARAMS``) and the package's version: a
checkpoint of other data or options is refused with a ValueError that says so, never
silently used.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import tempfile
import warnings
import zipfile
from dataclasses import asdict, fields
from pathlib import Path

import numpy as np
import scipy.sparse as sparse
import torch

from training.model import sparse_input
from training.optim.monitor import FitResult
from training.optim.stages import StageRecord

FORMAT = "nca-knn-fit-checkpoint/1"
# parameters that change what a fit shows, not what it computes: a fit resumed in a terminal
# after one run into a log (or the other way round) is the same fit
DISPLAY_PARAMS = frozenset({"verbose", "progress", "callback"})


def package_version() -> str:
    """This installation's version of the package (a checkpoint of another is refused)."""
    try:
        return importlib.metadata.version("nca-knn")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree
        return "unknown"


def fingerprint(X: np.ndarray, y: np.ndarray, X_val, y_val, params: dict, version: str) -> str:
    """SHA-256 of what decides a fit: the prepared rows X (N, D) and labels y (N,), the
    validation rows and labels (or None), the parameters (callables by their type only)."""
    digest = hashlib.sha256()
    for array in (X, y, X_val, y_val):
        if array is None:
            digest.update(b"none")
            continue
        if sparse.issparse(array):  # a sparse X: its shape, index arrays and values
            digest.update(b"csr")
            for part in sparse_input.fingerprint_parts(array):
                digest.update(np.ascontiguousarray(part).tobytes())
            continue
        array = np.ascontiguousarray(array)
        digest.update(f"{array.dtype.str}{array.shape}".encode())
        digest.update(memoryview(array).cast("B"))
    described = {
        name: (type(value).__name__ if callable(value) else repr(value))
        for name, value in sorted(params.items())
        if name not in DISPLAY_PARAMS
    }
    digest.update(json.dumps(described, sort_keys=True).encode())
    digest.update(version.encode())
    return digest.hexdigest()


class FitCheckpoint:
    """The checkpoint of one fit in ``directory`` (rank ``rank``'s file), for the fit whose
    :func:`fingerprint` is ``key``."""

    def __init__(self, directory: str | os.PathLike, key: str, rank: int = 0):
        self.directory = Path(directory)
        self.path = self.directory / f"fit-rank{rank}.npz"
        self.key = key
        self.failed: str | None = None  # why a save failed: the fit then goes on without

    def load(self) -> dict | None:
        """The state saved (theta, torch_rng and the meta record's fields), or None when
        there is none. ValueError when it is not a checkpoint or is another fit's."""
        if not self.path.exists():
            return None
        try:
            with np.load(self.path, allow_pickle=False) as data:
                meta = json.loads(str(data["meta"]))
                state = {"theta": data["theta"], "torch_rng": data["torch_rng"], **meta}
        except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as exc:
            raise ValueError(
                f"checkpoint {self.path}: not a readable fit checkpoint ({exc})"
            ) from None
        if state.get("format") != FORMAT:
            raise ValueError(f"checkpoint {self.path}: not a fit checkpoint of this format")
        if state.get("fingerprint") != self.key:
            raise ValueError(
                f"checkpoint {self.path} is of another fit (other data or options): remove "
                f"{self.directory} to start over, or give the same data and options"
            )
        return state

    def save(
        self,
        *,
        stages_done: int,
        result: FitResult,
        records: list[StageRecord],
        candidate_history: list[dict],
        n_candidates: int | None,
        finished_iter: int,
        rng: np.random.Generator,
    ) -> None:
        """Write the state after ``stages_done`` stages, atomically. A disk that refuses it
        (full, read-only, the file-size limit) costs the checkpoint, not the fit: one
        RuntimeWarning, and no later save is tried."""
        if self.failed is not None:
            return
        summary = {f.name: getattr(result, f.name) for f in fields(result) if f.name != "theta"}
        meta = {
            "format": FORMAT,
            "fingerprint": self.key,
            "stages_done": stages_done,
            "result": summary,
            "records": [asdict(record) for record in records],
            "candidate_history": candidate_history,
            "n_candidates": n_candidates,
            "finished_iter": finished_iter,
            "rng": rng.bit_generator.state,
        }
        text = json.dumps(meta, default=_plain)
        try:
            self._write(text, np.asarray(result.theta, dtype=np.float64))
        except OSError as exc:
            self.failed = f"{exc.strerror or exc}"
            warnings.warn(
                f"cannot write the fit's checkpoint {self.path}: {self.failed}; the fit goes "
                "on without one (a killed fit would start over)",
                RuntimeWarning,
                stacklevel=3,
            )

    def _write(self, text: str, theta: np.ndarray) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".fit.", suffix=".tmp", dir=self.directory)
        try:
            with os.fdopen(fd, "wb") as fh:
                np.savez(
                    fh,
                    theta=theta,
                    torch_rng=torch.get_rng_state().numpy(),
                    meta=np.array(text),
                )
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, self.path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)

    @staticmethod
    def restore(state: dict, rng: np.random.Generator) -> tuple[FitResult, list[StageRecord]]:
        """The result and stage records a loaded ``state`` holds; both generators set as
        they were when it was saved."""
        rng.bit_generator.state = state["rng"]
        torch.set_rng_state(torch.from_numpy(np.asarray(state["torch_rng"], dtype=np.uint8)))
        result = FitResult(theta=np.array(state["theta"], dtype=np.float64), **state["result"])
        records = [StageRecord(**record) for record in state["records"]]
        return result, records


def _plain(value):
    """JSON for numpy scalars and arrays in a history record."""
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")
