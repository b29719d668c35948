"""The engine: the current model, and the operations every wire calls.

A wire (/v1, /v2 REST, gRPC) decodes a request into rows and a :class:`Query`
(``service.engine.infer.resolve``), calls one operation and encodes what it returns:

* :meth:`Engine.classify`: neighbours and a decision per row, with the outlier flags of the
  query's threshold (``Answer.outliers``), and the embedding when asked for;
* :meth:`Engine.neighbors`: neighbours only;
* :meth:`Engine.embed`: the embeddings only.

Each operation owns what a request needs on its way through: the in-flight gate (429
rather than an unbounded queue), the batcher (or a worker thread when batching is off),
the trace spans, and the events the metrics count (rows per request, outliers flagged,
requests in flight: ``service.engine.events``).

The engine holds the current model (``service.engine.model.load_model`` reads and indexes
one) and replaces it in one reference assignment after the new one has been fully loaded;
a request that captured the old model finishes on it. A failed load leaves the current
model serving and is recorded in ``Engine.last_error``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from service.config import Settings
from service.core.artifact import ArtifactError, artifact_fingerprint
from service.core.knn import outlier_flags
from service.core.sparse import dense_rows_equivalent
from service.engine.batcher import Batcher
from service.engine.events import EngineEvents
from service.engine.infer import Answer, Query, embed, infer_one
from service.engine.model import LoadedModel, load_model
from service.errors import NotReady, Overloaded, ReloadFailed
from service.ops.tracing import NoTracing, Tracing, record_inference

log = logging.getLogger("service.engine")
INLINE_EMBED_ROWS = 64  # below this, projection runs on the event loop


class Engine:
    """Holds the current model (loads a new one off to the side and swaps it in) and runs
    requests on it: :meth:`classify`, :meth:`neighbors` and :meth:`embed`.

    Failed loads are remembered by the artifact's fingerprint (directory identity, manifest
    hash, file sizes and times: ``artifact_fingerprint``), not by its version: a version that
    failed while it was being written is retried as soon as its files change, and any failed
    artifact again after ``retry_failed_seconds``.
    """

    def __init__(
        self,
        settings: Settings,
        events: EngineEvents | None = None,
        clock: Callable[[], float] = time.monotonic,
        retry_failed_seconds: float = 60.0,
        tracing: Tracing | NoTracing | None = None,
    ):
        self.settings = settings
        # every load that swapped a model in or failed, whoever asked for it (startup, the
        # reload route, the poller), every request admitted and every outlier flagged
        self.events = events if events is not None else EngineEvents()
        self.clock = clock
        self.retry_failed_seconds = retry_failed_seconds
        self._model: LoadedModel | None = None
        self._load_lock = threading.Lock()  # one load at a time; others are refused
        self._load_started = 0.0
        self.last_error: str | None = None
        self.draining = False
        self._loaded_fingerprint: tuple | None = None
        self._failed_fingerprint: tuple | None = None
        self._failed_at = 0.0
        # serving: the in-flight gate, the batcher (set by the app's lifespan), tracing
        self.in_flight = 0
        self.batcher: Batcher | None = None
        self.tracing = tracing if tracing is not None else NoTracing()

    @property
    def ready(self) -> bool:
        return self._model is not None and not self.draining

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

    def load(self, path: str | Path | None = None) -> LoadedModel:
        """Load the artifact at ``path`` (default: the configured one) and swap it in.

        Raises the load error after recording it; the current model keeps serving.
        """
        path = Path(path or self.settings.model_path)
        if not self._load_lock.acquire(blocking=False):
            raise ReloadFailed(
                f"another load of the model has been running for "
                f"{time.monotonic() - self._load_started:.1f} s; a load does not queue behind "
                "it: retry when it has finished (GET /v1/model shows the result)"
            )
        self._load_started = time.monotonic()
        try:
            return self._load(path)
        finally:
            self._load_lock.release()

    def _load(self, path: Path) -> LoadedModel:
        """Load ``path`` and swap it in, with the load lock held (:meth:`load`).

        The model is remembered with the fingerprint of exactly the bytes it was built from
        (``Artifact.fingerprint``, taken through the directory the reader pinned), and a
        failure with the fingerprint of what failed (None when the reader did not get as far
        as a manifest, or failed outside the artifact's checks: then it is retried at the
        next poll). Whatever the path was repointed to during the read, the poller's next
        look (:meth:`changed_on_disk`) sees that the path names something else."""
        try:
            model = load_model(path, self.settings, on_fallback=self.events.search_fell_back)
        except Exception as exc:
            self._failed_fingerprint = exc.fingerprint if isinstance(exc, ArtifactError) else None
            self._failed_at = self.clock()
            self.last_error = f"{type(exc).__name__}: {exc}"
            log.error("model load failed", extra={"path": str(path), "error": self.last_error})
            self.events.model_load_failed(exc)
            raise
        self._model = model  # one reference assignment: the swap
        self._loaded_fingerprint = model.artifact.fingerprint
        self._failed_fingerprint = None
        self.last_error = None
        log.info(
            "model loaded",
            extra={
                "path": str(path),
                "model_version": model.version,
                "seconds": model.load_seconds,
            },
        )
        self.events.model_loaded(model)
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
        """True when the model path holds an artifact other than the one loaded, and not one
        that already failed unchanged (unless ``retry_failed_seconds`` have passed)."""
        fingerprint = artifact_fingerprint(self.settings.model_path)
        if fingerprint is None or fingerprint == self._loaded_fingerprint:
            return False
        if fingerprint == self._failed_fingerprint:
            return self.clock() - self._failed_at >= self.retry_failed_seconds
        return True

    async def classify(
        self,
        model: LoadedModel,
        rows: np.ndarray,
        query: Query,
        route: str,
        with_embedding: bool = False,
    ) -> Answer:
        """Neighbours and a decision for rows (n, D) float32 (or SparseRows), with
        ``outliers`` (n,) bool when the query has an outlier threshold (counted as an event)
        and ``embedding`` (n, d) when asked for. InvalidInput for rows whose embedding
        overflows, Overloaded at the in-flight limit."""
        with self.admit(route, len(rows)):
            answer = await self.search(model, rows, query)
            if with_embedding:
                answer = dataclasses.replace(answer, embedding=await self.project(model, rows))
        if query.threshold is not None:
            flags = outlier_flags(answer.distances, query.threshold)  # (n,)
            self.events.outliers_flagged(int(flags.sum()))
            answer = dataclasses.replace(answer, outliers=flags)
        return answer

    async def neighbors(
        self, model: LoadedModel, rows: np.ndarray, query: Query, route: str
    ) -> Answer:
        """The k nearest references of rows (n, D) float32 or SparseRows (a query that
        decides nothing)."""
        with self.admit(route, len(rows)):
            return await self.search(model, rows, query)

    async def embed(self, model: LoadedModel, rows: np.ndarray, route: str) -> np.ndarray:
        """rows (n, D) float32 or SparseRows -> embeddings (n, d) float32."""
        with self.admit(route, len(rows)):
            return await self.project(model, rows)

    @contextmanager
    def admit(self, route: str, rows: int):
        """The in-flight gate: fail fast with 429 rather than queue without bound."""
        if self.in_flight >= self.settings.max_in_flight:
            raise Overloaded(
                f"{self.in_flight} requests in flight, the limit is "
                f"{self.settings.max_in_flight}; retry later"
            )
        self.in_flight += 1
        try:
            self.events.request_admitted(route, rows)
            yield
        finally:
            self.in_flight -= 1
            self.events.request_done()

    async def search(self, model: LoadedModel, rows: np.ndarray, query: Query) -> Answer:
        """The inference path for one admitted request: merged with others by the batcher
        when batching is on, else computed alone in a worker thread. With tracing on, the
        request's parse / queue / search / decide spans are recorded from its timings."""
        called = time.time_ns() if self.tracing.enabled else 0
        if self.batcher is not None:
            answer = await self.batcher.submit(model, rows, query)
        else:
            loop = asyncio.get_running_loop()
            answer = await loop.run_in_executor(None, infer_one, model, rows, query)
            if called and "search" in answer.timings:  # the hop to the worker thread
                answer.timings.setdefault("queue", (called, answer.timings["search"][0]))
        if self.tracing.enabled:
            record_inference(self.tracing, called, answer.timings)
        return answer

    async def project(self, model: LoadedModel, rows: np.ndarray) -> np.ndarray:
        """rows (n, D) -> embeddings (n, d): on the event loop up to INLINE_EMBED_ROWS rows
        (a thread hop costs more; sparse rows counted by their non-zeros' work:
        ``dense_rows_equivalent``), else in a worker thread."""
        if dense_rows_equivalent(rows) <= INLINE_EMBED_ROWS:
            return embed(model, rows)
        return await asyncio.get_running_loop().run_in_executor(None, embed, model, rows)
