"""kNCA's fast path in C (``training/objectives/kernels/knca_linear.c``): log P_i and its
Jacobian in one pass.

:func:`training.objectives.knca.linear_log_prob` runs the float64 polynomial programme as
some hundred small torch operations a row block and leaves the backward to autograd, which
records every one of them. The C source runs the same programme a row at a time and writes
its reverse mode out by hand, so one call returns log P_i (B,) and d log P_i / d logit_ij
(B, M) (``benchmarks/README.md``, "kNCA cost"); the source's comment has the mathematics.
Built at install and loaded by :mod:`training.objectives.native`; when it was not built,
``NCA_KNN_NATIVE=0`` is set or the tensors are not on the CPU, callers use the torch
programme.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from training.objectives import native

ROWS_PER_THREAD = 128  # fewer rows than this per thread are not worth a thread


@functools.cache
def _load() -> tuple[ctypes._CFuncPtr, ctypes._CFuncPtr] | None:
    lib = native.load_library("knca_linear_f64")
    if lib is None:
        return None
    i64, p = ctypes.c_int64, ctypes.c_void_p
    lib.knca_linear_work_size.restype = i64
    lib.knca_linear_work_size.argtypes = [i64, i64, i64]
    lib.knca_linear_rows.restype = i64
    lib.knca_linear_rows.argtypes = [p, p, p, p, i64, i64, i64, i64, ctypes.c_int32, p, p, p]
    return lib.knca_linear_rows, lib.knca_linear_work_size


def usable(logits: torch.Tensor) -> bool:
    """Whether the C fast path can evaluate these rows: CPU tensors, the switch on, and the
    library built."""
    return logits.device.type == "cpu" and native.enabled() and _load() is not None


def log_prob_and_jacobian(
    logits: torch.Tensor,
    shift: torch.Tensor,
    labels: torch.Tensor,
    own: torch.Tensor,
    n_classes: int,
    k: int,
    variant: str,
    *,
    threads: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log P_i (B,), d log P_i / d logit_ij (B, M)), both float64, for rows in the linear range.

    logits (B, M) (-inf where absent), shift (B, 1) from ``in_linear_range``, labels (B, M) and
    own (B,) in 0..n_classes-1 ("all": 0 = i's class, 1 = any other, n_classes = 2). Rows are
    split into contiguous parts, one per thread (the C call releases the GIL).
    """
    loaded = _load()
    if loaded is None:
        raise RuntimeError("the native kNCA kernel is not available")
    rows_fn, work_size = loaded
    if variant not in ("majority", "all"):
        raise ValueError(f"variant must be 'majority' or 'all', got {variant!r}")
    b, m = logits.shape
    logits = logits.detach().to(torch.float64).contiguous()
    shift = shift.detach().to(torch.float64).reshape(b).contiguous()
    labels = labels.to(torch.int64).contiguous()
    own = own.to(torch.int64).contiguous()
    log_p = torch.empty(b, dtype=torch.float64)
    jac = torch.empty((b, m), dtype=torch.float64)
    if b == 0:
        return log_p, jac
    if threads is None:
        threads = torch.get_num_threads()
    threads = max(1, min(threads, b // ROWS_PER_THREAD))
    size = int(work_size(m, n_classes, k))
    status = [0] * threads
    _ptr = torch.Tensor.data_ptr

    def run(t: int, lo: int, hi: int) -> None:
        work = torch.empty(size, dtype=torch.float64)
        status[t] = rows_fn(
            _ptr(logits) + 8 * lo * m,
            _ptr(shift) + 8 * lo,
            _ptr(labels) + 8 * lo * m,
            _ptr(own) + 8 * lo,
            hi - lo,
            m,
            n_classes,
            k,
            int(variant == "all"),
            _ptr(log_p) + 8 * lo,
            _ptr(jac) + 8 * lo * m,
            _ptr(work),
        )

    native.run_in_threads(run, b, threads)
    if any(status):
        raise ValueError(f"labels and own classes must lie in 0..{n_classes - 1}")
    return log_p, jac
