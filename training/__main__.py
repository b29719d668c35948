"""``python -m training``: SIGINT and SIGTERM are handled from the first line. During the
seconds of imports (torch, the readers) a signal ends the command at once, from the handler,
with one line and the shell's status (130, 143): nothing was read or written yet, so there
is nothing to finish, and nothing is raised inside an import (an exception raised in a
module's initialisation can leave numpy half-imported and surface as an unrelated
ImportError or RecursionError, with a traceback). Once the command is parsed, its own handling
takes over (``training.errors.raise_on_interrupt``, installed by ``training.cli.main``).

Before torch is imported it also shortens how long OpenMP's idle worker threads spin
(``GOMP_SPINCOUNT``), unless the environment sets it or ``OMP_WAIT_POLICY`` (from which
libgomp derives the spin count when ``GOMP_SPINCOUNT`` is unset: PASSIVE 0, ACTIVE
30,000,000,000); libgomp reads them once, when torch loads it. After each of torch's
parallel regions its worker spins on the other core for 300,000 turns by default, and the C
row pass that follows the GEMM gets one core in effect; at 10,000 the real digits' default
fit took 26.7 s instead of 29.4 s and clustered20k's 6.2 s instead of 7.6 s, the same maps
(medians of three alternating pairs, ``benchmarks/README.md``, "OpenMP's spinning
worker")."""

import os
import signal
import sys

# OpenMP's idle workers spin this many turns before they sleep (libgomp's default: 300,000)
OPENMP_SPIN_COUNT = "10000"
if "GOMP_SPINCOUNT" not in os.environ and "OMP_WAIT_POLICY" not in os.environ:
    os.environ["GOMP_SPINCOUNT"] = OPENMP_SPIN_COUNT


def _stop_while_starting(signum: int, frame) -> None:
    name = signal.Signals(signum).name
    line = f"error: interrupted by {name} while starting; nothing was read or written\n"
    os.write(2, line.encode())
    os._exit(128 + signum)


for _signum in (signal.SIGINT, signal.SIGTERM):
    signal.signal(_signum, _stop_while_starting)

from training.cli import main  # noqa: E402  (after the handlers: the imports take seconds)

sys.exit(main())  # which installs raise_on_interrupt's handlers once the command is parsed
