"""The rules every stage of a fit follows: it keeps the better of its start and its end
(docs/training.md, "Stages"), it stops when its work stops paying, and it stops when the fit's
budget is spent.

A fit runs in stages: the first optimisation (exact, or on candidate sets), then, after a
candidate fit, the exact finish (``training.model.fitting``). A stage starts from a map and
ends with another, and more work is no promise of a better map: a penalty or a candidate set
can pull the objective away from what k-NN needs. So maps are scored on rows the fit never
saw: the k-NN accuracy, at the served k and rule, of the validation split, or of the rows
held out of the fit for this purpose (``training.model.preparation.held_out``:
min(SELECTION_ROWS, N / 10) rows above 8,192). Rows the map was fitted on cannot judge it:
NCA makes their leave-one-out neighbourhoods pure, so an overfit stage looks better on them
(measured: a finish that raised the test accuracy from 0.929 to 0.939 lowered the training
rows' leave-one-out accuracy from 0.976 to 0.918).

**The judge** (:class:`StageJudge`) scores a stage's start and its end and keeps the end
unless it classifies at least two more of the scored rows wrongly than the start (one row of
a small set is the measure's smallest step, not a worse map); a stage whose end scores lower
is undone.

**The guard** (:class:`StageGuard`) watches a stage while it runs, after every iteration:

* *the budget*: once the fit has run ``max_seconds`` (:class:`FitClock`), the stage stops
  (``max_seconds``), later stages are skipped, and the fit returns the best judged map it has;
* *a stage pays for its work*: the held-out score is checked on the monitor's schedule
  (every ``validation_interval`` iterations: iteration counts, not the clock, so the maps
  scored are the same on every run and rank). A stage whose last :data:`STALL_CHECKS`
  checks in a row did not beat its best score so far (its start included) by more than the
  judge's tolerance stops: ``hurt`` when the last check scored below its start by more than
  the tolerance (so a stage that hurts is stopped at its second check, not after its
  iterations), else ``stalled``. Neither rule reads the clock: the same data and seed stop
  at the same check on any machine, whatever else it runs (``stop_stalled_stages=False``
  turns the rule off);
* the best map a check scored (rising above its start by more than the tolerance) is
  remembered: the stage's end is the better of it and the last iterate (a stage stopped
  after its score fell ends on the map before the fall).

Without held-out rows (a small fit without validation, or ``select_stages=False``) only the
budget applies. What each stage did is a :class:`StageRecord` (``NCA.stages_``; the training
report shows it).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import numpy as np

SELECTION_ROWS = 4096
STALL_CHECKS = 2  # checks in a row without a gain that stop a stage
CACHED_MAPS = 4  # the judge remembers the scores of this many maps


class StageStop(Exception):
    """Raised by the guard (through the monitor) to end a stage: ``reason`` is
    ``max_seconds``, ``hurt`` or ``stalled``."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class FitClock:
    """Seconds since the fit started, and its budget: ``max_seconds`` (None: none).

    ``agree``: (flags,) -> the flags every process uses. Under torchrun each rank has its own
    clock, so a decision taken by the clock (the budget spent, a check due) is rank 0's
    (``training.distributed.ranks.agreed_flags``), taken by every rank at the same point."""

    def __init__(
        self,
        max_seconds: float | None = None,
        clock: Callable[[], float] | None = None,
        agree: Callable[[tuple[bool, ...]], tuple[bool, ...]] | None = None,
    ):
        self.clock = clock or time.perf_counter
        self.started = self.clock()
        self.max_seconds = max_seconds
        self.agree = agree or (lambda flags: flags)

    def elapsed(self) -> float:
        return self.clock() - self.started

    def exhausted(self) -> bool:
        """Whether the budget is spent (every rank's answer is rank 0's)."""
        return self.agree((self.spent(),))[0]

    def spent(self) -> bool:
        """Whether this process's clock has passed the budget."""
        return self.max_seconds is not None and self.elapsed() >= self.max_seconds


@dataclass
class Judgement:
    """The scores of a stage's start and end, and which one was kept."""

    start_score: float
    end_score: float
    kept: str  # "end" or "start" (the stage was undone)
    seconds: float  # time spent scoring the two


class StageJudge:
    """Scores maps with ``score`` (theta -> accuracy on ``n_rows`` held-out rows, described
    by ``measure``) and keeps, for each stage, the better of its start and its end."""

    def __init__(self, score: Callable[[np.ndarray], float], measure: str, n_rows: int):
        self.score = score
        self.measure = measure
        self.tolerance = 1.5 / max(1, n_rows)  # more than one row of the n_rows scored
        self._cache: list[tuple[np.ndarray, float]] = []  # the maps scored last, newest last

    def score_of(self, theta: np.ndarray) -> float:
        """score(theta), remembered for the CACHED_MAPS maps scored last (a stage's start is
        scored when it begins and again when it is judged; its end is the next stage's
        start)."""
        for cached, value in self._cache:
            if np.array_equal(cached, theta):
                return value
        value = float(self.score(theta))
        self._cache = [*self._cache[-(CACHED_MAPS - 1) :], (np.array(theta, copy=True), value)]
        return value

    def judge(self, start: np.ndarray, end: np.ndarray) -> Judgement:
        """Which of ``start`` and ``end`` to keep: the end when it scores at least as well,
        within the tolerance."""
        started = time.perf_counter()
        start_score = self.score_of(start)
        end_score = self.score_of(end)
        kept = "end" if end_score >= start_score - self.tolerance else "start"
        return Judgement(start_score, end_score, kept, time.perf_counter() - started)


@dataclass(frozen=True)
class StageProgress:
    """Where a fit is, as its progress callback sees it: at a stage's start (iteration 0)
    and after each of its iterations."""

    stage: str  # "exact fit", "candidate stage", "exact finish"
    iteration: int  # iterations of this stage so far
    max_iter: int  # ... and at most
    held_out: float | None  # the stage's latest held-out score (None: not judged)
    seconds: float  # since the fit started
    max_seconds: float | None  # the fit's budget (None: none)


class StageGuard:
    """Watches one stage as it runs (see the module docstring): stops it when the fit's
    budget is spent or when it stalls, and remembers the best map a check scored.
    ``after_iteration`` is called by the stage's monitor after every iteration; ``progress``
    (optional) gets a :class:`StageProgress` at the stage's start and after each of them."""

    def __init__(
        self,
        clock: FitClock,
        judge: StageJudge | None,
        start: np.ndarray,
        stop_stalled=True,
        stage: str = "",
        max_iter: int = 0,
        progress: Callable[[StageProgress], None] | None = None,
    ):
        self.clock, self.judge, self.stop_stalled = clock, judge, stop_stalled
        self.stage, self.max_iter, self.progress = stage, max_iter, progress
        self.stop_reason: str | None = None
        self.iterations = 0
        self.checks = 0  # held-out checks made during the stage (its start's included)
        self.check_seconds = 0.0
        self.last_score: float | None = None  # the latest check's
        self.best_score: float | None = None
        self.best_theta: np.ndarray | None = None  # the best checked map other than the start
        self.best_objective = float("nan")  # the objective the monitor reported at it
        self.start_score: float | None = None
        self.flat_checks = 0  # checks in a row that did not beat the best score
        if judge is not None and not clock.exhausted():
            self.best_score = self.start_score = self._check(start)
        self._report()

    def after_iteration(
        self, theta: np.ndarray, scheduled: bool, objective: float = float("nan")
    ) -> None:
        """Raise StageStop when the budget is spent, or when a scheduled check (the
        monitor's schedule: every ``validation_interval`` iterations) is the STALL_CHECKS-th
        in a row without a gain (the module's docstring). The budget's decision is agreed
        between ranks (``FitClock.agree``); the scores already are. The progress callback
        hears of the iteration either way."""
        try:
            self._watch(theta, scheduled, objective)
        finally:
            self.count_iteration()

    def count_iteration(self) -> None:
        """One more iteration of the stage, told to the progress callback (also for the
        iteration at which early stopping ends the stage, which the guard does not watch)."""
        self.iterations += 1
        self._report()

    def _watch(self, theta: np.ndarray, scheduled: bool, objective: float) -> None:
        if self.clock.exhausted():
            self.stop_reason = "max_seconds"
            raise StageStop("max_seconds")
        if not scheduled or self.best_score is None:
            return
        score = self._check(theta)
        tolerance = self.judge.tolerance
        if score > self.best_score + tolerance:  # rising: the stage goes on
            self.best_score, self.best_theta = score, np.array(theta, copy=True)
            self.best_objective = objective
            self.flat_checks = 0
            return
        self.flat_checks += 1
        if self.stop_stalled and self.flat_checks >= STALL_CHECKS:
            # "hurt": the stage ends below where it started (its best map is its start)
            self.stop_reason = "hurt" if score < self.start_score - tolerance else "stalled"
            raise StageStop(self.stop_reason)

    def _check(self, theta: np.ndarray) -> float:
        before = self.clock.elapsed()
        score = self.judge.score_of(theta)
        self.checks += 1
        self.check_seconds += self.clock.elapsed() - before
        self.last_score = score
        return score

    def _report(self) -> None:
        if self.progress is not None:
            self.progress(
                StageProgress(
                    stage=self.stage,
                    iteration=self.iterations,
                    max_iter=self.max_iter,
                    held_out=self.last_score,
                    seconds=self.clock.elapsed(),
                    max_seconds=self.clock.max_seconds,
                )
            )


@dataclass
class StageRecord:
    """What one stage did: its time and work, and the score it started and ended with."""

    stage: str  # "exact fit", "candidate stage", "exact finish"
    start_score: float | None  # held-out score of its start (None: not judged)
    end_score: float | None  # ... and of the end it offered
    kept: str  # "end", "start" (the stage was undone) or "end (not judged)"
    seconds: float  # the stage's wall time, its checks and judgement included
    iterations: int
    evaluations: int  # of the objective and its gradient
    refreshes: int  # candidate-set computations
    checks: int  # held-out scores computed while it ran (its start's included)
    check_seconds: float  # ... and their time
    stop_reason: (
        str  # the optimiser's, or "hurt", "stalled", "max_seconds", "skipped (max_seconds)"
    )
    # per candidate refresh, the fraction of points whose nearest set changed (the first: 1)
    refresh_changes: list[float] = field(default_factory=list)
    # ... and the share of candidate entries it replaced (the first: 1)
    refresh_replaced: list[float] = field(default_factory=list)
    # ... and K, the candidates per kind it kept
    refresh_sizes: list[int] = field(default_factory=list)
    # ... and an IVF search's neighbour mass against exact sets' (None: exact search)
    search_mass_ratios: list[float | None] = field(default_factory=list)

    def describe(self) -> dict:
        return asdict(self)
