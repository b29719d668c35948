"""Memory-bounded evaluation of a neighbourhood objective and its gradient: the dispatcher
above the two evaluation paths.

``objective_sum(z, labels, objective)`` picks the path:

* NCA's objectives (``nca``, ``nca-log``) take the fused closed-form kernel by default
  (``training.objectives.nca_kernel.FusedNCA``: value and gradient in one pass, no autograd
  graph; the value alone when z does not require grad);
  ``method="autograd"`` forces the generic path, which the tests use to check the kernel.
* every other objective (kNCA) takes the generic chunked autograd path below.

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

from training.numerics import PrecomputedGradient, chunk_rows, class_runs
from training.objectives.nca import NCAObjective, Objective
from training.objectives.nca_kernel import FusedNCA


class RowTable:
    """Candidate sets kept for some of the points only: ``table`` (B, M) holds the sets of
    the points ``rows`` (B,), in that order. It reads like the (N, M) table of every point
    (``candidates[q]``, ``shape``), for query rows q among ``rows``; asking for another
    row's set is an error, never another row's answer. A fit whose loss averages over a
    sample of query rows keeps O(B M) candidates instead of O(N M)."""

    def __init__(self, table: torch.Tensor, rows: torch.Tensor, n_points: int):
        self.table = table  # (B, M)
        self.rows = rows  # (B,)
        self.slot = torch.full((n_points,), -1, dtype=torch.long, device=table.device)  # (N,)
        self.slot[rows] = torch.arange(rows.shape[0], device=table.device)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.slot.shape[0], self.table.shape[1])

    def __getitem__(self, points: torch.Tensor) -> torch.Tensor:
        """(len(points), M): the sets of ``points``, each of which must be one of ``rows``."""
        slots = self.slot[points]
        if slots.numel() and int(slots.min()) < 0:
            missing = points[slots < 0][:5].tolist()
            raise IndexError(f"no candidate set is kept for rows {missing}")
        return self.table[slots]


def pairwise_sq_dist(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """||a_i - b_j||^2 = ||a_i||^2 + ||b_j||^2 - 2 a_i.b_j, clamped at 0.

    a (B, d), b (M, d) -> (B, M)."""
    d2 = (a * a).sum(1)[:, None] + (b * b).sum(1)[None, :] - 2.0 * (a @ b.T)
    return d2.clamp_min(0.0)


class CandidateNegSqDist(torch.autograd.Function):
    """-||z_i - z_c||^2 for query rows i (B,) and their candidates c (B, M), from z (N, d).

    Forward as NCA's candidate kernel computes it: the candidates gathered once (B, M, d)
    with ``index_select``, then 2 z_i.z_c - ||z_i||^2 - ||z_c||^2 by one batched product,
    clamped at 0 (rounding could make a squared distance slightly negative). Backward by
    hand, with G = d loss / d out (B, M):

        d/dz_i = -2 sum_c G_ic (z_i - z_c) = 2 (G z_c - rowsum(G) z_i),
        d/dz_c += 2 G_ic (z_i - z_c)

    scattered into one (N, d) gradient with ``index_add_``: autograd's own backward of the
    gather is slower (index_put with accumulation, saved copies).
    """

    @staticmethod
    def forward(ctx, z, rows, candidates):
        b, m = candidates.shape
        zq = z.index_select(0, rows)  # (B, d)
        zc = z.index_select(0, candidates.reshape(-1)).view(b, m, -1)  # (B, M, d)
        sq = (z * z).sum(1)  # (N,)
        dot = torch.bmm(zc, zq.unsqueeze(2)).squeeze(2)  # (B, M)
        neg = dot.mul_(2.0).sub_(sq[rows][:, None]).sub_(sq[candidates]).clamp_max_(0.0)
        ctx.save_for_backward(rows, candidates, zq, zc)
        ctx.n = z.shape[0]
        return neg

    @staticmethod
    def backward(ctx, grad_out):
        rows, candidates, zq, zc = ctx.saved_tensors
        d = zq.shape[1]
        g2 = 2.0 * grad_out  # (B, M)
        to_rows = torch.bmm(g2.unsqueeze(1), zc).squeeze(1) - g2.sum(1, keepdim=True) * zq
        to_candidates = (zq[:, None, :] - zc).mul_(g2.unsqueeze(2))  # (B, M, d)
        grad = torch.zeros((ctx.n, d), dtype=zq.dtype, device=zq.device)
        grad.index_add_(0, rows, to_rows)
        grad.index_add_(0, candidates.reshape(-1), to_candidates.view(-1, d))
        return grad, None, None


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
        neighbour_labels = labels[None, :].expand(chunk_rows.shape[0], n)
    else:
        idx = candidates[chunk_rows]  # (B, M), -1 marks padding
        valid = idx >= 0
        safe = idx.clamp_min(0)
        neg = CandidateNegSqDist.apply(leaf, chunk_rows, safe)  # (B, M)
        neighbour_labels = labels[safe]
    return objective.point_scores(neg, neighbour_labels, yq, valid).sum()


def _rows_by_classes_present(
    rows: torch.Tensor, labels: torch.Tensor, candidates: torch.Tensor
) -> torch.Tensor:
    """rows (B,) reordered by how many classes their candidates (N, M) hold: a chunk of rows
    then needs about as many class polynomials as each of its rows (kNCA sizes a chunk's
    polynomials by its largest count). The sum over rows does not depend on the order."""
    idx = candidates[rows]  # (B, M)
    classes = torch.where(idx >= 0, labels[idx.clamp_min(0)], labels[rows][:, None])
    n_classes = int(labels.max()) + 1
    present = torch.zeros(rows.shape[0], n_classes, dtype=torch.bool, device=rows.device)
    present.scatter_(1, classes, True)
    return rows[torch.argsort(present.sum(1), stable=True)]


class ChunkedObjective(PrecomputedGradient):
    """value = sum_{i in rows} score_i(Z); backward gives d value / d Z (N, d)."""

    @staticmethod
    def forward(ctx, z, labels, objective, rows, candidates, chunk_size):
        leaf = z.detach().requires_grad_(True)
        total = torch.zeros((), dtype=z.dtype, device=z.device)
        with torch.enable_grad():
            for start in range(0, rows.shape[0], chunk_size):
                chunk = rows[start : start + chunk_size]
                value = _chunk_scores(leaf, labels, chunk, objective, candidates)
                value.backward()
                total += value.detach()
        grad = leaf.grad if leaf.grad is not None else torch.zeros_like(z)
        ctx.save_for_backward(grad)
        return total


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
    or a ``RowTable`` that holds them for the query rows only, or None for exact evaluation
    against all points. method: "fused" uses the closed-form NCA kernels (NCA objectives
    only), "autograd" the generic chunked autograd path, "auto" the fused kernel where it
    applies.
    """
    if method not in ("auto", "fused", "autograd"):
        raise ValueError(f"method must be 'auto', 'fused' or 'autograd', got {method!r}")
    fused_applies = isinstance(objective, NCAObjective)
    if method == "fused" and not fused_applies:
        raise ValueError(f"the fused kernel computes NCA objectives only, not {objective!r}")
    n = z.shape[0]
    if fused_applies and method != "autograd":
        return FusedNCA.apply(z, labels, objective.log_form, rows, candidates, chunk_size)
    if rows is None:
        rows = torch.arange(n, device=z.device)
    if candidates is not None:
        rows = _rows_by_classes_present(rows, labels, candidates)
    if chunk_size is None:
        m = n if candidates is None else candidates.shape[1]
        # gathered candidates add their d coordinates to every pair's working set
        per_pair = objective.floats_per_pair(m) + (0 if candidates is None else z.shape[1])
        chunk_size = chunk_rows(m, per_pair)
    return ChunkedObjective.apply(z, labels, objective, rows, candidates, int(chunk_size))


@torch.no_grad()
def nearest_candidates(
    z: torch.Tensor,
    labels: torch.Tensor,
    n_candidates: int,
    *,
    rows: torch.Tensor | None = None,
    chunk_size: int = 256,
) -> torch.Tensor:
    """For each point, its ``n_candidates`` nearest same-class and nearest other-class points.

    z: (N, d), labels: (N,)  ->  (N, 2K) int64 indices: K same-class (nearest first), then K
    other-class (nearest first), padded with -1 where there are fewer such points. The point
    itself is never its own candidate. With ``rows`` (B,), the candidates of those rows only,
    (B, 2K) in the order given. Points are sorted by class so that a chunk of rows of one
    class finds its same-class neighbours in one contiguous slice. Memory O(chunk * N).
    """
    n = z.shape[0]
    k = min(n_candidates, n - 1)
    order = torch.argsort(labels, stable=True)
    zs = z[order]
    neg_sq = -(zs * zs).sum(1)[None, :]  # (1, N)
    # the answer's row of each sorted position (-1: not asked for); only the rows asked for
    # are held (B, 2K), not (N, 2K)
    slot = torch.full((n,), -1, dtype=torch.long, device=z.device)
    repeat = None  # the answer's row of each row asked for, when rows repeat
    if rows is None:
        slot = order.clone()  # every point, in its own place
    else:
        unique, repeat = torch.unique(rows, return_inverse=True)
        slot[torch.argsort(order)[unique]] = torch.arange(unique.shape[0], device=z.device)
    wanted = slot >= 0
    out = torch.full((int(wanted.sum()), 2 * k), -1, dtype=torch.long, device=z.device)
    # one (chunk, N) buffer for every chunk: a fresh one each time costs more than the GEMM
    # (page faults on a new mapping; benchmarks/README.md, "Training: ours vs scikit-learn")
    buffer = torch.empty((min(chunk_size, n), n), dtype=z.dtype, device=z.device)
    for s, e in class_runs(labels[order]):
        k_same = min(k, e - s - 1)
        k_other = min(k, n - (e - s))
        positions = torch.nonzero(wanted[s:e]).squeeze(1) + s  # sorted positions in this class
        for start in range(0, positions.shape[0], chunk_size):
            q = positions[start : start + chunk_size]
            closeness = buffer[: q.shape[0]]  # (B, N): -d_ij + ||z_i||^2
            torch.addmm(neg_sq, zs[q], zs.T, alpha=2.0, out=closeness)
            closeness[torch.arange(q.shape[0], device=z.device), q] = float("-inf")
            targets = slot[q]
            if k_same > 0:
                idx = torch.topk(closeness[:, s:e], k_same, dim=1).indices + s
                out[targets, :k_same] = order[idx]
            if k_other > 0:
                closeness[:, s:e] = float("-inf")
                idx = torch.topk(closeness, k_other, dim=1).indices
                out[targets, k : k + k_other] = order[idx]
    return out if repeat is None else out[repeat]
