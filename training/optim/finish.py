"""The exact finish: after a fit on candidate sets, L-BFGS iterations on the exact objective
from the candidate fit's map, every training point a neighbour,

    max_A  (1/B) sum_{i in rows} score_i(A) - l2 ||A||_F^2,   p_ij over all j != i,

with rows every training point, or ``max_rows`` evenly spaced ones when N is larger (the
same on every rank; a finishing iteration costs O(B N d)). Candidate sets cannot be gamed
here: what the map improves is what it is judged by. Tested by
``tests/training/optim/test_exact_finish.py``.
"""

from __future__ import annotations

import torch

from training.numerics import evenly_spaced_rows
from training.optim.lbfgs import run_lbfgs
from training.optim.monitor import FitResult, Monitor


def finish_exactly(
    exact,
    first: FitResult,
    first_monitor: Monitor,
    *,
    n_iter: int,
    max_rows: int,
    tol: float,
    validate,
    monitor_options: dict,
    max_evaluations: int | None = None,
) -> tuple[FitResult, FitResult]:
    """(the fit's result with the finish merged in, the finish's own result). The history
    goes on from the first stage's, its records tagged ``stage: exact finish``; with early
    stopping the best validated map of either stage is kept; converged and the stop reason
    stay the first stage's (the finish runs a fixed budget by design). ``max_evaluations``
    bounds the objective evaluations, so a line search that overshoots cannot multiply the
    finish's cost."""
    n = exact.n_samples
    if n > max_rows:
        exact.query_rows = torch.as_tensor(evenly_spaced_rows(n, max_rows), device=exact.X.device)
    n_rows = n if exact.query_rows is None else len(exact.query_rows)
    if monitor_options["verbose"]:
        print(
            f"[{monitor_options['name']}] Finishing on the exact objective: {n_iter} "
            f"iterations over {n_rows} of {n} query rows, l2={exact.l2:g}",
            flush=True,
        )
    best = None if first.best_val_accuracy is None else (first.best_val_accuracy, first.theta)
    monitor = Monitor(
        max_iter=n_iter,
        validate=validate,
        components=exact.components,
        first_iteration=first.n_iter + 1,
        tags={"stage": "exact finish"},
        continues=first_monitor,
        best_so_far=best,
        penalty=exact.penalty,
        **monitor_options,
    )
    finish = run_lbfgs(
        exact,
        first.theta,
        max_iter=n_iter,
        tol=tol,
        monitor=monitor,
        max_evaluations=max_evaluations,
    )
    merged = FitResult(
        theta=finish.theta,
        n_iter=first.n_iter + finish.n_iter,
        converged=first.converged,
        stop_reason=first.stop_reason,
        objective=finish.objective,
        history=first.history + finish.history,
        best_val_accuracy=finish.best_val_accuracy,
        n_evaluations=first.n_evaluations + finish.n_evaluations,
        seconds=finish.seconds,  # the finish's clock started with the fit's
        n_refreshes=first.n_refreshes,
        refresh_changes=first.refresh_changes,
        refresh_replaced=first.refresh_replaced,
        refresh_sizes=first.refresh_sizes,
        search_mass_ratios=first.search_mass_ratios,
    )
    return merged, finish
