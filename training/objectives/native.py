"""The native kernels (``training/objectives/kernels/*.c``): built at install, loaded with ctypes.

This module finds and loads them; kNCA's fast path is in :mod:`training.objectives.knca_native`,
NCA on candidate sets in :mod:`training.objectives.native_candidates`, exact NCA's row pass
(its exps and their sums; the products stay in torch) in
:mod:`training.objectives.native_rows` (``benchmarks/README.md``, "Which native kernels
pay", "The exact row pass in C").

Building: ``setup.py`` compiles every source at install time, once per dtype flavour and per
instruction-set level of the machine's architecture (``kernels/levels.py``: on x86-64 the
psABI levels v4 (AVX-512), v3 (AVX2 + FMA) and the baseline), into libraries beside the
sources. Nothing is compiled at run time: :func:`load_library` loads the best level whose CPU
flags this machine has (``/proc/cpuinfo``), so one wheel runs on any x86-64.

When no level of a library was built (the install had no C compiler), ``NCA_KNN_NATIVE=0`` is
set, or the tensors are not CPU float32 / float64, callers use the torch path; a library that
was not built warns once, and the fit records which path ran (``NCA.kernels_``).
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform
import sysconfig
import threading
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

from training.objectives.kernels import levels

KERNEL_DIR = Path(levels.__file__).resolve().parent  # the C sources and the built libraries
FLAVOURS = {torch.float32: "f32", torch.float64: "f64"}


def enabled() -> bool:
    """False when the environment turns the native kernel off (NCA_KNN_NATIVE=0)."""
    return os.environ.get("NCA_KNN_NATIVE", "1").strip().lower() not in ("0", "false", "no", "off")


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as /proc/cpuinfo lists them (empty where it cannot be read:
    only the baseline level is then loaded)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def library_file(library: str) -> tuple[str, Path] | None:
    """(level, path) of the best built level of ``library`` (e.g. "nca_candidates_f32") that this
    CPU runs, or None when the install built none."""
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    for level, _compile_flags, needs in levels.levels_for(platform.machine()):
        path = KERNEL_DIR / f"{library}_{level}{suffix}"
        if set(needs) <= cpu_flags() and path.is_file():
            return level, path
    return None


@functools.cache
def load_library(library: str) -> ctypes.CDLL | None:
    """The loaded library, or None (with one warning naming it) when the install built no
    level of it that this CPU runs, or the load fails."""
    found = library_file(library)
    problem = "was not built by this install (setup.py builds it where a C compiler is present)"
    if found is not None:
        try:
            return ctypes.CDLL(str(found[1]))
        except OSError as error:
            problem = f"failed to load from {found[1]}: {error}"
    warnings.warn(
        f"native kernel {library} {problem}; training uses the torch path", RuntimeWarning, 3
    )
    return None


def run_in_threads(work: Callable[[int, int, int], None], n: int, threads: int) -> None:
    """work(t, lo, hi) on ``threads`` contiguous parts [lo, hi) of range(n), part 0 on the
    calling thread (a ctypes call releases the GIL, so the parts run in parallel). Whatever
    any part raises is re-raised here, after every part has ended."""
    bounds = [n * t // threads for t in range(threads + 1)]
    errors: list[BaseException] = []

    def guarded(t: int) -> None:
        try:
            work(t, bounds[t], bounds[t + 1])
        except BaseException as error:  # re-raised below, once every thread has ended
            errors.append(error)

    workers = [threading.Thread(target=guarded, args=(t,)) for t in range(1, threads)]
    for worker in workers:
        worker.start()
    guarded(0)
    for worker in workers:
        worker.join()
    if errors:
        raise errors[0]
