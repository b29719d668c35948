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
) -> FitResult:
    """Full-batch L-BFGS-B (scipy) on the problem's loss, in rounds with candidates: a round
    ends (L-BFGS restarts on fresh candidates) when the :class:`CandidateWatch` says so; the
    fit ends when a round converges with candidates that hardly changed at its start (fewer
    than ``candidate_change_tol`` of the points)."""
    theta = np.asarray(theta0, dtype=np.float64).ravel().copy()
    state = {"iter": 0, "score": math.nan, "n_eval": 0, "refresh": False}
    watch = candidate_watch(problem, refresh_every, refresh_tol, target_mass)

    def fun(t):
        loss, grad, score = problem.loss_and_grad(t)
        state["score"] = score
        state["n_eval"] += 1
        _check_finite(loss, grad, state, problem)
        return loss, grad

    def on_iteration(intermediate_result):
        state["iter"] += 1
        theta_now = intermediate_result.x
        figures = {}
        if watch is not None:
            state["refresh"], figures = watch.after_iteration(theta_now)
        try:
            monitor(state["iter"], theta_now, state["score"], figures)
        except EarlyStop:
            state["refresh"] = False
            raise StopIteration from None
        if state["refresh"] and state["iter"] < max_iter:
            raise StopIteration  # end the round: the candidates are stale

    stop_reason = "max_iter"
    while state["iter"] < max_iter:
        changed = 1.0
        if watch is not None:
            changed = watch.refresh(theta)
        state["refresh"] = False
        iter_before = state["iter"]
        options = {"maxiter": max_iter - state["iter"]}
        result = minimize(
            fun, theta, jac=True, method="L-BFGS-B", tol=tol, callback=on_iteration, options=options
        )
        theta = result.x
        if state["refresh"]:
            continue
        reason = _round_end(result)
        if reason == "early_stopping":
            stop_reason = reason
            break
        round_converged = reason in ("converged", "precision")
        if watch is None:
            stop_reason = reason
            break
        if round_converged and (changed < candidate_change_tol or state["iter"] == iter_before):
            stop_reason = reason
            break
    result = finished_result(
        problem, monitor, theta, state["iter"], stop_reason, state["score"], state["n_eval"]
    )
    result.n_refreshes = 0 if watch is None else watch.n_refreshes
    return result


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
