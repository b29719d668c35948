"""The stages of one fit: the first optimisation and the judged exact finish.

``StagedFit`` holds what every stage of a fit shares (the objective over the training rows,
the monitor options, the judge of ``training.optim.stages``) and runs the stages in order:

1. **first stage**: L-BFGS or Adam from the initial map, on the exact objective or on
   candidate sets (``training.optim.lbfgs``, ``training.optim.adam``);
2. **judged finish**: after a fit on candidate sets, L-BFGS iterations on the exact objective
   (``training.optim.finish``).

Each stage ends with the judge keeping the better of its start and its end (docs/training.md,
"Stages"). ``NCA.fit`` (``training.model.estimator``) reads top to bottom around it: prepare, plan,
first stage, judged finish, publish the fitted attributes. Tested through the estimator
(``tests/training/model/test_estimator.py``, ``tests/training/optim/test_stages.py``,
``test_exact_finish.py``).
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import torch

from training.distributed.ranks import broadcast_from_rank0
from training.model import sparse_input
from training.numerics import evenly_spaced_rows
from training.objectives.registry import make_objective
from training.optim.adam import run_adam
from training.optim.candidate_search import CandidateSearch
from training.optim.candidates import candidate_audit
from training.optim.finish import finish_exactly
from training.optim.lbfgs import run_lbfgs
from training.optim.monitor import FitResult, Monitor, single_class_result
from training.optim.problem import Problem
from training.optim.sharded_problem import ShardedProblem
from training.optim.stages import FitClock, StageGuard, StageJudge, StageRecord


class StagedFit:
    """The stages of the estimator ``est``'s fit on the prepared rows ``prep``
    (``training.model.preparation.Prepared``) under the ``plan``
    (``training.model.plan.FitPlan``), in the process group ``group``, on the fit's
    ``clock`` (its budget: ``training.optim.stages.FitClock``)."""

    def __init__(self, est, settings, prep, plan, group, clock: FitClock, checkpoint=None):
        # settings: every setting of the fit by name (training.model.options.fit_settings)
        self.name, self.settings = type(est).__name__, settings
        self.prep, self.plan, self.group, self.clock = prep, plan, group, clock
        # training.model.checkpoint.FitCheckpoint, or None: the stages a killed fit finished
        self.checkpoint = checkpoint
        self.saved = None if checkpoint is None else checkpoint.load()
        self.resumed_stages = 0  # stages a checkpoint held
        self.make_problem = self._problem_factory()
        self.problem = self.make_problem()
        self.validate = prep.validate(self.problem)
        self.monitor = self._monitor()
        self.judge = self._judge() if settings.select_stages else None
        self.records: list[StageRecord] = []
        self.finished_iter = 0  # iterations of the exact finish
        self.candidate_history: list[dict] = []  # the first stage's history

    # ------------------------------------------------------------------ stages

    def first_stage(self) -> FitResult:
        """The first optimisation from the initial map, judged against it; one class alone
        has nothing to learn and keeps the initial map, as does a fit whose budget is spent
        before it starts."""
        prep, problem, plan = self.prep, self.problem, self.plan
        if len(prep.classes) == 1:  # every neighbour is of the same class
            result = single_class_result(problem, prep.theta0, self.monitor)
            self.candidate_history = result.history
            return result
        stage = "exact fit" if plan.n_candidates is None else "candidate stage"
        if self.saved is not None:  # a fit that was killed after this stage
            return self._resume()
        if self.clock.exhausted():
            self._skip(stage)
            unfitted = FitResult(
                np.array(prep.theta0, copy=True), 0, False, "max_seconds", math.nan
            )
            return self._result_at(prep.theta0, problem, unfitted)
        started = self.clock.elapsed()
        guard = self.monitor.guard = self._guard(prep.theta0, stage, self.settings.max_iter)
        result = self._optimise(problem, prep.theta0, plan.solver, prep.rng)
        kept = self._settle(stage, prep.theta0, result, guard, started)
        result = self._result_at(kept, problem, result, guard)
        self.candidate_history = result.history
        self._save(1, result)
        return result

    def judged_finish(self, result: FitResult) -> FitResult:
        """After a fit on candidate sets, ``plan.finish_iter`` L-BFGS iterations on the exact
        objective, judged against the first stage's map; otherwise ``result`` unchanged.
        Skipped when the fit's budget is spent."""
        plan = self.plan
        if not plan.finish_iter or result.stop_reason == "single_class":
            return result
        if self.saved is not None and self.saved["stages_done"] >= 2:
            return self._resume()
        if self.clock.exhausted():
            self._skip("exact finish")
            return result
        exact = self.make_problem(l2=plan.finish_l2, n_candidates=None, n_draws=0)
        start, started = result.theta, self.clock.elapsed()
        guard = self._guard(start, "exact finish", plan.finish_iter)
        merged, finish = finish_exactly(
            exact,
            result,
            self.monitor,
            n_iter=plan.finish_iter,
            max_rows=plan.finish_max_rows,
            tol=self.settings.tol,
            validate=self.prep.validate(exact),
            monitor_options={**self.monitor_options(), "guard": guard},
            max_evaluations=plan.finish_max_evaluations,
        )
        self.finished_iter = finish.n_iter
        kept = self._settle("exact finish", start, finish, guard, started)
        merged = replace(merged, stop_reason=self._fit_stop_reason(result.stop_reason))
        result = self._result_at(kept, exact, merged, guard)
        self._save(2, result)
        return result

    # ------------------------------------------------------------------ checkpoints

    def _save(self, stages_done: int, result: FitResult) -> None:
        """The checkpoint after ``stages_done`` stages (``training.model.checkpoint``)."""
        if self.checkpoint is None:
            return
        self.checkpoint.save(
            stages_done=stages_done,
            result=result,
            records=self.records,
            candidate_history=self.candidate_history,
            n_candidates=self.problem.n_candidates,
            finished_iter=self.finished_iter,
            rng=self.prep.rng,
        )

    def _resume(self) -> FitResult:
        """The result, records and generators a checkpoint saved: the stages it holds are
        done. Its first stage's state is used once; a later stage's when asked again."""
        saved = self.saved
        result, self.records = self.checkpoint.restore(saved, self.prep.rng)
        self.candidate_history = saved["candidate_history"]
        self.problem.n_candidates = saved["n_candidates"]
        self.finished_iter = saved["finished_iter"]
        if saved["stages_done"] < 2:
            self.saved = None  # the finish runs from here
        self.resumed_stages = saved["stages_done"]
        return result

    def _guard(self, start: np.ndarray, stage: str, max_iter: int) -> StageGuard:
        """The guard of the stage ``stage`` that starts at ``start`` and runs at most
        ``max_iter`` iterations (``training.optim.stages``); it tells the estimator's
        ``progress`` callback (on rank 0) where the fit is."""
        return StageGuard(
            self.clock,
            self.judge,
            start,
            stop_stalled=self.settings.stop_stalled_stages,
            stage=stage,
            max_iter=max_iter,
            progress=self.settings.progress if self.group.rank == 0 else None,
        )

    def _settle(self, stage, start, result: FitResult, guard, started) -> np.ndarray:
        """The map a stage leaves, and its record: its end (the better of its last iterate
        and the best map its guard checked), or its start when the judge undoes it."""
        end = result.theta
        if self.judge is not None and guard.best_theta is not None:
            if self.judge.score_of(guard.best_theta) > self.judge.score_of(end):
                end = guard.best_theta
        judgement = None if self.judge is None else self.judge.judge(start, end)
        kept = "end (not judged)" if judgement is None else judgement.kept
        self.records.append(
            StageRecord(
                stage=stage,
                start_score=None if judgement is None else judgement.start_score,
                end_score=None if judgement is None else judgement.end_score,
                kept=kept,
                seconds=self.clock.elapsed() - started,
                iterations=result.n_iter,
                evaluations=result.n_evaluations,
                refreshes=result.n_refreshes,
                checks=guard.checks,
                check_seconds=guard.check_seconds,
                stop_reason=result.stop_reason,
                refresh_changes=list(result.refresh_changes),
                refresh_replaced=list(result.refresh_replaced),
                refresh_sizes=list(result.refresh_sizes),
                search_mass_ratios=list(result.search_mass_ratios),
            )
        )
        return start if kept == "start" else end

    def _skip(self, stage: str) -> None:
        """The record of a stage the spent budget skipped."""
        self.records.append(
            StageRecord(stage, None, None, "start", 0.0, 0, 0, 0, 0, 0.0, "skipped (max_seconds)")
        )

    def _fit_stop_reason(self, first: str) -> str:
        """The fit's stop reason: the first stage's, unless the budget cut any stage short."""
        if any(r.stop_reason in ("max_seconds", "skipped (max_seconds)") for r in self.records):
            return "max_seconds"
        return first

    @staticmethod
    def _result_at(theta: np.ndarray, problem, result: FitResult, guard=None) -> FitResult:
        """``result`` at the map ``theta``: the objective the monitor reported there when it
        is the guard's best checked map, else computed afresh on ``problem`` (on fresh
        candidates for a candidate problem)."""
        if theta is result.theta:
            return result
        if guard is not None and theta is guard.best_theta:
            return replace(
                result, theta=np.array(theta, dtype=np.float64), objective=guard.best_objective
            )
        if problem.n_candidates is not None:
            problem.refresh_candidates(theta)
        with torch.no_grad():
            objective = float(problem.mean_score(problem.to_tensor(theta), problem.query_rows))
        return replace(
            result,
            theta=np.array(theta, dtype=np.float64),
            objective=objective,
            n_evaluations=result.n_evaluations + 1,
        )

    @property
    def budget_exhausted(self) -> bool:
        """Whether the budget cut the fit short (a stage stopped by it, or skipped)."""
        return self._fit_stop_reason("") == "max_seconds"

    # ------------------------------------------------------------------ what the stages share

    def _problem_factory(self):
        """problem(**overrides) -> the objective over the training points as the plan says
        (sharded across ranks under torchrun), with ``overrides`` for the exact finish."""
        settings, prep, plan, group = self.settings, self.prep, self.plan, self.group
        draw_seed = 0  # a seed only when drawing: the generator's stream (Adam's) stays as it was
        if plan.candidate_draws:
            draw_seed = int(prep.rng.integers(2**31 - 1))
            if group.is_distributed:  # every rank draws the same candidates
                seed = torch.tensor([draw_seed], dtype=torch.int64, device=prep.device)
                draw_seed = int(broadcast_from_rank0(seed, group)[0])
        defaults = dict(
            transform=settings.transformation,
            n_components=prep.d,
            l2=plan.l2,
            n_candidates=plan.n_candidates,
            n_draws=plan.candidate_draws,
            seed=draw_seed,
            chunk_size=settings.chunk_size,
            search=CandidateSearch(kind=settings.candidate_search, seed=draw_seed),
        )
        if sparse_input.is_sparse(prep.X):  # (N, D) sparse CSR: Z = X A^T costs O(nnz d)
            X = sparse_input.torch_csr(prep.X, prep.device)
        else:
            X = torch.as_tensor(prep.X, dtype=torch.float32, device=prep.device)
        labels = torch.as_tensor(prep.y, dtype=torch.long, device=prep.device)
        objective = make_objective(settings.objective, settings.k, n_classes=len(prep.classes))
        if plan.candidate_rows is not None and not group.is_distributed:
            rows = evenly_spaced_rows(len(prep.y), plan.candidate_rows)
            defaults["candidate_rows"] = torch.as_tensor(rows, device=prep.device)

        def make_problem(**overrides):
            kwargs = {**defaults, **overrides}
            if kwargs["n_candidates"] is None:  # the exact finish chooses its own rows
                kwargs.pop("candidate_rows", None)
            if group.is_distributed:
                return ShardedProblem(X, labels, objective, group=group, **kwargs)
            return Problem(X, labels, objective, **kwargs)

        return make_problem

    def _judge(self) -> StageJudge | None:
        """What each stage's start and end are scored by (``training.optim.stages``): the
        k-NN accuracy of the validation split, or of the rows held out to judge the fit
        (``preparation.held_out``); None when no rows are held out (a small fit without
        validation)."""
        prep = self.prep
        score = prep.judge(self.problem)
        if score is None:
            return None
        measure = (
            "validation accuracy"
            if prep.X_val is not None
            else f"k-NN accuracy of {prep.n_judged} training rows held out of the fit"
        )
        return StageJudge(score, measure, prep.n_judged)

    def _monitor(self) -> Monitor:
        problem = self.problem
        return Monitor(
            max_iter=self.settings.max_iter,
            validate=self.validate,
            components=problem.components,
            audit=candidate_audit(problem),
            penalty=problem.penalty,
            **self.monitor_options(),
        )

    def monitor_options(self) -> dict:
        """What every stage's Monitor shares: early stopping, the table, the callback."""
        settings = self.settings
        return dict(
            early_stopping=settings.early_stopping,
            interval=settings.validation_interval,
            patience=settings.n_iter_no_change,
            verbose=bool(settings.verbose) and self.group.rank == 0,
            name=self.name,
            callback=settings.callback,
        )

    def _optimise(self, problem, theta0, solver, rng) -> FitResult:
        settings = self.settings
        shared = dict(  # what both optimisers take: the budget, the monitor, the refreshes
            max_iter=settings.max_iter,
            tol=settings.tol,
            monitor=self.monitor,
            refresh_every=settings.refresh_every,
            refresh_tol=settings.refresh_tol,
            target_mass=settings.candidate_mass,
        )
        if solver == "lbfgs":
            return run_lbfgs(problem, theta0, **shared)
        return run_adam(
            problem,
            theta0,
            learning_rate=settings.learning_rate,
            batch_size=settings.batch_size,
            rng=rng,
            **shared,
        )

    def describe(self) -> list[dict]:
        """What each stage did (``NCA.stages_``): time, work, scores, what was kept."""
        return [record.describe() for record in self.records]

    def measure(self) -> str | None:
        """What the scores in the records are (``NCA.stage_measure_``)."""
        return None if self.judge is None else self.judge.measure
