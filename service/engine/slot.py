"""One served model's place: the artifact path it is read from, the model serving now, and
what its last load brought.

A :class:`ModelSlot` loads a new model off to the side and swaps it in with one reference
assignment once it is fully loaded, indexed and warmed up; a request that captured the old
model finishes on it. A failed load leaves the current model serving and is recorded in
``last_error``. The engine holds one slot in single-model mode and one per name in a model
repository (``service.engine.repository``); each loads, swaps and fails on its own.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

from service.config import Settings
from service.core.artifact import artifact_fingerprint
from service.engine.events import EngineEvents
from service.engine.model import LoadedModel, load_model
from service.errors import NotReady, ReloadFailed

log = logging.getLogger("service.engine")


class ModelSlot:
    """Holds one model under one name (loads a new one off to the side and swaps it in).

    Failed loads are remembered by the artifact's fingerprint (directory identity, manifest
    hash, file sizes and times: ``artifact_fingerprint``), not by its version: a version that
    failed while it was being written is retried as soon as its files change, and any failed
    artifact again after ``retry_failed_seconds``.

    ``path`` is where the artifact is read from: a fixed path, or a callable giving it at
    each load and look (a repository's newest version directory).
    """

    def __init__(
        self,
        name: str,
        path: Path | Callable[[], Path],
        settings: Settings,
        events: EngineEvents,
        clock: Callable[[], float] = time.monotonic,
        retry_failed_seconds: float = 60.0,
    ):
        self.name = name
        self._path = path
        self.settings = settings
        self.events = events
        self.clock = clock
        self.retry_failed_seconds = retry_failed_seconds
        self._model: LoadedModel | None = None
        self._load_lock = threading.Lock()  # one load at a time; others are refused
        self._load_started = 0.0
        self.last_error: str | None = None
        self._loaded_fingerprint: tuple | None = None
        self._failed_fingerprint: tuple | None = None
        self._failed_at = 0.0

    @property
    def path(self) -> Path:
        """The artifact path a load reads now."""
        return self._path() if callable(self._path) else Path(self._path)

    def peek(self) -> LoadedModel | None:
        """The loaded model, or None."""
        return self._model

    def current(self) -> LoadedModel:
        model = self._model
        if model is None:
            raise NotReady(
                "no model is loaded yet; "
                + (f"the last load failed: {self.last_error}" if self.last_error else "loading")
            )
        return model

    def load(
        self,
        path: str | Path | None = None,
        admit: Callable[[LoadedModel], None] | None = None,
    ) -> LoadedModel:
        """Load the artifact at ``path`` (default: :attr:`path`) and swap it in.

        ``admit(model)``, when given, sees the fully built model before the swap and may
        refuse it by raising (the repository's memory budget). Raises the load error after
        recording it; the current model keeps serving.
        """
        if not self._load_lock.acquire(blocking=False):
            raise ReloadFailed(
                f"another load of the model has been running for "
                f"{time.monotonic() - self._load_started:.1f} s; a load does not queue behind "
                "it: retry when it has finished (GET /v1/model shows the result)"
            )
        self._load_started = time.monotonic()
        try:
            return self._load(Path(path) if path is not None else self.path, admit)
        finally:
            self._load_lock.release()

    def _load(self, path: Path, admit: Callable[[LoadedModel], None] | None) -> LoadedModel:
        """Load ``path`` and swap it in, with the load lock held (:meth:`load`).

        The model is remembered with the fingerprint of exactly the bytes it was built from
        (``Artifact.fingerprint``, taken through the directory the reader pinned), and a
        failure with the fingerprint of what failed (None when the reader did not get as far
        as a manifest, or failed outside the artifact's checks: then it is retried at the
        next poll). Whatever the path was repointed to during the read, the poller's next
        look (:meth:`changed_on_disk`) sees that the path names something else."""
        try:
            model = load_model(path, self.settings, on_fallback=self.events.search_fell_back)
            if self.name:
                model = dataclasses.replace(model, name=self.name)
            if admit is not None:
                try:
                    admit(model)
                except Exception as exc:  # refused whole: remembered as these bytes' failure
                    exc.fingerprint = model.artifact.fingerprint
                    raise
        except Exception as exc:
            self.record_failure(f"{type(exc).__name__}: {exc}", getattr(exc, "fingerprint", None))
            log.error(
                "model load failed",
                extra={"model": self.name, "path": str(path), "error": self.last_error},
            )
            self.events.model_load_failed(exc)
            raise
        self._model = model  # one reference assignment: the swap
        self._loaded_fingerprint = model.artifact.fingerprint
        self._failed_fingerprint = None
        self.last_error = None
        log.info(
            "model loaded",
            extra={
                "model": self.name,
                "path": str(path),
                "model_version": model.version,
                "seconds": model.load_seconds,
            },
        )
        self.events.model_loaded(model)
        return model

    def record_failure(self, message: str, fingerprint: tuple | None) -> None:
        """Remember a failed load: its message, and the fingerprint of what failed (None:
        unknown, tried again at the next look), so that the poller does not try the same
        bytes again before ``retry_failed_seconds``."""
        self._failed_fingerprint = fingerprint
        self._failed_at = self.clock()
        self.last_error = message

    def unload(self) -> LoadedModel | None:
        """Stop serving this slot's model (requests that captured it finish on it); returns
        what was loaded. The slot remembers nothing of it: a later load starts afresh."""
        model, self._model = self._model, None
        self._loaded_fingerprint = None
        self._failed_fingerprint = None
        self.last_error = None
        return model

    async def reload(self, timeout: float) -> LoadedModel:
        """:meth:`load` in a worker thread, waited for at most ``timeout`` seconds: past it
        ReloadFailed, while the load goes on in the background (a model it completes is
        swapped in then; a failure is recorded as any other)."""
        loop = asyncio.get_running_loop()
        try:
            return await asyncio.wait_for(loop.run_in_executor(None, self.load), timeout)
        except TimeoutError:
            raise ReloadFailed(
                f"the load did not finish within {timeout:g} s (reload_timeout_seconds); it "
                "goes on in the background, and GET /v1/model shows what it brought"
            ) from None

    def changed_on_disk(self) -> bool:
        """True when the path holds an artifact other than the one loaded, and not one that
        already failed unchanged (unless ``retry_failed_seconds`` have passed)."""
        fingerprint = artifact_fingerprint(self.path)
        if fingerprint is None or fingerprint == self._loaded_fingerprint:
            return False
        if fingerprint == self._failed_fingerprint:
            return self.clock() - self._failed_at >= self.retry_failed_seconds
        return True
