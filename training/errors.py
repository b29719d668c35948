"""The training job's errors for what it cannot use or cannot write.

``ConfigError`` sits at the bottom of ``training``: the configuration, publishing, the job
and the references command all raise it, and the command line maps it to exit status 2
(``training.cli``). A data file the job cannot read raises ``training.data.DataError``.

``WriteError`` is an ``OSError`` met while writing what the job or a references command
produces (the artifact, the ``--publish`` link, the report page) for a reason of the file
system: a full disk (ENOSPC), a read-only one (EROFS), the file-size limit (EFBIG, under
``ulimit -f``; :func:`raise_on_file_size_limit` makes that an error rather than a signal
that kills the process). Its message is one line naming the path and the cause; the
command line maps it, as any ``OSError`` (:func:`describe_os_error`), to exit status 2.
The writers make their output under a temporary name and rename it into place, so a write
that fails replaces nothing.
"""

from __future__ import annotations

import _thread
import argparse
import contextlib
import errno
import os
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path


class ConfigError(ValueError):
    """An option has a value the job cannot use."""


class WriteError(OSError):
    """Writing ``what`` at ``path`` failed with ``cause`` (an OSError): errno and strerror
    are the cause's, ``filename`` is ``path``."""

    def __init__(self, what: str, path: str | os.PathLike, cause: OSError):
        super().__init__(cause.errno, cause.strerror or str(cause), os.fspath(path))
        self.what = what

    def __str__(self) -> str:
        return (
            f"cannot write {self.what} {self.filename}: {_cause(self)}; "
            "nothing at that path was replaced"
        )


def _cause(exc: OSError) -> str:
    """'No space left on device (ENOSPC)': the cause and its errno's name."""
    name = errno.errorcode.get(exc.errno) if exc.errno is not None else None
    text = exc.strerror or str(exc)
    return f"{text} ({name})" if name else text


def describe_os_error(exc: OSError) -> str:
    """One line for the command line: a WriteError's own, else the path(s) and the cause
    ('/data/x.npy: Permission denied (EACCES)')."""
    if isinstance(exc, WriteError):
        return str(exc)
    paths = [os.fspath(p) for p in (exc.filename, exc.filename2) if p is not None]
    where = " -> ".join(str(p) for p in paths)
    return f"{where}: {_cause(exc)}" if where else _cause(exc)


# What a command refuses with exit status 2 and one line: bad input (DataError, ConfigError
# and ArtifactError are ValueErrors), settings that drive the fit out of floating-point
# range, output that cannot be written (an OSError: its path and cause)
REFUSED = (ValueError, FloatingPointError, OSError)


def refusal(exc: Exception) -> str:
    """The line of a REFUSED exception: an OSError's path and cause, another's text."""
    return str(exc) if isinstance(exc, (ValueError, FloatingPointError)) else describe_os_error(exc)


@contextlib.contextmanager
def writing(what: str, path: str | os.PathLike) -> Iterator[None]:
    """Any OSError inside becomes a WriteError naming ``what`` and ``path``."""
    try:
        yield
    except WriteError:
        raise
    except OSError as exc:
        raise WriteError(what, path, exc) from exc


def raise_on_file_size_limit() -> None:
    """Ignore SIGXFSZ, so that a write past the file-size limit (``ulimit -f``) fails with
    EFBIG, which the writers report, instead of killing the process."""
    if hasattr(signal, "SIGXFSZ"):
        try:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        except ValueError:  # not the main thread (the CLI called from a thread): as it was
            pass


def print_output(text: str) -> OSError | None:
    """Print ``text`` and a newline on stdout, flushed; the OSError when stdout refuses it
    (redirected to a full disk or a read-only file, a closed pipe), else None. After a
    failure stdout is pointed at /dev/null, so the interpreter's last flush of what is left
    in its buffer does not fail again (a traceback and exit status 120)."""
    try:
        print(text, flush=True)
    except OSError as exc:
        with contextlib.suppress(OSError, ValueError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            os.close(devnull)
        return exc
    return None


class Interrupted(BaseException):
    """SIGINT or SIGTERM reached the job: it stops where it is (a BaseException, so that no
    ``except Exception`` on the way swallows it; a write in progress removes its staging)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum
        self.written: str | None = None  # an artifact written whole before the command stopped

    @property
    def exit_status(self) -> int:
        return 128 + self.signum  # the shell's convention: 130 for SIGINT, 143 for SIGTERM


class _Hold:
    """A signal held by ``holding_interrupts``: which (None: none yet), and the timer that
    raises it when the hold's time is up."""

    def __init__(self, seconds: float | None):
        self.seconds = seconds
        self.signum: int | None = None
        self.timer: threading.Timer | None = None


_hold: _Hold | None = None  # the hold in force (None: a signal raises at once)
_from_timer = False  # the next signal is a hold's timer's (``_expire``), not the system's


def _expire(hold: _Hold) -> None:
    """A hold's time is up: its signal raised in the main thread, if the hold is still in
    force (a timer that fires as its hold ends does nothing)."""
    global _from_timer
    if _hold is hold:
        _from_timer = True
        _thread.interrupt_main(hold.signum)


def _on_signal(signum, frame):
    global _from_timer
    from_timer, _from_timer = _from_timer, False
    hold = _hold
    if from_timer and (hold is None or hold.timer is None):  # its hold ended meanwhile
        return
    if hold is None or hold.signum is not None:  # no hold, or a second signal: at once
        if hold is not None and hold.timer is not None:
            hold.timer.cancel()
        raise Interrupted(hold.signum if hold is not None and hold.signum else signum)
    hold.signum = signum
    if hold.seconds is not None:  # then raised, wherever the work is
        hold.timer = threading.Timer(hold.seconds, _expire, args=(hold,))
        hold.timer.daemon = True
        hold.timer.start()


def raise_on_interrupt() -> None:
    """SIGINT and SIGTERM raise :class:`Interrupted` in the main thread (a Kubernetes node
    drain sends SIGTERM), so the command ends with one line, not a traceback or silence;
    within ``holding_interrupts`` the first is held."""
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, _on_signal)


@contextlib.contextmanager
def holding_interrupts(seconds: float | None) -> Iterator[_Hold]:
    """Within it a first SIGINT or SIGTERM is held rather than raised, so that the work in
    hand can end at a point of its choosing: ``held_interrupt()`` names it, and the work
    raises it once it has saved what it must. A second signal, or ``seconds`` after the
    first (None: no limit), raises it wherever the work is. A signal still held when the
    block ends is the caller's to act on (``hold.signum``). Inert when the process's handler
    is not ``raise_on_interrupt``'s (the estimator used from Python), and in any thread but
    the main one."""
    global _hold
    main = threading.current_thread() is threading.main_thread()
    if not main or signal.getsignal(signal.SIGTERM) is not _on_signal:
        yield _Hold(seconds)
        return
    outer, _hold = _hold, _Hold(seconds)
    hold = _hold
    try:
        yield hold
    finally:
        if hold.timer is not None:
            hold.timer.cancel()
        _hold = outer
        if outer is not None and hold.signum is not None and outer.signum is None:
            outer.signum = hold.signum  # an outer hold keeps it for its own end


def held_interrupt() -> int | None:
    """The signal the hold in force has held (None: none, or no hold)."""
    return None if _hold is None else _hold.signum


def interrupted_line(exc: Interrupted, seconds: float, out: str | None, checkpoint=None) -> str:
    """The one line an interrupted command prints; ``checkpoint``: the fit's checkpoint
    directory (a Path, or None), named when it holds a fit's or a prototype learning's state
    to resume from."""
    if exc.written:  # the signal came once the artifact was written: nothing to run again
        return (
            f"interrupted by {exc.args[0]} after {seconds:.1f} s; {exc.written} was written "
            "whole first (its --publish may not be repointed)"
        )
    where = f"; nothing was written at {out} (a version already there is intact)" if out else ""
    again = "run the same command again to start over"
    saved = ("fit-rank*.npz", "prototypes-*.npz")  # a fit's, a condense's prototype learning
    if checkpoint is not None and any(any(Path(checkpoint).glob(name)) for name in saved):
        again = f"run the same command again to resume from the checkpoint in {checkpoint}"
    return f"interrupted by {exc.args[0]} after {seconds:.1f} s{where}; {again}"


SEED_MAX = 2**32 - 1  # numpy's and torch's seeds: 0 .. 2^32 - 1


def check_lock_timeout(value: float | None, option: str = "--lock-timeout") -> float | None:
    """``value`` when it is None or a finite number of seconds >= 0; ConfigError naming
    ``option``."""
    if value is not None and not (isinstance(value, (int, float)) and 0 <= value < float("inf")):
        raise ConfigError(f"{option}={value!r} must be a finite number of seconds >= 0")
    return value


def check_seed(value: int, option: str = "--seed") -> int:
    """``value`` when it is an integer in [0, SEED_MAX]; ConfigError naming ``option``."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= SEED_MAX:
        raise ConfigError(f"{option}={value!r} must be an integer in [0, {SEED_MAX}]")
    return value


class OneLineParser(argparse.ArgumentParser):
    """The command line's parser (the job's and the references command's), whose usage
    errors are one line, as every other error of the job is: ``error: PROG: MESSAGE (PROG
    --help lists the options)``, exit status 2. An unknown option followed by its value
    (``--validation-fraction 0.2``) is named as the option, not as a command '0.2'."""

    def parse_known_args(self, args=None, namespace=None):
        self._argv = list(sys.argv[1:] if args is None else args)  # for error()
        return super().parse_known_args(args, namespace)

    def error(self, message: str):
        unknown = self._option_before_invalid_choice(message)
        if unknown is not None:
            message = f"unrecognized option {unknown[0]} (given the value {unknown[1]!r})"
        self.exit(2, f"error: {self.prog}: {message} ({self.prog} --help lists the options)\n")

    def _option_before_invalid_choice(self, message: str) -> tuple[str, str] | None:
        """(option, value) when argparse took an unknown option's value for a command's
        name: the value ``message`` calls an invalid choice follows an option argparse
        does not know."""
        if "invalid choice: " not in message:
            return None
        value = message.split("invalid choice: ", 1)[1].split(" (choose", 1)[0].strip("'")
        argv = [str(a) for a in getattr(self, "_argv", [])]
        if value not in argv[1:]:
            return None
        before = argv[argv.index(value, 1) - 1]
        known = before.split("=", 1)[0] in self._option_string_actions
        return (before, value) if before.startswith("-") and not known else None
