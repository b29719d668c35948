"""Dynamic batching: concurrent requests merged into one projection, one FAISS search and
one decision per rule.

Requests put a job (model, rows, k, rule) on a queue and await its future. One worker task
takes the first waiting job, keeps collecting until ``max_rows`` rows or ``max_wait_us``
have passed, groups the jobs by (model, k), and runs each group in a worker thread, off the
event loop (or, for groups of at most ``inline_rows`` rows, on the event loop itself: on one
core that saves two thread hand-offs a batch and nothing runs in parallel anyway): one
``project``, one ``search_embedded``, and one ``decide`` for each decision
rule the group's jobs asked for. Each job gets its own slice of the answer
(:class:`service.engine.Answer`). The projection, the final distances and the decision are
all computed row by row (see ``service.knn``), so a batched answer equals the answer the
request would get alone.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from service.engine import Answer, embedding_overflow, non_finite_rows
from service.knn import decide, project
from service.vocabulary import DecisionRule

SOFT_PRIOR = DecisionRule.SOFT_PRIOR.value


@dataclass
class Job:
    model: object  # LoadedModel (kept generic: no engine import needed)
    rows: np.ndarray  # (n, D) float32
    k: int
    rule: str | None  # the decision rule, or None for neighbours only
    future: asyncio.Future
    threshold: float | None = None  # the outlier threshold setting the soft_prior rule
    enqueued: float = field(default_factory=time.perf_counter)


class Batcher:
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

    async def answer(
        self,
        model,
        rows: np.ndarray,
        k: int,
        rule: str | None = None,
        threshold: float | None = None,
    ) -> Answer:
        """The k neighbours of raw rows (n, D), and the decision by ``rule`` when given
        (``threshold``: the outlier threshold of the soft_prior rule)."""
        future = asyncio.get_running_loop().create_future()
        self._queue.put_nowait(Job(model, rows, k, rule, future, threshold=threshold))
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
                        job.future.set_result(result)
                if self.on_batch is not None:
                    self.on_batch(sum(len(j.rows) for j in group), waited)


def _groups(jobs: list[Job]) -> list[list[Job]]:
    groups: dict[tuple[int, int], list[Job]] = {}
    for job in jobs:
        groups.setdefault((id(job.model), job.k), []).append(job)
    return list(groups.values())


def _decision_key(job: Job) -> tuple[str, float | None] | None:
    """Jobs with equal keys share one decision: the rule, and for soft_prior its threshold."""
    if job.rule is None:
        return None
    return (job.rule, job.threshold if job.rule == SOFT_PRIOR else None)


def _run_group(group: list[Job]) -> list[Answer | Exception]:
    """One projection, one search and one decision per rule for jobs on the same (model, k).

    A job whose rows cannot be embedded (an embedding beyond float32) gets its own error;
    the other jobs of the group are answered without it.
    """
    model, k = group[0].model, group[0].k
    rows = group[0].rows if len(group) == 1 else np.concatenate([j.rows for j in group])
    with np.errstate(over="ignore", invalid="ignore"):
        z = project(rows, model.projection, model.offset)
    bad = non_finite_rows(z)
    out: list = [None] * len(group)
    if len(bad):
        keep = np.ones(len(z), dtype=bool)
        start = 0
        for i, job in enumerate(group):
            n = len(job.rows)
            bad_here = bad[(bad >= start) & (bad < start + n)]
            if len(bad_here):
                out[i] = embedding_overflow(int(bad_here[0]), start)
                keep[start : start + n] = False
            start += n
        z = z[keep]
    served = [i for i in range(len(group)) if out[i] is None]
    if not served:
        return out
    distances, indices = model.search_embedded(z, k)
    # row spans of the served jobs in the searched rows
    spans, start = [], 0
    for i in served:
        n = len(group[i].rows)
        spans.append((i, start, start + n))
        start += n
    keys = {_decision_key(group[i]) for i in served} - {None}
    predicted = probabilities = None
    if keys:
        predicted = np.zeros(len(distances), dtype=np.int64)
        probabilities = np.zeros((len(distances), len(model.classes)), dtype=np.float64)
        for key in keys:
            if len(keys) == 1 and all(_decision_key(group[i]) == key for i in served):
                selected = slice(None)
            else:
                selected = np.concatenate(
                    [np.arange(a, b) for i, a, b in spans if _decision_key(group[i]) == key]
                )
            rule, threshold = key
            background = model.background(z[selected], rule, threshold)
            p, proba = decide(
                model.labels[indices[selected]],
                distances[selected],
                len(model.classes),
                rule,
                background,
            )
            predicted[selected], probabilities[selected] = p, proba
    answer = Answer(distances, indices, predicted, probabilities)
    for i, a, b in spans:
        part = answer.rows(a, b)
        out[i] = part if group[i].rule is not None else Answer(part.distances, part.indices)
    return out
