"""``python -m training``: SIGINT and SIGTERM are handled from the first line. A signal that
arrives during the seconds of imports (torch, the readers) is held until they are done (a
signal raised inside an import can surface as another error: Python wraps what a class's
``__set_name__`` raises in a RuntimeError), then ends the command with one line and the
shell's status (130, 143), never a traceback."""

import signal
import sys

from training.errors import holding_interrupts, raise_on_interrupt

raise_on_interrupt()
with holding_interrupts(None) as hold:
    from training.cli import main
if hold.signum is not None:
    name = signal.Signals(hold.signum).name
    print(
        f"error: interrupted by {name} while starting; nothing was read or written",
        file=sys.stderr,
        flush=True,
    )
    sys.exit(128 + hold.signum)

sys.exit(main())
