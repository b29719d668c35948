"""kNCA: the dynamic programme against brute-force enumeration, gradients, stability."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import training.objectives.knca
from tests.training.problems import brute_force
from training.objectives.knca import (
    KNCAObjective,
    class_polynomials,
    in_linear_range,
    log_poly_mul,
    log_prob_majority,
    poly_mul,
    present_classes,
)
from training.objectives.nca import NCAObjective
from training.objectives.neighbourhood import nearest_candidates, objective_sum


@pytest.fixture(params=["native", "torch"])
def fast_path(request, monkeypatch):
    """Run the test with the float64 fast path in C (where it builds) and in torch."""
    monkeypatch.setenv("NCA_KNN_NATIVE", "1" if request.param == "native" else "0")
    return request.param


@pytest.mark.parametrize("block", [64, 3, 1])  # one block; blocks and a tree; all tree
def test_class_polynomials_equal_expanded_products(block, monkeypatch):
    import training.objectives.knca

    monkeypatch.setattr(training.objectives.knca, "RECURRENCE_BLOCK", block)
    rng = np.random.default_rng(0)
    w = rng.uniform(0.1, 2.0, size=(3, 7))
    labels = rng.integers(0, 3, size=(3, 7))
    got = class_polynomials(torch.tensor(np.log(w)), torch.tensor(labels), 3, 4).exp().numpy()
    for b in range(3):
        for c in range(3):
            coeffs = np.array([1.0])
            for wj in w[b][labels[b] == c]:
                coeffs = np.convolve(coeffs, [1.0, wj])
            expected = np.zeros(5)
            expected[: min(5, len(coeffs))] = coeffs[:5]
            np.testing.assert_allclose(got[b, c], expected, rtol=1e-12)


def test_absent_weights_and_impossible_degrees():
    log_w = torch.tensor([[0.0, float("-inf"), 0.0]], dtype=torch.float64)
    e = class_polynomials(log_w, torch.zeros(1, 3, dtype=torch.long), 1, 3).exp()
    np.testing.assert_allclose(e.numpy(), [[[1.0, 2.0, 1.0, 0.0]]])
    a = torch.tensor([0.0, float("-inf")], dtype=torch.float64)
    assert torch.equal(log_poly_mul(a, a).exp(), a.exp())


@pytest.mark.parametrize("variant", ["majority", "all"])
@pytest.mark.parametrize("seed", range(12))
def test_equals_enumeration_of_every_k_subset(variant, seed, fast_path):
    """Up to k = 7: majority's truncated products (m = 2..k // 2) and its shared one."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(5, 13))
    k = int(rng.integers(1, min(7, n) + 1))
    n_classes = int(rng.integers(2, 6))
    dists = rng.uniform(0, 3, size=n)
    labels = rng.integers(0, n_classes, size=n)
    own = int(rng.integers(0, n_classes))
    obj = KNCAObjective(variant, k, log_form=True, n_classes=n_classes)
    log_p = obj.log_probabilities(
        torch.tensor(-dists)[None],
        torch.tensor(labels)[None],
        torch.tensor([own]),
        torch.ones(1, n, dtype=torch.bool),
    )
    expected = brute_force(dists, labels, own, k, variant)
    if expected == 0:
        assert torch.isneginf(log_p).all()
    else:
        assert float(log_p.exp()) == pytest.approx(expected, rel=1e-10, abs=1e-12)


@pytest.mark.parametrize("variant", ["majority", "all"])
def test_k1_equals_nca(variant, fast_path):
    rng = np.random.default_rng(1)
    z = torch.tensor(rng.normal(size=(30, 3)))
    y = torch.tensor(rng.integers(0, 3, 30))
    for log_form in (False, True):
        nca = objective_sum(z, y, NCAObjective(log_form), method="autograd")
        knca = objective_sum(z, y, KNCAObjective(variant, 1, log_form, n_classes=3))
        assert float(knca) == pytest.approx(float(nca), rel=1e-10)


@pytest.mark.parametrize("name", ["knca-majority", "knca-all", "knca-majority-log", "knca-all-log"])
def test_gradcheck_float64(name, fast_path):
    from training.objectives.registry import make_objective

    rng = np.random.default_rng(2)
    X = torch.tensor(rng.normal(size=(12, 4)))
    y = torch.tensor(np.arange(12) % 3)
    A = torch.tensor(rng.normal(size=(2, 4)) * 0.7, requires_grad=True)
    obj = make_objective(name, k=5, n_classes=3)
    assert torch.autograd.gradcheck(
        lambda a: objective_sum(X @ a.T, y, obj, chunk_size=5), (A,), eps=1e-6, atol=1e-6
    )


def test_adding_a_constant_to_all_distances_changes_nothing():
    rng = np.random.default_rng(3)
    d = torch.tensor(rng.uniform(0, 4, size=(4, 9)))
    labels = torch.tensor(rng.integers(0, 3, size=(4, 9)))
    own = torch.tensor([0, 1, 2, 0])
    valid = torch.ones(4, 9, dtype=torch.bool)
    for variant in ("majority", "all"):
        obj = KNCAObjective(variant, 4, log_form=True, n_classes=3)
        a = obj.log_probabilities(-d, labels, own, valid)
        b = obj.log_probabilities(-(d + 123.456), labels, own, valid)
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_all_is_never_more_likely_than_majority():
    rng = np.random.default_rng(4)
    d = torch.tensor(rng.uniform(0, 2, size=(50, 15)))
    labels = torch.tensor(rng.integers(0, 3, size=(50, 15)))
    own = torch.tensor(rng.integers(0, 3, size=50))
    valid = torch.ones(50, 15, dtype=torch.bool)
    for k in (2, 3, 5):
        p_all = KNCAObjective("all", k, True, 3).log_probabilities(-d, labels, own, valid)
        p_maj = KNCAObjective("majority", k, True, 3).log_probabilities(-d, labels, own, valid)
        assert (p_all <= p_maj + 1e-12).all()


@pytest.mark.parametrize(
    "variant, n",
    [
        ("majority", 10_000),
        ("all", 10_000),
        pytest.param("majority", 100_000, marks=pytest.mark.slow),
        pytest.param("all", 100_000, marks=pytest.mark.slow),
    ],
)
def test_float32_is_stable_over_wide_distance_ranges_and_many_candidates(variant, n):
    rng = np.random.default_rng(5)
    dists = np.exp(rng.uniform(np.log(1e-6), np.log(1e4), size=(2, n)))  # 1e-6 .. 1e4
    labels = rng.integers(0, 3, size=(2, n))
    own = np.array([0, 2])
    results = {}
    for dtype in (torch.float32, torch.float64):
        neg = torch.tensor(-dists, dtype=dtype, requires_grad=True)
        obj = KNCAObjective(variant, 10, log_form=True, n_classes=3)
        log_p = obj.log_probabilities(
            neg, torch.tensor(labels), torch.tensor(own), torch.ones(2, n, dtype=torch.bool)
        )
        (grad,) = torch.autograd.grad(log_p.sum(), neg)
        assert torch.isfinite(log_p).all() and torch.isfinite(grad).all()
        results[dtype] = (log_p.detach().double(), grad.double())
    torch.testing.assert_close(
        results[torch.float32][0], results[torch.float64][0], rtol=1e-4, atol=0
    )
    g32, g64 = results[torch.float32][1], results[torch.float64][1]
    # gradients: relative to each row's gradient norm (single entries of 1e5 are float32 noise)
    assert (torch.linalg.norm(g32 - g64, dim=1) <= 1e-4 * torch.linalg.norm(g64, dim=1)).all()


def test_candidate_mode_matches_exact_when_candidates_cover_everything():
    rng = np.random.default_rng(6)
    z = torch.tensor(rng.normal(size=(24, 3)))
    y = torch.tensor(np.arange(24) % 3)
    obj = KNCAObjective("majority", 3, log_form=False, n_classes=3)
    exact = objective_sum(z, y, obj)
    cand = nearest_candidates(z, y, 23)
    assert float(objective_sum(z, y, obj, candidates=cand)) == pytest.approx(
        float(exact), rel=1e-10
    )


@pytest.mark.parametrize("log_form", [False, True])
def test_classes_absent_from_candidates_are_dropped_without_changing_anything(log_form):
    # 8 classes, 3 + 3 candidates a row: most rows see 2-4 classes, and padding (-1) where a
    # class is small; the value and gradient equal the full C = 8 computation
    rng = np.random.default_rng(7)
    y = torch.tensor(np.r_[rng.integers(0, 7, 60), [7, 7, 7]])  # class 7: 3 points
    z = torch.tensor(rng.normal(size=(63, 4)))
    cand = nearest_candidates(z, y, 3)
    cand[61, 2] = -1  # one more padding slot among the same-class ones
    obj = KNCAObjective("majority", 4, log_form=log_form, n_classes=8)
    rows = torch.arange(63)

    def full_c(zz):  # the same scores without renumbering: every row runs all 8 classes
        idx = cand[rows]
        valid = idx >= 0
        neg = -((zz[:, None, :] - zz[idx.clamp_min(0)]) ** 2).sum(-1)
        logits = neg.masked_fill(~valid, float("-inf"))
        log_w = logits - logits.detach().amax(1, keepdim=True)
        log_e = class_polynomials(log_w, y[idx.clamp_min(0)], 8, 4)
        log_p = log_prob_majority(log_e, y, 4)
        ok = torch.isfinite(log_p)
        safe = torch.where(ok, log_p, torch.zeros_like(log_p))
        return (safe if log_form else torch.where(ok, safe.exp(), 0 * safe)).sum()

    results = []
    for f in (lambda zz: objective_sum(zz, y, obj, candidates=cand, chunk_size=16), full_c):
        zz = z.clone().requires_grad_()
        value = f(zz)
        (grad,) = torch.autograd.grad(value, zz)
        results.append((float(value.detach()), grad))
    assert results[0][0] == pytest.approx(results[1][0], rel=1e-12)
    torch.testing.assert_close(results[0][1], results[1][1], rtol=1e-10, atol=1e-12)
    _, _, n_present = present_classes(y[cand.clamp_min(0)], y, cand >= 0, 8)
    assert n_present < 8


def log_programme_only(obj, neg, labels, own, valid, monkeypatch):
    """The same log P_i with the float64 fast path switched off (every row in log space)."""
    with monkeypatch.context() as m:
        m.setattr(
            training.objectives.knca,
            "in_linear_range",
            lambda logits, k: (
                torch.zeros(logits.shape[0], dtype=torch.bool),
                torch.zeros(logits.shape[0], 1),
            ),
        )
        return obj.log_probabilities(neg, labels, own, valid)


def test_poly_mul_against_numpy_convolution():
    rng = np.random.default_rng(8)
    a, b = rng.uniform(0, 2, (4, 6)), rng.uniform(0, 2, (4, 3))
    got = poly_mul(torch.tensor(a), torch.tensor(b), max_degree=5).numpy()
    expected = np.stack([np.convolve(x, y)[:6] for x, y in zip(a, b, strict=True)])
    np.testing.assert_allclose(got, expected, rtol=1e-13)
    assert poly_mul(torch.tensor(a), torch.tensor(b), max_degree=20).shape[-1] == 8


@pytest.mark.parametrize("variant", ["majority", "all"])
@pytest.mark.parametrize("k", [1, 2, 5, 10])
def test_float64_fast_path_equals_the_log_programme(k, variant, monkeypatch, fast_path):
    # rows in range go through the fast path; values and gradients equal the log programme's
    rng = np.random.default_rng(k)
    d = rng.uniform(0, 12, size=(40, 30))
    labels = torch.tensor(rng.integers(0, 5, size=(40, 30)))
    own = torch.tensor(rng.integers(0, 5, size=40))
    valid = torch.tensor(rng.uniform(size=(40, 30)) > 0.1)
    obj = KNCAObjective(variant, k, log_form=True, n_classes=5)
    in_range, _ = in_linear_range(torch.tensor(-d).masked_fill(~valid, -np.inf), k)
    assert in_range.float().mean() > 0.8
    grads = []
    for fast in (True, False):
        neg = torch.tensor(-d, requires_grad=True)
        if fast:
            log_p = obj.log_probabilities(neg, labels, own, valid)
        else:
            log_p = log_programme_only(obj, neg, labels, own, valid, monkeypatch)
        finite = torch.isfinite(log_p)
        (grad,) = torch.autograd.grad(log_p[finite].sum(), neg)
        grads.append((log_p.detach(), grad))
    (fast_p, fast_g), (log_p, log_g) = grads
    assert torch.equal(torch.isfinite(fast_p), torch.isfinite(log_p))
    torch.testing.assert_close(fast_p, log_p, rtol=1e-11, atol=1e-11)
    torch.testing.assert_close(fast_g, log_g, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("variant", ["majority", "all"])
def test_rows_out_of_the_fast_paths_range_take_the_log_programme(variant, monkeypatch, fast_path):
    # one row in range, one whose k nearest span 3,000 in distance (beyond float64 as
    # coefficients), one whose own class is 700 beyond the rest (P_i ~ exp(-2,100) or less),
    # one with fewer candidates than k: all equal the log programme, gradients finite
    k = 4
    d = np.tile(np.linspace(0, 6, 12), (4, 1))
    d[1] = np.arange(12) * 1000.0
    labels = np.tile(np.arange(12) % 3, (4, 1))
    labels[2] = 1
    labels[2, -4:] = 0
    d[2, -4:] = 700.0
    valid = np.ones((4, 12), dtype=bool)
    valid[3, 3:] = False
    own = torch.tensor([0, 0, 0, 0])
    obj = KNCAObjective(variant, k, log_form=True, n_classes=3)
    args = (torch.tensor(labels), own, torch.tensor(valid))
    in_range, _ = in_linear_range(torch.tensor(-d).masked_fill(~torch.tensor(valid), -np.inf), k)
    assert in_range.tolist() == [True, False, True, False]
    neg = torch.tensor(-d, requires_grad=True)
    log_p = obj.log_probabilities(neg, *args)
    (grad,) = torch.autograd.grad(log_p[torch.isfinite(log_p)].sum(), neg)
    expected = log_programme_only(obj, torch.tensor(-d), *args, monkeypatch)
    torch.testing.assert_close(log_p.detach(), expected, rtol=1e-12, atol=0)  # -inf == -inf
    # majority: 3 of the 4 draws from i's class, ~exp(-3 x 700); all: 4 of 4, ~exp(-4 x 700)
    low, high = (-2200, -2000) if variant == "majority" else (-2900, -2700)
    assert low < float(log_p.detach()[2]) < high and torch.isneginf(log_p[3])
    assert torch.isfinite(grad).all()


@pytest.mark.parametrize("variant", ["majority", "all"])
def test_a_row_with_fewer_candidates_than_k_is_impossible(variant):
    # 3 valid candidates, all of the row's class, k = 4: no 4-subset exists, so the event has
    # no probability (it read P = 1 before: log 0 - log 0 in the log programme)
    obj = KNCAObjective(variant, 4, log_form=True, n_classes=2)
    valid = torch.tensor([[True, True, True, False, False, False]])
    neg = -torch.arange(6.0, dtype=torch.float64)[None].requires_grad_()
    log_p = obj.log_probabilities(neg, torch.tensor([[0, 0, 0, 1, 1, 1]]), torch.tensor([0]), valid)
    assert torch.isneginf(log_p).all()
    scores = obj.point_scores(neg, torch.tensor([[0, 0, 0, 1, 1, 1]]), torch.tensor([0]), valid)
    assert float(scores.detach().sum()) == 0.0
