"""Mini-batch Adam over query rows on the loss, one epoch a step.

``AdamEpochs`` has L-BFGS's interface (``training.optim.lbfgs.LBFGS``: ``start``, ``step``,
``reset``, ``evaluations``), so the fit's loop (``training.model.fitting``) runs either. One
step is one epoch: the rows in a fresh order (the fit's generator), in batches of
``batch_size``, one Adam update (Kingma & Ba 2015, torch's) per batch on

    L_B(A) = -(1 / |B|) sum_{i in B} score_i(A) + l2 ||A||_F^2.

The epoch's mean score is reported; the fit has converged when it changed by at most
``tol`` (relative, at least absolute) over one epoch.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from training.optim.lbfgs import Evaluation, Step
from training.optim.problem import Problem


class AdamEpochs:
    """Adam's state on ``problem``: the parameters, the moments (kept across candidate
    refreshes: ``reset`` forgets nothing) and the last epoch's mean score."""

    def __init__(
        self,
        problem: Problem,
        learning_rate: float,
        batch_size: int,
        rng: np.random.Generator,
        tol: float,
    ):
        self.problem, self.rng, self.tol = problem, rng, tol
        self.batch_size = max(1, min(batch_size, problem.n_samples))
        self.params: torch.Tensor | None = None
        self.learning_rate = learning_rate
        self.optimiser: torch.optim.Adam | None = None
        self.previous = math.nan  # the last epoch's mean score
        self.evaluations = 0  # batches

    def reset(self) -> None:
        """Nothing: Adam's moments carry over fresh candidate sets."""

    def start(self, theta: np.ndarray) -> Evaluation:
        """No evaluation: an epoch measures its own mean score."""
        return Evaluation(math.nan, np.empty(0), math.nan)

    def step(self, theta: np.ndarray, at: Evaluation, max_evaluations=None) -> Step:
        """One epoch from theta (P,)."""
        if self.params is None:
            self.params = self.problem.to_tensor(theta, requires_grad=True)
            self.optimiser = torch.optim.Adam([self.params], lr=self.learning_rate)
        n = self.problem.n_samples
        order = torch.as_tensor(self.rng.permutation(n), device=self.problem.X.device)
        total, count = 0.0, 0
        for start in range(0, n, self.batch_size):
            rows = order[start : start + self.batch_size]
            self.optimiser.zero_grad(set_to_none=True)
            loss, batch_score = self.problem.loss(self.params, rows)
            loss.backward()
            self.optimiser.step()
            self.evaluations += 1
            total += batch_score * rows.shape[0]
            count += rows.shape[0]
        score = total / count
        converged = abs(score - self.previous) <= self.tol * max(1.0, abs(score))
        self.previous = score
        x = self.params.detach().cpu().numpy().astype(np.float64).ravel()
        if not (math.isfinite(score) and np.isfinite(x).all()):  # as L-BFGS refuses one
            raise FloatingPointError(
                f"the mean score ({score}) or the map ({int((~np.isfinite(x)).sum())} of "
                f"{x.size} entries not finite) after Adam's epoch of {self.problem.objective!r} "
                "is not finite; nothing was fitted"
            )
        batches = -(-n // self.batch_size)
        stop = "converged" if converged else None
        return Step(x, Evaluation(math.nan, np.empty(0), score), batches, stop, moved=True)
