"""The native kernels (``training/objectives/kernels/*.c``): built at install, loaded with ctypes.

This module loads them and holds the exact-NCA entry point; kNCA's fast path is in
:mod:`training.objectives.knca_native`, NCA on candidate sets in
:mod:`training.objectives.native_candidates`. The exact-NCA source (``nca_exact.c``) computes
exactly what :func:`training.objectives.nca_kernel.nca_value_and_grad` computes (its docstring
has the mathematics), but keeps each block of logits in cache from the GEMM to the last use of
W instead of making a dozen passes over a (chunk, N) buffer in memory.

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
from typing import NamedTuple

import torch

from training.objectives.kernels import levels

KERNEL_DIR = Path(levels.__file__).resolve().parent  # the C sources and the built libraries
TILE = 16  # padding multiple of the embedding width and of N (TILE in the C source)
ROWS_PER_THREAD = 64  # fewer query rows than this per thread are not worth a thread
ROWS = 8  # query rows per register tile (ROWS in the C source): blocks are multiples of it
MIN_BLOCK_ROWS = 16  # query rows per block at least ...
SCRATCH_BYTES = 32 * 2**20  # ... and otherwise as many as fit this per thread (w and w_same)
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
    """(level, path) of the best built level of ``library`` (e.g. "nca_exact_f32") that this
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


class Kernel(NamedTuple):
    """The C entry point for one dtype and the most query rows per block it takes."""

    fn: ctypes._CFuncPtr
    max_block_rows: int


def block_rows_for(npad: int, longest: int, itemsize: int, max_rows: int) -> int:
    """Query rows per block: as many as keep a thread's block scratch, the logits w
    (rows, npad) and the same-class exps (rows, longest), within SCRATCH_BYTES, between
    MIN_BLOCK_ROWS and ``max_rows``, a multiple of ROWS. Every block reads z, zt and
    grad_t (N x d each) from memory, so at large N more rows per block cost less per row
    (nca_exact.c's header has the figures); at small N the budget allows the most."""
    fit = SCRATCH_BYTES // (itemsize * (npad + longest))
    return int(max(MIN_BLOCK_ROWS, min(max_rows, fit // ROWS * ROWS)))


@functools.cache
def _load(dtype: torch.dtype) -> Kernel | None:
    flavour = FLAVOURS[dtype]
    lib = load_library(f"nca_exact_{flavour}")
    if lib is None:
        return None
    fn = getattr(lib, f"nca_exact_block_rows_{flavour}")
    fn.restype = ctypes.c_double
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    fn.argtypes = [p, p, p, i64, i64, i64, p, p, p, i64, i64, ctypes.c_int32, *[p] * 7]
    lib.nca_exact_block_size.restype = ctypes.c_int64
    return Kernel(fn, int(lib.nca_exact_block_size()))


def kernel(dtype: torch.dtype) -> Kernel | None:
    """The C kernel for ``dtype``, or None when the torch path must be used."""
    if dtype not in FLAVOURS or not enabled():
        return None
    return _load(dtype)


def usable(z: torch.Tensor) -> bool:
    """Whether the native kernel can evaluate these embeddings.

    CPU, float32 or float64, the library available, and every |z| small enough that
    4 d max|z|^2 (the largest logit difference) stays below 1/16 of the dtype's largest
    value: the C code then never meets an infinity or a NaN, so it tests for neither.
    """
    if z.device.type != "cpu" or z.dtype not in FLAVOURS or z.numel() == 0:
        return False
    limit = (torch.finfo(z.dtype).max / (64.0 * max(z.shape[1], 1))) ** 0.5
    if not bool(z.abs().max() < limit):  # also False for NaN and Inf
        return False
    return kernel(z.dtype) is not None


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


def _padded(zs: torch.Tensor):
    """(z (N, dp) and its transpose (dp, N padded), squared norms (N padded,)), the
    coordinates and rows zero-padded to multiples of TILE for the kernel's register tiles."""
    n, d = zs.shape
    dp, npad = -(-d // TILE) * TILE, -(-n // TILE) * TILE
    z = torch.zeros((n, dp), dtype=zs.dtype)
    z[:, :d] = zs
    zt = torch.zeros((dp, npad), dtype=zs.dtype)
    zt[:, :n] = z.T
    sq = torch.zeros(npad, dtype=zs.dtype)
    sq[:n] = (zs * zs).sum(1)
    return z, zt, sq


def exact_value_and_grad(
    zs: torch.Tensor,
    query: torch.Tensor,
    run_start: torch.Tensor,
    run_end: torch.Tensor,
    *,
    log_form: bool,
    threads: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of the query rows' scores, its gradient with respect to zs (N, d)).

    zs: (N, d) embeddings sorted by class; query: (Q,) positions in zs, in class order;
    run_start / run_end: (Q,) the [s, e) class run of each query row, every run at least 2
    long; a row listed twice counts twice. Query rows are split into contiguous parts, one per
    thread (the C call releases the GIL); each part accumulates its own share of the gradient,
    summed at the end.
    """
    native = kernel(zs.dtype)
    if native is None:
        raise RuntimeError("the native NCA kernel is not available")
    fn, max_block = native
    n, d = zs.shape
    dtype = zs.dtype
    z, zt, sq = _padded(zs)  # (N, dp), (dp, N padded), (N padded,)
    dp, npad = zt.shape
    query = query.to(torch.int64).contiguous()
    run_start = run_start.to(torch.int64).contiguous()
    run_end = run_end.to(torch.int64).contiguous()
    longest = int((run_end - run_start).max()) if query.numel() else 1
    block = block_rows_for(npad, longest, zs.element_size(), max_block)

    n_query = query.shape[0]
    if threads is None:
        threads = torch.get_num_threads()
    threads = max(1, min(threads, n_query // ROWS_PER_THREAD))
    _ptr = torch.Tensor.data_ptr
    totals = [0.0] * threads
    # per thread, its own (grad (N, dp), grad_t (dp, N padded), col (N padded,)): a row listed
    # in two parts is summed, not raced
    shape = [(n, dp), (dp, npad), (npad,)]
    shares = [[torch.zeros(s, dtype=dtype) for s in shape] for _ in range(threads)]

    def run(t: int, a: int, b: int) -> None:
        grad, grad_t, col = shares[t]
        w = torch.empty((block, npad), dtype=dtype)  # the block's logits, then W
        w_same = torch.empty((block, longest), dtype=dtype)  # same-class exps
        zq2 = torch.empty((block, dp), dtype=dtype)
        gi = torch.empty((block, dp), dtype=dtype)
        totals[t] = fn(
            _ptr(z),
            _ptr(zt),
            _ptr(sq),
            n,
            npad,
            dp,
            _ptr(query) + 8 * a,
            _ptr(run_start) + 8 * a,
            _ptr(run_end) + 8 * a,
            b - a,
            block,
            int(log_form),
            _ptr(w),
            _ptr(w_same),
            _ptr(zq2),
            _ptr(gi),
            _ptr(grad),
            _ptr(grad_t),
            _ptr(col),
        )

    run_in_threads(run, n_query, threads)

    grad = sum(share[0] for share in shares)  # (N, dp)
    grad_t = sum(share[1] for share in shares)  # (dp, N padded)
    col = sum(share[2] for share in shares)  # (N padded,)
    out = grad[:, :d] + grad_t[:d, :n].T - 2.0 * col[:n, None] * zs
    return torch.tensor(sum(totals), dtype=dtype), out
