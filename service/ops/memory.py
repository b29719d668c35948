"""Giving freed memory back to the operating system after large requests.

glibc keeps freed heap pages for reuse; after a request that parsed tens of megabytes the
process would otherwise stay at its peak RSS. ``malloc_trim(0)`` returns free pages at the
top and inside the heap. It runs off the event loop, at most once per
``MIN_INTERVAL_SECONDS``, and is a no-op where glibc is absent. ``trim_soon`` asks for one
from the event loop: within the interval of the last trim, the request is not dropped but
runs when the interval ends, so the memory of a burst of large requests (several stalled
bodies cut off at once) comes back after the last of them.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import threading
import time

MIN_INTERVAL_SECONDS = 1.0
LARGE_REQUEST_BYTES = 4 * 2**20  # requests with bodies or answers this large trigger a trim

_lock = threading.Lock()
_last = 0.0
_scheduled = False  # a trim_soon is pending
_trim = None
try:  # pragma: no branch
    _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    _trim = _libc.malloc_trim
    _trim.argtypes = [ctypes.c_size_t]
    _trim.restype = ctypes.c_int
except (OSError, AttributeError):  # pragma: no cover - not glibc
    _trim = None


def trim() -> bool:
    """Return free heap memory to the OS; False when skipped (too soon, or not glibc)."""
    global _last
    if _trim is None:
        return False
    with _lock:
        now = time.monotonic()
        if now - _last < MIN_INTERVAL_SECONDS:
            return False
        _last = now
    _trim(0)
    return True


def trim_soon() -> None:
    """Ask for a trim from the event loop: in a worker thread now, or when MIN_INTERVAL_SECONDS
    have passed since the last one; one pending trim covers every request made meanwhile."""
    global _scheduled
    if _trim is None or _scheduled:
        return
    _scheduled = True
    loop = asyncio.get_running_loop()

    def run() -> None:
        global _scheduled
        _scheduled = False
        loop.run_in_executor(None, trim)

    loop.call_later(max(0.0, MIN_INTERVAL_SECONDS - (time.monotonic() - _last)), run)
