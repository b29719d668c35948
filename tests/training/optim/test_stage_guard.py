"""A stage pays for its work and a fit keeps to its budget (training.model.fitting): the stop
rule and the keep rule on scripted scores, then through the estimator, where the scores of
the maps each iteration reaches and the seconds each iteration takes are scripted, so that
what the rules decide does not hang on this machine's speed or on one floating-point path."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from sklearn.exceptions import ConvergenceWarning

from tests.training.problems import blobs
from training import NCA
from training.model import fitting, preparation
from training.model.fitting import FitClock, FitState, HeldOut, Snapshot, StageChecks, StopReason
from training.model.options import with_options


class Clock:
    """A clock the test moves: ``now`` seconds."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def verdicts(start: float, scores: list[float], patience: int | None = 2, n_rows: int = 100):
    """The stop rule's verdict after each check of a stage that starts at ``start``."""
    checks = StageChecks(HeldOut(lambda theta: (0.0, None), n_rows, "scripted"), patience)
    checks.start(start)
    return [checks.after(score) for score in scores], checks


def test_a_stage_that_stops_rising_stops_after_two_checks_without_a_gain():
    # rises by 10 rows, then 0.6 and 0.61: neither beats 0.6 by more than 1.5 rows
    said, checks = verdicts(0.5, [0.6, 0.6, 0.61])
    assert said == [None, None, StopReason.STALLED]
    assert checks.best_score == 0.6 and checks.end_score == 0.61 and checks.count == 4


def test_a_stage_below_its_start_at_two_checks_stops_as_hurt():
    said, _ = verdicts(0.5, [0.45, 0.44])
    assert said == [None, StopReason.HURT]


def test_without_the_rule_a_stage_runs_on():
    said, checks = verdicts(0.5, [0.6, 0.4, 0.4, 0.4], patience=None)
    assert said == [None] * 4 and checks.end_score == 0.6


def test_a_stage_that_keeps_rising_runs_on():
    said, _ = verdicts(0.5, [0.5 + 0.05 * i for i in range(1, 10)])
    assert said == [None] * 9


def test_the_keep_rule_keeps_the_latest_map_within_a_row_and_a_half_of_the_best():
    state = FitState(Snapshot(np.zeros(1), 0.0, None, 0))
    tolerance = 1.5 / 100
    offered = [0.5, 0.6, 0.59, 0.589, 0.58, 0.62, 0.61]
    kept = []
    for i, score in enumerate(offered, start=1):
        state.offer(Snapshot(np.full(1, float(i)), 0.0, score, i), tolerance)
        kept.append(state.kept.iteration)
    # 0.59 and 0.589 are within 0.015 of the best 0.6 (kept: more trained); 0.58 is not;
    # the drift stops there: 0.589 is not a new best the next must stay near
    assert kept == [1, 2, 3, 4, 4, 6, 7]
    assert state.best_score == 0.62


def test_unjudged_maps_are_kept_as_they_come():
    state = FitState(Snapshot(np.zeros(1), 0.0, None, 0))
    for i, score in enumerate([0.9, 0.1], start=1):
        state.offer(Snapshot(np.full(1, float(i)), 0.0, score, i), None)
    assert state.kept.iteration == 2


def test_the_held_out_scorer_computes_a_map_once():
    calls = []

    def figures(theta):  # (score, accuracy) of a map
        calls.append(float(theta[0]))
        return float(theta[0]), float(theta[0]) / 10

    held = HeldOut(figures, 10, "t")
    for value in (1.0, 2.0, 1.0, 2.0, 3.0):
        assert held(np.array([value]), "exact fit", 1) == value
    assert held.accuracy(np.array([2.0])) == 0.2  # remembered with its score
    assert calls == [1.0, 2.0, 3.0] and held.checks == 3
    held.remember(np.array([4.0]), 4.0)  # a checkpoint's score: the accuracy is computed
    assert held(np.array([4.0]), "exact fit", 2) == 4.0 and calls == [1.0, 2.0, 3.0]
    assert held.accuracy(np.array([4.0])) == 0.4 and calls == [1.0, 2.0, 3.0, 4.0]


def test_a_users_scorer_is_asked_at_every_check_and_the_rows_still_give_the_accuracy():
    asked, computed = [], []

    def figures(theta):  # the held-out rows' (score, accuracy)
        computed.append(float(theta[0]))
        return 0.0, float(theta[0]) / 10

    def scorer(theta, stage, iteration):  # where the fit is decides the score
        asked.append((stage, iteration))
        return float(theta[0]) + iteration

    held = HeldOut(figures, 10, "t", scorer)
    assert held(np.array([1.0]), "exact finish", 0) == 1.0
    assert held(np.array([1.0]), "exact finish", 2) == 3.0  # the same map, asked again
    assert asked == [("exact finish", 0), ("exact finish", 2)] and held.checks == 2
    # the stage's last map offered again at its end: the answer is remembered
    assert held(np.array([1.0]), "exact finish", 2) == 3.0 and held.checks == 2
    assert held.accuracy(np.array([1.0])) == 0.1 and computed == [1.0]
    assert held.tolerance == 0.0  # the user's units: no rows' worth
    assert HeldOut(figures, 10, "t").tolerance == 0.15  # the rows' score: 1.5 rows' worth


def test_the_budget_is_rank_0s_decision():
    """Under torchrun every rank's clock is its own: the decision is rank 0's."""
    clock = Clock()
    fit_clock = FitClock(max_seconds=5.0, clock=clock)
    clock.now = 4.9
    assert not fit_clock.exhausted()
    clock.now = 5.0
    assert fit_clock.exhausted()
    rank0_says = (True,)
    assert FitClock(max_seconds=100.0, clock=Clock(), agree=lambda flags: rank0_says).exhausted()


# ---------------------------------------------------------------- through the estimator


@pytest.fixture
def scripted(monkeypatch):
    """Every iteration takes one scripted second (the fit's clock), and a map's held-out
    score (``held_out_score``, with the ``callback`` that records the maps: pass both) is
    ``script(stage, iteration)`` of the fit's iteration that reached it (stage: "first" or
    "finish"; the initial map, and any map no iteration reached, is iteration 0 of the
    first stage). Returns (the script's holder, {iteration: the map it reached}, the
    clock)."""
    clock = Clock()
    monkeypatch.setattr(fitting.time, "perf_counter", clock)
    reached: dict[bytes, tuple[str, int]] = {}
    maps: dict[int, np.ndarray] = {}
    holder = {"script": lambda stage, it: 0.5, "finish_from": None}

    def callback(components, iteration):
        clock.now += 1.0
        stage = (
            "first"
            if holder["finish_from"] is None or iteration < holder["finish_from"]
            else "finish"
        )
        reached[np.asarray(components, dtype=np.float64).tobytes()] = (stage, iteration)
        maps[iteration] = np.array(components, copy=True)

    def held_out_score(A, stage_name, stage_iteration):  # the script's, by the map's iteration
        key = np.asarray(A, dtype=np.float64).ravel().tobytes()
        return holder["script"](*reached.get(key, ("first", 0)))

    holder["callback"], holder["held_out_score"] = callback, held_out_score
    return holder, maps, clock


def fit(X, y, holder, **params):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = NCA(
            **with_options(
                dict(
                    n_components=2,
                    random_state=0,
                    callback=holder["callback"],
                    held_out_score=holder["held_out_score"],
                    **params,
                )
            )
        )
        return model.fit(X, y)


def test_a_first_stage_that_stalls_stops_and_returns_its_best_checked_map(scripted):
    holder, maps, _ = scripted
    X, y = blobs(300)
    # rising at iterations 1 and 2, then lower but above the start: the checks at 4 and 6
    # do not rise, so the stage stops at 6 and ends on the map before the fall
    holder["script"] = lambda stage, it: 0.5 + 0.01 * it if it <= 2 else 0.515
    model = fit(X, y, holder, max_iter=100, tol=0, validation_interval=2)
    record = model.stages_[0]
    assert record["stage"] == "exact fit" and record["stop_reason"] == "stalled"
    assert record["iterations"] == 6  # checks at 1 and 2 rise; 4 and 6 do not
    assert record["kept"] == "end" and record["end_score"] == pytest.approx(0.52)
    np.testing.assert_array_equal(model.components_.ravel(), maps[2].ravel())
    assert model.stop_reason_ == "stalled" and model.converged_
    assert record["checks"] == 5 and record["seconds"] == pytest.approx(6.0)


FIRST_ITERATIONS = 4  # the first stage's, each checked and rising by 0.01 from 0.5
FINISH_START = 0.5 + 0.01 * FIRST_ITERATIONS  # the score the finish starts from


def finish_after_rising_stage(scripted, finish_score: float, exact_finish: int = 60) -> NCA:
    """A candidate fit of FIRST_ITERATIONS iterations, checked at each and scored 0.5 +
    0.01 * iteration, then an exact finish of ``exact_finish`` iterations whose every map
    scores ``finish_score``."""
    holder, _, _ = scripted
    holder["finish_from"] = FIRST_ITERATIONS + 1
    holder["script"] = lambda stage, it: 0.5 + 0.01 * it if stage == "first" else finish_score
    params = dict(n_candidates=5, max_iter=FIRST_ITERATIONS, tol=0, validation_interval=1)
    return fit(*blobs(300), holder, exact_finish=exact_finish, **params)


def test_a_finish_without_a_gain_at_its_first_iteration_stops_there_undone(scripted):
    """A later stage starts from a trained map and must earn its cost: checked at its first
    iteration, it stops there ("no gain") unless it scored above its start by more than the
    tolerance (here 0: a ``held_out_score``), and its map is not kept."""
    model = finish_after_rising_stage(scripted, finish_score=0.5)  # below the first stage's
    first, finish = model.stages_
    assert first["stop_reason"] == "max_iter" and first["iterations"] == FIRST_ITERATIONS
    assert finish["stage"] == "exact finish" and finish["stop_reason"] == "no gain"
    assert finish["iterations"] == 1  # judged at its first iteration, not after 60
    assert finish["kept"] == "start"  # it never beat the first stage's map
    assert model.kept_iteration_ == FIRST_ITERATIONS


def test_a_finish_that_ties_its_start_at_its_first_iteration_is_not_kept(scripted):
    """A tie is no gain: the finish's first iteration scored exactly its start (which the
    keep rule, with a ``held_out_score``'s tolerance of 0, would keep as the more trained
    map) stops the finish, and the fit returns the first stage's last map, bit for bit
    that of a fit without the finish."""
    _, maps, _ = scripted
    model = finish_after_rising_stage(scripted, finish_score=FINISH_START)
    finish = model.stages_[1]
    assert (finish["stop_reason"], finish["iterations"], finish["kept"]) == ("no gain", 1, "start")
    assert model.kept_iteration_ == FIRST_ITERATIONS
    np.testing.assert_array_equal(model.components_.ravel(), maps[FIRST_ITERATIONS].ravel())
    alone = finish_after_rising_stage(scripted, finish_score=FINISH_START, exact_finish=0)
    np.testing.assert_array_equal(model.components_, alone.components_)


def test_a_finish_that_gains_at_its_first_iteration_goes_on_to_its_other_checks(scripted):
    """The same finish scored one point above its start at its first iteration and flat
    after: it passes its first check, runs on, and stops stalled at its later checks, its
    first iteration's map kept (the keep rule's most trained map within the tolerance)."""
    model = finish_after_rising_stage(scripted, finish_score=FINISH_START + 0.01)
    finish = model.stages_[1]
    assert finish["stop_reason"] == "stalled" and finish["iterations"] > 1
    assert finish["kept"] == "end" and finish["end_score"] == pytest.approx(FINISH_START + 0.01)


def test_the_same_fit_under_two_scripted_clocks_gives_the_same_map(monkeypatch):
    """The stop rules read no clock: a fit whose preparation takes a scripted 10^6 s (a rule
    that weighs a stage's seconds against the fit's before it would never stop a stage) and
    one whose every clock reading in the stages advances 1000 s (such a rule would stop the
    first check without a gain) stop at the same checks and give the same map, bit for bit."""
    X, y = blobs(900, seed=3)
    X, y, X_val, y_val = X[:600], y[:600], X[600:], y[600:]  # the stages are judged on these
    clock = Clock()
    monkeypatch.setattr(fitting.time, "perf_counter", clock)
    real_prepare = preparation.prepare

    def fit_under(prepare_seconds: float, seconds_per_reading: float) -> NCA:
        def prepare(*args, **kwargs):
            clock.now += prepare_seconds
            return real_prepare(*args, **kwargs)

        def reading() -> float:
            clock.now += seconds_per_reading
            return clock.now

        monkeypatch.setattr(preparation, "prepare", prepare)
        monkeypatch.setattr(fitting.time, "perf_counter", reading)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = NCA(
                n_components=2, random_state=0, n_candidates=5, options=dict(validation_interval=1)
            )
            return model.fit(X, y, X_val, y_val)

    slow_start = fit_under(1e6, 0.0)
    crawling = fit_under(0.0, 1000.0)
    assert [r["stop_reason"] for r in crawling.stages_] == [
        r["stop_reason"] for r in slow_start.stages_
    ]
    assert [r["iterations"] for r in crawling.stages_] == [
        r["iterations"] for r in slow_start.stages_
    ]
    np.testing.assert_array_equal(crawling.components_, slow_start.components_)


def test_the_budget_returns_the_best_judged_map_and_says_so(scripted, monkeypatch):
    holder, maps, clock = scripted
    real_prepare = preparation.prepare

    def slow_prepare(*args, **kwargs):  # 100 scripted seconds: no stage stalls in 7
        clock.now += 100.0
        return real_prepare(*args, **kwargs)

    monkeypatch.setattr(preparation, "prepare", slow_prepare)
    X, y = blobs(300)
    holder["script"] = lambda stage, it: 0.5 + 0.01 * it if it <= 3 else 0.5  # best: 3
    with pytest.warns(ConvergenceWarning, match="budget max_seconds=107 ran out"):
        model = NCA(
            n_components=2,
            random_state=0,
            callback=holder["callback"],
            n_candidates=5,
            max_iter=50,
            tol=0,
            max_seconds=107.0,
            options=dict(
                validation_interval=1,
                stop_stalled_stages=False,
                held_out_score=holder["held_out_score"],
            ),
        ).fit(X, y)
    first, finish = model.stages_
    assert first["stop_reason"] == "max_seconds" and first["iterations"] == 7
    assert finish["stop_reason"] == "skipped (max_seconds)" and finish["iterations"] == 0
    assert model.budget_exhausted_ and model.stop_reason_ == "max_seconds"
    assert not model.converged_
    np.testing.assert_array_equal(model.components_.ravel(), maps[3].ravel())


def test_a_stage_that_ends_by_its_own_rule_as_the_budget_runs_out_says_its_rule(
    scripted, monkeypatch
):
    """The budget names only the stops it caused: a last stage that reaches its max_iter at
    the iteration that spends the budget stopped at max_iter (max_iter's own warning, no
    budget warning, not ``budget_exhausted_``); one more iteration allowed, the budget stops
    it."""
    holder, _, clock = scripted
    real_prepare = preparation.prepare

    def slow_prepare(*args, **kwargs):  # 100 scripted seconds, then one a callback
        clock.now += 100.0
        return real_prepare(*args, **kwargs)

    monkeypatch.setattr(preparation, "prepare", slow_prepare)
    X, y = blobs(300)
    holder["script"] = lambda stage, it: 0.5 + 0.01 * it  # rising: no held-out stop

    def budgeted(max_iter: int) -> NCA:
        clock.now = 0.0
        return NCA(
            n_components=2,
            random_state=0,
            callback=holder["callback"],
            n_candidates=5,
            max_iter=max_iter,
            tol=0,
            max_seconds=107.0,
            options=dict(
                exact_finish=0,
                validation_interval=1,
                stop_stalled_stages=False,
                held_out_score=holder["held_out_score"],
            ),
        ).fit(X, y)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = budgeted(max_iter=7)  # its 7th iteration ends at 107 s
    said = [str(w.message) for w in caught]
    assert any("did not converge in max_iter=7" in m for m in said)  # the limit it hit
    assert not any("budget" in m for m in said), said
    (record,) = model.stages_
    assert (record["stop_reason"], record["iterations"]) == ("max_iter", 7)
    assert model.stop_reason_ == "max_iter" and not model.budget_exhausted_
    with pytest.warns(ConvergenceWarning, match="budget max_seconds=107 ran out"):
        cut = budgeted(max_iter=8)
    (record,) = cut.stages_
    assert (record["stop_reason"], record["iterations"]) == ("max_seconds", 7)
    assert cut.budget_exhausted_
    np.testing.assert_array_equal(cut.components_, model.components_)


def test_a_budget_spent_before_the_first_stage_returns_the_initial_map(monkeypatch):
    prepared = []
    real_prepare = preparation.prepare

    def prepare(*args, **kwargs):
        prepared.append(real_prepare(*args, **kwargs))
        return prepared[-1]

    monkeypatch.setattr(preparation, "prepare", prepare)
    X, y = blobs(300)
    with pytest.warns(ConvergenceWarning, match="ran out"):
        model = NCA(n_components=2, random_state=0, max_seconds=1e-12).fit(X, y)
    assert [r["stop_reason"] for r in model.stages_] == ["skipped (max_seconds)"]
    assert model.n_iter_ == 0 and model.budget_exhausted_
    np.testing.assert_array_equal(model.components_, prepared[0].theta0)


def fit_with_events(**params):
    """(the model, the StageProgress events it reported) of a 2-d fit on 300 blob rows."""
    X, y = blobs(300)
    events = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = NCA(
            **with_options(
                dict(
                    n_components=2,
                    random_state=0,
                    tol=0,
                    **params,
                    validation_interval=1,
                    progress=events.append,
                )
            )
        ).fit(X, y)
    return model, events


def test_the_estimator_reports_each_stage_to_its_progress_callback():
    model, events = fit_with_events(
        n_candidates=5, max_iter=4, exact_finish=3, stop_stalled_stages=False
    )
    first, finish = model.stages_
    for record in (first, finish):
        seen = [e for e in events if e.stage == record["stage"]]
        assert [e.iteration for e in seen] == list(range(record["iterations"] + 1))
        assert seen[0].held_out == pytest.approx(record["start_score"])  # the start's check
    assert next(e.max_iter for e in events if e.stage == "candidate stage") == 4
    assert next(e.max_iter for e in events if e.stage == "exact finish") == 3
    seconds = [e.seconds for e in events]
    assert seconds == sorted(seconds)
    # each refresh's share of changed candidate sets: the first builds them all
    assert len(first["refresh_changes"]) == first["refreshes"] >= 1
    assert first["refresh_changes"][0] == 1.0
    assert all(0.0 <= c <= 1.0 for c in first["refresh_changes"])
    assert finish["refresh_changes"] == [] and finish["refreshes"] == 0
    assert len(first["refresh_replaced"]) == first["refreshes"]
    assert first["refresh_replaced"][0] == 1.0
    # a set changes when one of its entries does: never fewer sets changed than entries
    assert all(
        0.0 <= r <= c
        for r, c in zip(first["refresh_replaced"], first["refresh_changes"], strict=True)
    )


def test_the_iteration_early_stopping_ends_on_is_reported_too():
    # validation falls after the first check: early stopping ends the stage at iteration 3
    # (the stages' own rules off: the real held-out rows would end it first)
    model, events = fit_with_events(
        max_iter=50,
        early_stopping=True,
        n_iter_no_change=2,
        stop_stalled_stages=False,
        held_out_score=lambda A, stage, it: 0.9 if it == 1 else 0.5,
    )
    (record,) = model.stages_
    assert model.stop_reason_ == "stalled" and record["iterations"] == 3
    assert [e.iteration for e in events] == [0, 1, 2, 3]


def test_a_users_callback_and_score_are_given_copies_of_the_map():
    """A callback and a held_out_score that write zeros into the map they are given leave
    the fit as it was: they get copies, not the fit's own parameters."""
    X, y = blobs(300)

    def meddling_callback(A, iteration):
        A[...] = 0.0

    def meddling_score(A, stage, iteration):
        A[...] = 0.0
        return float(iteration)  # rising: the keep rule keeps the last map, as unjudged

    base = dict(n_components=2, random_state=0, max_iter=8, tol=0, validation_interval=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plain = NCA(**with_options(base)).fit(X, y)
        meddled = NCA(
            **with_options(dict(base, callback=meddling_callback, held_out_score=meddling_score))
        ).fit(X, y)
    assert meddled.stage_measure_ == "held_out_score (FitOptions)"
    assert meddled.n_iter_ == plain.n_iter_ > 1
    np.testing.assert_array_equal(meddled.components_, plain.components_)


def test_a_held_out_score_is_asked_once_a_check_and_never_when_nothing_is_judged():
    from tests.training.problems import hard_noisy

    X, y = hard_noisy(300)[:2]  # overlapping noisy classes: the loss keeps falling
    asked = []

    def score(A, stage, iteration):
        asked.append((stage, iteration))
        return float(iteration)

    params = dict(n_components=2, random_state=0, max_iter=6, tol=0, validation_interval=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        judged = NCA(**with_options(dict(params, held_out_score=score))).fit(X, y)
        # the start, the first iteration, every second one, and the stage's last map, which
        # when it was a check is offered again at the stage's end: remembered, not asked
        n = judged.n_iter_
        assert n >= 3
        checked = [0, 1, *range(2, n + 1, 2)]
        assert asked == [("exact fit", i) for i in (checked if n in checked else [*checked, n])]
        assert judged.stages_[0]["checks"] == len(asked)
        asked.clear()
        unjudged = NCA(**with_options(dict(params, held_out_score=score, select_stages=False)))
        unjudged.fit(X, y)
    assert asked == [] and unjudged.stages_[0]["kept"] == "end (not judged)"
    assert unjudged.stages_[0]["checks"] == 0


def test_no_training_rows_are_held_out_of_the_fit_for_a_users_score():
    """Rows are held out of a large fit only to judge it: with a held_out_score, which
    judges instead, every row is fitted."""
    from training.distributed.ranks import ProcessGroup
    from training.model.options import fit_settings

    X, y = blobs(20000)  # above HOLDOUT_MIN_SAMPLES
    for held_out_score in (None, lambda A, stage, iteration: 0.5):
        settings = fit_settings(NCA(options={"held_out_score": held_out_score}).get_params())
        rng = np.random.default_rng(0)
        rows, held, _, _ = preparation.held_out(
            None, settings, X, y, np.unique(y), None, None, rng, ProcessGroup()
        )
        if held_out_score is None:  # a tenth of the rows, stratified
            assert abs(len(held) - 2000) <= 5 and len(rows) + len(held) == len(X)
        else:
            assert held is None and len(rows) == len(X)
