"""Dynamic batching: concurrent requests merged into one projection and one FAISS search.

Requests put a job (model, rows, k) on a queue and await its future. One worker task takes
the first waiting job, keeps collecting until ``max_rows`` rows or ``max_wait_us`` have
passed, groups the jobs by (model, k), and runs each group as one ``embed`` + one
``search_embedded`` in a worker thread, off the event loop. Each job gets its own slice of
the answer. Because the projection and the final distances are batch-invariant (see
``service.knn``), a batched answer equals the answer the request would get alone.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from service.engine import embedding_overflow, non_finite_rows
from service.knn import project


@dataclass
class Job:
    model: object  # LoadedModel (kept generic: no engine import needed)
    rows: np.ndarray  # (n, D) float32
    k: int
    future: asyncio.Future
    enqueued: float = field(default_factory=time.perf_counter)


class Batcher:
    def __init__(
        self,
        *,
        max_rows: int,
        max_wait_us: int,
        on_batch: Callable[[int, float], None] | None = None,
    ):
        self.max_rows = max_rows
        self.max_wait = max_wait_us / 1e6
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

    async def search(self, model, rows: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """(distances (n, k), reference row indices (n, k)) for raw rows (n, D)."""
        future = asyncio.get_running_loop().create_future()
        await self._queue.put(Job(model, rows, k, future))
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


def _run_group(group: list[Job]) -> list[tuple[np.ndarray, np.ndarray] | Exception]:
    """One projection and one search for a group of jobs on the same (model, k).

    A job whose rows cannot be embedded (an embedding beyond float32) gets its own error;
    the other jobs of the group are searched without it.
    """
    model, k = group[0].model, group[0].k
    rows = group[0].rows if len(group) == 1 else np.concatenate([j.rows for j in group])
    with np.errstate(over="ignore", invalid="ignore"):
        z = project(rows, model.projection, model.offset)
    bad = non_finite_rows(z)
    out: list = []
    keep = np.ones(len(z), dtype=bool)
    start = 0
    for job in group:
        n = len(job.rows)
        bad_here = bad[(bad >= start) & (bad < start + n)]
        if len(bad_here):
            out.append(embedding_overflow(int(bad_here[0]), start))
            keep[start : start + n] = False
        else:
            out.append(None)
        start += n
    if keep.all():
        dist, idx = model.search_embedded(z, k)
    elif keep.any():
        dist, idx = model.search_embedded(z[keep], k)
    else:
        return out
    start = 0
    for i, job in enumerate(group):
        if out[i] is None:
            n = len(job.rows)
            out[i] = (dist[start : start + n], idx[start : start + n])
            start += n
    return out
