"""Whether a process of this host (this PID namespace) still exists."""

from __future__ import annotations

import os


def process_alive(pid: int) -> bool:
    """True unless signal 0 to ``pid`` says no such process (ESRCH). A process owned by
    another user (EPERM) exists. ``pid`` <= 0 names no one process (0 and negative numbers
    signal process groups), and a number beyond pid_t names none: False for both."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):
        return False
    except PermissionError:
        return True
    return True
