"""The checkpoint of one prototype learning (``training.references.learned``), so that a
killed ``references condense --method prototypes`` resumes where it was.

One file per loss learned, ``DIRECTORY/prototypes-{loss}.npz``, written atomically
(``training.state_file``) every ``CHECKPOINT_SECONDS`` of learning (after an iteration) and
when the learning ends:

    theta      float64 (P,)    the iterate (prototypes, and the map in the joint mode)
    g          float64 (P,)    the loss's gradient there
    pairs_s    float64 (m, P)  L-BFGS's curvature pairs, oldest first
    pairs_y    float64 (m, P)
    best       float64 (P,)    the parameters kept so far (best on validation)
    meta       str (0-d)       JSON: the key, the loss there, the iteration, the
                               evaluations, why it stopped (None: it goes on), the loss at
                               the start, and the checks (history, best accuracy, its
                               iteration and loss, checks without a gain)

The learning has no random state after its k-means start (deterministic for a seed), so a
resumed learning takes the steps the uninterrupted one takes and ends with the same
prototypes, bit for bit, as long as the loss evaluates to the same bits in both processes.
One exception is known: under CPU load, a process of the tests has evaluated the same loss
at the same prototypes to other low-order bits than the others (cause not found); the
learning, run to its float32 noise floor, then ends at other prototypes.

The key is a SHA-256 of the rows, labels, validation rows, budget, starting map and settings
and the package's version: the state of other work is refused with a ValueError, never used.
"""

from __future__ import annotations

import hashlib
import json
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from training.errors import describe_os_error
from training.state_file import (
    digest_array,
    package_version,
    read_state,
    write_npz_atomically,
    wrong_arrays,
)

FORMAT = "nca-knn-prototype-checkpoint/1"
CHECKPOINT_SECONDS = 10.0  # a save after an iteration once this long has passed since the last
REMEDY = "remove it to start over"  # what a checkpoint that cannot be used asks of the user
STATE_ARRAYS = ("theta", "g", "pairs_s", "pairs_y")  # the arrays every save writes


@dataclass
class LearningState:
    """Where one prototype learning stands: the iterate ``theta`` (P,), its loss ``f`` and
    gradient ``g`` (P,), L-BFGS's pairs (m, P) and evaluations, the iterations done, why it
    stopped (None: it goes on), the loss at the start, and the validation checks (see
    ``learned.BestOnValidation``)."""

    theta: np.ndarray
    f: float
    g: np.ndarray
    pairs_s: np.ndarray
    pairs_y: np.ndarray
    evaluations: int
    iteration: int
    stop: str | None
    loss_start: float
    checks: dict = field(default_factory=dict)
    best_theta: np.ndarray | None = None


def learning_key(arrays: list, settings: dict) -> str:
    """SHA-256 of the arrays that decide a learning (None allowed), its settings (JSON) and
    the package's version."""
    digest = hashlib.sha256()
    for array in arrays:
        digest_array(digest, None if array is None else np.asarray(array))
    digest.update(json.dumps(settings, sort_keys=True, default=str).encode())
    digest.update(package_version().encode())
    return digest.hexdigest()


def checkpoint_path(directory: str | Path, loss: str) -> Path:
    """The file of the learning with ``loss`` in ``directory``."""
    return Path(directory) / f"prototypes-{loss}.npz"


class PrototypeCheckpoint:
    """The checkpoint file of the learning keyed ``key`` with loss ``loss`` in ``directory``.
    ``clock`` (seconds, monotonic) decides when a save is due, never what is computed."""

    def __init__(self, directory: str | Path, loss: str, key: str, clock=time.monotonic):
        self.path = checkpoint_path(directory, loss)
        self.key, self.clock = key, clock
        self.last_save = clock()
        self.failed: str | None = None  # why a save failed: the learning goes on without

    def load(self) -> LearningState | None:
        """The saved state, or None when there is none; ValueError when the file cannot be
        read, is not a checkpoint of this format or is another learning's."""
        if not self.path.exists():
            return None
        meta, arrays = read_state(
            self.path, "prototype checkpoint", FORMAT, REMEDY, required=STATE_ARRAYS
        )
        if meta.get("key") != self.key:
            raise ValueError(
                f"checkpoint {self.path} is of another condense (other model, data or "
                f"options): remove {self.path} to start over, or give the same ones"
            )
        extra = sorted(set(arrays) - {*STATE_ARRAYS, "best"})  # members no save writes
        vectors = ("theta", "g", "best") if "best" in arrays else ("theta", "g")
        wrong = wrong_arrays(arrays, vectors, ("pairs_s", "pairs_y"))
        if extra:
            wrong = f"it has members {', '.join(extra)} that no checkpoint writes"
        if wrong is not None:  # the key matched: the file was changed after the save
            raise ValueError(f"checkpoint {self.path}: {wrong}; {REMEDY}")
        try:
            return LearningState(
                **{name: arrays[name] for name in STATE_ARRAYS},
                **meta["state"],
                best_theta=arrays.get("best"),
            )
        except (TypeError, KeyError) as exc:
            raise ValueError(
                f"checkpoint {self.path}: its state does not read back ({exc}); {REMEDY}"
            ) from None

    def due(self) -> bool:
        """Whether CHECKPOINT_SECONDS have passed since the last save."""
        return self.clock() - self.last_save >= CHECKPOINT_SECONDS

    def save(self, state: LearningState) -> None:
        """Write ``state`` atomically. A disk that refuses it costs the checkpoint, not the
        learning: one RuntimeWarning, and no later save is tried."""
        self.last_save = self.clock()
        if self.failed is not None:
            return
        scalars = {
            "f": float(state.f),
            "evaluations": int(state.evaluations),
            "iteration": int(state.iteration),
            "stop": state.stop,
            "loss_start": float(state.loss_start),
            "checks": state.checks,
        }
        meta = {"format": FORMAT, "key": self.key, "state": scalars}
        arrays = {name: getattr(state, name) for name in STATE_ARRAYS}
        arrays["meta"] = np.array(json.dumps(meta))
        if state.best_theta is not None:
            arrays["best"] = state.best_theta
        try:
            write_npz_atomically(self.path, arrays)
        except OSError as exc:
            self.failed = f"{exc.strerror or exc}"
            warnings.warn(
                f"cannot write the prototypes' checkpoint {self.path}: {self.failed}; the "
                "learning goes on without one (a killed condense would start over)",
                RuntimeWarning,
                stacklevel=2,
            )


def remove_checkpoints(directory: str | Path, losses) -> None:
    """Delete the checkpoint files of the learnings with these losses in ``directory`` (their
    result is written), and the directory when that leaves it empty; nothing else. A file
    the file system will not remove (a read-only directory) is a RuntimeWarning: the result
    is written, and a later condense of other data refuses the stale state."""
    directory = Path(directory)
    for loss in losses:
        try:
            checkpoint_path(directory, loss).unlink(missing_ok=True)
        except OSError as exc:
            warnings.warn(
                f"the new version is written, but its checkpoint stays: {describe_os_error(exc)}",
                RuntimeWarning,
                stacklevel=2,
            )
    try:
        directory.rmdir()
    except OSError:  # not empty (files not ours), or already gone
        pass
