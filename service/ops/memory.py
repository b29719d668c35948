"""Giving freed memory back to the operating system after large requests.

glibc keeps freed heap pages for reuse; after a request that parsed tens of megabytes the
process would otherwise stay at its peak RSS. ``malloc_trim(0)`` returns free pages at the
top and inside the heap. It is called off the event loop, at most once per
``MIN_INTERVAL_SECONDS``, and is a no-op where glibc is absent.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import threading
import time

MIN_INTERVAL_SECONDS = 1.0
LARGE_REQUEST_BYTES = 4 * 2**20  # requests with bodies or answers this large trigger a trim

_lock = threading.Lock()
_last = 0.0
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
