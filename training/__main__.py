"""``python -m training``: SIGINT and SIGTERM are handled from the first line. During the
seconds of imports (torch, the readers) a signal ends the command at once, from the handler,
with one line and the shell's status (130, 143): nothing was read or written yet, so there
is nothing to finish, and nothing is raised inside an import (an exception raised in a
module's initialisation can leave numpy half-imported and surface as an unrelated
ImportError or RecursionError, with a traceback). Once the command is parsed, its own handling
takes over (``training.errors.raise_on_interrupt``, installed by ``training.cli.main``)."""

import os
import signal
import sys


def _stop_while_starting(signum: int, frame) -> None:
    name = signal.Signals(signum).name
    line = f"error: interrupted by {name} while starting; nothing was read or written\n"
    os.write(2, line.encode())
    os._exit(128 + signum)


for _signum in (signal.SIGINT, signal.SIGTERM):
    signal.signal(_signum, _stop_while_starting)

from training.cli import main  # noqa: E402  (after the handlers: the imports take seconds)

sys.exit(main())  # which installs raise_on_interrupt's handlers once the command is parsed
