"""Memory-bounded evaluation of a neighbourhood objective and its gradient.

Given embeddings Z = X A^T (N, d), the objective is sum_i score_i over query rows i, where
score_i depends on the squared distances from z_i to its neighbours. Two neighbour modes:

* exact: every other point is a neighbour. Rows are processed in chunks of B against all
  N points, so the peak extra memory is O(B N), never N x N.
* candidates: each row i has a fixed candidate list (its nearest same-class and other-class
  points in the current projection, see :func:`nearest_candidates`); cost O(N M) per pass.

The gradient is taken with respect to Z chunk by chunk: for each chunk a fresh autograd graph
is built on a detached copy of Z, back-propagated, and freed, so the gradients accumulate in an
(N, d) buffer. :class:`ChunkedObjective` wraps this as a ``torch.autograd.Function`` whose
backward returns that buffer; autograd then carries it through Z = X A^T to A.
"""

from __future__ import annotations

import torch

from training.objectives import Objective

DEFAULT_MEMORY_BUDGET = 256 * 2**20  # bytes for one chunk's (B, M) temporaries


def auto_chunk_size(n_neighbours: int, budget_bytes: int = DEFAULT_MEMORY_BUDGET) -> int:
    """Rows per chunk so that ~10 float32 (B, M) temporaries stay within the budget."""
    return int(max(16, min(8192, budget_bytes // (40 * max(1, n_neighbours)))))


def pairwise_sq_dist(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """||a_i - b_j||^2 = ||a_i||^2 + ||b_j||^2 - 2 a_i.b_j, clamped at 0.  (B, d), (M, d) -> (B, M)."""
    d2 = (a * a).sum(1)[:, None] + (b * b).sum(1)[None, :] - 2.0 * (a @ b.T)
    return d2.clamp_min(0.0)


def _chunk_scores(
    leaf: torch.Tensor,
    labels: torch.Tensor,
    chunk_rows: torch.Tensor,
    objective: Objective,
    candidates: torch.Tensor | None,
) -> torch.Tensor:
    """Sum of the objective's scores over ``chunk_rows`` (B,), built on ``leaf`` (N, d)."""
    zq = leaf[chunk_rows]  # (B, d)
    yq = labels[chunk_rows]  # (B,)
    if candidates is None:
        n = leaf.shape[0]
        neg = -pairwise_sq_dist(zq, leaf)  # (B, N)
        valid = torch.arange(n, device=leaf.device)[None, :] != chunk_rows[:, None]
        same = yq[:, None] == labels[None, :]
    else:
        idx = candidates[chunk_rows]  # (B, M), -1 marks padding
        valid = idx >= 0
        safe = idx.clamp_min(0)
        zc = leaf[safe]  # (B, M, d)
        neg = -((zq[:, None, :] - zc) ** 2).sum(-1)  # (B, M)
        same = yq[:, None] == labels[safe]
    return objective.point_scores(neg, same, valid).sum()


class ChunkedObjective(torch.autograd.Function):
    """value = sum_{i in rows} score_i(Z); backward gives d value / d Z (N, d)."""

    @staticmethod
    def forward(ctx, z, labels, objective, rows, candidates, chunk_size):
        leaf = z.detach().requires_grad_(True)
        total = torch.zeros((), dtype=z.dtype, device=z.device)
        with torch.enable_grad():
            for start in range(0, rows.shape[0], chunk_size):
                chunk_rows = rows[start : start + chunk_size]
                value = _chunk_scores(leaf, labels, chunk_rows, objective, candidates)
                value.backward()
                total += value.detach()
        grad = leaf.grad if leaf.grad is not None else torch.zeros_like(z)
        ctx.save_for_backward(grad)
        return total

    @staticmethod
    def backward(ctx, grad_output):
        (grad_z,) = ctx.saved_tensors
        return grad_output * grad_z, None, None, None, None, None


def objective_sum(
    z: torch.Tensor,
    labels: torch.Tensor,
    objective: Objective,
    *,
    rows: torch.Tensor | None = None,
    candidates: torch.Tensor | None = None,
    chunk_size: int | None = None,
    method: str = "auto",
) -> torch.Tensor:
    """sum_{i in rows} score_i for embeddings z (N, d) and labels (N,); differentiable in z.

    rows: (B,) query rows (default: all); candidates: (N, M) neighbour indices (-1 padding),
    or None for exact evaluation against all points. method: "fused" uses the closed-form
    NCA kernel (exact mode, NCA objectives only), "autograd" the generic chunked autograd
    path, "auto" the fused kernel where it applies.
    """
    from training.nca_kernel import FusedNCA
    from training.objectives import NCAObjective

    if method not in ("auto", "fused", "autograd"):
        raise ValueError(f"method must be 'auto', 'fused' or 'autograd', got {method!r}")
    fused_applies = candidates is None and isinstance(objective, NCAObjective)
    if method == "fused" and not fused_applies:
        raise ValueError("the fused kernel needs exact mode (candidates=None) and an NCA objective")
    n = z.shape[0]
    if fused_applies and method != "autograd":
        return FusedNCA.apply(z, labels, objective.log_form, rows, chunk_size)
    if rows is None:
        rows = torch.arange(n, device=z.device)
    if chunk_size is None:
        width = n if candidates is None else candidates.shape[1] * (z.shape[1] + 2)
        chunk_size = auto_chunk_size(width)
    return ChunkedObjective.apply(z, labels, objective, rows, candidates, int(chunk_size))


@torch.no_grad()
def nearest_candidates(
    z: torch.Tensor,
    labels: torch.Tensor,
    n_candidates: int,
    *,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """For each point, its ``n_candidates`` nearest same-class and nearest other-class points.

    z: (N, d), labels: (N,)  ->  (N, 2K) int64 indices, the same-class block first, padded
    with -1 where a class has fewer than K other members (or there are fewer than K points of
    other classes). The point itself is never its own candidate. Memory O(chunk * N).
    """
    n = z.shape[0]
    k_same = min(n_candidates, n - 1)
    k_other = min(n_candidates, n - 1)
    if chunk_size is None:
        chunk_size = auto_chunk_size(n)
    out = torch.full((n, k_same + k_other), -1, dtype=torch.long, device=z.device)
    all_idx = torch.arange(n, device=z.device)
    for start in range(0, n, chunk_size):
        rows = all_idx[start : start + chunk_size]
        d2 = pairwise_sq_dist(z[rows], z)  # (B, N)
        d2[torch.arange(rows.shape[0], device=z.device), rows] = float("inf")
        same = labels[rows][:, None] == labels[None, :]
        for offset, mask, k in ((0, same, k_same), (k_same, ~same, k_other)):
            if k == 0:
                continue
            masked = d2.masked_fill(~mask, float("inf"))
            dist, idx = torch.topk(masked, k, dim=1, largest=False, sorted=True)
            idx = idx.masked_fill(torch.isinf(dist), -1)
            out[rows, offset : offset + k] = idx
    return out
