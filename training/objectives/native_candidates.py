"""NCA on candidate sets in C (``training/objectives/kernels/nca_candidates.c``): the value and
gradient of :func:`training.objectives.nca_kernel.nca_value_and_grad_candidates`, a query row
at a time.

The torch path gathers each chunk's candidates into a (B, M, d) block, multiplies it in small
batched products and scatters the candidates' share of the gradient back with ``index_add_``,
where most of its time goes. The C source reads a row's candidates once and adds the
gradient in place (``benchmarks/README.md``, "Which native kernels pay"). Built at install
and loaded by :mod:`training.objectives.native`; when it was not built,
``NCA_KNN_NATIVE=0`` is set, the tensors are not CPU float32 / float64 or M is larger than the
source allows, callers use the torch path. Tested against it by
``tests/training/objectives/test_native_candidates.py``.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from training.objectives import native

ROWS_PER_THREAD = 2048  # fewer query rows than this per thread are not worth a thread


@functools.cache
def _load(dtype: torch.dtype) -> tuple[ctypes._CFuncPtr, int] | None:
    """(the C entry point for ``dtype``, the most candidates per row it takes), or None."""
    flavour = native.FLAVOURS[dtype]
    lib = native.load_library(f"nca_candidates_{flavour}")
    if lib is None:
        return None
    fn = getattr(lib, f"nca_candidates_rows_{flavour}")
    fn.restype = ctypes.c_double
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    fn.argtypes = [p, p, i64, i64, p, i64, p, i64, i64, ctypes.c_int32, p]
    lib.nca_candidates_max.restype = i64
    return fn, int(lib.nca_candidates_max())


def usable(z: torch.Tensor, n_candidates: int) -> bool:
    """Whether the C kernel can evaluate these embeddings with rows of ``n_candidates``: CPU,
    float32 or float64, finite, the switch on, the library built, M within its limit."""
    if z.device.type != "cpu" or z.dtype not in native.FLAVOURS or not native.enabled():
        return False
    if z.numel() == 0 or not bool(torch.isfinite(z).all()):
        return False
    loaded = _load(z.dtype)
    return loaded is not None and n_candidates <= loaded[1]


def value_and_grad(
    z: torch.Tensor,
    rows: torch.Tensor,
    candidates: torch.Tensor,
    *,
    k_same: int,
    log_form: bool,
    threads: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of the query rows' scores, its gradient with respect to z (N, d)).

    z: (N, d); rows: (B,) query rows; candidates: (B, M) each row's candidates (same class
    in the first ``k_same`` columns), -1 where absent. The rows
    are split into contiguous parts, one per thread (the C call releases the GIL), each
    adding into its own (N, d) gradient; the parts are summed at the end."""
    loaded = _load(z.dtype)
    if loaded is None:
        raise RuntimeError("the native candidate kernel is not available")
    fn = loaded[0]
    z = z.detach().contiguous()
    n, d = z.shape
    sq = (z * z).sum(1).contiguous()  # (N,)
    rows = rows.to(torch.int64).contiguous()
    candidates = candidates.to(torch.int64).contiguous()
    m = candidates.shape[1]
    n_rows = rows.shape[0]
    if threads is None:
        threads = torch.get_num_threads()
    threads = max(1, min(threads, n_rows // ROWS_PER_THREAD))
    grads = [torch.zeros_like(z) for _ in range(threads)]  # (N, d) per thread
    totals = [0.0] * threads
    ptr = torch.Tensor.data_ptr

    def run(t: int, a: int, b: int) -> None:
        totals[t] = fn(
            ptr(z),
            ptr(sq),
            n,
            d,
            ptr(rows) + 8 * a,
            b - a,
            ptr(candidates) + 8 * a * m,
            m,
            k_same,
            int(log_form),
            ptr(grads[t]),
        )

    native.run_in_threads(run, n_rows, threads)
    grad = grads[0]
    for other in grads[1:]:
        grad += other
    return torch.tensor(sum(totals), dtype=z.dtype), grad
