"""The engine at run time and the one inference path.

Once its wire has parsed a request into rows and a :class:`Query` (:func:`resolve`), the
request runs through this module: :meth:`Engine.admit` (the in-flight gate, 429),
:meth:`Engine.infer` (the request joins the :class:`Batcher`, or runs alone in a worker
thread) and :func:`infer`, the only place the service embeds, searches and decides. Every
wire (/v1, /v2 REST, gRPC) calls :meth:`Engine.infer`; they differ only in how they parse
a request and render the :class:`Answer`.

For rows x (n, D) of one model and one k, :func:`infer` computes::

    z = x W^T + b                     embed (float64 accumulation, float32 result)
    rows whose z is not finite        -> that part's InvalidInput, the others go on
    (dist, idx) = kNN(z, k)           one search for every part (service.search.index)
    background = FarPrior(z, t)       the soft_prior rule's component, per threshold t
    (label, proba) = decide(...)      one decision per (rule, threshold) asked for

The projection, the final distances and the decision are computed row by row (service.core.knn),
so a part's answer does not depend on the parts searched with it: a batched answer equals
the answer the request gets alone.

The :class:`Batcher` merges concurrent requests: one worker task takes the first waiting
job, keeps collecting until ``max_rows`` rows or ``max_wait_us`` have passed, groups the jobs
by (model, k) and calls :func:`infer` once per group, in a search thread (or, for groups of
at most ``inline_rows`` rows, on the event loop itself: on one core that saves two thread
hand-offs a batch and nothing runs in parallel anyway). Each job gets its own part.

The :class:`Engine` holds the current model (``service.engine.model.load_model`` reads and
indexes one) and replaces it in one reference assignment after the new one has been fully
loaded; a request that captured the old model finishes on it. A failed load leaves the
current model serving and is recorded in ``Engine.last_error``.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from service.config import Settings
from service.core.artifact import artifact_fingerprint
from service.core.knn import decide, outlier_threshold, project
from service.core.vocabulary import RULES, DecisionRule
from service.engine.model import LoadedModel, load_model
from service.errors import InvalidInput, NotReady, Overloaded, ReloadFailed, ServiceError
from service.ops.tracing import NoTracing, Tracing, record_inference
from service.search.index import search

log = logging.getLogger("service.engine")
INLINE_EMBED_ROWS = 64  # below this, projection runs on the event loop

SOFT_PRIOR = DecisionRule.SOFT_PRIOR.value
FLOAT32_MAX = float(np.finfo(np.float32).max)


@dataclass(frozen=True)
class Query:
    """What a request asks of the model, resolved and checked (:func:`resolve`)."""

    k: int  # neighbours per row, 1 <= k <= min(max_k, N)
    rule: str | None  # the decision rule, or None for neighbours only
    threshold: float | None = None  # the outlier threshold at the request's quantile

    @property
    def decision_key(self) -> tuple[str, float | None] | None:
        """Queries with equal keys share one decision: the rule, and for soft_prior its
        threshold (the other rules do not depend on it)."""
        if self.rule is None:
            return None
        return (self.rule, self.threshold if self.rule == SOFT_PRIOR else None)


@dataclass(frozen=True)
class Answer:
    """What a search gives n queries: their k neighbours and, when a decision rule was asked
    for, the decision."""

    distances: np.ndarray  # (n, k) squared distances, float64, ascending
    indices: np.ndarray  # (n, k) reference row indices
    predicted: np.ndarray | None = None  # (n,) class indices
    probabilities: np.ndarray | None = None  # (n, C)
    # where the time went, {"search" | "decide" | "queue": (start, end)} in epoch nanoseconds,
    # for the request's trace (service.ops.tracing); shared by every part of a merged batch
    timings: dict = field(default_factory=dict, compare=False)

    def rows(self, start: int, stop: int, decided: bool = True) -> Answer:
        """The answer of rows [start, stop) (views, no copies), without the decision when
        ``decided`` is False."""
        part = slice(start, stop)
        timings = dict(self.timings)
        if not decided or self.predicted is None:
            return Answer(self.distances[part], self.indices[part], timings=timings)
        return Answer(
            self.distances[part],
            self.indices[part],
            self.predicted[part],
            self.probabilities[part],
            timings=timings,
        )


def resolve(
    model,
    max_k: int,
    *,
    k: int | None = None,
    rule: str | None = None,
    quantile: float | None = None,
    decides: bool = True,
) -> Query:
    """A request's options against the model and the limits, the same for every wire.

    k: the model's default when None; InvalidInput over ``max_k`` or the number of
    references. rule (when the request ``decides``): the model's default when None.
    quantile: the outlier threshold through the model's calibration (None: the setting's);
    InvalidInput outside the calibrated range, or given to a model without a calibration.
    soft_prior needs a calibration.
    """
    k = model.default_k if k is None else k
    if k > max_k:
        raise InvalidInput(f"k={k} is over the limit max_k={max_k}")
    if not 1 <= k <= model.n_references:
        raise InvalidInput(
            f"k={k} must lie in [1, {model.n_references}] (the number of reference points)"
        )
    threshold = threshold_at(model, quantile)
    if threshold is None and quantile is not None:
        raise InvalidInput(
            f"outlier_quantile={quantile!r}: this model has no outlier calibration (it was "
            "trained without a validation split), so nothing is flagged; leave it out"
        )
    if not decides:
        return Query(k, None, threshold)
    rule = rule or model.decision_rule
    if rule not in RULES:
        raise InvalidInput(f"rule must be one of {list(RULES)}, got {rule!r}")
    if rule == SOFT_PRIOR and (threshold is None or model.far_prior is None):
        raise InvalidInput(
            "rule 'soft_prior' needs the model's outlier calibration, and this model has "
            "none (it was trained without a validation split); use 'majority' or 'soft'"
        )
    return Query(k, rule, threshold)


def threshold_at(model, quantile: float | None = None) -> float | None:
    """The squared nearest distance beyond which a query is an outlier at ``quantile``
    (None: the setting's, computed at load), or None when the model has no calibration.
    InvalidInput when the quantile is outside the calibrated range."""
    if model.outlier_quantiles is None:
        return None
    if quantile is None or quantile == model.default_outlier_quantile:
        return model.default_outlier_threshold
    try:
        return outlier_threshold(model.outlier_quantiles, quantile)
    except ValueError as exc:
        raise InvalidInput(str(exc)) from None


def embed(model, x: np.ndarray) -> np.ndarray:
    """x (n, D) -> z = x W^T + b (n, d) float32; InvalidInput naming the first row whose
    embedding is not finite in float32."""
    with np.errstate(over="ignore", invalid="ignore"):
        z = project(x, model.projection, model.offset)
    bad = non_finite_rows(z)
    if len(bad):
        raise embedding_overflow(int(bad[0]))
    return z


def non_finite_rows(z: np.ndarray) -> np.ndarray:
    """Indices of the rows of z (n, d) with a value that is not a finite float32."""
    return np.flatnonzero(~np.isfinite(z).all(axis=1))


def embedding_overflow(row: int) -> InvalidInput:
    return InvalidInput(
        f"instances[{row}] projects to an embedding beyond float32 range "
        f"(|z| > {FLOAT32_MAX:.4g}): its values are too large for this model's map; "
        "rows must have finite values whose embedding is finite"
    )


def infer(model, parts: Sequence[tuple[np.ndarray, Query]]) -> list[Answer | ServiceError]:
    """The answers of ``parts`` (rows (n_i, D) float32, Query), all with the same k: one
    projection, one search and one decision per (rule, threshold). A part whose rows cannot
    be embedded (an embedding beyond float32) gets its own InvalidInput; the others are
    answered without it."""
    k = parts[0][1].k
    assert all(query.k == k for _, query in parts), "infer: one k per call"
    started = time.time_ns()
    rows = parts[0][0] if len(parts) == 1 else np.concatenate([r for r, _ in parts])
    with np.errstate(over="ignore", invalid="ignore"):
        z = project(rows, model.projection, model.offset)  # (n, d)
    out: list[Answer | ServiceError | None] = [None] * len(parts)
    spans, start = [], 0  # (part, first row, end row) in z
    for i, (part_rows, _) in enumerate(parts):
        spans.append((i, start, start + len(part_rows)))
        start += len(part_rows)
    bad = non_finite_rows(z)
    if len(bad):
        keep = np.ones(len(z), dtype=bool)
        for i, a, b in spans:
            bad_here = bad[(bad >= a) & (bad < b)]
            if len(bad_here):
                out[i] = embedding_overflow(int(bad_here[0]) - a)
                keep[a:b] = False
        z = z[keep]
        spans = _served_spans(parts, out)
        if not spans:
            return out  # type: ignore[return-value]
    distances, indices = search(model, z, k)  # (m, k), (m, k)
    searched = time.time_ns()
    answer = _decided(model, z, distances, indices, [(parts[i][1], a, b) for i, a, b in spans])
    answer.timings.update(search=(started, searched), decide=(searched, time.time_ns()))
    for i, a, b in spans:
        out[i] = answer.rows(a, b, decided=parts[i][1].rule is not None)
    return out  # type: ignore[return-value]


def infer_one(model, rows: np.ndarray, query: Query) -> Answer:
    """:func:`infer` of one part; raises its error."""
    (result,) = infer(model, [(rows, query)])
    if isinstance(result, ServiceError):
        raise result
    return result


def _served_spans(parts, out) -> list[tuple[int, int, int]]:
    """(part, first row, end row) of the parts still to answer, in the rows kept."""
    spans, start = [], 0
    for i, (rows, _) in enumerate(parts):
        if out[i] is None:
            spans.append((i, start, start + len(rows)))
            start += len(rows)
    return spans


def _decided(model, z, distances, indices, spans: list[tuple[Query, int, int]]) -> Answer:
    """The neighbours with one decision for each (rule, threshold) the spans ask for."""
    keys = {query.decision_key for query, _, _ in spans} - {None}
    if not keys:
        return Answer(distances, indices)
    n, n_classes = len(distances), len(model.classes)
    predicted = np.zeros(n, dtype=np.int64)  # (n,)
    probabilities = np.zeros((n, n_classes), dtype=np.float64)  # (n, C)
    for key in keys:
        chosen = [(a, b) for query, a, b in spans if query.decision_key == key]
        if len(keys) == 1 and len(chosen) == len(spans):
            selected = slice(None)
        else:
            selected = np.concatenate([np.arange(a, b) for a, b in chosen])
        rule, threshold = key
        background = None
        if rule == SOFT_PRIOR:
            background = model.far_prior.background(z[selected], threshold)
        predicted[selected], probabilities[selected] = decide(
            model.labels[indices[selected]], distances[selected], n_classes, rule, background
        )
    return Answer(distances, indices, predicted, probabilities)


# ---------------------------------------------------------------- batching


@dataclass
class Job:
    """One request waiting in the batcher's queue."""

    model: LoadedModel
    rows: np.ndarray  # (n, D) float32
    query: Query
    future: asyncio.Future
    enqueued: float = field(default_factory=time.perf_counter)
    enqueued_ns: int = field(default_factory=time.time_ns)  # for the request's trace


class Batcher:
    """Concurrent requests merged into one :func:`infer` call per (model, k) (the module's
    docstring says how a batch is collected)."""

    def __init__(
        self,
        *,
        max_rows: int,
        max_wait_us: int,
        on_batch: Callable[[int, float], None] | None = None,
        inline_rows: int = 0,
    ):
        self.max_rows = max_rows
        self.max_wait = max_wait_us / 1e6
        # groups of at most this many rows run on the event loop, larger ones in the thread
        self.inline_rows = inline_rows
        self.on_batch = on_batch  # (rows in merged search, seconds the oldest job waited)
        self._queue: asyncio.Queue[Job | None] = asyncio.Queue()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="search")
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="batcher")

    async def stop(self) -> None:
        """Finish every queued job, then stop the worker."""
        if self._task is not None:
            await self._queue.put(None)
            await self._task
            self._task = None
        self._executor.shutdown(wait=True)

    async def submit(self, model, rows: np.ndarray, query: Query) -> Answer:
        """The answer to ``query`` for raw rows (n, D), computed with whatever else is
        waiting for the same (model, k)."""
        future = asyncio.get_running_loop().create_future()
        self._queue.put_nowait(Job(model, rows, query, future))
        return await future

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        stopping = False
        while not stopping:
            first = await self._queue.get()
            if first is None:
                break
            jobs = [first]
            rows = len(first.rows)
            deadline = loop.time() + self.max_wait
            while rows < self.max_rows:
                if self._queue.empty():
                    remaining = deadline - loop.time()
                    if remaining <= 0:
                        break
                    await asyncio.sleep(remaining)  # wait out the window once, then drain
                    if self._queue.empty():
                        break
                job = self._queue.get_nowait()
                if job is None:
                    stopping = True
                    break
                jobs.append(job)
                rows += len(job.rows)
            waited = time.perf_counter() - first.enqueued
            for group in _groups(jobs):
                group_started = time.time_ns()
                try:
                    if sum(len(j.rows) for j in group) <= self.inline_rows:
                        results = _run_group(group)
                    else:
                        results = await loop.run_in_executor(self._executor, _run_group, group)
                except Exception as exc:  # reported to every request of the group
                    for job in group:
                        if not job.future.done():
                            job.future.set_exception(exc)
                    continue
                for job, result in zip(group, results, strict=True):
                    if job.future.done():
                        continue
                    if isinstance(result, Exception):
                        job.future.set_exception(result)
                    else:
                        result.timings["queue"] = (job.enqueued_ns, group_started)
                        job.future.set_result(result)
                if self.on_batch is not None:
                    self.on_batch(sum(len(j.rows) for j in group), waited)


def _groups(jobs: list[Job]) -> list[list[Job]]:
    groups: dict[tuple[int, int], list[Job]] = {}
    for job in jobs:
        groups.setdefault((id(job.model), job.query.k), []).append(job)
    return list(groups.values())


def _run_group(group: list[Job]) -> list:
    """One call of the inference path for jobs on the same (model, k)."""
    return infer(group[0].model, [(job.rows, job.query) for job in group])


# ---------------------------------------------------------------- the engine


class Engine:
    """Holds the current model (loads a new one off to the side and swaps it in) and runs
    requests on it: the in-flight gate, then batched or alone through :func:`infer`.

    Failed loads are remembered by the artifact's fingerprint (directory identity, manifest
    hash, file sizes and times: ``artifact_fingerprint``), not by its version: a version that
    failed while it was being written is retried as soon as its files change, and any failed
    artifact again after ``retry_failed_seconds``.
    """

    def __init__(
        self,
        settings: Settings,
        on_fallback: Callable[[int, int], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        retry_failed_seconds: float = 60.0,
        on_load: Callable[[LoadedModel], None] | None = None,
        on_load_failure: Callable[[Exception], None] | None = None,
        in_flight_gauge=None,
        tracing: Tracing | NoTracing | None = None,
    ):
        self.settings = settings
        self.on_fallback = on_fallback
        # called after every load that swapped a model in / after every failed load, whoever
        # asked for it (startup, the reload route, the poller): the one place metrics learn it
        self.on_load = on_load
        self.on_load_failure = on_load_failure
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
        self.in_flight_gauge = in_flight_gauge  # a prometheus Gauge, or None
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
        """Load ``path`` and swap it in, with the load lock held (:meth:`load`)."""
        fingerprint = artifact_fingerprint(path)
        try:
            model = load_model(path, self.settings, on_fallback=self.on_fallback)
        except Exception as exc:
            self._failed_fingerprint = fingerprint
            self._failed_at = self.clock()
            self.last_error = f"{type(exc).__name__}: {exc}"
            log.error("model load failed", extra={"path": str(path), "error": self.last_error})
            if self.on_load_failure is not None:
                self.on_load_failure(exc)
            raise
        self._model = model  # one reference assignment: the swap
        self._loaded_fingerprint = fingerprint
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
        if self.on_load is not None:
            self.on_load(model)
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

    @contextmanager
    def admit(self):
        """The in-flight gate: fail fast with 429 rather than queue without bound."""
        if self.in_flight >= self.settings.max_in_flight:
            raise Overloaded(
                f"{self.in_flight} requests in flight, the limit is "
                f"{self.settings.max_in_flight}; retry later"
            )
        self.in_flight += 1
        if self.in_flight_gauge is not None:
            self.in_flight_gauge.inc()
        try:
            yield
        finally:
            self.in_flight -= 1
            if self.in_flight_gauge is not None:
                self.in_flight_gauge.dec()

    async def infer(self, model, rows: np.ndarray, query: Query) -> Answer:
        """The inference path for one request: merged with others by the batcher when
        batching is on, else computed alone in a worker thread. With tracing on, the
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

    async def embed(self, model, rows: np.ndarray) -> np.ndarray:
        """rows (n, D) -> embeddings (n, d): on the event loop up to INLINE_EMBED_ROWS rows
        (a thread hop costs more), else in a worker thread."""
        if len(rows) <= INLINE_EMBED_ROWS:
            return embed(model, rows)
        return await asyncio.get_running_loop().run_in_executor(None, embed, model, rows)
