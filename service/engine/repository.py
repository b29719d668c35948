"""A model repository: every artifact under one directory served by name, side by side.

Layout (Triton's): ``ROOT/NAME/`` is a model. It is either an artifact itself (it holds
``manifest.json``) or a folder of versions ``ROOT/NAME/1/``, ``ROOT/NAME/2/``, ... of which
the highest-numbered one is served. A name is 1 to 128 characters of letters, digits,
``_``, ``.`` and ``-``, not starting with a dot; other folders are not models and are
left alone.

Each model has its own :class:`ModelSlot`: it loads, swaps and fails on its own, so a
broken artifact makes that model unavailable (with the reason in :meth:`index`) while the
others serve, and a reload swaps the whole model in one assignment (an answer never mixes
two versions). Loads and unloads are serialised by one lock, under which the one memory
budget the repository shares (``repository_memory_mib``) is held:

    used(others) + size(new model) <= budget

checked twice: against the artifact's size on disk before anything is read, then against
the built model's size (its arrays and its index) before it is swapped in. A refused load
leaves the models that serve, that one's previous version included, serving. What the
budget does not see: during a reload both versions of the model are held for a moment,
and an unloaded model stays in memory until the requests that captured it end.

With several workers, each worker's loads and unloads are recorded (``announce``, inside
the lock, so in the order they were applied) and replayed by the others (:meth:`replay`).
"""

from __future__ import annotations

import logging
import math
import os
import re
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from service.config import Settings
from service.core.artifact import MANIFEST_FILE, artifact_fingerprint
from service.engine.events import EngineEvents
from service.engine.model import LoadedModel
from service.engine.slot import ModelSlot
from service.errors import NotFound, NotReady, ReloadFailed
from service.search.index import index_bytes

log = logging.getLogger("service.repository")
MODEL_NAME = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9_.-]{0,127}$", re.ASCII)
VERSION_NAME = re.compile(r"^[1-9][0-9]{0,17}$", re.ASCII)
MIB = 2**20

READY, UNAVAILABLE, LOADING = "READY", "UNAVAILABLE", "LOADING"  # the protocol's states
Announce = Callable[[str, str], None]  # (name, "load" | "unload"): tells the other workers


@dataclass(frozen=True)
class IndexEntry:
    """One model of the repository index: its name, the version it serves (or would),
    its state and why it is not ready."""

    name: str
    version: str
    state: str
    reason: str

    def as_dict(self) -> dict[str, str]:
        return {
            "name": self.name,
            "version": self.version,
            "state": self.state,
            "reason": self.reason,
        }


def check_model_name(name: str) -> None:
    """NotFound for a name that no repository folder can have (path separators, dots
    first, over 128 characters)."""
    if not MODEL_NAME.match(name):
        raise NotFound(
            f"{name[:140]!r} is not a model name: names are 1 to 128 letters, digits, '_', "
            "'.' and '-', not starting with a dot"
        )


def is_folder(entry: os.DirEntry) -> bool:
    """Whether a directory entry is a folder (following a symlink); False for one that
    cannot be read (a symlink loop, a vanished entry, no permission)."""
    try:
        return entry.is_dir()
    except OSError:
        return False


def folders(path: Path, pattern: re.Pattern) -> list[str]:
    """The names of the folders in ``path`` that match ``pattern`` (none when ``path``
    cannot be listed)."""
    try:
        entries = list(os.scandir(path))
    except OSError:
        return []
    return [e.name for e in entries if pattern.match(e.name) and is_folder(e)]


def version_folders(model_dir: Path) -> list[int]:
    """The version folders of a model folder (named 1, 2, ...: ASCII digits, no leading
    zero), ascending."""
    return sorted(int(name) for name in folders(model_dir, VERSION_NAME))


def served_path(model_dir: Path) -> Path:
    """The artifact a model folder serves: itself when it holds a manifest, else its
    highest-numbered version folder that holds one (a newer folder still being written
    is passed over), else its highest-numbered one, else itself (whose load then says
    what is missing)."""
    if (model_dir / MANIFEST_FILE).exists():
        return model_dir
    versions = [model_dir / str(v) for v in reversed(version_folders(model_dir))]
    complete = [path for path in versions if (path / MANIFEST_FILE).exists()]
    return (complete or versions or [model_dir])[0]


def artifact_bytes(path: Path) -> int:
    """The bytes of the files directly in an artifact directory (what a load reads: a lower
    bound of the model's memory)."""
    total = 0
    try:
        for entry in os.scandir(path):
            if entry.is_file():
                total += entry.stat().st_size
    except OSError:
        return 0
    return total


def model_bytes(model: LoadedModel) -> int:
    """The memory a loaded model holds: its arrays and its artifact's, each buffer counted
    once, and its FAISS index as serialised (a flat index holds its own copy of the
    references)."""
    arrays = [
        model.projection,
        model.offset,
        model.embeddings,
        model.labels,
        model.ids,
        model.artifact.projection,
        model.artifact.offset,
        model.artifact.embeddings,
        model.artifact.labels,
        model.artifact.mean,
        model.artifact.scale,
        model.artifact.ids,
        model.artifact.validation_embeddings,
        model.artifact.validation_labels,
    ]
    seen: dict[int, int] = {}
    for array in arrays:
        if isinstance(array, np.ndarray):
            owner = array
            while isinstance(owner.base, np.ndarray):
                owner = owner.base
            seen[id(owner)] = max(seen.get(id(owner), 0), owner.nbytes)
    return sum(seen.values()) + index_bytes(model.index) + len(model.artifact.index_bytes or b"")


class Repository:
    """The models of one repository directory, each in its own slot, under one memory
    budget. Every method that loads runs in a worker thread (the caller's)."""

    def __init__(
        self,
        root: Path,
        settings: Settings,
        events: EngineEvents,
        clock: Callable[[], float] = time.monotonic,
        retry_failed_seconds: float = 60.0,
    ):
        self.root = Path(root)
        self.settings = settings
        self.events = events
        self.clock = clock
        self.retry_failed_seconds = retry_failed_seconds
        # bytes; 0: no budget (a budget of a fraction of a byte is one byte, not none)
        self.budget = math.ceil(settings.repository_memory_mib * MIB)
        self.slots: dict[str, ModelSlot] = {}
        self.sizes: dict[str, int] = {}  # name -> bytes of the model it serves
        self.loading: set[str] = set()
        self._lock = threading.RLock()  # one load or unload at a time, for the budget
        self._loading_lock = threading.Lock()  # guards ``loading``
        self._replay_failures: dict[str, tuple[str, float]] = {}  # name -> (token, when)

    # ------------------------------------------------------------------ what is there

    def names_on_disk(self) -> list[str]:
        """The model folders under the root, sorted (an entry that cannot be read, such
        as a symlink loop, is not a model). A listing of the disk: callers on the event
        loop run it in a worker thread."""
        return sorted(folders(self.root, MODEL_NAME))

    def on_disk(self, name: str) -> bool:
        """Whether ``name`` is a model folder (one look, not a listing)."""
        try:
            return MODEL_NAME.match(name) is not None and (self.root / name).is_dir()
        except OSError:
            return False

    def index(self, ready_only: bool = False) -> list[IndexEntry]:
        """Every model on disk or loaded: READY (serving), LOADING (its first load runs) or
        UNAVAILABLE with the reason (its load failed, or it is not loaded)."""
        if ready_only:  # what serves (no look at the disk: readiness probes ask this)
            return [IndexEntry(n, v, READY, "") for n, v in self.ready_versions().items()]
        entries = []
        for name in sorted(set(self.names_on_disk()) | set(self.slots)):
            slot = self.slots.get(name)
            model = slot.peek() if slot is not None else None
            if model is not None:
                reason = (
                    f"serving; the last load failed: {slot.last_error}" if slot.last_error else ""
                )
                entries.append(IndexEntry(name, model.version, READY, reason))
            else:
                state = LOADING if name in self.loading else UNAVAILABLE
                reason = "loading" if state == LOADING else "unloaded"
                if slot is not None and slot.last_error and state == UNAVAILABLE:
                    reason = slot.last_error
                entries.append(IndexEntry(name, "", state, reason))
        return entries

    def used_bytes(self, excluding: str | None = None) -> int:
        return sum(size for name, size in self.sizes.items() if name != excluding)

    def ready_versions(self) -> dict[str, str]:
        """{name: version} of the models that serve now, by name."""
        serving = {name: slot.peek() for name, slot in list(self.slots.items())}
        return {name: model.version for name, model in sorted(serving.items()) if model}

    def any_ready(self) -> bool:
        return any(slot.peek() is not None for slot in list(self.slots.values()))

    # ------------------------------------------------------------------ serving

    def model(self, name: str, version: str | None = None) -> LoadedModel:
        """The model serving under ``name`` (and ``version``, when given: the served
        artifact's version, or its version folder's number). NotFound for a name the
        repository does not hold, NotReady for one that is not loaded."""
        slot = self.slots.get(name)
        if slot is None:
            check_model_name(name)
            if self.on_disk(name):
                raise NotReady(
                    f"model {name!r} is not loaded; load it with the repository's load call "
                    f"(POST /v2/repository/models/{name}/load, or gRPC RepositoryModelLoad)"
                )
            serving = list(self.ready_versions())
            shown = ", ".join(repr(n) for n in serving[:20]) + (" ..." if len(serving) > 20 else "")
            raise NotFound(
                f"unknown model {name!r}; the models serving are {shown or 'none'} (the "
                "repository index lists every model)"
            )
        model = slot.peek()
        if model is None:
            reason = slot.last_error or ("loading" if name in self.loading else "not loaded")
            raise NotReady(f"model {name!r} is unavailable: {reason}")
        if version not in (None, "") and version not in (model.version, self.folder_of(model)):
            raise NotFound(
                f"unknown version {version!r} of model {name!r}; the loaded version is "
                f"{model.version!r}"
            )
        return model

    def folder_of(self, model: LoadedModel) -> str | None:
        """The version folder's number a model was read from (``ROOT/NAME/VERSION``), None
        for an unversioned one (``ROOT/NAME``, whatever its name)."""
        path = Path(model.artifact.path)
        versioned = path.parent.name == model.name and VERSION_NAME.match(path.name)
        return path.name if versioned else None

    # ------------------------------------------------------------------ loads

    def load(
        self, name: str, wait: float | None = None, announce: Announce | None = None
    ) -> LoadedModel:
        """Load (or reload) the model ``name`` and swap it in, within the memory budget.
        ReloadFailed names what stopped it; whatever served before keeps serving.

        ``wait``: how long to wait behind another model's load or unload (default
        reload_timeout_seconds). ``announce(name, "load")`` is called on success, inside the
        repository's lock, so that the order the actions are recorded in is the order they
        were applied in (the other workers replay them: :meth:`replay`)."""
        check_model_name(name)
        if name not in self.slots and not self.on_disk(name):
            raise NotFound(f"no model folder {name!r} in the repository {self.root}")
        with self._claim(name, wait):
            slot = self.slots.get(name)
            if slot is None:
                model_dir = self.root / name
                slot = ModelSlot(
                    name,
                    lambda: served_path(model_dir),
                    self.settings,
                    self.events,
                    self.clock,
                    self.retry_failed_seconds,
                )
                self.slots[name] = slot
            model = self._load_within_budget(slot)
            if announce is not None:
                announce(name, "load")
            return model

    def _load_within_budget(self, slot: ModelSlot) -> LoadedModel:
        """The load itself, with the lock held: the budget checked against the artifact's
        bytes on disk, then against the built model, for the one path read."""
        name, path = slot.name, slot.path
        others = self.used_bytes(excluding=name)
        if self.budget:
            on_disk = artifact_bytes(path)
            if others + on_disk > self.budget:
                error = ReloadFailed(self._over_budget(name, on_disk, others, "on disk"))
                slot.record_failure(f"ReloadFailed: {error}", artifact_fingerprint(path))
                self.events.model_load_failed(error)
                raise error
        sizes: list[int] = []

        def admit(model: LoadedModel) -> None:
            sizes.append(model_bytes(model))
            if self.budget and others + sizes[-1] > self.budget:
                raise ReloadFailed(self._over_budget(name, sizes[-1], others, "loaded"))

        try:
            model = slot.load(path, admit=admit)
        except ReloadFailed:
            raise
        except Exception as exc:
            raise ReloadFailed(f"cannot load model {name!r} from {path}: {exc}") from None
        self.sizes[name] = sizes[-1]
        self.events.repository_model_ready(name, sizes[-1])
        return model

    @contextmanager
    def _claim(self, name: str, wait: float | None):
        """Hold the repository for a load of ``name``: refused at once when a load of the
        same name is running or waiting (loads do not pile up behind each other), and
        after ``wait`` seconds behind another model's load or unload. The index shows the
        model LOADING from the moment it is claimed."""
        with self._loading_lock:
            if name in self.loading:
                raise ReloadFailed(
                    f"a load of model {name!r} is already running or waiting; it does not "
                    "queue twice: retry when it has finished (the repository index shows it)"
                )
            self.loading.add(name)
        try:
            with self._repository_lock(f"load model {name!r}", wait):
                yield
        finally:
            with self._loading_lock:
                self.loading.discard(name)

    @contextmanager
    def _repository_lock(self, what: str, wait: float | None = None):
        """The one lock of loads and unloads (reentrant: a replay loads under it), waited
        for at most ``wait`` seconds (default reload_timeout_seconds)."""
        waited = self.settings.reload_timeout_seconds if wait is None else wait
        if not self._lock.acquire(timeout=max(waited, 0.0)):
            raise ReloadFailed(
                f"cannot {what} now: another model's load or unload has held the repository "
                f"for over {waited:.3g} s; retry when it has finished"
            )
        try:
            yield
        finally:
            self._lock.release()

    def _over_budget(self, name: str, size: int, others: int, measured: str) -> str:
        return (
            f"model {name!r} needs {size / MIB:.3g} MiB ({measured}) and the models serving "
            f"hold {others / MIB:.3g} MiB: over the repository's memory budget of "
            f"{self.budget / MIB:.3g} MiB (repository_memory_mib); unload a model or raise "
            "the budget"
        )

    def unload(self, name: str, announce: Announce | None = None) -> None:
        """Stop serving ``name``: requests that captured it finish on it; its memory is
        released when the last of them ends. NotFound for a name the repository does not
        hold (a model whose load failed is held: unloading it forgets the failure).
        ``announce(name, "unload")`` as for :meth:`load`."""
        check_model_name(name)
        with self._repository_lock(f"unload model {name!r}"):
            slot = self.slots.pop(name, None)
            if slot is None:
                raise NotFound(f"model {name!r} is not loaded")
            slot.unload()
            self.sizes.pop(name, None)
            self.events.repository_model_removed(name)
            if announce is not None:
                announce(name, "unload")
        log.info("model unloaded", extra={"model": name})

    def load_all(self, skip: set[str] = frozenset()) -> None:
        """Load every model on disk but ``skip`` (at startup), in name order; a model that
        fails is recorded UNAVAILABLE and the others load."""
        for name in self.names_on_disk():
            if name in skip:
                continue
            try:
                self.load(name)
            except Exception as exc:
                log.error("model not loaded", extra={"model": name, "error": str(exc)})

    def replay(self, wanted: dict[str, tuple[str, str]], applied: dict[str, str]) -> None:
        """Make this worker hold what the other workers asked for: ``wanted`` is {name:
        (action, token)} (the shared record, ``service.server.workers.RepositoryActions``),
        ``applied`` {name: token} of what this worker already did, updated here. Unloads
        first, then loads (so that a load fits the budget the unloads free); each action is
        marked applied only once it succeeded, so one that failed (the budget, a busy
        repository, a disk error) is tried again at the next replay, no sooner than
        retry_failed_seconds after its failure. Runs in a worker thread."""
        order = sorted(wanted.items(), key=lambda item: (item[1][0] != "unload", item[0]))
        for name, (action, token) in order:
            if applied.get(name) == token:
                continue
            failed = self._replay_failures.get(name)
            if (
                failed
                and failed[0] == token
                and self.clock() - failed[1] < self.retry_failed_seconds
            ):
                continue
            try:
                if action == "unload" and name in self.slots:
                    self.unload(name)
                elif action == "load":
                    self.load(name)
            except NotFound:
                pass  # nothing to unload, or no such folder here: nothing to do
            except Exception as exc:
                self._replay_failures[name] = (token, self.clock())
                log.error(
                    "cannot apply another worker's repository action here; retrying later",
                    extra={"model": name, "action": action, "error": str(exc)},
                )
                continue
            applied[name] = token
            self._replay_failures.pop(name, None)

    def changed_on_disk(self) -> list[str]:
        """The loaded models whose artifact changed (a new version folder, a republish),
        and those whose failed artifact changed since (per ``ModelSlot.changed_on_disk``).
        A model whose folder cannot be read is left as it is (and logged); the others are
        still looked at."""
        changed = []
        for name, slot in list(self.slots.items()):
            try:
                if slot.changed_on_disk():
                    changed.append(name)
            except OSError as exc:
                log.warning(
                    "cannot look at a model's folder", extra={"model": name, "error": str(exc)}
                )
        return changed

    def last_error(self, name: str) -> str | None:
        """What the last failed load of ``name`` said (None: none, or not held)."""
        slot = self.slots.get(name)
        return slot.last_error if slot is not None else None

    def serves(self, model: LoadedModel) -> bool:
        """Whether ``model``'s name is still held (not unloaded)."""
        return model.name in self.slots
