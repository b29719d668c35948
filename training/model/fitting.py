"""The fit loop: a plan of stages, run one after the other by one loop.

A fit is a list of stages (:func:`plan_stages`): an exact fit; or a stage on candidate sets
and then the exact finish. Each says its objective (exact or on candidate sets), the rows
its loss averages over, its penalty, its optimiser and its limits. ``StagedFit.run``
runs them; its shape (``docs/training.md`` shows it too):

    kept = Snapshot(the initial map)
    for stage in plan_stages(plan, max_iter):     # [exact fit] or [candidate stage, exact finish]
        if the budget is spent: record the stage as skipped; next stage
        problem = the stage's objective; theta = kept.theta
        score theta on held-out rows, offer it to the keep rule (it is the kept map)
        if stage.scaled_start (the NCA finish): theta = s theta, s its loss's best scale
                                                 (and its first step's length likewise)
        while no stop reason:
            if the candidate sets are stale: refresh them (L-BFGS forgets its pairs)
            theta = optimiser.step(theta)          # one L-BFGS iteration or one Adam epoch
            record it (history_, the verbose table, callback, progress)
            a later stage's first iteration: stop, undone, unless it gained ("no gain")
            on a check: score theta on held-out rows, offer it to the keep rule,
                        stop when `patience` checks bring no gain (hurt or stalled)
            stop when the optimiser says so (on candidate sets, a new round instead
            unless the last refresh changed under 1% of the sets), at max_iter, else
            when the budget is spent
        offer the stage's last map to the keep rule; record the stage (stages_)
    return kept

**The score** of a map is computed on held-out rows (``preparation.HeldOutScores``: a
validation split, or the rows held out of the fit to judge it, chosen by the function
``preparation.held_out``): their soft-neighbour score, NCA's p_i at its best temperature
over the nearest references (``sharded_stats.soft_neighbour_score``), which is blind to
the map's scale as k-NN is and moves with a gain that 4,096 rows' accuracy is too coarse
to show. A validation split's
k-NN accuracy at the served k and rule is reported beside it (``val_accuracy``), not
judged by. Rows the map was fitted on cannot judge it: NCA makes their leave-one-out
neighbourhoods pure. A user's ``held_out_score(A, stage, iteration)`` (``FitOptions``)
replaces that score wherever maps are judged, with a tolerance of 0 (no rows are then held
out of the fit; a validation split still gives the accuracy).
It is checked at the fit's first iteration and every ``validation_interval``-th iteration of
the fit (iteration counts, not the clock: the same maps are scored on every run and rank),
and a later stage (the exact finish) at its own first iteration too (below).

**The finish's start scale.** The candidate stage runs without a penalty (``l2="auto"`` is
0 on candidate sets) and grows the map until each softmax sits on its nearest candidates;
the exact finish carries ``l2 ||A||^2``, whose optimum lies at a far smaller scale, and
would spend its first iterations shrinking the map. So the NCA finish
(``Stage.scaled_start``, from the plan) starts from s theta, the first local minimum of its
loss along that ray on a grid of powers of sqrt 2 within 1/16 and 16 (:func:`start_scale`:
from 1 down, or up, while the loss falls; each scale tried is a forward pass over an
eighth of the stage's rows). The held-out score is blind to the scale, so s theta scores as
theta does; a finish that is undone returns theta itself (and its objective on the
finish's problem, one more forward pass). ``stages_`` records s. Its first L-BFGS step
(along -g, no curvature pairs yet) tries first the length where the loss on the same
sample rows stops falling along -g, on a grid of powers of 2 from a unit step
(:func:`first_step_length`; forward passes on those rows, not counted as evaluations),
where a unit step overshoots and costs the line search a second evaluation
(``benchmarks/README.md``, "Page faults, repeated products and the finish's first step").
kNCA's finish starts where it did: its start scale and first step are not measured.

**The keep rule** (one, for the whole fit): a map scored is kept when it scores at least
the best score of the fit so far less the tolerance (one and a half rows' worth), so
the kept map is the most trained one within that tolerance of the best. Without held-out rows or a
``held_out_score`` (or with ``select_stages=False`` and no ``early_stopping``) the last
map is kept.

**The stop rule** (one, for every stage): ``patience`` checks in a row without a gain over
the stage's best score (its start's included) by more than the tolerance stop the stage:
``hurt`` when the last scores below the start by more than the tolerance, else ``stalled``
(so a stage that hurts stops at its second check). A later stage starts from a trained map
and must earn its cost: it is checked at its own first iteration too, and unless that
iteration scores above its start by more than the tolerance it stops there (``no gain``)
and is undone (its map is not offered to the keep rule; the kept map and its objective
stay as the stage before left them). Through the job on the real digits (seed 0) the
finish's first iteration gained 1.2 rows' worth on the validation rows, and its five
iterations had cost 16 s for a map 0.1 point worse on test; where the first gains (the
synthetic sets, where the finish buys 1.2 points of 1-NN error) it runs as before
(``benchmarks/README.md``, "A finish that must gain at its first iteration"). ``patience`` is
STALL_CHECKS, or ``n_iter_no_change`` when ``early_stopping`` asked for it; both rules are
off when both ``early_stopping`` and ``stop_stalled_stages`` are. The budget (``max_seconds``,
:class:`FitClock`) stops a stage after any iteration and skips the stages left. No rule but
the budget reads the clock.
"""

from __future__ import annotations

import contextlib
import math
import numbers
import signal
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from enum import Enum
from functools import partial

import numpy as np
import torch

from training.distributed.ranks import broadcast_from_rank0, lowest_and_highest
from training.errors import Interrupted, held_interrupt, holding_interrupts
from training.model import sparse_input
from training.numerics import evenly_spaced_rows
from training.objectives.registry import make_objective
from training.optim.adam import AdamEpochs
from training.optim.candidates import AUDIT_ROWS, CandidateSearch, CandidateWatch
from training.optim.lbfgs import LBFGS, Evaluation, ProblemLoss
from training.optim.problem import Problem, map_components
from training.optim.sharded_problem import ShardedProblem

STALL_CHECKS = 2  # checks in a row without a gain that stop a stage (without early_stopping)
# the finish's start scale: scales SCALE_RATIO^k, |k| <= SCALE_STEPS, tried on
# 1 / SCALE_SHARE of its rows (at least SCALE_MIN_ROWS, or all of them)
SCALE_RATIO = 2**0.5
SCALE_STEPS = 8
SCALE_SHARE = 8
SCALE_MIN_ROWS = 256
FIRST_STEP_RATIO = 2.0  # the grid of the finish's first step length (first_step_length)
CANDIDATE_CHANGE_TOL = 0.01  # a round converged on sets that changed less than this: done
CACHED_MAPS = 4  # the held-out scores of this many maps are remembered
# an exact L-BFGS stage is checkpointed after an iteration when this many seconds have passed
# since the last save (the clock decides when to save, never what the fit computes); a save
# (the map and the optimiser's pairs, about 2 MiB at 32 x 784) costs milliseconds against
# the seconds of an exact iteration (benchmarks/results/resume_cost.json)
CHECKPOINT_SECONDS = 10.0
# a signal in a checkpointed stage waits at most this long for the iteration's end (its save)
HOLD_SECONDS = 5.0


class StopReason(str, Enum):
    """Why a stage ended (``stages_[i]["stop_reason"]``, ``stop_reason_``)."""

    CONVERGED = "converged"  # f's relative decrease or max |g| fell below tol
    PRECISION = "precision"  # no step along the direction decreased f at this precision
    MAX_ITER = "max_iter"
    MAX_EVALUATIONS = "max_evaluations"  # the stage's evaluations are spent
    HURT = "hurt"  # a held-out check below the stage's start
    STALLED = "stalled"  # patience checks in a row without a held-out gain
    NO_GAIN = "no gain"  # a later stage's first iteration gained nothing held out: undone
    MAX_SECONDS = "max_seconds"  # the fit's budget ran out during the stage
    SKIPPED = "skipped (max_seconds)"  # ... before it
    SINGLE_CLASS = "single_class"  # one class: nothing to learn

    def __str__(self) -> str:
        return self.value


# the stop reasons of a fit that ended where it meant to (``converged_``): the optimiser's
# tests, or the stop rule on held-out checks; not a limit of iterations, evaluations or time
ENDED_AS_MEANT = {
    StopReason.CONVERGED,
    StopReason.PRECISION,
    StopReason.HURT,
    StopReason.STALLED,
    StopReason.NO_GAIN,
    StopReason.SINGLE_CLASS,
}


@dataclass(frozen=True)
class Snapshot:
    """A map the fit reached: its parameters, the mean score of the objective it was reached
    on (of the later stage's objective once a later stage starts from it: ``objective_value_``
    is of the objective optimised last, as ``l2_`` is), its held-out score (None: not
    scored) and the fit's iteration count there."""

    theta: np.ndarray  # (P,) float64: A (d, D) raveled, or the diagonal a (D,)
    objective: float
    score: float | None
    iteration: int


@dataclass(frozen=True)
class Stage:
    """One stage of the plan."""

    name: str  # "exact fit", "candidate stage", "exact finish"
    on_candidates: bool  # the objective on candidate sets (refreshed when stale), or exact
    l2: float  # the penalty l2 ||A||_F^2
    solver: str  # "lbfgs" or "adam"
    max_iter: int
    max_evaluations: int | None = None  # of the objective and its gradient (None: no bound)
    max_rows: int | None = None  # query rows the loss averages over, at most (None: all)
    scaled_start: bool = False  # starts at its loss's best scale along the kept map's ray
    max_points: int | None = None  # an evenly spaced sample of this many points (None: all)


def plan_stages(plan, max_iter: int) -> list[Stage]:
    """The stages of ``plan`` (``training.model.plan.FitPlan``)."""
    on_candidates = plan.n_candidates is not None
    first = Stage(
        "candidate stage" if on_candidates else "exact fit",
        on_candidates=on_candidates,
        l2=plan.l2,
        solver=plan.solver,
        max_iter=max_iter,
    )
    stages = [first]
    if on_candidates and plan.finish_iter:
        finish = Stage(
            "exact finish",
            on_candidates=False,
            l2=plan.finish_l2,
            solver="lbfgs",
            max_iter=plan.finish_iter,
            max_evaluations=plan.finish_max_evaluations,
            max_rows=plan.finish_max_rows,
            scaled_start=plan.finish_scaled_start,
            max_points=plan.finish_points,
        )
        stages.append(finish)
    return stages


class FitClock:
    """Seconds since the fit started, and its budget ``max_seconds`` (None: none).

    ``agree``: (flags,) -> the flags every process uses. Under torchrun each rank has its own
    clock, so the budget's decision is rank 0's (``ranks.agreed_flags``), taken by every rank
    at the same point."""

    def __init__(self, max_seconds=None, clock: Callable[[], float] | None = None, agree=None):
        self.clock = clock or time.perf_counter
        self.started = self.clock()
        self.max_seconds = max_seconds
        self.agree = agree or (lambda flags: flags)

    def elapsed(self) -> float:
        return self.clock() - self.started

    def exhausted(self) -> bool:
        """Whether the budget is spent (every rank's answer is rank 0's)."""
        spent = self.max_seconds is not None and self.elapsed() >= self.max_seconds
        return self.agree((spent,))[0]


@dataclass(frozen=True)
class StageProgress:
    """Where a fit is, as its progress callback sees it: at a stage's start (iteration 0)
    and after each of its iterations."""

    stage: str
    iteration: int  # iterations of this stage so far
    max_iter: int  # ... and at most
    held_out: float | None  # the stage's latest held-out score (None: not scored)
    seconds: float  # since the fit started
    max_seconds: float | None  # the fit's budget (None: none)


@dataclass
class StageRecord:
    """What one stage did (``NCA.stages_``; the training report shows it)."""

    stage: str
    start_score: float | None  # held-out score of its start (None: not judged)
    end_score: float | None  # ... and of the best map it reached
    kept: str  # "end", "start" (the stage was undone) or "end (not judged)"
    seconds: float  # the stage's wall time, its checks included
    iterations: int
    evaluations: int  # of the objective and its gradient
    refreshes: int  # candidate-set computations
    checks: int  # held-out scores computed (its start's included)
    check_seconds: float  # ... and their time
    stop_reason: str
    start_scale: float = 1.0  # the factor its start map was scaled by (start_scale())
    # per candidate refresh: the fraction of sets it changed (the first: 1), the share of
    # entries it replaced, K (the candidates per kind it kept) and an IVF search's neighbour
    # mass against exact sets' (None: exact search)
    refresh_changes: list[float] = field(default_factory=list)
    refresh_replaced: list[float] = field(default_factory=list)
    refresh_sizes: list[int] = field(default_factory=list)
    search_mass_ratios: list[float | None] = field(default_factory=list)

    def describe(self) -> dict:
        return asdict(self)


def with_refreshes(record: StageRecord, watch) -> StageRecord:
    """``record`` with what the candidate sets' watch (``candidates.CandidateWatch``) saw
    at each refresh."""
    return replace(
        record,
        refreshes=watch.n_refreshes,
        refresh_changes=list(watch.changes),
        refresh_replaced=list(watch.replaced),
        refresh_sizes=list(watch.sizes),
        search_mass_ratios=list(watch.search_mass_ratios),
    )


class HeldOut:
    """Scores maps on held-out rows (``figures``: theta -> (score, accuracy), the score in
    [0, 1] a mean probability over ``n_rows`` rows, the accuracy a validation split's k-NN
    accuracy or None), the last CACHED_MAPS remembered; ``tolerance`` is one and a half
    rows' worth, 1.5 / n_rows.

    ``scorer`` (the user's ``held_out_score``, or None): (theta, stage, iteration) -> the
    score that judges theta in place of the rows' score, in the user's units (so the
    tolerance is 0), asked anew at each (stage, iteration) since it may depend on where the
    fit is; the rows, when there are any, still give a validation split's accuracy."""

    def __init__(
        self,
        figures: Callable[[np.ndarray], tuple],
        n_rows: int,
        measure: str,
        scorer: Callable[[np.ndarray, str, int], float] | None = None,
    ):
        self.figures, self.measure, self.scorer = figures, measure, scorer
        self.tolerance = 0.0 if scorer is not None else 1.5 / max(1, n_rows)
        self.checks, self.seconds = 0, 0.0  # scores computed, and their time
        self._cache: list[tuple[np.ndarray, float, float | None]] = []
        self._asked: tuple | None = None  # the scorer's last (stage, iteration, theta, score)

    def __call__(self, theta: np.ndarray, stage: str, iteration: int) -> float:
        """The score that judges ``theta``, the map ``stage`` reached at its ``iteration``
        (0: its start)."""
        if self.scorer is not None:
            asked = self._asked  # a stage's last map is offered again at its end
            if asked is not None and asked[:2] == (stage, iteration):
                if np.array_equal(asked[2], theta):
                    return asked[3]
            started = time.perf_counter()
            score = float(self.scorer(theta, stage, iteration))
            self.checks += 1
            self.seconds += time.perf_counter() - started
            self._asked = (stage, iteration, np.array(theta, copy=True), score)
            return score
        cached = self._cached(theta)
        return cached[1] if cached is not None else self._computed(theta)[0]

    def accuracy(self, theta: np.ndarray) -> float | None:
        """The validation split's k-NN accuracy at ``theta`` (None for rows held out of the
        fit), computed with its score unless remembered."""
        cached = self._cached(theta)
        if cached is not None and cached[2] is not None:
            return cached[2]
        return self._computed(theta)[1]

    def _computed(self, theta: np.ndarray) -> tuple[float, float | None]:
        started = time.perf_counter()
        score, accuracy = self.figures(theta)
        self.checks += 1
        self.seconds += time.perf_counter() - started
        self._store(theta, score, accuracy)
        return float(score), accuracy

    def _cached(self, theta: np.ndarray) -> tuple | None:
        for entry in self._cache:
            if np.array_equal(entry[0], theta):
                return entry
        return None

    def remember(self, theta: np.ndarray, value: float | None) -> None:
        """``theta``'s score as a checkpoint recorded it (its accuracy is computed again when
        asked for)."""
        if value is not None:
            self._store(theta, value, None)

    def _store(self, theta: np.ndarray, score: float, accuracy: float | None) -> None:
        entry = (np.array(theta, copy=True), score, accuracy)
        self._cache = [*self._cache[-(CACHED_MAPS - 1) :], entry]


@dataclass
class StageResume:
    """Where an exact L-BFGS stage (the exact finish, an exact fit) stood after an
    iteration: what a killed fit goes on from, mid-stage, to the map an
    uninterrupted fit reaches (L-BFGS's step depends on nothing else)."""

    index: int  # of the stage in the plan
    iteration: int  # the stage's iterations so far
    theta: np.ndarray  # (P,) the iterate
    f: float  # the loss there, its gradient (P,) and mean score
    g: np.ndarray
    extra: float
    pairs_s: np.ndarray  # (m, P) L-BFGS's curvature pairs, oldest first
    pairs_y: np.ndarray  # (m, P)
    evaluations: int  # the stage's evaluations so far
    seconds: float  # the stage's time so far
    checks: dict  # the stage's held-out checks (StageChecks' numbers)
    start_scale: float = 1.0  # the factor the stage's start map was scaled by


@dataclass
class FitState:
    """Everything a fit has done so far: what a checkpoint saves after each stage, and
    within an exact L-BFGS stage every CHECKPOINT_SECONDS (``resume``)."""

    kept: Snapshot  # the map the fit returns if it ends now
    best_score: float | None = None  # the best held-out score of the fit
    records: list[StageRecord] = field(default_factory=list)
    history: list[dict] = field(default_factory=list)  # one record per iteration
    iterations: int = 0
    evaluations: int = 0
    stop_reason: str | None = None  # the first stage's
    n_candidates: int | None = None  # K at the end of the candidate stage
    stages_done: int = 0
    resume: StageResume | None = None  # the running stage's, mid-stage

    def offer(self, snapshot: Snapshot, tolerance: float | None) -> bool:
        """The keep rule (the module's docstring); ``tolerance`` None: not judged, the
        latest map is kept. Whether ``snapshot`` is now the kept map."""
        if tolerance is None or snapshot.score is None:
            self.kept = snapshot
            return True
        best = snapshot.score if self.best_score is None else self.best_score
        self.best_score = max(best, snapshot.score)
        if snapshot.score >= self.best_score - tolerance:
            self.kept = snapshot
            return True
        return False

    @property
    def budget_exhausted(self) -> bool:
        reasons = (StopReason.MAX_SECONDS, StopReason.SKIPPED)
        return any(record.stop_reason in reasons for record in self.records)

    @property
    def fit_stop_reason(self) -> str:
        """The first stage's stop reason (a finish runs a fixed budget by design), unless the
        budget cut a stage short."""
        return StopReason.MAX_SECONDS if self.budget_exhausted else self.stop_reason


def _position(state: FitState | None) -> int:
    """Where a saved state stands in the fit, as one ordered number (-1: no state)."""
    return -1 if state is None else state.stages_done * 10**9 + state.iterations


class StagedFit:
    """The stages of a fit on the prepared rows ``prep`` (``preparation.Prepared``) under
    ``plan`` (``plan.FitPlan``), in the process group ``group``, on the fit's ``clock``;
    ``name`` is the estimator's, for its messages; ``checkpoint``
    (``checkpoint.FitCheckpoint`` or None) saves the state after each stage and holds a
    killed fit's."""

    def __init__(self, name, settings, prep, plan, group, clock: FitClock, checkpoint=None):
        self.name, self.settings = name, settings  # name: the estimator's, for its messages
        self.prep, self.plan, self.group, self.clock = prep, plan, group, clock
        self.checkpoint = checkpoint
        self.stages = plan_stages(plan, settings.max_iter)
        self.make_problem = self._problem_factory()
        D = prep.X.shape[1]
        # theta -> the map A (d, D) it holds
        self.components = partial(map_components, transform=settings.transformation, d=prep.d, D=D)
        self.held_out = self._held_out()
        # whether the keep rule reads the scores (early stopping keeps the best validated map)
        keep_best = settings.select_stages or settings.early_stopping
        self.judged = self.held_out is not None and keep_best
        self.patience = self._patience()
        self.verbose = bool(settings.verbose) and group.rank == 0
        self.header_printed, self.last_line = False, 0.0
        self.resumed_stages = 0  # stages a checkpoint held done
        self.resumed_iterations = 0  # ... and iterations, mid-stage ones included

    # ------------------------------------------------------------------ the loop

    def run(self) -> FitState:
        """Run every stage not done yet (a checkpoint's stages are done) from the initial
        map, and return the fit's state."""
        state = self._resume() or FitState(Snapshot(self._start_theta(), math.nan, None, 0))
        if len(self.prep.classes) == 1:  # every neighbour has the point's class: nothing to learn
            state.kept = self._evaluated(state.kept)
            state.stop_reason, state.evaluations = StopReason.SINGLE_CLASS, 1
            return state
        self.last_line = self.clock.elapsed()  # the verbose table's first time counts from here
        self.last_save = self.last_line  # when the checkpoint was last written
        for index, stage in enumerate(self.stages):
            if index < state.stages_done:
                continue
            # SIGINT / SIGTERM in a checkpointed stage are held to the iteration's end, then
            # saved there and raised (training.errors.holding_interrupts)
            holds = self._checkpoints_mid_stage(stage)
            # under torchrun no rank stops on its own clock (a rank raising mid-iteration
            # would leave the others in a collective): the ranks stop together, agreed
            seconds = None if self.group.is_distributed else HOLD_SECONDS
            with holding_interrupts(seconds) if holds else contextlib.nullcontext() as hold:
                self._run_stage(index, stage, state)
                state.stages_done = index + 1
                if self.checkpoint is not None:
                    self._save(state)
            if holds and self._any_rank_signalled(hold.signum):  # held to the stage's end
                raise Interrupted(hold.signum or signal.SIGTERM)
        # the kept map has no objective: the budget skipped every stage, or an Adam stage
        # (whose start computes none) kept its start
        if math.isnan(state.kept.objective):
            state.kept = self._evaluated(state.kept)
            state.evaluations += 1
        self._close()
        return state

    def _evaluated(self, snapshot: Snapshot) -> Snapshot:
        """``snapshot`` with its objective: the first stage's mean score at its map (one
        class: every p_i is 1, on any candidate sets)."""
        problem = self.make_problem(self.stages[0])
        if problem.n_candidates is not None and len(self.prep.classes) > 1:
            problem.refresh_candidates(snapshot.theta)
        return replace(snapshot, objective=objective_at(problem, snapshot.theta))

    def _run_stage(self, index: int, stage: Stage, state: FitState) -> None:
        """One stage from the kept map, by the rules of the module's docstring."""
        started, before = self.clock.elapsed(), state.iterations
        resuming = state.resume is not None and state.resume.index == index
        if self.clock.exhausted() and not resuming:
            state.records.append(skipped_record(stage.name))
            return
        problem = self.make_problem(stage)
        solver = self._solver(stage, problem)
        watch = audit = None
        if stage.on_candidates:  # the sets' watch and audit on the same fixed sample rows
            settings, rows = self.settings, problem.sample_rows(AUDIT_ROWS)
            watch = CandidateWatch(
                problem, rows, settings.refresh_every, settings.refresh_tol, settings.candidate_mass
            )
            audit = partial(problem.audit, rows=rows)
        self._announce(stage, problem)
        check = StageChecks(self.held_out, self.patience)
        rounds = Rounds(watch)
        theta, at, iteration, resumed = self._stage_start(index, stage, state, solver, check)
        objective_before = state.kept.objective  # the kept map's, as the stage before left it
        scale = 1.0 if resumed is None else resumed.start_scale
        if resumed is not None:  # mid-stage: the stage's time and iterations so far count
            started, before = started - resumed.seconds, before - resumed.iteration
        elif stage.scaled_start:  # the finish's penalty wants a smaller map: its best scale
            scale = start_scale(problem, theta)
            theta = scale * theta
        stop = None
        if resumed is not None and self.clock.exhausted():  # a stage cut short where its
            stop = StopReason.MAX_SECONDS  # checkpoint stood (its iterations count)
        while stop is None:
            if iteration >= stage.max_iter:
                stop = StopReason.MAX_ITER
                break
            if rounds.due:  # a new round: fresh candidate sets, a fresh curvature estimate
                rounds.refresh(theta, iteration)
                solver.reset()
                at = None
            if at is None:
                at = solver.start(theta)
                if iteration == 0 and scale == 1.0:  # the start's objective, on this stage's
                    state.kept = replace(state.kept, objective=at.objective)  # problem
            left = None
            if stage.max_evaluations is not None:
                left = stage.max_evaluations - solver.evaluations
                if left <= 0:
                    stop = StopReason.MAX_EVALUATIONS
                    break
            if stage.scaled_start and iteration == 0:  # the finish's first step: its length
                first = partial(first_step_length, problem, theta, at.g)  # on sample rows
                step = solver.step(theta, at, left, first_length=first)
            else:
                step = solver.step(theta, at, left)
            if not step.moved:  # the start meets the gradient test, or no step decreases f
                stop = rounds.stop_for(step.stop, iteration, moved=False)
                continue
            theta, at, iteration = step.x, step.at, iteration + 1
            state.iterations += 1
            figures = rounds.after_iteration(theta)
            # the fit's schedule: its first iteration and every validation_interval-th; a
            # later stage is checked at its own first iteration too (it must earn its cost)
            scheduled = state.iterations == 1
            scheduled = scheduled or state.iterations % self.settings.validation_interval == 0
            first_of_later = index > 0 and iteration == 1 and self.judged
            first_of_later = first_of_later and self.patience is not None
            if scheduled and audit is not None:
                figures.update(audit(theta))
            record = self._record(index, stage, problem, theta, at.objective, figures, state)
            score = self._score(index, iteration, theta) if scheduled or first_of_later else None
            if score is not None and self.prep.X_val is not None:
                record["val_accuracy"] = self.held_out.accuracy(theta)
                record["val_score"] = score
            self._print(record)
            if first_of_later and score is not None and not check.gains(score):
                # undone: the map is not offered, and the kept map keeps the objective the
                # stage before gave it (an unscaled start took this stage's at iteration 0)
                check.after(score)
                stop = StopReason.NO_GAIN
                state.kept = replace(state.kept, objective=objective_before)
            elif score is not None:
                state.offer(Snapshot(theta, at.objective, score, state.iterations), self._tolerance)
                stop = check.after(score)
            self._progress(stage, iteration, check.last_score)
            # a stage that ends here by its own rules says so; the budget names only the
            # stops it caused (it is spent, and the stage would have gone on)
            if stop is None and step.stop is not None:
                stop = rounds.stop_for(step.stop, iteration, moved=True)
            if stop is None and iteration >= stage.max_iter:
                stop = StopReason.MAX_ITER
            if stop is None and self.clock.exhausted():
                stop = StopReason.MAX_SECONDS
            save, interrupted = self._saves_mid_stage(stage) if stop is None else (False, False)
            if save:
                state.resume = self._where(
                    index, iteration, theta, at, solver, check, started, scale
                )
                self._save(state)
                state.resume = None
            if interrupted:  # a signal held to here: saved when checkpointed, and raised
                raise Interrupted(held_interrupt() or signal.SIGTERM)
        if iteration > 0 and stop != StopReason.NO_GAIN:
            # the stage's last map, offered to the keep rule too (not an undone stage's)
            score = self._score(index, iteration, theta)
            check.seen(score)
            state.offer(Snapshot(theta, at.objective, score, state.iterations), self._tolerance)
        undone = state.kept.iteration <= before and stop != StopReason.NO_GAIN
        if scale != 1.0 and undone:  # undone by the keep rule: the kept map is the stage's
            # unscaled start, whose objective on this stage's problem is not at.objective (a
            # stage without a gain leaves the kept map as the stage before left it)
            state.kept = replace(state.kept, objective=objective_at(problem, state.kept.theta))
        state.evaluations += solver.evaluations
        if index == 0:
            state.stop_reason = stop
        if watch is not None:
            state.n_candidates = problem.n_candidates
        record = StageRecord(
            stage=stage.name,
            start_score=check.start_score if self.judged else None,
            end_score=check.end_score if self.judged else None,
            kept=self._kept_label(state, before),
            seconds=self.clock.elapsed() - started,
            iterations=iteration,
            evaluations=solver.evaluations,
            refreshes=0,
            checks=check.count,
            check_seconds=check.seconds,
            stop_reason=str(stop),
            start_scale=scale,
        )
        state.records.append(record if watch is None else with_refreshes(record, watch))

    def _stage_start(self, index, stage, state, solver, check) -> tuple:
        """(theta, L-BFGS's point or None, iterations done, the ``StageResume`` or None)
        where stage ``index`` starts: the kept map, scored and offered to the keep rule; or,
        for a fit killed within the stage, where its checkpoint says (the solver's pairs and
        the checks restored)."""
        resume, state.resume = state.resume, None
        if resume is not None and resume.index == index:  # a killed fit, mid-stage
            solver.restore(resume.pairs_s, resume.pairs_y, resume.evaluations)
            check.restore(resume.checks)
            return resume.theta, resume_point(resume), resume.iteration, resume
        check.start(self._score(index, 0, state.kept.theta))
        if self.judged:  # the start, scored: the kept map (the keep rule's invariant)
            state.offer(replace(state.kept, score=check.start_score), self.held_out.tolerance)
        self._progress(stage, 0, check.last_score)
        return state.kept.theta, None, 0, None

    # ------------------------------------------------------------------ what the loop uses

    def validation_accuracy(self, theta: np.ndarray) -> float | None:
        """The validation split's k-NN accuracy at ``theta`` (None without one)."""
        if self.held_out is None or self.prep.X_val is None:
            return None
        return self.held_out.accuracy(theta)

    def _score(self, index: int, iteration: int, theta: np.ndarray) -> float | None:
        """The held-out score of ``theta``, the map stage ``index`` reached at its
        ``iteration`` (0: its start); None when maps are not scored."""
        if self.held_out is None:
            return None
        return self.held_out(theta, self.stages[index].name, iteration)

    @property
    def _tolerance(self) -> float | None:
        """The keep rule's tolerance; None when maps are not judged (the latest is kept)."""
        return self.held_out.tolerance if self.judged else None

    def _kept_label(self, state: FitState, iterations_before: int) -> str:
        if not self.judged:
            return "end (not judged)"
        return "end" if state.kept.iteration > iterations_before else "start"

    def _start_theta(self) -> np.ndarray:
        return np.asarray(self.prep.theta0, dtype=np.float64).ravel().copy()

    def _resume(self) -> FitState | None:
        """The state a checkpoint holds (its stages are done; both generators as they were),
        or None. Under torchrun every rank resumes from the same point or none does: a rank
        whose last save is ahead of another's (it was killed between the two ranks' writes)
        takes its previous save; when the ranks still disagree, the fit starts over."""
        if self.checkpoint is None:
            return None
        rng, torch_rng = self.prep.rng.bit_generator.state, torch.get_rng_state()
        limits = [stage.max_iter for stage in self.stages]
        state = self.checkpoint.load(self.prep.rng, limits)
        lowest, highest = lowest_and_highest(_position(state), self.group)
        disagreed = lowest != highest
        if disagreed and _position(state) != lowest:
            state = self.checkpoint.load(self.prep.rng, limits, previous=True)
            if _position(state) != lowest:
                state = None
            lowest, highest = lowest_and_highest(_position(state), self.group)
        if lowest != highest:
            state = None
        if state is None:  # no common point: start over, the generators as drawn
            self.prep.rng.bit_generator.state = rng
            torch.set_rng_state(torch_rng)
            if disagreed and self.group.rank == 0:
                warnings.warn(
                    f"the ranks' checkpoints in {self.checkpoint.directory} hold no point of "
                    "the fit in common; the fit starts over",
                    RuntimeWarning,
                    stacklevel=3,
                )
        if state is not None:
            self.resumed_stages = state.stages_done
            self.resumed_iterations = state.iterations
            if self.held_out is not None:  # the kept map's score, remembered
                self.held_out.remember(state.kept.theta, state.kept.score)
        return state

    def _checkpoints_mid_stage(self, stage: Stage) -> bool:
        """Whether the stage is checkpointed mid-stage: an exact L-BFGS stage's (a stage on
        candidate sets starts over: its sets and search are not saved)."""
        return self.checkpoint is not None and not stage.on_candidates and stage.solver == "lbfgs"

    def _saves_mid_stage(self, stage: Stage) -> tuple[bool, bool]:
        """(save, interrupted) after an iteration: save once CHECKPOINT_SECONDS have passed
        since the last save, or when a rank holds a signal (interrupted: saved, then
        raised). Under torchrun rank 0's clock decides the save and any rank's signal the
        stop, for every rank, so that all save at the same iterations. A fit of one process
        that is not checkpointed mid-stage stops here too, unsaved, when a caller's hold keeps
        a signal (the job's cross-fitted fits: ``training.evaluation.cross_fit``)."""
        if not self._checkpoints_mid_stage(stage):
            return False, not self.group.is_distributed and held_interrupt() is not None
        due = self.clock.elapsed() - self.last_save >= CHECKPOINT_SECONDS
        save = self.clock.agree((due,))[0]
        interrupted = self._any_rank_signalled(held_interrupt())
        return save or interrupted, interrupted

    def _any_rank_signalled(self, signum: int | None) -> bool:
        """Whether any rank holds a signal (``signum``: this rank's, None for none): one
        all-reduce under torchrun, so that every rank stops at the same point."""
        return lowest_and_highest(int(signum is not None), self.group)[1] == 1

    def _where(self, index, iteration, theta, at, solver, check, started, scale) -> StageResume:
        """Where the running stage stands (a mid-stage checkpoint's)."""
        s, y = solver.pairs_arrays()
        seconds = self.clock.elapsed() - started
        return StageResume(
            index,
            iteration,
            theta,
            at.f,
            at.g,
            at.objective,
            s,
            y,
            solver.evaluations,
            seconds,
            check.numbers(),
            scale,
        )

    def _save(self, state: FitState) -> None:
        self.checkpoint.save(state, self.prep.rng)
        self.last_save = self.clock.elapsed()

    def _solver(self, stage: Stage, problem):
        settings = self.settings
        if stage.solver == "adam":
            return AdamEpochs(
                problem, settings.learning_rate, settings.batch_size, self.prep.rng, settings.tol
            )
        return LBFGS(ProblemLoss(problem), settings.tol)

    def _problem_factory(self):
        """stage -> the objective over the training points the stage says (sharded across
        ranks under torchrun): exact or on candidate sets, its rows, its penalty."""
        settings, prep, plan, group = self.settings, self.prep, self.plan, self.group

        def points_tensor(rows: np.ndarray | None = None):  # (N or len(rows), D)
            chosen = prep.X if rows is None else prep.X[rows]
            if sparse_input.is_sparse(chosen):  # (N, D) sparse CSR: Z = X A^T costs O(nnz d)
                return sparse_input.torch_csr(chosen, prep.device)
            return torch.as_tensor(chosen, dtype=torch.float32, device=prep.device)

        X = points_tensor()
        labels = torch.as_tensor(prep.y, dtype=torch.long, device=prep.device)
        objective = make_objective(settings.objective, settings.k, n_classes=len(prep.classes))
        n = len(prep.y)

        def make_problem(stage: Stage):
            stage_X, stage_labels, m = X, labels, n  # the stage's points (all, or a sample)
            # a sample of the points (the plan sets none under torchrun: a rank holds its shard)
            if stage.max_points is not None and n > stage.max_points and not group.is_distributed:
                sample = evenly_spaced_rows(n, stage.max_points)
                stage_X, m = points_tensor(sample), len(sample)
                stage_labels = labels[torch.as_tensor(sample, device=prep.device)]
            rows = None  # the query rows the loss averages over, of the stage's points (None: all)
            if stage.on_candidates and plan.candidate_rows is not None:  # none under torchrun
                rows = evenly_spaced_rows(m, plan.candidate_rows)
            if not stage.on_candidates and stage.max_rows is not None and m > stage.max_rows:
                rows = evenly_spaced_rows(m, stage.max_rows)
            kwargs = dict(
                transform=settings.transformation,
                n_components=prep.d,
                l2=stage.l2,
                n_candidates=plan.n_candidates if stage.on_candidates else None,
                chunk_size=settings.chunk_size,
                search=CandidateSearch(kind=settings.candidate_search),
                query_rows=None if rows is None else torch.as_tensor(rows, device=prep.device),
            )
            if group.is_distributed:
                return ShardedProblem(stage_X, stage_labels, objective, group=group, **kwargs)
            return Problem(stage_X, stage_labels, objective, **kwargs)

        return make_problem

    def _held_out(self) -> HeldOut | None:
        """The held-out rows' scorer: the validation split's, or that of the rows held out
        of the fit to judge it (chosen by the function ``preparation.held_out``), or the
        user's ``held_out_score`` (with or without rows); None when nothing scores maps."""
        scores, user_score = self.prep.held_out, self.settings.held_out_score
        if not (self.settings.select_stages or self.settings.early_stopping):
            user_score = None  # nothing is judged: the user's function is not asked
        if scores is None and user_score is None:
            return None
        n_rows = 0 if scores is None else scores.n_rows
        validation = scores is not None and scores.validation
        held = "validation rows" if validation else "training rows held out of the fit"
        measure = f"soft-neighbour score of {n_rows} {held}"

        def figures(theta: np.ndarray) -> tuple[float, float | None]:
            return scores.figures(self.components(theta).astype(np.float32))

        scorer = None
        if user_score is not None:
            measure = "held_out_score (FitOptions)"

            def scorer(theta: np.ndarray, stage: str, iteration: int) -> float:
                # asked on rank 0 alone (with a copy of the map: the fit's own is not the
                # user's to change); every rank judges by its number, so that no rank takes
                # another branch, and a failure there is raised on every rank
                score, failure = math.nan, None
                if self.group.rank == 0:
                    try:
                        score = user_score(self.components(theta).copy(), stage, iteration)
                    except Exception as exc:  # raised below, after the other ranks hear of it
                        failure = exc
                    else:
                        if not isinstance(score, numbers.Real) or not math.isfinite(score):
                            failure = ValueError(
                                f"held_out_score returned {score!r} for the map of the "
                                f"{stage}'s iteration {iteration}; expected a finite number "
                                "(higher is better)"
                            )
                            score = math.nan
                agreed = torch.tensor([float(score)], dtype=torch.float64, device=self.prep.device)
                agreed = float(broadcast_from_rank0(agreed, self.group)[0])
                if failure is not None:
                    raise failure
                if math.isnan(agreed):  # rank 0 failed (it raised its own error)
                    raise ValueError(
                        f"held_out_score failed on rank 0 for the map of the {stage}'s "
                        f"iteration {iteration}; its error is in rank 0's output"
                    )
                return agreed

        return HeldOut(figures, n_rows, measure, scorer)

    def _patience(self) -> int | None:
        """Checks in a row without a gain that stop a stage (None: the rule is off, as it is
        when the scores judge nothing: ``select_stages=False`` without early stopping)."""
        if not self.judged:
            return None
        if self.settings.early_stopping:
            return self.settings.n_iter_no_change
        return STALL_CHECKS if self.settings.stop_stalled_stages else None

    # ------------------------------------------------------------------ what the loop reports

    def _record(self, index, stage, problem, theta, objective, figures, state) -> dict:
        """The iteration's history record (kept in ``state``; the held-out score is added
        to it when checked), and the callback."""
        record = {"iteration": state.iterations, "objective": objective}
        record["seconds"] = self.clock.elapsed()
        if index > 0:  # a later stage's records are tagged with its name
            record["stage"] = stage.name
        record.update(figures)
        record["penalty"] = problem.penalty(theta)
        state.history.append(record)
        if self.settings.callback is not None:  # scikit-learn's form: (A raveled, iteration),
            # a copy: the fit's own map is not the callback's to change
            self.settings.callback(self.components(theta).ravel().copy(), state.iterations)
        return record

    def _print(self, record: dict) -> None:
        """The iteration's line of the verbose table (scikit-learn's, and the validation
        accuracy when it was measured)."""
        if not self.verbose:
            return
        self._print_header()
        line = f"[{self.name}] {record['iteration']:>10} {record['objective']:>20.6e}"
        line += f" {record['seconds'] - self.last_line:>10.2f}"
        if "val_accuracy" in record:
            line += f"  val_accuracy {record['val_accuracy']:.4f}"
            line += f"  val_score {record['val_score']:.4f}"
        print(line, flush=True)
        self.last_line = record["seconds"]

    def _print_header(self) -> None:
        if not self.header_printed:
            header = "{:>10} {:>20} {:>10}".format("Iteration", "Objective Value", "Time(s)")
            print(f"[{self.name}]\n[{self.name}] {header}\n[{self.name}] {'-' * len(header)}")
            self.header_printed = True

    def _announce(self, stage: Stage, problem) -> None:
        """The verbose line that opens a later stage."""
        if self.verbose and stage.name == "exact finish":
            n = problem.n_samples
            rows = n if problem.query_rows is None else len(problem.query_rows)
            sample = " (an evenly spaced sample of the points)" if stage.max_points else ""
            print(
                f"[{self.name}] Finishing on the exact objective: {stage.max_iter} iterations "
                f"over {rows} of {n} query rows{sample}, l2={stage.l2:g}",
                flush=True,
            )

    def _progress(self, stage: Stage, iteration: int, held_out: float | None) -> None:
        if self.settings.progress is not None and self.group.rank == 0:
            self.settings.progress(
                StageProgress(
                    stage.name,
                    iteration,
                    stage.max_iter,
                    held_out,
                    self.clock.elapsed(),
                    self.clock.max_seconds,
                )
            )

    def _close(self) -> None:
        if self.verbose:
            self._print_header()
            print(f"[{self.name}] Training took {self.clock.elapsed():8.2f}s.", flush=True)

    def describe(self, state: FitState) -> list[dict]:
        """What each stage did (``NCA.stages_``)."""
        return [record.describe() for record in state.records]

    @property
    def measure(self) -> str | None:
        """What the scores in the records are (``NCA.stage_measure_``)."""
        return self.held_out.measure if self.judged else None


class Rounds:
    """The rounds of a stage on candidate sets (one round on the exact objective). A round
    starts on fresh sets; it ends when the candidate watch (``optim.candidates``) finds them
    stale, or when the optimiser converged on them while they had changed at the round's
    start (CANDIDATE_CHANGE_TOL of the points or more). Converging on sets that hardly
    changed ends the stage."""

    def __init__(self, watch):
        self.watch = watch
        self.due = watch is not None  # a refresh before the next step
        self.changed = 1.0  # the fraction of sets the round's refresh changed
        self.started_at = 0  # the iteration the round started at

    def refresh(self, theta: np.ndarray, iteration: int) -> None:
        self.changed, self.started_at, self.due = self.watch.refresh(theta), iteration, False

    def after_iteration(self, theta: np.ndarray) -> dict:
        """The watch's figures for the history; a refresh is due when they went stale."""
        if self.watch is None:
            return {}
        self.due, figures = self.watch.after_iteration(theta)
        return figures

    def stop_for(self, reason: str, iteration: int, moved: bool) -> StopReason | None:
        """The stage's stop when the optimiser says ``reason``, or None: a new round."""
        if reason == StopReason.MAX_EVALUATIONS or self.watch is None:
            return StopReason(reason)
        if self.changed < CANDIDATE_CHANGE_TOL or (not moved and iteration == self.started_at):
            return StopReason(reason)
        self.due = True
        return None


class StageChecks:
    """The held-out checks of one stage: its start's score, its best and last, the checks in
    a row without a gain, and the stop rule on each (the module's docstring)."""

    def __init__(self, held: HeldOut | None, patience: int | None):
        self.held, self.patience = held, patience
        self.seconds_before = 0.0 if held is None else held.seconds
        self.count = 0  # checks made (the start's included)
        self.start_score = self.best_score = self.last_score = self.end_score = None
        self.reached = False  # whether a map of the stage was scored
        self.flat = 0  # checks in a row without a gain over best_score

    def start(self, score: float | None) -> None:
        """The stage's start's score."""
        self.start_score = self.best_score = self.last_score = self.end_score = score
        self.count += score is not None

    def after(self, score: float) -> StopReason | None:
        """A check's score: the stop rule's verdict."""
        self.count += 1
        self.seen(score)
        self.last_score = score
        tolerance = self.held.tolerance
        if score > self.best_score + tolerance:
            self.best_score, self.flat = score, 0
            return None
        self.flat += 1
        if self.patience is None or self.flat < self.patience:
            return None
        return StopReason.HURT if score < self.start_score - tolerance else StopReason.STALLED

    def gains(self, score: float) -> bool:
        """Whether ``score`` is above the stage's start by more than the tolerance."""
        return score > self.start_score + self.held.tolerance

    def seen(self, score: float | None) -> None:
        if score is not None:
            self.end_score = score if not self.reached else max(self.end_score, score)
            self.reached = True

    NUMBERS = ("count", "start_score", "best_score", "last_score", "end_score", "reached", "flat")

    def numbers(self) -> dict:
        """What a checkpoint keeps of the checks (``restore`` takes it back)."""
        return {name: getattr(self, name) for name in self.NUMBERS}

    def restore(self, numbers: dict) -> None:
        for name in self.NUMBERS:
            setattr(self, name, numbers[name])

    @property
    def seconds(self) -> float:
        """The time the stage's scores took."""
        return 0.0 if self.held is None else self.held.seconds - self.seconds_before


def resume_point(resume: StageResume) -> Evaluation:
    """The evaluation a resumed stage stood at."""
    return Evaluation(resume.f, np.asarray(resume.g, dtype=np.float64), resume.extra)


def objective_at(problem, theta: np.ndarray) -> float:
    """The problem's mean score at ``theta`` over its query rows (a forward pass)."""
    with torch.no_grad():
        return float(problem.mean_score(problem.to_tensor(theta), problem.query_rows))


def sample_loss(problem) -> Callable[[np.ndarray], float]:
    """theta -> the problem's loss (a forward pass) on evenly spaced rows of its query rows,
    1 / SCALE_SHARE of them (at least SCALE_MIN_ROWS, or all): the same rows on every call,
    run and rank (a sharded problem's loss is the same on every rank)."""
    query = problem.query_rows
    available = problem.n_samples if query is None else len(query)
    count = min(available, max(SCALE_MIN_ROWS, available // SCALE_SHARE))
    picked = torch.as_tensor(evenly_spaced_rows(available, count))
    rows = picked if query is None else query[picked.to(query.device)]
    rows = rows.to(problem.X.device)

    def loss_at(theta: np.ndarray) -> float:
        with torch.no_grad():
            loss, _score = problem.loss(problem.to_tensor(theta), rows)
        return float(loss)

    return loss_at


def grid_minimum(loss_at: Callable[[float], float], start: float, ratio: float) -> float:
    """The first local minimum of ``loss_at`` on the grid start ratio^k (|k| <= SCALE_STEPS):
    from ``start`` downwards while the loss falls, else upwards while it falls."""
    best_x, best = start, loss_at(start)
    for factor in (1 / ratio, ratio):
        x = best_x
        for _ in range(SCALE_STEPS):
            x *= factor
            loss = loss_at(x)
            if not loss < best:
                break
            best_x, best = x, loss
        if best_x != start:  # it fell downwards: do not try upwards
            break
    return best_x


def start_scale(problem, theta: np.ndarray) -> float:
    """The scale s = SCALE_RATIO^k (|k| <= SCALE_STEPS) where the problem's loss at s theta
    stops falling (``grid_minimum`` from 1), the loss on ``sample_loss``'s rows.
    Deterministic: the same rows and scales on every run and rank."""
    loss_at = sample_loss(problem)
    return grid_minimum(lambda scale: loss_at(scale * theta), 1.0, SCALE_RATIO)


def first_step_length(problem, theta: np.ndarray, gradient: np.ndarray) -> float:
    """The length a at which a stage's first L-BFGS step along -g tries its first point:
    ``grid_minimum`` of the loss at theta - a g from a = 1 / ||g|| (the optimiser's own first
    trial, a unit step) in factors of FIRST_STEP_RATIO, on ``sample_loss``'s rows (the finish
    started at its best scale: its first unit step overshot and the line search spent a
    second evaluation on 4 of 5 fits measured, benchmarks/README.md)."""
    loss_at = sample_loss(problem)
    unit = 1.0 / max(float(np.linalg.norm(gradient)), np.finfo(float).tiny)
    return grid_minimum(lambda a: loss_at(theta - a * gradient), unit, FIRST_STEP_RATIO)


def skipped_record(stage: str) -> StageRecord:
    """The record of a stage the spent budget skipped."""
    return StageRecord(
        stage,
        start_score=None,
        end_score=None,
        kept="start",
        seconds=0.0,
        iterations=0,
        evaluations=0,
        refreshes=0,
        checks=0,
        check_seconds=0.0,
        stop_reason=str(StopReason.SKIPPED),
    )
