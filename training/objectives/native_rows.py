"""Exact NCA's row pass in C (``training/objectives/kernels/nca_exact_rows.c``): the exps of a
chunk's query rows against every point and their sums, in place, in float32.

The exact path's GEMMs stay in torch (BLAS): the C source replaces what torch spent four
passes over each (B, N) chunk on (the bias row, the softmax, the threshold, the block's sum)
with one, and never makes a subnormal float (``benchmarks/README.md``, "The exact row pass
in C"). Built at install and loaded
by :mod:`training.objectives.native`; when it was not built, ``NCA_KNN_NATIVE=0`` is set, or
the embeddings are not finite CPU float32, :mod:`training.objectives.nca_kernel` takes its
torch path. Tested against it by ``tests/training/objectives/test_native_rows.py``.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from training.objectives import native

ROWS_PER_THREAD = 16  # fewer rows than this per thread are not worth a thread


@functools.cache
def _load() -> ctypes._CFuncPtr | None:
    """The C entry point, or None when the install built no level of it for this CPU."""
    lib = native.load_library("nca_exact_rows_f32")
    if lib is None:
        return None
    fn = lib.nca_exact_rows_f32
    fn.restype = None
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    fn.argtypes = [p, i64, i64, p, p, i64, i64, p, p]
    return fn


def usable(z: torch.Tensor) -> bool:
    """Whether the C row pass can serve these embeddings: CPU float32, finite, the switch on,
    the library built."""
    if z.device.type != "cpu" or z.dtype != torch.float32 or not native.enabled():
        return False
    if z.numel() == 0 or not bool(torch.isfinite(z).all()):
        return False
    return _load() is not None


def exp_rows(
    dots: torch.Tensor, sq: torch.Tensor, own: torch.Tensor, block: tuple[int, int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(S (B,), S^c (B,)) in float64; ``dots`` (B, N) = z_i.z_j, contiguous, is replaced by
    e_ij = exp(2 z_i.z_j - sq_j - sq_i) = exp(-||z_i - z_j||^2) (0 below exp(-70) and at
    j = own_i, i's own column); S_i = sum_j e_ij, S^c_i the same over the block [s, e) of
    columns. sq (N,): ||z_j||^2. A row whose largest e_ij is below exp(-20) (its nearest
    point beyond squared distance 20), or whose sums are not finite, gets NaN sums: the
    caller recomputes it. The rows are split into contiguous parts, one per thread (the C
    call releases the GIL)."""
    fn = _load()
    if fn is None:
        raise RuntimeError("the native exact row pass is not available")
    if not dots.is_contiguous() or dots.dtype != torch.float32 or dots.dim() != 2:
        raise ValueError(
            f"dots must be a contiguous 2-D float32 tensor, got {dots.dtype} of shape "
            f"{tuple(dots.shape)}, strides {tuple(dots.stride())}"
        )
    b, n = dots.shape
    s, e = block
    # the C source trusts these: a bad index would read or write out of bounds
    if sq.dtype != torch.float32 or tuple(sq.shape) != (n,):
        raise ValueError(f"sq must be float32 of shape ({n},), got {sq.dtype} {tuple(sq.shape)}")
    if tuple(own.shape) != (b,) or (b and not 0 <= int(own.min()) <= int(own.max()) < n):
        raise ValueError(f"own must hold {b} column indices in [0, {n}), got {own.tolist()}")
    if not 0 <= s <= e <= n:
        raise ValueError(f"the block [{s}, {e}) must lie within the {n} columns")
    sq = sq.contiguous()
    own = own.to(torch.int64).contiguous()
    row_sum = torch.empty(b, dtype=torch.float64)
    block_sum = torch.empty(b, dtype=torch.float64)
    ptr = torch.Tensor.data_ptr

    def run(_t: int, lo: int, hi: int) -> None:
        fn(
            ptr(dots) + 4 * lo * n,
            hi - lo,
            n,
            ptr(sq),
            ptr(own) + 8 * lo,
            s,
            e,
            ptr(row_sum) + 8 * lo,
            ptr(block_sum) + 8 * lo,
        )

    threads = max(1, min(torch.get_num_threads(), b // ROWS_PER_THREAD))
    native.run_in_threads(run, b, threads)
    return row_sum, block_sum
