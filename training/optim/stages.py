"""Every stage of a fit keeps the better of its start and its end (DESIGN.md, rule 6).

A fit runs in stages: the first optimisation (exact, or on candidate sets), then, after a
candidate fit, the exact finish. A stage starts from a map and ends with another, and more
work is no promise of a better map: a penalty or a candidate set can pull the objective
away from what k-NN needs. So each stage's end is scored against its start on rows the fit
never saw, and kept only when it scores at least as well: the k-NN accuracy, at the served k
and rule, of the validation split, or of the rows held out of the fit for this purpose
(``training.model.preparation.held_out``: min(SELECTION_ROWS, N / 10) rows above 8,192).
Rows the map was fitted on cannot judge it: NCA makes their leave-one-out neighbourhoods
pure, so an overfit stage looks better on them (measured: a finish that raised the test
accuracy from 0.929 to 0.939 lowered the training rows' leave-one-out accuracy from 0.976 to
0.918).

A stage whose end scores lower is undone: the fit goes on from its start (or returns it),
and :class:`StageJudge` records it (``NCA.stages_``; the training report shows it). Lower
means by more than one scored row: a stage is undone when its end classifies at least two
more of the scored rows wrongly than its start, so that the measure's smallest step (one
row of a small set) does not throw away a fit that is as good.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace

import numpy as np
import torch

SELECTION_ROWS = 4096


@dataclass
class StageRecord:
    """What one stage did to the score it is judged by."""

    stage: str  # "exact fit", "candidate stage", "exact finish", ...
    start_score: float
    end_score: float
    kept: str  # "end" or "start" (the stage was undone)
    seconds: float  # time spent scoring

    def describe(self) -> dict:
        return asdict(self)


class StageJudge:
    """Scores maps with ``score`` (theta -> accuracy on ``n_rows`` held-out rows, described
    by ``measure``) and keeps, for each stage, the better of its start and its end."""

    def __init__(self, score: Callable[[np.ndarray], float], measure: str, n_rows: int):
        self.score = score
        self.measure = measure
        self.tolerance = 1.5 / max(1, n_rows)  # more than one row of the n_rows scored
        self.records: list[StageRecord] = []
        self._cache: tuple[np.ndarray, float] | None = None  # the last map scored

    def score_of(self, theta: np.ndarray) -> float:
        """score(theta), remembered for the map scored last (a stage's end is the next
        stage's start)."""
        if self._cache is not None and np.array_equal(self._cache[0], theta):
            return self._cache[1]
        value = float(self.score(theta))
        self._cache = (np.array(theta, copy=True), value)
        return value

    def keep_better(self, stage: str, start: np.ndarray, end: np.ndarray) -> np.ndarray:
        """``end`` when it scores at least as well as ``start``, else ``start``."""
        started = time.perf_counter()
        start_score = self.score_of(start)
        end_score = self.score_of(end)
        kept = "end" if end_score >= start_score - self.tolerance else "start"
        self.records.append(
            StageRecord(stage, start_score, end_score, kept, time.perf_counter() - started)
        )
        if kept == "start":
            self._cache = (np.array(start, copy=True), start_score)
            return start
        return end

    def undone(self) -> list[StageRecord]:
        return [r for r in self.records if r.kept == "start"]


def keep_better(judge: StageJudge | None, stage: str, start: np.ndarray, result, problem):
    """The optimiser's ``result`` (a FitResult) of a stage that started at ``start``, or,
    when the judge keeps the start, the same result at ``start``: its objective recomputed
    on ``problem`` (on fresh candidates for a candidate problem)."""
    if judge is None or not np.isfinite(result.theta).all():
        return result  # no selection, or not a map to judge (the fit refuses it)
    kept = judge.keep_better(stage, start, result.theta)
    if kept is result.theta:
        return result
    if problem.n_candidates is not None:
        problem.refresh_candidates(start)
    with torch.no_grad():
        objective = float(problem.mean_score(problem.to_tensor(start), problem.query_rows))
    return replace(
        result,
        theta=np.array(start, dtype=np.float64),
        objective=objective,
        n_evaluations=result.n_evaluations + 1,
    )
