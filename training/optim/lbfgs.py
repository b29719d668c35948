"""Full-batch L-BFGS (scipy's L-BFGS-B) on the loss, in rounds of fresh candidate sets."""

from __future__ import annotations

import math

import numpy as np
from scipy.optimize import minimize

from training.optim.candidates import candidate_watch
from training.optim.monitor import EarlyStop, FitResult, Monitor, finished_result
from training.optim.problem import Problem


def run_lbfgs(
    problem: Problem,
    theta0: np.ndarray,
    *,
    max_iter: int,
    tol: float,
    monitor: Monitor,
    refresh_every: int = 50,
    refresh_tol: float | None = 0.05,
    target_mass: float | None = None,
    candidate_change_tol: float = 0.01,
    max_evaluations: int | None = None,
) -> FitResult:
    """Full-batch L-BFGS-B (scipy) on the problem's loss, in rounds with candidates: a round
    ends (L-BFGS restarts on fresh candidates) when the :class:`CandidateWatch` says so; the
    fit ends when a round converges with candidates that hardly changed at its start (fewer
    than ``candidate_change_tol`` of the points), or when ``max_evaluations`` objective
    evaluations are spent."""
    theta = np.asarray(theta0, dtype=np.float64).ravel().copy()
    watch = candidate_watch(problem, refresh_every, refresh_tol, target_mass)
    rounds = _Rounds(problem, monitor, watch, max_iter)
    stop_reason = "max_iter"
    while rounds.iter < max_iter:
        changed = watch.refresh(theta) if watch is not None else 1.0
        rounds.refresh, iter_before = False, rounds.iter
        options = {"maxiter": max_iter - rounds.iter}
        if max_evaluations is not None:  # a budget for the whole fit, across its rounds
            options["maxfun"] = max(1, max_evaluations - rounds.n_eval)
        result = minimize(
            rounds.loss_and_grad,
            theta,
            jac=True,
            method="L-BFGS-B",
            tol=tol,
            callback=rounds.on_iteration,
            options=options,
        )
        theta = result.x
        if max_evaluations is not None and rounds.n_eval >= max_evaluations:
            stop_reason = "max_evaluations"
            break
        if rounds.refresh:
            continue  # the candidates went stale: a new round on fresh ones
        reason = _round_end(result)
        round_converged = reason in ("converged", "precision")
        if reason == "early_stopping" or watch is None:
            stop_reason = reason
            break
        if round_converged and (changed < candidate_change_tol or rounds.iter == iter_before):
            stop_reason = reason
            break
    result = finished_result(
        problem, monitor, theta, rounds.iter, stop_reason, rounds.score, rounds.n_eval
    )
    result.n_refreshes = 0 if watch is None else watch.n_refreshes
    result.refresh_changes = [] if watch is None else list(watch.changes)
    result.refresh_replaced = [] if watch is None else list(watch.replaced)
    result.refresh_sizes = [] if watch is None else list(watch.sizes)
    result.search_mass_ratios = [] if watch is None else list(watch.search_mass_ratios)
    return result


class _Rounds:
    """What scipy's callbacks share across the rounds of one L-BFGS fit: the iteration and
    evaluation counts, the last objective, and whether the watch asked for a refresh."""

    def __init__(self, problem: Problem, monitor: Monitor, watch, max_iter: int):
        self.problem, self.monitor, self.watch, self.max_iter = problem, monitor, watch, max_iter
        self.iter, self.n_eval, self.score, self.refresh = 0, 0, math.nan, False

    def loss_and_grad(self, theta: np.ndarray):
        loss, grad, self.score = self.problem.loss_and_grad(theta)
        self.n_eval += 1
        _check_finite(loss, grad, {"n_eval": self.n_eval, "iter": self.iter}, self.problem)
        return loss, grad

    def on_iteration(self, intermediate_result) -> None:
        self.iter += 1
        theta = intermediate_result.x
        figures = {}
        if self.watch is not None:
            self.refresh, figures = self.watch.after_iteration(theta)
        try:
            self.monitor(self.iter, theta, self.score, figures)
        except EarlyStop:
            self.refresh = False
            raise StopIteration from None
        if self.refresh and self.iter < self.max_iter:
            raise StopIteration  # end the round: the candidates are stale


def _round_end(result) -> str:
    """Why scipy's L-BFGS-B round ended: early_stopping (the monitor stopped it),
    converged, precision (the line search cannot improve at this precision) or max_iter."""
    if result.status == 99 or "StopIteration" in str(result.message):
        return "early_stopping"
    if result.status == 0:
        return "converged"
    if result.status == 2 or "ABNORMAL" in str(result.message):
        return "precision"
    return "max_iter"


def _check_finite(loss: float, grad: np.ndarray, state: dict, problem) -> None:
    """L-BFGS would carry a NaN into the parameters and return it as a map: refuse first."""
    if not (math.isfinite(loss) and np.isfinite(grad).all()):
        raise FloatingPointError(
            f"the loss ({loss}) or its gradient ({int((~np.isfinite(grad)).sum())} of "
            f"{grad.size} entries not finite) at evaluation {state['n_eval']} (iteration "
            f"{state['iter']}) of {problem.objective!r} is not finite; nothing was fitted"
        )
