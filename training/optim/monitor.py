"""What every iteration reports to: ``Monitor`` prints the verbose table, records the
history and stops early on validation kNN accuracy, keeping the best map; ``FitResult``
is what an optimiser returns."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from training.optim.problem import Problem
from training.optim.stages import StageGuard, StageStop


@dataclass
class FitResult:
    theta: np.ndarray
    n_iter: int
    converged: bool
    # converged | precision | max_iter | max_evaluations | early_stopping | single_class |
    # stalled | max_seconds (the stage guard's: training.optim.stages)
    stop_reason: str
    objective: float  # mean score per point at the returned parameters' last evaluation
    history: list[dict] = field(default_factory=list)
    best_val_accuracy: float | None = None
    n_evaluations: int = 0
    seconds: float = 0.0
    n_refreshes: int = 0  # candidate-set computations (0 for exact evaluation)
    # per refresh, the fraction of points whose nearest candidate set changed (the first: 1)
    refresh_changes: list[float] = field(default_factory=list)
    # ... and the share of candidate entries it replaced (how far the neighbourhoods moved)
    refresh_replaced: list[float] = field(default_factory=list)
    # ... and K, the candidates per kind it kept (chosen by the neighbour mass they hold)
    refresh_sizes: list[int] = field(default_factory=list)
    # ... and, with an approximate (IVF) search, the neighbour mass its sets held against
    # exact sets' on sample rows (None: exact search)
    search_mass_ratios: list[float | None] = field(default_factory=list)


# the stop reasons of a fit that ended where it meant to: a stalled stage stopped because its
# held-out score stopped rising; the budget (max_seconds) cut a fit short
CONVERGED = ("converged", "precision", "early_stopping", "single_class", "stalled", "hurt")


class EarlyStop(Exception):
    """Raised by the monitor to end the optimisation: early stopping, or the stage guard
    (``Monitor.stopped_by`` says which)."""


class Monitor:
    """Per-iteration bookkeeping: history, verbose table, early stopping on validation accuracy.

    validate: theta -> validation accuracy (or None when there is no validation set).
    Early stopping checks every ``interval`` iterations and stops after ``patience``
    checks without improvement, keeping the best parameters seen. ``guard``: the stage's
    :class:`training.optim.stages.StageGuard`, asked after every iteration whether the
    stage must stop (the fit's budget, a stalled stage).
    """

    def __init__(
        self,
        *,
        max_iter: int,
        validate: Callable[[np.ndarray], float] | None,
        early_stopping: bool,
        interval: int = 5,
        patience: int = 5,
        verbose: bool = False,
        name: str = "NCA",
        callback: Callable[[np.ndarray, int], None] | None = None,
        components: Callable[[np.ndarray], np.ndarray] | None = None,
        clock: Callable[[], float] = time.perf_counter,
        audit: Callable[[np.ndarray], dict[str, float]] | None = None,
        first_iteration: int = 1,
        tags: dict | None = None,
        continues: Monitor | None = None,
        best_so_far: tuple[float, np.ndarray] | None = None,
        penalty: Callable[[np.ndarray], float] | None = None,
        guard: StageGuard | None = None,
    ):
        """``continues``: the monitor of an earlier stage of the same fit; its clock and
        table go on (history seconds count from the fit's start, the header is not printed
        again). ``best_so_far``: (validation accuracy, map) that early stopping must beat.
        ``penalty``: theta -> the loss's penalty, recorded beside the (unpenalised) mean
        score, so that the penalised objective is objective - penalty."""
        self.clock = clock  # seconds, for the history (injectable for tests)
        # a later stage of one fit numbers its iterations on from the earlier one's and tags
        # its history records (the exact finish after candidate sets: {"stage": ...})
        self.iteration_offset = first_iteration - 1
        self.tags = dict(tags or {})
        # theta -> extra figures recorded on the validation schedule (candidate-mode audit)
        self.audit = audit
        self.penalty = penalty
        self.validate = validate
        self.early_stopping = early_stopping and validate is not None
        self.interval = max(1, interval)
        self.patience = max(1, patience)
        self.callback = callback
        self.components = components or (lambda theta: np.asarray(theta))
        self.history: list[dict] = []
        self.best_acc = -math.inf
        self.best_theta: np.ndarray | None = None
        self.bad_checks = 0
        self.stage_start = clock()
        self.start = continues.start if continues is not None else self.stage_start
        self.verbose = verbose
        self.name = name  # prefixes the verbose lines, as scikit-learn's "[ClassName]"
        self.last_call = self.stage_start
        self.header_printed = continues is not None and continues.header_printed
        self.guard = guard
        self.stopped_by: str | None = None  # "early_stopping", or the guard's reason
        if best_so_far is not None and self.early_stopping:
            self.best_acc, self.best_theta = best_so_far[0], np.array(best_so_far[1], copy=True)

    def __call__(
        self, iteration: int, theta: np.ndarray, objective: float, figures: dict | None = None
    ) -> None:
        """figures: extra per-iteration values for the history (the candidate watch's)."""
        iteration += self.iteration_offset
        record = {
            "iteration": iteration,
            "objective": objective,
            "seconds": self.clock() - self.start,
            **self.tags,
            **(figures or {}),
        }
        if self.penalty is not None:
            record["penalty"] = self.penalty(theta)
        scheduled = iteration % self.interval == 0 or iteration == 1
        if self.audit is not None and scheduled:
            record.update(self.audit(theta))
        if self.validate is not None and scheduled:
            acc = float(self.validate(theta))
            record["val_accuracy"] = acc
            if acc > self.best_acc:
                self.best_acc, self.best_theta, self.bad_checks = acc, theta.copy(), 0
            else:
                self.bad_checks += 1
        self.history.append(record)
        if self.verbose:
            self._print_iteration(iteration, objective, record.get("val_accuracy"))
        if self.callback is not None:  # scikit-learn's form: (A raveled (d * D,), iteration)
            self.callback(self.components(theta).ravel(), iteration)
        if self.early_stopping and self.bad_checks >= self.patience:
            self.stopped_by = "early_stopping"
            if self.guard is not None:  # the progress callback hears of this iteration too
                self.guard.count_iteration()
            raise EarlyStop
        if self.guard is not None:
            try:
                self.guard.after_iteration(theta, scheduled, objective)
            except StageStop as stop:
                self.stopped_by = stop.reason
                raise EarlyStop from None

    def _print_iteration(self, iteration: int, objective: float, val_accuracy) -> None:
        """One line per iteration in scikit-learn's verbose table (its header before the
        first), plus the validation accuracy when it was measured."""
        now = self.clock()
        self._print_header()
        line = f"[{self.name}] {iteration:>10} {objective:>20.6e} {now - self.last_call:>10.2f}"
        if val_accuracy is not None:
            line += f"  val_accuracy {val_accuracy:.4f}"
        print(line, flush=True)
        self.last_call = now

    def _print_header(self) -> None:
        if not self.header_printed:
            header = "{:>10} {:>20} {:>10}".format("Iteration", "Objective Value", "Time(s)")
            print(f"[{self.name}]\n[{self.name}] {header}\n[{self.name}] {'-' * len(header)}")
            self.header_printed = True

    def close(self) -> None:
        if self.verbose:
            self._print_header()  # also when the optimiser stopped before one iteration
            now = self.clock()
            if "stage" in self.tags:  # a later stage: its own time and the fit's
                print(
                    f"[{self.name}] The {self.tags['stage']} took {now - self.stage_start:8.2f}s; "
                    f"training took {now - self.start:8.2f}s in all.",
                    flush=True,
                )
            else:
                print(f"[{self.name}] Training took {now - self.start:8.2f}s.", flush=True)


def finished_result(problem, monitor, theta, n_iter, stop_reason, objective, n_eval) -> FitResult:
    """The result at the parameters returned: early stopping returns the best validated
    ones, whose objective is then computed afresh (``objective`` is the last iterate's). A
    stage the guard stopped says why (``stalled``, ``max_seconds``)."""
    monitor.close()
    if stop_reason == "early_stopping" and monitor.stopped_by is not None:
        stop_reason = monitor.stopped_by
    if monitor.early_stopping and monitor.best_theta is not None:
        if not np.array_equal(monitor.best_theta, theta):
            theta = monitor.best_theta
            if problem.n_candidates is not None:  # the candidates of these parameters
                problem.refresh_candidates(theta)
            with torch.no_grad():
                objective = float(problem.mean_score(problem.to_tensor(theta), problem.query_rows))
            n_eval += 1
    return FitResult(
        theta=np.asarray(theta, dtype=np.float64),
        n_iter=n_iter,
        converged=stop_reason in CONVERGED,
        stop_reason=stop_reason,
        objective=objective,
        history=monitor.history,
        best_val_accuracy=None if monitor.best_theta is None else monitor.best_acc,
        n_evaluations=n_eval,
        seconds=monitor.clock() - monitor.start,
    )


def single_class_result(problem: Problem, theta: np.ndarray, monitor: Monitor) -> FitResult:
    """One class: every point's neighbours share its label, so the objective is constant
    (p_i = 1) and its gradient zero; the initial parameters are the answer (as in
    scikit-learn, which fits a single class without changing the initial transformation)."""
    with torch.no_grad():
        objective = float(problem.mean_score(problem.to_tensor(theta)))
    return finished_result(problem, monitor, theta, 0, "single_class", objective, 1)
