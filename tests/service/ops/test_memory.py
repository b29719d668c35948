"""The memory trim after large requests: every request is covered by a trim that runs
after it, trims are at least MIN_INTERVAL_SECONDS apart, and none is ever skipped."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from service.ops import memory

INTERVAL = 0.2


@pytest.fixture
def trims(monkeypatch):
    """The times (time.monotonic) at which malloc_trim was called, in order; the interval
    made short and the last trim forgotten."""
    calls: list[float] = []
    lock = threading.Lock()

    def fake_trim(pad: int) -> int:
        assert pad == 0
        with lock:
            calls.append(time.monotonic())
        return 1

    monkeypatch.setattr(memory, "_trim", fake_trim)
    monkeypatch.setattr(memory, "MIN_INTERVAL_SECONDS", INTERVAL)
    monkeypatch.setattr(memory, "_last", -float("inf"))
    monkeypatch.setattr(memory, "_scheduled", False)
    return calls


def test_a_first_request_is_trimmed_at_once(trims):
    async def scenario():
        asked = time.monotonic()
        memory.trim_soon()
        await asyncio.sleep(INTERVAL / 2)
        return asked

    asked = asyncio.run(scenario())
    assert len(trims) == 1 and trims[0] - asked < INTERVAL / 2


def test_requests_within_the_interval_share_one_trim_after_the_last_of_them(trims):
    async def scenario():
        memory.trim_soon()  # trimmed at once
        await asyncio.sleep(0.01)
        asked = []
        for _ in range(5):  # within the interval: one trim, one interval after the first
            asked.append(time.monotonic())
            memory.trim_soon()
            await asyncio.sleep(0.01)
        await asyncio.sleep(2 * INTERVAL)
        return asked

    asked = asyncio.run(scenario())
    assert len(trims) == 2
    assert trims[1] - trims[0] >= INTERVAL * 0.95
    assert trims[1] > asked[-1]  # the last request's memory was covered


def test_a_request_while_a_trim_waits_for_its_thread_gets_a_trim_of_its_own(trims):
    """The race a fresh-clone CI run met: a trim handed to a busy thread pool, then the
    request that frees the memory; the second trim must run after the first (one interval
    later), not be skipped as too soon when both finally reach a thread."""
    gate = threading.Event()

    async def scenario():
        loop = asyncio.get_running_loop()
        loop.set_default_executor(ThreadPoolExecutor(max_workers=1))
        busy = loop.run_in_executor(None, gate.wait, 5)  # the pool is busy, as under load
        memory.trim_soon()
        await asyncio.sleep(0.01)  # handed to the pool, not yet run
        freed = time.monotonic()
        memory.trim_soon()  # the answer's memory is freed now
        await asyncio.sleep(0.01)
        gate.set()
        await busy
        await asyncio.sleep(2 * INTERVAL)
        return freed

    freed = asyncio.run(scenario())
    assert len(trims) == 2
    assert trims[1] > freed


def test_without_glibc_nothing_is_scheduled(trims, monkeypatch):
    monkeypatch.setattr(memory, "_trim", None)

    async def scenario():
        memory.trim_soon()
        await asyncio.sleep(0.01)

    asyncio.run(scenario())
    assert trims == [] and memory._scheduled is False
