"""Mini-batch Adam over query rows on the loss, in rounds of fresh candidate sets."""

from __future__ import annotations

import math

import numpy as np
import torch

from training.optim.candidates import candidate_watch
from training.optim.monitor import EarlyStop, FitResult, Monitor, finished_result
from training.optim.problem import Problem


def run_adam(
    problem: Problem,
    theta0: np.ndarray,
    *,
    max_iter: int,
    tol: float,
    monitor: Monitor,
    learning_rate: float,
    batch_size: int,
    rng: np.random.Generator,
    refresh_every: int = 50,
    refresh_tol: float | None = 0.05,
    target_mass: float | None = None,
) -> FitResult:
    """Mini-batch Adam over query rows; one iteration is one epoch over the rows. With
    candidates, the :class:`CandidateWatch` is asked after every epoch."""
    params = problem.to_tensor(theta0, requires_grad=True)
    optimiser = torch.optim.Adam([params], lr=learning_rate)
    n = problem.n_samples
    batch_size = max(1, min(batch_size, n))
    previous = math.nan
    stop_reason = "max_iter"
    epoch = 0
    n_eval = 0
    score = math.nan
    watch = candidate_watch(problem, refresh_every, refresh_tol, target_mass)
    due = watch is not None
    try:
        for epoch in range(1, max_iter + 1):
            if due:
                watch.refresh(params.detach().cpu().numpy().astype(np.float64))
            order = torch.as_tensor(rng.permutation(n), device=problem.X.device)
            total, count = 0.0, 0
            for start in range(0, n, batch_size):
                rows = order[start : start + batch_size]
                optimiser.zero_grad(set_to_none=True)
                loss, batch_score = problem.loss(params, rows)
                loss.backward()
                optimiser.step()
                n_eval += 1
                total += batch_score * rows.shape[0]
                count += rows.shape[0]
            score = total / count
            theta = params.detach().cpu().numpy().astype(np.float64)
            due, figures = (False, {}) if watch is None else watch.after_iteration(theta)
            monitor(epoch, theta, score, figures)
            if abs(score - previous) <= tol * max(1.0, abs(score)):
                stop_reason = "converged"
                break
            previous = score
    except EarlyStop:
        stop_reason = "early_stopping"
    theta = params.detach().cpu().numpy().astype(np.float64)
    result = finished_result(problem, monitor, theta, epoch, stop_reason, score, n_eval)
    result.n_refreshes = 0 if watch is None else watch.n_refreshes
    result.refresh_changes = [] if watch is None else list(watch.changes)
    result.refresh_replaced = [] if watch is None else list(watch.replaced)
    result.refresh_sizes = [] if watch is None else list(watch.sizes)
    result.search_mass_ratios = [] if watch is None else list(watch.search_mass_ratios)
    return result
