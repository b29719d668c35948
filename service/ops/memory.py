"""Giving freed memory back to the operating system after large requests.

glibc keeps freed heap pages for reuse; after a request that parsed tens of megabytes the
process would otherwise stay at its peak RSS. ``malloc_trim(0)`` returns free pages at the
top and inside the heap. ``trim_soon`` asks for one from the event loop; it runs in a
worker thread, at most once per ``MIN_INTERVAL_SECONDS``, and is a no-op where glibc is
absent. A request within the interval of the last trim is not dropped: one trim runs when
the interval ends and covers every request made meanwhile, so the memory of a burst of large
requests (several stalled bodies cut off at once, or an answer freed by its task a few loop
iterations after its connection was reset) comes back after the last of them.

The interval counts from when a trim is handed to the worker thread, on the event loop's
thread, so a trim asked for while another is still waiting for a thread is scheduled one
interval later and always runs (it is never skipped as "too soon").
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import time

MIN_INTERVAL_SECONDS = 1.0
LARGE_REQUEST_BYTES = 4 * 2**20  # requests with bodies or answers this large trigger a trim

_last = -float("inf")  # time.monotonic() when the last trim was handed to a worker thread
_scheduled = False  # a trim is scheduled and not yet handed to a thread
_trim = None
try:  # pragma: no branch
    _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    _trim = _libc.malloc_trim
    _trim.argtypes = [ctypes.c_size_t]
    _trim.restype = ctypes.c_int
except (OSError, AttributeError):  # pragma: no cover - not glibc
    _trim = None


def trim_soon() -> None:
    """Ask for a trim from the event loop: handed to a worker thread now, or when
    MIN_INTERVAL_SECONDS have passed since the last one was; one pending trim covers every
    request made meanwhile."""
    global _scheduled
    if _trim is None or _scheduled:
        return
    _scheduled = True
    loop = asyncio.get_running_loop()

    def run() -> None:
        global _scheduled, _last
        _scheduled = False
        _last = time.monotonic()
        loop.run_in_executor(None, _trim, 0)

    loop.call_later(max(0.0, _last + MIN_INTERVAL_SECONDS - time.monotonic()), run)
