"""The exact finish: L-BFGS iterations on the exact objective (every training point a
neighbour) after a fit on candidate sets (``exact_finish``)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import scipy.sparse as sp
import torch

from tests.training.problems import blobs, brute_force, hard_noisy
from training import NCA
from training.model import plan as estimator
from training.model.fitting import SCALE_RATIO, SCALE_STEPS, first_step_length, start_scale
from training.model.options import fit_settings, with_options
from training.model.plan import AUTO_EXACT_FINISH_ITER, AUTO_KNCA_FINISH_ITER, DEFAULT_L2
from training.objectives.nca import NCAObjective
from training.optim.problem import Problem


def penalised_exact_loss(model, X, y, l2, rows=None) -> float:
    """-(1/B) sum_{i in rows} p_i + l2 ||A||^2 of a fitted model, in float64, from scratch:
    p_i = sum_{j: y_j = y_i} softmax_{j != i}(-||A x_i - A x_j||^2) over all N points."""
    Xs = (X - model.mean_) / model.scale_
    z = Xs @ model.components_.T  # (N, d)
    rows = np.arange(len(y)) if rows is None else rows
    d2 = ((z[rows, None, :] - z[None, :, :]) ** 2).sum(-1)  # (B, N)
    d2[np.arange(len(rows)), rows] = np.inf
    logits = -d2 - (-d2).max(1, keepdims=True)
    p = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
    p_correct = (p * (y[None, :] == y[rows, None])).sum(1)
    return float(-p_correct.mean() + l2 * (model.components_**2).sum())


def fit(X, y, **params):
    # the finish itself, whatever it does to the score (the stage selection is tested in
    # test_stages.py)
    base = dict(
        n_components=4, random_state=0, max_iter=30, standardize="feature", select_stages=False
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return NCA(**with_options(dict(**{**base, **params}))).fit(X, y)


def test_auto_finishes_a_candidate_fit_with_exact_iterations_tagged_in_the_history():
    X, y = blobs(400)
    model = fit(X, y, n_candidates=5)
    assert 1 <= model.exact_finish_iter_ <= AUTO_EXACT_FINISH_ITER
    assert model.l2_ == DEFAULT_L2  # the finish carries the penalty nearest candidates cannot
    stages = [r.get("stage") for r in model.history_]
    n_first = model.n_iter_ - model.exact_finish_iter_
    assert stages == [None] * n_first + ["exact finish"] * model.exact_finish_iter_
    assert [r["iteration"] for r in model.history_] == list(range(1, model.n_iter_ + 1))
    seconds = [r["seconds"] for r in model.history_]
    assert seconds == sorted(seconds)  # one clock for both stages
    # the reported objective is the exact one at the returned map (no penalty)
    assert model.objective_value_ == pytest.approx(
        -penalised_exact_loss(model, X, y, l2=0.0), abs=1e-5
    )


def test_the_finish_converges_to_the_exact_fits_penalised_optimum():
    """Given iterations enough, candidates + finish and the exact fit reach the same
    penalised exact loss: the finish optimises the exact objective, not the candidates'."""
    X, y = blobs(300, seed=1)
    exact = fit(X, y, n_candidates=None, max_iter=500, tol=1e-10)
    finished = fit(X, y, n_candidates=4, exact_finish=500, tol=1e-10)
    unfinished = fit(X, y, n_candidates=4, exact_finish=0, l2=DEFAULT_L2, tol=1e-10)
    target = penalised_exact_loss(exact, X, y, DEFAULT_L2)
    assert penalised_exact_loss(finished, X, y, DEFAULT_L2) == pytest.approx(target, abs=1e-4)
    # without the finish the same penalty on candidates lands elsewhere
    assert penalised_exact_loss(unfinished, X, y, DEFAULT_L2) > target + 1e-3


def test_a_finish_that_takes_no_step_reports_its_own_objective_penalty_and_kernel():
    """A finish whose start already meets the gradient test (tol huge: no stage takes a step)
    leaves the kept map's objective the finish's (the exact mean score, every point a
    neighbour): ``l2_`` is the penalty of that objective's loss and ``kernels_`` names the
    exact kernel it evaluated (they said the candidate stage's 0 and no exact kernel,
    beside the finish's objective)."""
    X, y = hard_noisy(600, seed=1)[:2]
    model = fit(X, y, n_candidates=5, exact_finish=5, tol=1e9, select_stages=True)
    assert [(r["iterations"], r["stop_reason"]) for r in model.stages_] == [(0, "converged")] * 2
    assert model.l2_ == DEFAULT_L2 and "nca_exact" in model.kernels_
    assert model.objective_value_ == pytest.approx(
        -penalised_exact_loss(model, X, y, l2=0.0), abs=1e-5
    )


def test_exact_finish_zero_is_the_candidate_fit_alone():
    X, y = blobs(400)
    model = fit(X, y, n_candidates=5, exact_finish=0)
    assert model.exact_finish_iter_ == 0 and model.l2_ == 0.0
    assert all("stage" not in r for r in model.history_)


def exact_problem(X, y, l2=DEFAULT_L2, query_rows=None):
    Xt = torch.as_tensor((X - X.mean(0)) / X.std(0), dtype=torch.float32)
    labels = torch.as_tensor(y, dtype=torch.int64)
    objective = NCAObjective(log_form=False)
    return Problem(
        Xt, labels, objective, transform="linear", n_components=2, l2=l2, query_rows=query_rows
    )


@pytest.mark.parametrize("size", [3.0, 0.1])
def test_the_start_scale_is_the_penalised_losss_least_on_its_grid(size):
    """A map far too large for the penalty is scaled down, one far too small up, each to a
    scale whose neighbours on the grid (a factor sqrt 2 either way) have a larger loss."""
    X, y = blobs(240, seed=3)
    problem = exact_problem(X, y)
    theta = size * np.random.default_rng(0).normal(size=2 * X.shape[1])
    scale = start_scale(problem, theta)
    rows = torch.arange(len(y))  # 240 rows: all of them are the sample

    def loss(s):
        with torch.no_grad():
            return float(problem.loss(problem.to_tensor(s * theta), rows)[0])

    assert (scale < 1) if size > 1 else (scale > 1)
    assert SCALE_RATIO ** (0.5 - SCALE_STEPS) < scale < SCALE_RATIO ** (SCALE_STEPS - 0.5)
    assert loss(scale) < loss(scale * SCALE_RATIO) and loss(scale) < loss(scale / SCALE_RATIO)
    steps = np.log(scale) / np.log(SCALE_RATIO)
    assert steps == pytest.approx(round(steps), abs=1e-9)  # a power of the ratio


def test_the_start_scale_is_chosen_on_the_stages_own_query_rows(monkeypatch):
    """On a problem averaging over some query rows (here one class's), the loss is taken on
    an evenly spaced eighth of those rows (at least 256, here all 73), and the scale is
    the least on the grid of those rows' loss."""
    X, y = blobs(300, seed=4)
    rows = torch.as_tensor(np.flatnonzero(y == 2))
    problem = exact_problem(X, y, query_rows=rows)
    theta = 5.0 * np.random.default_rng(1).normal(size=2 * X.shape[1])
    asked = []
    loss = problem.loss
    monkeypatch.setattr(problem, "loss", lambda p, r: asked.append(r) or loss(p, r))
    scale = start_scale(problem, theta)
    assert asked and all(torch.equal(r, rows) for r in asked)

    def loss_at(s):
        with torch.no_grad():
            return float(loss(problem.to_tensor(s * theta), rows)[0])

    assert scale < 1
    assert loss_at(scale) < loss_at(scale * SCALE_RATIO)
    assert loss_at(scale) < loss_at(scale / SCALE_RATIO)


def test_the_finish_starts_from_the_scaled_map_and_stages_say_so():
    """The candidate stage (no penalty) grows the map; the finish (l2) starts from it scaled
    down: after one finishing iteration its penalty is far below that of the candidate
    stage's map (l2 ||A||^2), and stages_ records the factor; without a penalty no scale is
    searched."""
    X, y = blobs(400)
    candidate_map = fit(X, y, n_candidates=5, exact_finish=0).components_
    model = fit(X, y, n_candidates=5, exact_finish=1)
    first, finish = model.stages_
    assert first["start_scale"] == 1.0 and finish["stage"] == "exact finish"
    assert finish["start_scale"] <= SCALE_RATIO**-1
    after_one = next(r for r in model.history_ if r.get("stage") == "exact finish")
    assert after_one["penalty"] < 0.75 * DEFAULT_L2 * float((candidate_map**2).sum())
    unpenalised = fit(X, y, n_candidates=5, exact_finish=3, l2=0.0)
    assert [s["start_scale"] for s in unpenalised.stages_] == [1.0, 1.0]


def judged_fit(**extra) -> NCA:
    """A candidate fit on blobs whose held-out scores are scripted (``held_out_score``) to
    fall in the finish: 0.9 for every map but the finish's after its start, 0.5."""
    X, y = blobs(400)
    X_val, y_val = blobs(120, seed=9)
    params = dict(
        n_components=4,
        random_state=0,
        max_iter=30,
        standardize="feature",
        n_candidates=5,
        held_out_score=lambda A, stage, i: 0.5 if stage == "exact finish" and i > 0 else 0.9,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return NCA(**with_options({**params, **extra})).fit(X, y, X_val, y_val)


@pytest.mark.parametrize("penalty", [{}, {"l2": 0.0}, {"objective": "knca-majority", "k": 3}])
def test_a_finish_without_a_gain_returns_the_candidate_stages_map_and_objective(penalty):
    """The finish's first iteration gains nothing, so it stops there undone, and the fit
    returns the candidate stage's map itself (not the scaled start) with that stage's
    objective and penalty, as a fit without a finish does: for NCA's scaled start, and for
    the unscaled starts (no penalty; kNCA), whose start took the finish's objective."""
    undone = judged_fit(exact_finish=3, **penalty)
    alone = judged_fit(exact_finish=0, **penalty)
    finish = undone.stages_[1]
    assert (finish["kept"], finish["stop_reason"], finish["iterations"]) == ("start", "no gain", 1)
    assert (finish["start_scale"] < 1) == (penalty == {})
    np.testing.assert_array_equal(undone.components_, alone.components_)
    assert undone.objective_value_ == alone.objective_value_
    assert undone.l2_ == alone.l2_ == undone.plan_.l2  # the candidate stage's penalty
    assert undone.converged_ and undone.stop_reason_ == alone.stop_reason_
    if "objective" not in penalty:  # the exact kernel ran (kNCA names one kernel for both)
        assert "nca_exact" in undone.kernels_ and "nca_exact" not in alone.kernels_


def test_with_the_stop_rules_off_the_keep_rule_undoes_the_finish_at_its_end():
    """Without the stop rules (``stop_stalled_stages=False``, no early stopping) the finish
    runs all its iterations; scoring below the candidate stage's map, it is undone by the
    keep rule at its end, and the fit returns the candidate stage's map itself (not the
    scaled start) with its mean score on the finish's objective (the objective optimised
    last)."""
    X, y = blobs(400)
    undone = judged_fit(exact_finish=3, stop_stalled_stages=False)
    alone = judged_fit(exact_finish=0, stop_stalled_stages=False)
    finish = undone.stages_[1]
    assert (finish["kept"], finish["stop_reason"], finish["iterations"]) == ("start", "max_iter", 3)
    assert finish["start_scale"] < 1
    np.testing.assert_array_equal(undone.components_, alone.components_)
    assert undone.objective_value_ == pytest.approx(
        -penalised_exact_loss(undone, X, y, l2=0.0), abs=1e-5
    )


def test_exact_fits_and_fits_that_auto_leaves_alone_have_no_finish():
    X, y = blobs(200)
    assert fit(X, y, n_candidates=None, exact_finish=5).exact_finish_iter_ == 0
    adam = fit(X, y, n_candidates=5, solver="adam", max_iter=3, batch_size=64)
    assert adam.exact_finish_iter_ == 0


def test_auto_finishes_knca_with_its_own_budget():
    """kNCA's "auto" finish runs up to AUTO_KNCA_FINISH_ITER iterations (more than NCA's,
    over fewer rows) and carries the exact objective's penalty. (How many of them L-BFGS
    takes before it converges depends on its floating-point path: the budget is what is
    checked.)"""
    X, y = blobs(200)
    model = fit(X, y, n_candidates=5, objective="knca-majority", k=3, tol=1e-12)
    assert model.plan_.finish_iter == AUTO_KNCA_FINISH_ITER > AUTO_EXACT_FINISH_ITER
    assert 1 <= model.exact_finish_iter_ <= AUTO_KNCA_FINISH_ITER
    assert model.l2_ == DEFAULT_L2
    finish = [r for r in model.history_ if r.get("stage") == "exact finish"]
    assert len(finish) == model.exact_finish_iter_


def test_an_explicit_finish_applies_to_knca_and_to_adam():
    """An explicit budget of 2 finishing iterations, L-BFGS's on both (it may converge
    sooner: the budget is what is checked); Adam's 3 epochs come first."""
    X, y = blobs(150)
    knca = fit(X, y, n_candidates=5, objective="knca-majority", k=3, exact_finish=2)
    assert knca.plan_.finish_iter == 2 and 1 <= knca.exact_finish_iter_ <= 2
    adam = fit(X, y, n_candidates=5, solver="adam", max_iter=3, batch_size=64, exact_finish=2)
    assert adam.plan_.finish_iter == 2 and 1 <= adam.exact_finish_iter_ <= 2
    assert adam.n_iter_ == 3 + adam.exact_finish_iter_


def test_above_the_row_limit_the_finish_averages_over_evenly_spaced_query_rows(monkeypatch):
    X, y = blobs(300)
    monkeypatch.setattr(estimator, "EXACT_FINISH_MAX_ROWS", 50)
    model = fit(X, y, n_candidates=5, exact_finish=3)
    rows = np.unique(np.linspace(0, 299, 50).astype(np.int64))
    on_rows = -penalised_exact_loss(model, X, y, l2=0.0, rows=rows)
    on_all = -penalised_exact_loss(model, X, y, l2=0.0)
    assert model.objective_value_ == pytest.approx(on_rows, abs=1e-5)
    assert abs(on_rows - on_all) > 1e-4  # the sample, not all rows, was averaged


@pytest.mark.parametrize(
    "n_samples, params, distributed, points, rows",
    [
        (2**16, {}, False, None, 2**14),  # at the limit: every point, 2^30 pairs' rows
        (2**16 + 1, {}, False, 2**16, 2**14),  # above it: a sample, the same rows
        (2**20, {}, False, 2**16, 2**14),
        (2**20, {}, True, None, 1024),  # torchrun: every point, FINISH_MIN_ROWS rows
        (2**20, {"objective": "knca-majority", "k": 3}, False, None, 1024),  # kNCA: all
        (2**20, {"objective": "nca-log"}, False, 2**16, 2**14),  # g is NCA's
        (2**20, {"exact_finish": 3}, False, 2**16, 2**14),  # an explicit finish: the same
        (2**20, {"exact_finish": 0}, False, None, 1024),  # no finish: no sample
        (2**20, {"solver": "adam"}, False, None, 1024),  # Adam: no finish unless asked
        (2**20, {"n_candidates": None}, False, None, 1024),  # an exact fit: no finish
    ],
)
def test_the_plan_samples_the_finishs_points_above_the_limit(
    n_samples, params, distributed, points, rows
):
    settings = vars(fit_settings(NCA(**with_options(params)).get_params()))
    plan = estimator.resolve_plan(settings, n_samples, distributed)
    assert plan.finish_points == points
    assert plan.finish_max_rows == rows


@pytest.mark.parametrize("layout", ["dense", "sparse"])
def test_above_the_point_limit_the_finish_is_exact_on_an_evenly_spaced_sample(monkeypatch, layout):
    """Above FINISH_MAX_POINTS points (monkeypatched to 120 of 300), the finish's objective
    is the exact one among an evenly spaced sample of the points, averaged over evenly spaced
    rows of that sample (FINISH_PAIRS // 120 = 40 of them): checked from scratch in float64
    at the fitted map, and against the same rows scored among all 300 points. A sparse X
    (CSR, ``standardize="none"``) is sampled the same way."""
    X, y = blobs(300)
    monkeypatch.setattr(estimator, "FINISH_MAX_POINTS", 120)
    monkeypatch.setattr(estimator, "FINISH_PAIRS", 120 * 40)
    monkeypatch.setattr(estimator, "FINISH_MIN_ROWS", 1)
    if layout == "sparse":
        model = fit(sp.csr_matrix(X), y, n_candidates=5, exact_finish=3, standardize="none")
    else:
        model = fit(X, y, n_candidates=5, exact_finish=3)
    assert (model.plan_.finish_points, model.plan_.finish_max_rows) == (120, 40)
    assert model.exact_finish_iter_ >= 1
    sample = np.unique(np.linspace(0, 299, 120).astype(np.int64))
    rows = np.unique(np.linspace(0, 119, 40).astype(np.int64))  # of the sample
    on_sample = -penalised_exact_loss(model, X[sample], y[sample], l2=0.0, rows=rows)
    among_all = -penalised_exact_loss(model, X, y, l2=0.0, rows=sample[rows])
    assert model.objective_value_ == pytest.approx(on_sample, abs=1e-5)
    assert abs(on_sample - among_all) > 1e-4  # the sample's points, not all 300, were scored


@pytest.mark.slow  # a long real-server or training scenario: make test-slow
def test_knca_finish_averages_over_its_own_row_limit(monkeypatch):
    """Above KNCA_FINISH_MAX_ROWS points (monkeypatched to 12), kNCA's finish averages the
    exact kNCA-majority probability over that many evenly spaced rows; checked against an
    enumeration of every k-subset of the other 39 points, in float64, at the fitted map."""
    X, y = blobs(40, seed=2)
    monkeypatch.setattr(estimator, "KNCA_FINISH_MAX_ROWS", 12)
    monkeypatch.setattr(estimator, "EXACT_FINISH_MAX_ROWS", 10**6)  # NCA's limit is not kNCA's
    model = fit(X, y, n_candidates=3, objective="knca-majority", k=3, exact_finish=2)
    assert model.plan_.finish_iter == 2 and model.exact_finish_iter_ >= 1
    z = ((X - model.mean_) / model.scale_) @ model.components_.T  # (N, d)
    probabilities = []
    for i in range(len(y)):
        others = np.delete(np.arange(len(y)), i)
        d2 = ((z[others] - z[i]) ** 2).sum(1)  # (N - 1,)
        probabilities.append(brute_force(d2, y[others], y[i], 3, "majority"))
    rows = np.unique(np.linspace(0, len(y) - 1, 12).astype(np.int64))
    on_rows = float(np.mean(np.array(probabilities)[rows]))
    assert model.objective_value_ == pytest.approx(on_rows, abs=1e-5)
    assert abs(on_rows - float(np.mean(probabilities))) > 1e-4  # the sample was averaged


@pytest.mark.parametrize("best_stage", ["candidate stage", "exact finish"])
def test_early_stopping_keeps_the_best_validated_map_of_either_stage(best_stage):
    """The validation score scripted (``held_out_score``) to peak at the first iteration of
    either stage: the fit returns that iterate's map and its accuracy, whatever the other
    iterates of both stages did."""
    X, y = hard_noisy(n=300, seed=0)
    maps = {}
    model = fit(
        X,
        y,
        n_candidates=8,
        exact_finish=5,
        early_stopping=True,
        validation_interval=1,
        n_iter_no_change=50,
        max_iter=15,
        callback=lambda A, iteration: maps.__setitem__(iteration, A.copy()),
        held_out_score=lambda A, stage, i: 0.9 if (stage, i) == (best_stage, 1) else 0.5,
    )
    validated = [(r["val_score"], r["iteration"], r.get("stage")) for r in model.history_]
    tag = None if best_stage == "candidate stage" else best_stage  # the first stage: no tag
    assert [(i, s) for a, i, s in validated if a == 0.9] == [
        next((i, s) for _, i, s in validated if s == tag)
    ]
    best = next(i for a, i, _ in validated if a == 0.9)
    assert 1 <= model.exact_finish_iter_ <= 5 and len(maps) == model.n_iter_
    assert (
        model.best_val_accuracy_
        == next(r for r in model.history_ if r["iteration"] == best)["val_accuracy"]
    )
    np.testing.assert_array_equal(model.components_.ravel(), maps[best])


def test_the_finish_closes_most_of_the_gap_to_the_exact_fit_on_hard_noisy_data():
    """The audit tests' hard noisy set: nearest candidates alone optimise another objective
    (no penalty, neighbourhoods cut at K); 10 finishing iterations bring the map's penalised
    exact loss most of the way to the exact fit's."""
    X, y = hard_noisy(n=1200)
    exact = fit(X, y, n_components=8, n_candidates=None, max_iter=40)
    alone = fit(X, y, n_components=8, n_candidates=8, exact_finish=0, max_iter=40)
    finished = fit(X, y, n_components=8, n_candidates=8, max_iter=40)
    target = penalised_exact_loss(exact, X, y, DEFAULT_L2)
    gap_alone = penalised_exact_loss(alone, X, y, DEFAULT_L2) - target
    gap_finished = penalised_exact_loss(finished, X, y, DEFAULT_L2) - target
    assert gap_alone > 0.01
    assert gap_finished < 0.25 * gap_alone


@pytest.mark.parametrize("value", ["lots", -1, 1.5, True, None])
def test_bad_exact_finish_is_refused_naming_the_value(value):
    X, y = blobs(50)
    with pytest.raises(ValueError, match=rf"exact_finish={value!r} must be 'auto' or an integer"):
        NCA(n_components=2, options=dict(exact_finish=value)).fit(X, y)


@pytest.mark.parametrize("l2, size, direction", [(0.3, 0.03, -1), (0.03, 3.0, 1)])
def test_the_first_step_length_is_the_sample_losss_least_on_its_grid_along_minus_g(
    l2, size, direction
):
    """From a unit step along -g (1 / ||g||), the length halves while the loss on the sample
    rows falls, or else doubles: here one map's unit step overshoots (the length halves)
    and another's falls short (it doubles); each ends on a power of 2 times the unit step
    whose neighbours on that grid have a larger loss."""
    X, y = blobs(240, seed=5)
    problem = exact_problem(X, y, l2=l2)
    theta = size * np.random.default_rng(2).normal(size=2 * X.shape[1])
    g = problem.loss_and_grad(theta)[1]
    length = first_step_length(problem, theta, g)
    rows = torch.arange(len(y))  # 240 rows: all of them are the sample

    def loss(a):
        with torch.no_grad():
            return float(problem.loss(problem.to_tensor(theta - a * g), rows)[0])

    steps = np.log2(length * np.linalg.norm(g))
    assert steps == pytest.approx(round(steps), abs=1e-9) and abs(steps) <= SCALE_STEPS
    assert np.sign(round(steps)) == direction
    assert loss(length) < loss(0.0)
    assert loss(length) < loss(2 * length) and loss(length) < loss(length / 2)


def test_only_the_scaled_finish_takes_its_first_step_at_the_probed_length(monkeypatch):
    """The penalised NCA finish asks ``first_step_length`` once, for its first step, and its
    first line search tries the length it answers first; the candidate stage, an
    unpenalised finish and kNCA's finish do not ask."""
    from training.model import fitting
    from training.optim import lbfgs

    asked, tried = [], []
    real_length, real_search = fitting.first_step_length, lbfgs.line_search

    def spy_length(problem, theta, gradient):  # half the probed length: a length of its own
        length = 0.5 * real_length(problem, theta, gradient)
        asked.append((length, len(tried)))  # the next line search is the one it is for
        return length

    def spy_search(fun, x, at, d, slope, first, budget):
        tried.append(first)
        return real_search(fun, x, at, d, slope, first, budget)

    monkeypatch.setattr(fitting, "first_step_length", spy_length)
    monkeypatch.setattr(lbfgs, "line_search", spy_search)
    X, y = blobs(400)
    model = fit(X, y, n_candidates=5, exact_finish=3)
    assert len(asked) == 1 and model.stages_[1]["start_scale"] != 1.0
    length, search = asked[0]
    assert tried[search] == length  # the finish's first line search tries it first
    asked.clear()
    fit(X, y, n_candidates=5, exact_finish=3, l2=0.0)
    fit(X, y, objective="knca-majority", k=3, n_candidates=5, exact_finish=3)
    assert asked == []
