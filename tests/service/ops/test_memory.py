"""The memory trim after large requests: every request is covered by a trim that runs
after it, requests within the interval share one trim, and no scheduled trim is skipped.

No bound here is a latency: each test waits (up to WAIT_SECONDS) for the trims it expects,
so a slow or loaded machine only makes it slower."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from service.ops import memory

INTERVAL = 0.2
WAIT_SECONDS = 10.0


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


async def wait_for_trims(trims: list[float], n: int) -> None:
    deadline = time.monotonic() + WAIT_SECONDS
    while len(trims) < n:
        assert time.monotonic() < deadline, f"{len(trims)} trims, {n} expected"
        await asyncio.sleep(0.01)


def test_a_first_request_is_trimmed_without_waiting_for_the_interval(trims, monkeypatch):
    """With an interval longer than the wait, a first request's trim still comes: it was
    not held back by the interval."""
    monkeypatch.setattr(memory, "MIN_INTERVAL_SECONDS", 2 * WAIT_SECONDS)

    async def scenario():
        memory.trim_soon()
        await wait_for_trims(trims, 1)

    asyncio.run(scenario())
    assert len(trims) == 1


def test_requests_within_the_interval_share_one_trim_after_the_last_of_them(trims):
    async def scenario():
        memory.trim_soon()
        await wait_for_trims(trims, 1)
        for _ in range(5):  # all at once, within the interval of the first trim
            memory.trim_soon()
        asked = time.monotonic()
        await wait_for_trims(trims, 2)
        await asyncio.sleep(3 * INTERVAL)  # no third trim comes
        return asked

    asked = asyncio.run(scenario())
    assert len(trims) == 2
    assert trims[1] > asked  # the last request's memory was covered


def test_a_request_while_a_trim_waits_for_its_thread_gets_a_trim_of_its_own(trims):
    """The race a fresh-clone CI run met: a trim handed to a busy thread pool, then the
    request that frees the memory; the second trim must run after it, not be skipped as
    too soon when both finally reach a thread (the old code ran 1 trim here)."""
    gate = threading.Event()

    async def scenario():
        loop = asyncio.get_running_loop()
        loop.set_default_executor(ThreadPoolExecutor(max_workers=1))
        busy = loop.run_in_executor(None, gate.wait, WAIT_SECONDS)  # the pool is busy
        memory.trim_soon()
        await asyncio.sleep(0.01)  # handed to the pool, not yet run
        freed = time.monotonic()
        memory.trim_soon()  # the answer's memory is freed now
        gate.set()
        await busy
        await wait_for_trims(trims, 2)
        return freed

    freed = asyncio.run(scenario())
    assert len(trims) == 2
    assert trims[1] > freed


def test_without_glibc_nothing_is_scheduled(trims, monkeypatch):
    monkeypatch.setattr(memory, "_trim", None)

    async def scenario():
        memory.trim_soon()
        await asyncio.sleep(0.05)

    asyncio.run(scenario())
    assert trims == [] and memory._scheduled is False
