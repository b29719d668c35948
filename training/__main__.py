"""``python -m training``: SIGINT and SIGTERM are handled from the first line. A signal that
arrives during the seconds of imports (torch, the readers) is held until they are done (a
signal raised inside an import can surface as another error: Python wraps what a class's
``__set_name__`` raises in a RuntimeError), then ends the command with one line and the
shell's status (130, 143), never a traceback; so does a second signal, raised in them."""

import signal
import sys

from training.errors import Interrupted, holding_interrupts, raise_on_interrupt


def _interrupted_by(exc: BaseException | None) -> Interrupted | None:
    """The Interrupted that ``exc`` is or was raised from (None: none)."""
    while exc is not None and not isinstance(exc, Interrupted):
        exc = exc.__cause__ or exc.__context__
    return exc


def _stop(signum: int) -> None:
    name = signal.Signals(signum).name
    print(
        f"error: interrupted by {name} while starting; nothing was read or written",
        file=sys.stderr,
        flush=True,
    )
    sys.exit(128 + signum)


raise_on_interrupt()
try:
    with holding_interrupts(None) as hold:
        from training.cli import main
except BaseException as exc:  # a second signal during the imports, however it surfaced
    interrupted = _interrupted_by(exc)
    if interrupted is None:
        raise
    _stop(interrupted.signum)
if hold.signum is not None:
    _stop(hold.signum)

sys.exit(main())
