"""Data-parallel evaluation of the neighbourhood objectives on ``torch.distributed``: a
:class:`ShardedProblem` is the :class:`Problem` of one rank's row shard.

P processes (ranks) each hold a contiguous row shard X_r (N_r, D) of the standardised
training set, every point's label (N,: small) and the same parameters A. One evaluation of
the objective sum_{i in rows} score_i and its gradient, identical to one process's:

    Z_r = X_r A^T                        (N_r, d)   on each rank
    Z   = all_gather(Z_r)                (N, d)     small: d << D
    v_r, G_r = sum_{i in rows, i in shard r} score_i(Z),  d v_r / d Z   (N, d)
                                                    each rank's own query rows against all
                                                    points (exact, or on candidate sets)
    v, G = all_reduce(v_r), all_reduce(G_r)
    grad_A = all_reduce( G[shard r]^T X_r )           (d, D)

(for the diagonal transform, Z_r = X_r * a and autograd carries G[shard r] to a the same
way). Rank 0's value and gradient are then broadcast as one buffer, so every rank's
optimiser (scipy L-BFGS, or Adam) sees the same bits and takes the same steps: no rank
drives the others, and no optimiser state is ever exchanged.

Memory per rank: O(N_r D) for the shard, O(N d) for Z and G, O(chunk x N) for one chunk's
logits (exact) or O(N_r M) for the candidates, never N x D or N x N.

Candidate sets: each rank finds the candidates of its own rows against the gathered Z and
the (N, 2K) table is all-gathered, so the search is split P ways and every rank holds the
same table. Figures that steer the optimisation (the candidate watch's masses) are computed
on every rank from the same Z and rank 0's are broadcast, so rounding can never make ranks
take different branches (a mismatched collective would hang the job).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from training.distributed.ranks import broadcast_from_rank0, gather_rows
from training.numerics import shard_bounds
from training.optim.problem import Problem


class ShardedScore(torch.autograd.Function):
    """value = sum_{i in rows} score_i over all ranks' rows (the same on every rank);
    backward returns d value / d params, computed in forward with the collectives above."""

    @staticmethod
    def forward(ctx, params, problem: ShardedProblem, rows):
        group = problem.group
        with torch.enable_grad():
            local_params = params.detach().requires_grad_(True)
            z_local = Problem.embed(problem, local_params)  # (N_r, d), with its graph
        z = gather_rows(z_local.detach(), problem.n_samples, group).requires_grad_(True)
        own = problem.own_rows(rows)  # (B_r,) global indices of this rank's query rows
        grad_z = torch.zeros_like(z)  # (N, d)
        value = torch.zeros((), dtype=z.dtype, device=z.device)
        if own.numel():
            with torch.enable_grad():
                value = problem.objective_total(z, own)
                (grad_z,) = torch.autograd.grad(value, z)
            value = value.detach()
        if group.is_distributed:
            dist.all_reduce(grad_z)
            dist.all_reduce(value)
        with torch.enable_grad():
            (grad_params,) = torch.autograd.grad(
                z_local, local_params, grad_outputs=grad_z[problem.start : problem.stop]
            )
        if group.is_distributed:
            dist.all_reduce(grad_params)
            packed = broadcast_from_rank0(torch.cat([value[None], grad_params.flatten()]), group)
            value, grad_params = packed[0], packed[1:].view_as(grad_params)
        ctx.save_for_backward(grad_params)
        return value.clone()

    @staticmethod
    def backward(ctx, grad_output):
        (grad_params,) = ctx.saved_tensors
        return grad_output * grad_params, None, None


class ShardedProblem(Problem):
    """A :class:`Problem` whose X is this rank's row shard [start, stop) of N points.

    ``labels`` are all N labels. ``embed`` returns the gathered (N, d) embedding (no graph:
    the figures computed from it need none), ``mean_score`` the data-parallel objective, so
    the optimisers, the candidate watch and the audit run unchanged on every rank.
    """

    def __init__(self, X_shard: torch.Tensor, labels: torch.Tensor, objective, *, group, **kwargs):
        super().__init__(X_shard, labels, objective, **kwargs)
        self.group = group
        self._n = labels.shape[0]
        self.start, self.stop = shard_bounds(self._n, group.rank, group.world_size)
        if X_shard.shape[0] != self.stop - self.start:
            raise ValueError(
                f"rank {group.rank} of {group.world_size} must hold rows [{self.start}, "
                f"{self.stop}) of N = {self._n}: {self.stop - self.start} rows, got "
                f"{X_shard.shape[0]}"
            )

    @property
    def n_samples(self) -> int:
        return self._n

    def own_rows(self, rows: torch.Tensor | None) -> torch.Tensor:
        """The query rows (global indices) this rank evaluates: its shard's share of
        ``rows`` (B,), or its whole shard when rows is None."""
        if rows is None:
            return torch.arange(self.start, self.stop, device=self.X.device)
        return rows[(rows >= self.start) & (rows < self.stop)]

    def embed(self, params: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return gather_rows(super().embed(params), self._n, self.group)

    def mean_score(self, params: torch.Tensor, rows: torch.Tensor | None = None):
        total = ShardedScore.apply(params, self, rows)
        return total / (self._n if rows is None else rows.shape[0])

    def find_candidates(self, z: torch.Tensor) -> torch.Tensor:
        """Each rank finds its own rows' candidates against the gathered Z (N, d); the
        (N, 2K) table is all-gathered, the same on every rank."""
        own = torch.arange(self.start, self.stop, device=z.device)
        mine = self.search.find(z, self.labels, self.n_candidates, rows=own)  # (N_r, 2K)
        return gather_rows(mine, self._n, self.group)

    def _rank0(self, values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device=self.X.device)
        return broadcast_from_rank0(t, self.group).tolist()

    def agreed(self, value: float) -> float:
        return self._rank0([value])[0]

    def outside_mass(self, theta: np.ndarray, rows: torch.Tensor) -> float:
        return self._rank0([super().outside_mass(theta, rows)])[0]

    def fresh_inside_mass(self, theta: np.ndarray, rows: torch.Tensor, ks: list[int]):
        return self._rank0(super().fresh_inside_mass(theta, rows, ks))
