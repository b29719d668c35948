"""Drawn candidates: uniform draws beyond the nearest candidates, weighted by the number of
points each stands for, so that the candidate objective estimates the neighbour mass the
nearest candidates leave out (``candidate_draws``)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from tests.training.problems import candidate_gaps, fit_history, hard_noisy
from training import NCA
from training.model.options import with_options
from training.model.plan import DEFAULT_L2
from training.objectives.nca_kernel import nca_value_and_grad_candidates
from training.objectives.neighbourhood import (
    nearest_candidates,
    objective_sum,
    sampled_candidates,
    with_sampled_candidates,
)
from training.objectives.registry import make_objective
from training.optim.problem import Problem


def blobs(n=240, n_classes=4, seed=0):
    rng = np.random.default_rng(seed)
    y = rng.integers(0, n_classes, n)
    X = rng.normal(0, 1.0, (n_classes, 5))[y] + rng.normal(0, 1.0, (n, 5))
    return X, y


def draws(labels, nearest, s, seed=0):
    return sampled_candidates(labels, nearest, s, torch.Generator().manual_seed(seed))


def test_draws_are_of_the_right_kind_never_the_point_itself_nor_a_nearest_candidate():
    X, y = blobs()
    labels = torch.as_tensor(y)
    nearest = nearest_candidates(torch.as_tensor(X), labels, 5)  # (N, 10)
    drawn, log_w = draws(labels, nearest, 12)
    assert drawn.shape == (240, 24) and log_w.shape == (240, 2)
    counts = np.bincount(y)
    for i in range(240):
        same, other = drawn[i, :12].numpy(), drawn[i, 12:].numpy()
        same, other = same[same >= 0], other[other >= 0]
        assert np.all(y[same] == y[i]) and np.all(y[other] != y[i])
        assert i not in same
        assert not set(same) & set(nearest[i].tolist())
        assert not set(other) & set(nearest[i].tolist())
        assert log_w[i].tolist() == pytest.approx(
            [np.log((counts[y[i]] - 1) / 12), np.log((240 - counts[y[i]]) / 12)]
        )


def test_draws_cover_each_kind_uniformly():
    """Every other point of the class (and every point of the other classes) is drawn about
    equally often: 20,000 draws per row, checked against the binomial spread."""
    y = np.array([0] * 5 + [1] * 3 + [2] * 4)
    labels = torch.as_tensor(y)
    no_nearest = torch.full((12, 2), -1)
    drawn, _ = draws(labels, no_nearest, 20_000)
    row = 0  # class 0: 4 others of its class, 7 of other classes
    same = np.bincount(drawn[row, :20_000].numpy(), minlength=12)
    other = np.bincount(drawn[row, 20_000:].numpy(), minlength=12)
    assert same[0] == 0 and np.all(same[5:] == 0) and np.all(other[:5] == 0)
    for hits, n_kind in ((same[1:5], 4), (other[5:], 7)):
        p = 1 / n_kind
        assert np.all(np.abs(hits - 20_000 * p) < 5 * np.sqrt(20_000 * p * (1 - p)))


def test_the_weighted_draws_estimate_the_mass_outside_the_nearest_without_bias():
    """E[w sum_s e_s 1(s kept)] = sum over the kind's points that are not nearest of e_j,
    for arbitrary positive e_j; mean of 400 independent drawings within 5 standard errors."""
    X, y = blobs(n=120)
    labels = torch.as_tensor(y)
    nearest = nearest_candidates(torch.as_tensor(X), labels, 3)
    e = np.random.default_rng(1).exponential(1.0, 120)  # any positive masses
    i = 7
    not_nearest = ~np.isin(np.arange(120), nearest[i].numpy())
    truth_same = e[(y == y[i]) & not_nearest & (np.arange(120) != i)].sum()
    truth_other = e[(y != y[i]) & not_nearest].sum()
    estimates = []
    for seed in range(400):
        drawn, log_w = draws(labels, nearest, 8, seed)
        same, other = drawn[i, :8].numpy(), drawn[i, 8:].numpy()
        w_same, w_other = np.exp(log_w[i].numpy())
        estimates.append([w_same * e[same[same >= 0]].sum(), w_other * e[other[other >= 0]].sum()])
    estimates = np.array(estimates)
    mean, error = estimates.mean(0), estimates.std(0) / np.sqrt(len(estimates))
    assert np.all(np.abs(mean - [truth_same, truth_other]) < 5 * error)


def test_a_class_of_one_and_a_single_class_draw_nothing_of_the_empty_kind():
    y = torch.tensor([0, 1, 1, 1])
    drawn, log_w = draws(y, torch.full((4, 2), -1), 3)
    assert drawn[0, :3].tolist() == [-1, -1, -1]  # no other point of class 0
    assert log_w[0, 0] == float("-inf")
    only = torch.zeros(5, dtype=torch.long)
    drawn, log_w = draws(only, torch.full((5, 2), -1), 3)
    assert (drawn[:, 3:] == -1).all() and torch.isinf(log_w[:, 1]).all()
    _, weights = with_sampled_candidates(torch.full((5, 2), -1), drawn, log_w, torch.float64)
    assert torch.isfinite(weights).all()  # empty kinds leave only padding, weighted 0


def test_the_table_keeps_each_kind_in_its_half_with_the_weights_beside_it():
    nearest = torch.tensor([[1, 2, 5, 6]])  # K = 2: same 1, 2; other 5, 6
    drawn = torch.tensor([[3, -1, 4, 7, 8, 9]])  # S = 3
    log_w = torch.tensor([[np.log(2.0), np.log(5.0)]], dtype=torch.float64)
    table, weights = with_sampled_candidates(nearest, drawn, log_w, torch.float64)
    assert table.tolist() == [[1, 2, 3, -1, 4, 5, 6, 7, 8, 9]]
    expected = [0, 0, np.log(2), 0, np.log(2), 0, 0, np.log(5), np.log(5), np.log(5)]
    assert weights[0].tolist() == pytest.approx(expected)


@pytest.mark.parametrize("log_form", [False, True])
def test_a_weight_counts_a_candidate_that_many_times(log_form):
    """log w = log 2 on a candidate gives the objective, and the gradient, of listing it
    twice: the weighted softmax is the softmax over the multiset."""
    X, y = blobs(n=60)
    z = torch.as_tensor(X[:, :3])
    labels = torch.as_tensor(y)
    base = nearest_candidates(z, labels, 4)  # (N, 8)
    doubled_col = 1  # the second same-class candidate, and the second other-class one (5)
    twice = torch.cat(
        [base[:, :4], base[:, doubled_col : doubled_col + 1], base[:, 4:], base[:, 5:6]], 1
    )  # (N, 10): the same multiset with both listed twice
    weights = torch.zeros(base.shape, dtype=torch.float64)
    weights[:, doubled_col] = weights[:, 5] = np.log(2.0)
    weights[base < 0] = 0.0
    v_w, g_w = nca_value_and_grad_candidates(
        z, labels, base, log_form=log_form, log_weights=weights
    )
    v_2, g_2 = nca_value_and_grad_candidates(z, labels, twice, log_form=log_form)
    assert float(v_w) == pytest.approx(float(v_2), rel=1e-12)
    torch.testing.assert_close(g_w, g_2, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("objective", ["nca", "nca-log"])
def test_fused_and_autograd_paths_agree_with_weights_and_match_finite_differences(objective):
    X, y = blobs(n=80)
    labels = torch.as_tensor(y)
    obj = make_objective(objective, 1, n_classes=4)
    z = torch.as_tensor(X[:, :3]).clone()
    nearest = nearest_candidates(z, labels, 3)
    drawn, log_w = draws(labels, nearest, 4)
    table, weights = with_sampled_candidates(nearest, drawn, log_w, torch.float64)
    values, grads = [], []
    for method in ("fused", "autograd"):
        leaf = z.clone().requires_grad_(True)
        value = objective_sum(
            leaf, labels, obj, candidates=table, log_weights=weights, method=method
        )
        value.backward()
        values.append(float(value.detach()))
        grads.append(leaf.grad)
    assert values[0] == pytest.approx(values[1], rel=1e-12)
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-9, atol=1e-12)

    def f(zz):
        return float(objective_sum(zz, labels, obj, candidates=table, log_weights=weights))

    step = 1e-6
    for i, j in [(0, 0), (11, 2), (57, 1)]:
        up, down = z.clone(), z.clone()
        up[i, j] += step
        down[i, j] -= step
        assert float(grads[0][i, j]) == pytest.approx((f(up) - f(down)) / (2 * step), abs=1e-6)


def test_weights_are_refused_where_they_mean_nothing():
    X, y = blobs(n=40)
    z, labels = torch.as_tensor(X), torch.as_tensor(y)
    weights = torch.zeros((40, 4), dtype=torch.float64)
    with pytest.raises(ValueError, match="got them with no candidates"):
        objective_sum(z, labels, make_objective("nca", 1, n_classes=4), log_weights=weights)
    knca = make_objective("knca-majority", 3, n_classes=4)
    table = nearest_candidates(z, labels, 2)
    with pytest.raises(ValueError, match=r"KNCAObjective|kNCA|knca"):
        objective_sum(z, labels, knca, candidates=table, log_weights=weights)


def problem(n_draws, seed=0, objective="nca"):
    X, y = blobs()
    return Problem(
        torch.as_tensor(X),
        torch.as_tensor(y),
        make_objective(objective, 1 if objective == "nca" else 3, n_classes=4),
        transform="linear",
        n_components=2,
        n_candidates=4,
        n_draws=n_draws,
        seed=seed,
    )


def test_a_refresh_draws_afresh_and_the_same_seed_draws_the_same():
    theta = np.random.default_rng(0).normal(size=(2, 5))
    a, b = problem(6), problem(6)
    a.refresh_candidates(theta)
    b.refresh_candidates(theta)
    assert a.candidates.shape == (240, 2 * (4 + 6))
    assert torch.equal(a.candidates, b.candidates)
    # [4 nearest same | 6 drawn same | 4 nearest other | 6 drawn other]
    assert torch.equal(a.candidates[:, :4], a.nearest[:, :4])
    assert torch.equal(a.candidates[:, 10:14], a.nearest[:, 4:])
    first = a.candidates.clone()
    a.refresh_candidates(theta)
    assert torch.equal(a.nearest, b.nearest)  # the nearest are the nearest
    assert not torch.equal(a.candidates, first)  # the draws are new
    plain = problem(0)
    plain.refresh_candidates(theta)
    assert plain.candidate_log_weights is None and torch.equal(plain.candidates, plain.nearest)
    # the watch's mass is of the nearest candidates, whatever is drawn
    rows = torch.arange(0, 240, 9)
    assert a.outside_mass(theta, rows) == pytest.approx(plain.outside_mass(theta, rows))


def test_draws_are_refused_for_knca_in_the_problem():
    with pytest.raises(ValueError, match="n_draws=4: drawn candidates weight NCA"):
        problem(4, objective="knca-all")


@pytest.mark.parametrize(
    "params, pattern",
    [
        (dict(candidate_draws=-1), r"candidate_draws=-1 must be an integer >= 0"),
        (dict(candidate_draws=2.5), r"candidate_draws=2.5 must be an integer >= 0"),
        (dict(candidate_draws=True), r"candidate_draws=True must be an integer >= 0"),
        (
            dict(candidate_draws=8, objective="knca-majority", k=3),
            r"candidate_draws=8 weights the candidates of NCA's objectives \('nca', 'nca-log'\), "
            r"not objective='knca-majority'",
        ),
    ],
)
def test_the_estimator_refuses_bad_draws(params, pattern):
    X, y = blobs()
    with pytest.raises(ValueError, match=pattern):
        NCA(**with_options(dict(n_components=2, **params))).fit(X, y)


def test_l2_auto_applies_the_penalty_on_candidates_only_with_draws():
    X, y = blobs()
    params = dict(n_components=2, n_candidates=4, max_iter=5, random_state=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert NCA(**with_options(dict(**params, exact_finish=0))).fit(X, y).l2_ == 0.0
        assert (
            NCA(**with_options(dict(**params, exact_finish=0, candidate_draws=4))).fit(X, y).l2_
            == DEFAULT_L2
        )
        assert (
            NCA(**with_options(dict(**params))).fit(X, y).l2_ == DEFAULT_L2
        )  # the exact finish's penalty
        exact = NCA(n_components=2, n_candidates=None, max_iter=5, options=dict(candidate_draws=4))
        assert exact.fit(X, y).l2_ == DEFAULT_L2  # exact: nothing to draw


def test_draws_keep_a_penalised_candidate_fit_faithful_where_nearest_candidates_cannot():
    """The penalty keeps neighbourhoods wide; 8 nearest candidates per kind (grown to 64)
    hold too little of the mass and the candidate objective runs far above the exact one on
    the audit sample. With 16 draws per kind the two stay together, and the audit is quiet."""
    X, y = hard_noisy(n_features=20, n_informative=4)
    nearest_only = fit_history(X, y, l2=DEFAULT_L2)
    drawn = fit_history(X, y, l2=DEFAULT_L2, candidate_draws=16)
    assert max(candidate_gaps(nearest_only)[2:]) > 0.2
    assert nearest_only.candidate_warning_ is not None
    assert max(abs(g) for g in candidate_gaps(drawn)[2:]) < 0.05
    assert drawn.candidate_warning_ is None
