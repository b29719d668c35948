"""The dynamic batcher: concurrent requests merged into one search.

One worker task takes the first waiting job, keeps collecting until ``max_rows`` rows or
``max_wait_us`` have passed, groups the jobs by (model, k) and calls
``service.engine.infer.infer`` once per group, in a search thread (or, for groups of at most
``inline_rows`` rows, on the event loop itself: on one core that saves two thread hand-offs a
batch and nothing runs in parallel anyway). Each job gets its own part of the answer, equal
to the answer it gets alone (the inference path computes row by row).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from service.core.sparse import SparseRows, dense_rows_equivalent
from service.engine.infer import Answer, Query, infer
from service.engine.model import LoadedModel


@dataclass
class Job:
    """One request waiting in the batcher's queue."""

    model: LoadedModel
    rows: np.ndarray | SparseRows  # (n, D) float32, or n sparse rows
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
        """The answer to ``query`` for raw rows (n, D) or SparseRows, computed with whatever else is
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
                    if sum(dense_rows_equivalent(j.rows) for j in group) <= self.inline_rows:
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
