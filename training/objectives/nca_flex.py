"""Exact NCA value and gradient as four fused attention passes (torch's ``flex_attention``).

For class-sorted embeddings z (N, d) with squared norms s_j = ||z_j||^2 and query rows Q, the
logits L'_ij = 2 z_i.z_j - s_j differ from -||z_i - z_j||^2 by a per-row constant that the
softmax ignores, so with queries [2 z_i, 1] and keys [z_j, -s_j] (q.k = L'_ij, scale 1)
attention computes, never holding more than a tile of the N x N logits:

    R1 (every j != i):       lse_i = log sum_j e^{L'_ij},
                             O_i = sum_j p_ij z_j
    R2 (j != i, i's class):  lse^s_i = log sum_{j in C_i} e^{L'_ij},
                             O^s_i = sum_{j in C_i} e^{L'_ij - lse^s_i} z_j

so log p_i = lse^s_i - lse_i exactly (g stays finite where p_i is below float range) and,
with W_ij = d score_i / d L_ij (nca_kernel.py: p_ij (1[j in C_i] - p_i) for f,
p_ij (1[j in C_i] / p_i - 1) for g), the row side of the gradient is

    sum_j W_ij z_j = p_i (O^s_i - O_i)   (f),      O^s_i - O_i   (g).

The column side, sum_i W_ij [z_i, 1] for every point j, is attention the other way round: point
j queries the rows i with [2 z_j, -s_j, 1] against keys [z_i, 1, b_i], whose score is
L'_ij - lse_i = log p_ij for b_i = -lse_i (and log(p_ij / p_i) for b_i = -lse^s_i). The pass's
unnormalised output exp(lse'_j) O'_j = sum_i e^{score} v_i is then

    C1 (every i != j):   v_i = [p_i z_i, p_i] (f) or [z_i, 1] (g), b_i = -lse_i
    C2 (i of j's class): v_i = [z_i, 1], b_i = -lse_i (f) or -lse^s_i (g)

and sum_i W_ij [z_i, 1] = C2 - C1. The gradient is nca_kernel.py's identity,
d/dz_i += 2 sum_j W_ij z_j and d/dz_j += 2 (sum_i W_ij z_i - (sum_i W_ij) z_j).

The same-class passes run on a block mask built from the class runs, so they cost
about 1/C of a full pass for C balanced classes. Only forward attention is used, so the
same code runs everywhere: compiled into fused Triton kernels on CUDA (``usable``), and as
flex_attention's eager reference on the CPU, which materialises the scores and serves the
tests at small N (tests/training/objectives/test_nca_flex.py, and its CUDA twin in test_cuda.py).
"""

from __future__ import annotations

import functools
import os
import warnings

import torch
import torch.nn.functional as F

BLOCK = 128  # flex_attention's sparse block (rows and columns of a mask tile)


def flex_available() -> bool:
    try:
        from torch.nn.attention import flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


_failed: list[str] = []  # why the fused path failed in this process, once it has


def usable(z: torch.Tensor) -> bool:
    """Whether the fused path evaluates this z: float32 on CUDA, flex_attention present, not
    turned off with NCA_KNN_FLEX=0, and not failed before in this process (the torch path
    is the fallback)."""
    return (
        z.is_cuda
        and z.dtype == torch.float32
        and os.environ.get("NCA_KNN_FLEX", "1") != "0"
        and not _failed
        and flex_available()
    )


def try_exact_value_and_grad(zs, classes, query, *, log_form: bool):
    """exact_value_and_grad, or None (with one warning per process) when compiling or
    running the fused kernels fails, so that the caller falls back to the torch path."""
    try:
        return exact_value_and_grad(zs, classes, query, log_form=log_form)
    except torch.cuda.OutOfMemoryError:
        raise
    except Exception as error:  # a compiler or kernel failure: the torch path still works
        _failed.append(f"{type(error).__name__}: {error}")
        warnings.warn(
            f"the fused flex_attention NCA kernel failed ({_failed[-1]}); the exact "
            "objective falls back to the chunked torch path for the rest of this process",
            RuntimeWarning,
            stacklevel=2,
        )
        return None


@functools.cache
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def _flex(device: torch.device):
    from torch.nn.attention.flex_attention import flex_attention

    return _compiled_flex() if device.type == "cuda" else flex_attention


def _width(n: int) -> int:
    """Head width for n columns: a power of two, at least 16 (the kernels' tile)."""
    return max(16, 1 << (n - 1).bit_length())


def _heads(t: torch.Tensor, width: int) -> torch.Tensor:
    """(L, n) -> (1, 1, L, width), zero-padded columns (which add nothing to a dot product)."""
    return F.pad(t, (0, width - t.shape[1])).unsqueeze(0).unsqueeze(0).contiguous()


def _padded(t: torch.Tensor, fill: int) -> torch.Tensor:
    """t (L,) padded to a multiple of BLOCK with ``fill``: what a mask reads past the end."""
    return F.pad(t, (0, -t.shape[0] % BLOCK), value=fill)


def same_class_block_mask(q_class, q_pos, k_class, k_pos):
    """A BlockMask of the pairs (a, b) with q_class[a] == k_class[b] and q_pos[a] != k_pos[b].

    q_class (Lq,), k_class (Lk,): class ids in non-decreasing order; q_pos, k_pos: positions
    in the sorted point set (a pair is the diagonal when they are equal). A query tile of
    BLOCK rows spans classes [lo, hi], so its key tiles are the ones that cover keys of those
    classes: a contiguous range, listed as partial tiles that the mask function completes.
    Memory O((Lq / BLOCK) x widest range), never Lq x Lk.
    """
    from torch.nn.attention.flex_attention import BlockMask

    device = q_class.device
    lq, lk = q_class.shape[0], k_class.shape[0]
    starts = torch.arange(0, lq, BLOCK, device=device)
    lo = q_class[starts]  # (nqb,) the first (smallest) class of each query tile
    hi = q_class[torch.clamp(starts + BLOCK, max=lq) - 1]  # the last
    first = torch.searchsorted(k_class, lo, right=False)  # first key of class >= lo
    last = torch.searchsorted(k_class, hi, right=True)  # one past the last key of class <= hi
    first_block = first // BLOCK
    n_blocks = torch.where(last > first, (last - 1) // BLOCK - first_block + 1, 0)
    widest = max(int(n_blocks.max()), 1)
    n_kv_blocks = -(-lk // BLOCK)
    indices = first_block[:, None] + torch.arange(widest, device=device)[None, :]
    indices = torch.clamp(indices, max=n_kv_blocks - 1)  # entries past n_blocks are unused
    qc, qp = _padded(q_class, -1), _padded(q_pos, -1)
    kc, kp = _padded(k_class, -2), _padded(k_pos, -2)

    def mask_mod(b, h, q_idx, kv_idx):
        return (qc[q_idx] == kc[kv_idx]) & (qp[q_idx] != kp[kv_idx])

    return BlockMask.from_kv_blocks(
        n_blocks.to(torch.int32)[None, None],
        indices.to(torch.int32)[None, None],
        BLOCK_SIZE=BLOCK,
        mask_mod=mask_mod,
        seq_lengths=(lq, lk),
        compute_q_blocks=False,  # only the backward reads them, and no pass is differentiated
    )


def _not_diagonal(q_pos, k_pos):
    """score_mod: -inf where the query and the key are the same point."""
    qp, kp = _padded(q_pos, -1), _padded(k_pos, -2)

    def score_mod(score, b, h, q_idx, kv_idx):
        return torch.where(qp[q_idx] == kp[kv_idx], -float("inf"), score)

    return score_mod


def _attend(queries, keys, values, *, score_mod=None, block_mask=None):
    """(sum_j softmax_j(q_a.k_j) v_j (La, wv), log-sum-exp (La,)) for queries (La, n),
    keys (Lb, n), values (Lb, nv); rows with every key masked give 0 and -inf."""
    width = _width(queries.shape[1])
    heads = (
        _heads(queries, width),
        _heads(keys, width),
        _heads(values, _width(values.shape[1])),
    )
    options = dict(score_mod=score_mod, block_mask=block_mask, scale=1.0)
    try:  # torch >= 2.9 asks for the log-sum-exp as an auxiliary output
        from torch.nn.attention.flex_attention import AuxRequest
    except ImportError:
        out, lse = _flex(queries.device)(*heads, **options, return_lse=True)
    else:
        out, aux = _flex(queries.device)(*heads, **options, return_aux=AuxRequest(lse=True))
        lse = aux.lse
    return out[0, 0, :, : values.shape[1]], lse[0, 0]


def _unnormalised(out: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """exp(lse) * out: the pass's plain sum sum_j e^{score_j} v_j (0 where all masked)."""
    scale = torch.where(torch.isfinite(lse), torch.exp(lse), torch.zeros_like(lse))
    return torch.nan_to_num(out) * scale[:, None]


def exact_value_and_grad(
    zs: torch.Tensor, classes: torch.Tensor, query: torch.Tensor, *, log_form: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of the query rows' scores, its gradient with respect to zs (N, d)).

    zs: (N, d) embeddings sorted by class; classes: (N,) their class ids, non-decreasing;
    query: (B,) positions in zs in non-decreasing order, every one with at least one other
    point of its class (a row listed twice counts twice).
    """
    n, d = zs.shape
    points = torch.arange(n, device=zs.device)
    sq = (zs * zs).sum(1, keepdim=True)  # (N, 1)
    zq, q_class = zs[query], classes[query]  # (B, d), (B,)
    ones_q = torch.ones_like(zq[:, :1])  # (B, 1)
    ones_n = torch.ones_like(sq)  # (N, 1)

    # rows: the query rows attend to every point
    row_queries = torch.cat([2.0 * zq, ones_q], 1)  # (B, d + 1)
    row_keys = torch.cat([zs, -sq], 1)  # (N, d + 1)
    out_all, lse_all = _attend(row_queries, row_keys, zs, score_mod=_not_diagonal(query, points))
    same_rows = same_class_block_mask(q_class, query, classes, points)
    out_same, lse_same = _attend(row_queries, row_keys, zs, block_mask=same_rows)
    log_p = lse_same - lse_all  # (B,)
    p = torch.exp(log_p)
    total = log_p.sum() if log_form else p.sum()
    row_part = out_same - out_all  # (B, d)
    if not log_form:
        row_part = p[:, None] * row_part

    # columns: every point attends to the query rows, scored log p_ij (or log p_ij / p_i)
    col_queries = torch.cat([2.0 * zs, -sq, ones_n], 1)  # (N, d + 2)
    plain = torch.cat([zq, ones_q], 1)  # (B, d + 1) = [z_i, 1]
    weighted = plain if log_form else p[:, None] * plain
    keys_all = torch.cat([zq, ones_q, -lse_all[:, None]], 1)  # (B, d + 2)
    keys_same = torch.cat([zq, ones_q, -(lse_same if log_form else lse_all)[:, None]], 1)
    c_all = _unnormalised(
        *_attend(col_queries, keys_all, weighted, score_mod=_not_diagonal(points, query))
    )
    same_cols = same_class_block_mask(classes, points, q_class, query)
    c_same = _unnormalised(*_attend(col_queries, keys_same, plain, block_mask=same_cols))
    column_sums = c_same - c_all  # (N, d + 1): [sum_i W_ij z_i, sum_i W_ij]

    grad = 2.0 * (column_sums[:, :d] - column_sums[:, d:] * zs)  # (N, d)
    grad.index_add_(0, query, 2.0 * row_part)
    return total, grad
