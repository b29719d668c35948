"""The objective as a function of the flattened map: ``Problem`` evaluates the mean
loss (and its gradient) on all rows or a batch, exactly or on candidate sets."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from service.core.knn import decide
from training.numerics import EXP_FLOOR, evenly_spaced_rows
from training.objectives.nca import NCAObjective, Objective
from training.objectives.neighbourhood import RowTable, nearest_candidates, objective_sum
from training.optim.candidates import CandidateSearch, held_mass

SAMPLE_BLOCK_ROWS = 64
SEARCH_AUDIT_ROWS = 512  # rows on which an approximate candidate search is measured
# sample rows whose (rows, N) neighbour probabilities are held at once: 64 x 1M float32 is
# 256 MiB, where all 512 audit rows at once would hold 2 GiB
AUDIT_BLOCK_ROWS = 64


def _log_neighbour_probabilities(z: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """log p_ij (B, N) for sample rows (B,) of embeddings z (N, d): log softmax over j != i
    of -||z_i - z_j||^2.

    Computed as the softmax of L'_ij = 2 z_i.z_j - ||z_j||^2 (L_ij plus the per-row constant
    ||z_i||^2, which softmax ignores): one GEMM with a bias row, then in-place passes. The
    exponents are floored at EXP_FLOOR because exp's subnormal path is slow on the CPU and a
    trained map puts most points far beyond exp's range
    (``benchmarks/README.md``, "Training: ours vs scikit-learn"). Entries below the floor come
    out as log p_ij >= EXP_FLOOR - log-sum, about 1e-35 too large, far below the float
    precision of any mass they are summed into."""
    log_p = torch.addmm(-(z * z).sum(1)[None, :], z[rows], z.T, alpha=2.0)  # (B, N)
    log_p[torch.arange(rows.shape[0], device=z.device), rows] = float("-inf")
    m = log_p.amax(1, keepdim=True)  # (B, 1)
    log_p.sub_(m)
    total = torch.cat(  # (B, 1); row blocks keep the exp temporaries small (cache, no mmap)
        [
            block.clamp_min(EXP_FLOOR).exp_().sum(1, keepdim=True)
            for block in log_p.split(SAMPLE_BLOCK_ROWS)
        ]
    )
    return log_p.sub_(torch.log(total))


def _table(candidates):
    """The tensor of candidate indices of a refresh: (N, M), or a RowTable's (B, M)."""
    return candidates.table if isinstance(candidates, RowTable) else candidates


REPLACED_BLOCK_ROWS = 65536  # rows compared at once


@dataclass(frozen=True)
class Refreshed:
    """What one refresh of the candidate sets did."""

    changed: float  # the fraction of sets that changed (1: the first refresh, or K changed)
    replaced: float  # the share of entries it replaced (``replaced_share``)
    search_mass_ratio: float | None  # an approximate search's held mass over exact sets'


def replaced_share(old: torch.Tensor | None, new: torch.Tensor) -> float:
    """The share of candidate entries a refresh replaced: the mean over rows of the fraction
    of a row's new candidates (N, M) not among its old ones (N, M'; M' may differ when K
    changed); 1 for the first refresh. Each old row is sorted and the new entries looked up
    in it (O(N M log M') time, O(block M) memory). A set changes as soon as one of its 2K
    entries does, so this says how far the neighbourhoods moved."""
    if old is None or old.shape[0] != new.shape[0]:
        return 1.0
    fresh = 0
    for start in range(0, new.shape[0], REPLACED_BLOCK_ROWS):
        a = new[start : start + REPLACED_BLOCK_ROWS].contiguous()  # (b, M)
        b = old[start : start + REPLACED_BLOCK_ROWS].sort(1).values.contiguous()  # (b, M')
        at = torch.searchsorted(b, a).clamp(max=b.shape[1] - 1)  # (b, M)
        fresh += int((b.gather(1, at) != a).sum())
    return fresh / new.numel()


def _leave_one_out_neighbours(z: torch.Tensor, rows: torch.Tensor, k: int):
    """(squared distances (B, k), indices (B, k)) of the k nearest other points of each row
    (B,) among z (N, d), nearest first; AUDIT_BLOCK_ROWS rows at a time."""
    sq = (z * z).sum(1)  # (N,)
    dists, indices = [], []
    for block in rows.split(AUDIT_BLOCK_ROWS):
        zq = z[block]  # (b, d)
        closeness = torch.addmm(-sq[None, :], zq, z.T, alpha=2.0)  # (b, N)
        closeness[torch.arange(block.shape[0], device=z.device), block] = float("-inf")
        top, idx = torch.topk(closeness, k, dim=1)  # (b, k)
        dists.append((sq[block][:, None] - top).clamp_min(0.0))  # ||z_i - z_j||^2
        indices.append(idx)
    return torch.cat(dists), torch.cat(indices)


def map_components(theta: np.ndarray, transform: str, d: int, D: int) -> np.ndarray:
    """The (d, D) matrix A that the parameters ``theta`` hold: A itself for the 'linear'
    transform (d D values), diag(a) for the 'diagonal' one (D values, d = D)."""
    if transform == "diagonal":
        return np.diag(np.asarray(theta, dtype=np.float64).reshape(D))
    return np.asarray(theta, dtype=np.float64).reshape(d, D)


class Problem:
    """Data, objective and parametrisation: theta (flat float64) -> loss and gradient.

    X: (N, D) standardised inputs on ``device``; labels: (N,) int64 class indices.
    transform 'linear': theta holds A (d, D), Z = X A^T; 'diagonal': theta holds a (D,), Z = X * a.

    query_rows: (B,) the query rows the loss averages over (every one of the N points is
    still a neighbour); on candidate sets, the sets are then searched and kept for these rows
    only (a ``RowTable``): each evaluation and refresh costs O(B M d) and the search of B
    queries, whatever N. None: every row.
    """

    def __init__(
        self,
        X: torch.Tensor,
        labels: torch.Tensor,
        objective: Objective,
        *,
        transform: str,
        n_components: int,
        l2: float = 0.0,
        n_candidates: int | None = None,
        chunk_size: int | None = None,
        search: CandidateSearch | None = None,
        query_rows: torch.Tensor | None = None,
    ):
        self.X = X
        self.labels = labels
        self.objective = objective
        self.transform = transform
        self.n_components = n_components
        self.l2 = float(l2)
        self.n_candidates = n_candidates
        self.chunk_size = chunk_size
        # how candidate sets are searched: exact, or approximately (IVF) at scale
        self.search = search if search is not None else CandidateSearch()
        self.candidates: torch.Tensor | None = None  # (N, 2K) nearest candidates, or None
        # (B,) the query rows the loss averages over (None: all N); neighbours are all points
        self.query_rows: torch.Tensor | None = query_rows
        self.candidate_rows = query_rows if n_candidates is not None else None
        # (params, Z) of the newest map ``mean_score`` embedded, without their graph: the
        # figures taken after an iteration read the embedding its accepted step computed
        self._embedded: tuple[torch.Tensor, torch.Tensor] | None = None
        n_features = X.shape[1]
        self.shape = (n_features,) if transform == "diagonal" else (n_components, n_features)

    @property
    def n_samples(self) -> int:
        return self.X.shape[0]

    def to_tensor(self, theta: np.ndarray, requires_grad: bool = False) -> torch.Tensor:
        t = torch.as_tensor(np.asarray(theta).reshape(self.shape), dtype=self.X.dtype)
        return t.to(self.X.device).requires_grad_(requires_grad)

    def embed(self, params: torch.Tensor) -> torch.Tensor:
        """Z = X A^T (N, d), or X * a for the diagonal transform."""
        if self.transform == "diagonal":
            return self.X * params[None, :]
        return self.X @ params.T

    def embedded(self, theta: np.ndarray) -> torch.Tensor:
        """Z (N, d) at ``theta``, without a gradient: the one the last evaluation computed
        when ``theta`` is its map (the same product), else computed here."""
        params = self.to_tensor(theta)
        if self._embedded is not None and torch.equal(self._embedded[0], params):
            return self._embedded[1]
        with torch.no_grad():
            return self.embed(params)

    def penalty(self, theta: np.ndarray) -> float:
        """l2 ||theta||^2: what the loss adds to -mean score (0 without a penalty)."""
        theta = np.asarray(theta, dtype=np.float64).ravel()
        return self.l2 * float(theta @ theta)

    def sample_rows(self, count: int) -> torch.Tensor:
        """``count`` evenly spaced rows (all when fewer) among those with candidate sets: the
        rows on which the candidates are audited and the search is measured."""
        if self.candidate_rows is None:
            rows = evenly_spaced_rows(self.n_samples, count)
            return torch.as_tensor(rows, device=self.X.device)
        picked = evenly_spaced_rows(self.candidate_rows.shape[0], count)
        return self.candidate_rows[torch.as_tensor(picked, device=self.X.device)]

    def find_candidates(self, z: torch.Tensor):
        """The candidate sets in the embedding z (N, d), exact or by an approximate search
        (``self.search``): (N, 2K) for every point, or a ``RowTable`` of the candidate rows'."""
        if self.candidate_rows is None:
            return self.search.find(z, self.labels, self.n_candidates)
        found = self.search.find(z, self.labels, self.n_candidates, rows=self.candidate_rows)
        return RowTable(found, self.candidate_rows, self.n_samples)

    def refresh_candidates(self, theta: np.ndarray, n_candidates: int | None = None) -> Refreshed:
        """Recompute candidate sets in the current projection (``n_candidates`` per kind from
        now on, when given); return how far the sets moved and, for an approximate search,
        its measured held mass on sample rows (``Refreshed``)."""
        if n_candidates is not None:
            self.n_candidates = n_candidates
        z = self.embedded(theta)
        with torch.no_grad():
            new = self.find_candidates(z)
            ratio = self.measure_search(z, new) if self.search.approximate(z) else None
        old, self.candidates = self.candidates, new
        old, new = _table(old), _table(new)
        changed = 1.0
        if old is not None and old.shape == new.shape:
            moved = (torch.sort(old, 1).values != torch.sort(new, 1).values).any(1)  # (N,)
            changed = float(moved.float().mean())
        return Refreshed(changed, replaced_share(old, new), ratio)

    def measure_search(self, z: torch.Tensor, found: torch.Tensor) -> float:
        """The neighbour mass the approximately found sets hold over what exact sets of the
        same size hold, averaged over SEARCH_AUDIT_ROWS sample rows (1: as good as exact);
        the search raises its effort for the next refresh when it falls short."""
        held_found = held_exact = 0.0
        for block in self.sample_rows(SEARCH_AUDIT_ROWS).split(AUDIT_BLOCK_ROWS):
            log_p = _log_neighbour_probabilities(z, block)  # (b, N)
            exact = nearest_candidates(z, self.labels, self.n_candidates, rows=block)  # (b, 2K)
            held_found += float(held_mass(log_p, found[block]).sum())
            held_exact += float(held_mass(log_p, exact).sum())
        ratio = self.agreed(held_found / held_exact)
        self.search.tune(ratio)
        return ratio

    def agreed(self, value: float) -> float:
        """The value every process uses for a figure that steers the fit (one process: it)."""
        return value

    def outside_mass(self, theta: np.ndarray, rows: torch.Tensor) -> float:
        """What the candidate objective cannot see, on sample rows (B,): the mean over the
        rows of the neighbour-probability mass that falls outside their candidates,

            1 - sum_{j in C_i} p_ij,   p_ij = softmax_{j != i}(-||z_i - z_j||^2)  (all N points),

        the same weights NCA and kNCA draw neighbours with. Small right after a refresh (the
        candidates are the nearest points); it grows when the map moves points that are
        nobody's candidates into neighbourhoods. O(B N d)."""
        outside = 0.0
        z = self.embedded(theta)
        with torch.no_grad():
            for block in rows.split(AUDIT_BLOCK_ROWS):
                log_p = _log_neighbour_probabilities(z, block)  # (b, N)
                inside = held_mass(log_p, self.candidates[block])  # (b,)
                outside += float((1.0 - inside).clamp_min(0.0).sum())
        return outside / rows.shape[0]

    def fresh_inside_mass(self, theta: np.ndarray, rows: torch.Tensor, ks: list[int]):
        """For each K in ``ks`` (ascending), the mean over sample rows (B,) of the neighbour
        mass held by their K nearest same-class and K nearest other-class points in the
        current projection: what fresh candidate sets of that size would hold."""
        totals = [0.0] * len(ks)
        z = self.embedded(theta)
        with torch.no_grad():
            for block in rows.split(AUDIT_BLOCK_ROWS):
                log_p = _log_neighbour_probabilities(z, block)  # (b, N)
                fresh = nearest_candidates(z, self.labels, ks[-1], rows=block)  # (b, 2 K_max)
                k_max = fresh.shape[1] // 2  # fewer than ks[-1] when N is small
                for i, k in enumerate(ks):
                    k = min(k, k_max)
                    prefix = torch.cat([fresh[:, :k], fresh[:, k_max : k_max + k]], dim=1)
                    totals[i] += float(held_mass(log_p, prefix).sum())
        return [total / rows.shape[0] for total in totals]

    def audit(self, theta: np.ndarray, rows: torch.Tensor) -> dict[str, float]:
        """What the optimiser improves against what it stands for, on a fixed sample of
        query rows (B,): the objective on the current candidate sets, the exact objective
        (every point a neighbour; NCA objectives, whose fused kernel makes it O(B N d)), and
        the leave-one-out k-NN accuracy of the rows among all training points (majority
        vote, the objective's k). Mean scores per row."""
        n, k = rows.shape[0], self.objective.k
        z = self.embedded(theta)
        with torch.no_grad():
            out = {
                "sample_candidate_objective": float(
                    objective_sum(
                        z,
                        self.labels,
                        self.objective,
                        rows=rows,
                        candidates=self.candidates,
                    )
                )
                / n
            }
            if isinstance(self.objective, NCAObjective):
                exact = objective_sum(z, self.labels, self.objective, rows=rows)
                out["sample_exact_objective"] = float(exact) / n
            dist, idx = _leave_one_out_neighbours(z, rows, k)
        labels = self.labels.cpu().numpy()
        n_classes = int(labels.max()) + 1
        predicted, _ = decide(
            labels[idx.cpu().numpy()], dist.double().cpu().numpy(), n_classes, "majority"
        )
        out["sample_loo_accuracy"] = float(np.mean(predicted == labels[rows.cpu().numpy()]))
        return out

    def objective_total(self, z: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """sum_{i in rows} score_i of embeddings z (N, d) under this problem's objective,
        candidates and chunking; differentiable in z."""
        return objective_sum(
            z,
            self.labels,
            self.objective,
            rows=rows,
            candidates=self.candidates,
            chunk_size=self.chunk_size,
        )

    def mean_score(self, params: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        z = self.embed(params)  # (N, d)
        # a copy of the map: Adam's step changes its params in place after this evaluation
        self._embedded = (params.detach().clone(), z.detach())
        total = self.objective_total(z, rows)
        return total / (self.n_samples if rows is None else rows.shape[0])

    def loss(self, params: torch.Tensor, rows: torch.Tensor | None = None):
        """(loss tensor, mean score as float)."""
        score = self.mean_score(params, rows)
        loss = -score
        if self.l2:
            loss = loss + self.l2 * (params * params).sum()
        return loss, float(score.detach())

    def loss_and_grad(self, theta: np.ndarray) -> tuple[float, np.ndarray, float]:
        params = self.to_tensor(theta, requires_grad=True)
        loss, score = self.loss(params, self.query_rows)
        loss.backward()
        grad = params.grad.detach().cpu().numpy().astype(np.float64).ravel()
        return float(loss.detach()), grad, score
