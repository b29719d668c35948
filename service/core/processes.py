"""Whether a process of this host (this PID namespace) still exists."""

from __future__ import annotations

import os


def process_alive(pid: int) -> bool:
    """True unless signal 0 to ``pid`` says no such process (ESRCH). A process owned by
    another user (EPERM) exists."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
