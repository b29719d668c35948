"""The engine: the served models, and the operations every wire calls.

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

The engine holds one model (``single``, a ``service.engine.slot.ModelSlot``) or a
repository of named ones (``repository``, ``service.engine.repository.Repository``: a slot
per name); every wire finds a model with :meth:`Engine.model` (by name and version) or
:meth:`Engine.current` (the unnamed routes). A slot replaces its model in one reference
assignment after the new one has been fully loaded; a request that captured the old model
finishes on it. A failed load leaves the current model serving and is recorded in the
slot's ``last_error``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import numpy as np

from service.config import Settings
from service.core.knn import outlier_flags
from service.core.sparse import dense_rows_equivalent
from service.engine.batcher import Batcher
from service.engine.events import EngineEvents
from service.engine.infer import Answer, Query, embed, infer_one
from service.engine.model import LoadedModel
from service.engine.repository import READY, UNAVAILABLE, Repository
from service.engine.slot import ModelSlot
from service.errors import NotFound, Overloaded, ReloadFailed
from service.ops.tracing import NoTracing, Tracing, record_inference

log = logging.getLogger("service.engine")
INLINE_EMBED_ROWS = 64  # below this, projection runs on the event loop


class Engine:
    """Holds the served model (a :class:`ModelSlot`: loads a new one off to the side and
    swaps it in) and runs requests on it: :meth:`classify`, :meth:`neighbors` and
    :meth:`embed`."""

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
        # one model (``single``), or a repository of named ones (``repository``)
        self.repository: Repository | None = None
        self.single: ModelSlot | None = None
        if settings.model_repository is not None:
            self.repository = Repository(
                settings.model_repository, settings, self.events, clock, retry_failed_seconds
            )
        else:
            self.single = ModelSlot(
                "", settings.model_path, settings, self.events, clock, retry_failed_seconds
            )
        # the repository actions shared with the other workers (the app's
        # service.server.workers.RepositoryActions: record, wanted, applied; None: one worker)
        self.shared_actions = None
        self.draining = False
        # serving: the in-flight gate, the batcher (set by the app's lifespan), tracing
        self.in_flight = 0
        self.batcher: Batcher | None = None
        self.tracing = tracing if tracing is not None else NoTracing()

    @property
    def ready(self) -> bool:
        """Not draining, and a model serves (in a repository: at least one)."""
        if self.draining:
            return False
        if self.repository is not None:
            return self.repository.any_ready()
        return self.single.peek() is not None

    @property
    def last_error(self) -> str | None:
        """What the single model's last failed load said (None after a load that swapped
        a model in; a repository's models give theirs in its index)."""
        return self.single.last_error if self.single is not None else None

    def peek(self) -> LoadedModel | None:
        """The single model, or None (none loaded, or a repository)."""
        return self.single.peek() if self.single is not None else None

    def current(self) -> LoadedModel:
        """The single model: what the unnamed routes serve. NotReady when none is loaded;
        NotFound with a repository, whose models are asked for by name."""
        if self.single is None:
            raise NotFound(
                "this server serves a model repository: name the model "
                "(/v1/models/{name}/classify, /v2/models/{name}/infer; GET /v1/models lists "
                "them)"
            )
        return self.single.current()

    def model(self, name: str, version: str | None = None) -> LoadedModel:
        """The model serving under ``name`` (and ``version``, when given). With one model,
        its name is the setting v2_model_name and its version the artifact's. NotFound for
        another name or version, NotReady for a model that is not loaded."""
        if self.repository is not None:
            return self.repository.model(name, version)
        served = self.settings.v2_model_name
        if name != served:
            raise NotFound(f"unknown model {name!r}; this server serves {served!r}")
        model = self.current()
        if version not in (None, "") and version != model.version:
            raise NotFound(
                f"unknown version {version!r} of model {name!r}; the loaded version is "
                f"{model.version!r}"
            )
        return model

    def name_of(self, model: LoadedModel) -> str:
        """A model's name in the protocol: its repository name, else v2_model_name."""
        return model.name or self.settings.v2_model_name

    def load(self, path: str | Path | None = None) -> LoadedModel:
        """Load the single model's artifact at ``path`` (default: the configured one) and
        swap it in (:meth:`ModelSlot.load`). Raises the load error after recording it; the
        current model keeps serving."""
        return self._single().load(path)

    async def reload(self, timeout: float) -> LoadedModel:
        """:meth:`load` in a worker thread, waited for at most ``timeout`` seconds
        (:meth:`ModelSlot.reload`)."""
        return await self._single().reload(timeout)

    def changed_on_disk(self) -> bool:
        """True when the model path holds an artifact other than the one loaded, and not one
        that already failed unchanged (unless ``retry_failed_seconds`` have passed)."""
        return self._single().changed_on_disk()

    def repository_index(self, ready_only: bool = False) -> list[dict[str, str]]:
        """The protocol's repository index: each model's name, version, state and reason.
        With one model, that model (READY, or UNAVAILABLE with its last error)."""
        if self.repository is not None:
            return [entry.as_dict() for entry in self.repository.index(ready_only)]
        model, name = self.single.peek(), self.settings.v2_model_name
        if model is not None:
            return [{"name": name, "version": model.version, "state": READY, "reason": ""}]
        if ready_only:
            return []
        reason = self.single.last_error or "loading"
        return [{"name": name, "version": "", "state": UNAVAILABLE, "reason": reason}]

    async def load_named(self, name: str, timeout: float) -> LoadedModel:
        """Load (or reload) the repository's model ``name`` in a worker thread, waited for
        at most ``timeout`` seconds: past it ReloadFailed while the load goes on (its
        failure, if it fails, is logged and shown in the index). The wait behind another
        model's load or unload is bounded by 0.8 ``timeout``, so that a load that never
        started says so rather than "goes on"."""
        repository = self._repository()
        loop = asyncio.get_running_loop()
        work = loop.run_in_executor(
            None, lambda: repository.load(name, wait=0.8 * timeout, announce=self._announce)
        )
        try:
            return await asyncio.wait_for(asyncio.shield(work), timeout)
        except TimeoutError:
            work.add_done_callback(partial(_log_background_failure, name))
            raise ReloadFailed(
                f"the load of model {name!r} did not finish within {timeout:g} s "
                "(reload_timeout_seconds); it goes on in the background, and the repository "
                "index shows what it brought"
            ) from None

    async def unload_named(self, name: str) -> None:
        """Stop serving the repository's model ``name`` (in a worker thread: it waits for a
        load of the repository in progress)."""
        repository = self._repository()
        unload = partial(repository.unload, name, announce=self._announce)
        await asyncio.get_running_loop().run_in_executor(None, unload)

    def _announce(self, name: str, action: str) -> None:
        """Record a repository action for the other workers (with one worker: nothing). A
        record that cannot be written is logged: the action itself happened."""
        if self.shared_actions is None:
            return
        try:
            self.shared_actions.record(name, action)
        except OSError as exc:
            log.error(
                "cannot record a repository action for the other workers",
                extra={"model": name, "action": action, "error": str(exc)},
            )

    def load_repository(self) -> None:
        """The startup: every model on disk but those the other workers unloaded (the
        shared record), then what else the record asks. In a worker thread."""
        repository = self._repository()
        wanted = self.shared_actions.wanted() if self.shared_actions is not None else {}
        unloaded = {name for name, (action, _) in wanted.items() if action == "unload"}
        repository.load_all(skip=unloaded)
        if self.shared_actions is None:
            return
        serving = repository.ready_versions()
        for name, (action, token) in wanted.items():
            if action == "unload" or name in serving:  # already as the record wants it
                self.shared_actions.applied[name] = token
        self.replay_repository()

    def replay_repository(self) -> None:
        """Apply what the other workers recorded and this one has not (``Repository.replay``).
        In a worker thread."""
        if self.shared_actions is not None:
            self._repository().replay(self.shared_actions.wanted(), self.shared_actions.applied)

    def reload_changed_models(self) -> list[str]:
        """Reload each repository model whose artifact changed on disk, each on its own;
        the names reloaded. In a worker thread."""
        repository, reloaded = self._repository(), []
        for name in repository.changed_on_disk():
            try:
                repository.load(name)
            except Exception:  # recorded in the model's slot (the index's reason) and logged
                continue
            reloaded.append(name)
        return reloaded

    def last_error_of(self, name: str) -> str | None:
        """What the last failed load of the model ``name`` said (None: none)."""
        if self.repository is not None:
            return self.repository.last_error(name)
        return self.last_error

    def _repository(self) -> Repository:
        if self.repository is None:
            raise NotFound(
                "this server serves one model (model_path), not a repository: start it with "
                "--model-repository DIR to load and unload models by name"
            )
        return self.repository

    def _single(self) -> ModelSlot:
        if self.single is None:
            raise NotFound(
                "this server serves a model repository: load a model with POST "
                "/v2/repository/models/{name}/load"
            )
        return self.single

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
        with self.admit(route, len(rows), model):
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
        with self.admit(route, len(rows), model):
            return await self.search(model, rows, query)

    async def embed(self, model: LoadedModel, rows: np.ndarray, route: str) -> np.ndarray:
        """rows (n, D) float32 or SparseRows -> embeddings (n, d) float32."""
        with self.admit(route, len(rows), model):
            return await self.project(model, rows)

    @contextmanager
    def admit(self, route: str, rows: int, model: LoadedModel | None = None):
        """The in-flight gate: fail fast with 429 rather than queue without bound. A
        repository's model counts its own requests (``model_request``)."""
        if self.in_flight >= self.settings.max_in_flight:
            raise Overloaded(
                f"{self.in_flight} requests in flight, the limit is "
                f"{self.settings.max_in_flight}; retry later"
            )
        self.in_flight += 1
        try:
            self.events.request_admitted(route, rows)
            # counted while the repository holds the model (one captured by a request just
            # before its unload does not bring its series back)
            if model is not None and model.name and self.repository.serves(model):
                self.events.model_request(model.name, rows)
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


def _log_background_failure(name: str, work: asyncio.Future) -> None:
    """A load that outlived its request's timeout and then failed: logged (its slot, when it
    got that far, shows the reason in the index)."""
    if not work.cancelled() and work.exception() is not None:
        log.error(
            "a load that went on in the background failed",
            extra={"model": name, "error": str(work.exception())},
        )
