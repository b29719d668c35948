"""NCA on candidate sets in C (training/objectives/native_candidates.py,
training/objectives/kernels/nca_candidates.c).

Its values against a brute-force numpy softmax over each row's candidates, its values and
gradients against the torch path (absent candidates, row subsets, kept row tables, thread
splits, float32 and float64), its gradient against central finite
differences, and the cases in which the torch path must answer instead.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from training.objectives import native_candidates
from training.objectives.nca_kernel import nca_value_and_grad_candidates
from training.objectives.neighbourhood import RowTable, nearest_candidates


@pytest.fixture(scope="module", autouse=True)
def built_at_install():
    # the project's install builds the kernels (setup.py): a library missing fails, never skips
    assert native_candidates._load(torch.float64) is not None
    assert native_candidates._load(torch.float32) is not None


def problem(n=120, d=5, n_classes=4, k=6, seed=0, dtype=torch.float64, scale=1.0):
    """Embeddings (N, d), labels (N,) and each point's k nearest same-class and other-class
    candidates (N, 2k), with a few candidates knocked out (-1) and one row with no
    same-class candidate at all."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(n, d, generator=g, dtype=dtype) * scale
    labels = torch.randint(0, n_classes, (n,), generator=g)
    candidates = nearest_candidates(z, labels, k).clone()
    candidates[::5, 1] = -1
    candidates[::7, k + 2] = -1
    candidates[3, :k] = -1  # row 3 has no same-class candidate: it scores 0
    return z, labels, candidates


def brute_force(z, candidates, log_form, rows=None):
    """sum over rows of p_i (or log p_i), p_i the softmax mass of the same-class half of the
    row's candidates, from explicit float64 numpy; a row with no same-class candidate
    scores 0."""
    z = z.double().numpy()
    cand = candidates.numpy()
    k = cand.shape[1] // 2
    total = 0.0
    for i in range(len(z)) if rows is None else rows.tolist():
        present = cand[i] >= 0
        if not present[:k].any():
            continue
        logits = -((z[cand[i]] - z[i]) ** 2).sum(1)
        logits = np.where(present, logits, -np.inf)
        top = logits.max()
        e = np.exp(logits - top)
        p = e[:k].sum() / e.sum()
        total += np.log(p) if log_form else p
    return total


@pytest.mark.parametrize("log_form", [False, True])
def test_values_equal_brute_force_and_gradients_equal_the_torch_path(log_form):
    z, labels, candidates = problem()
    kwargs = dict(log_form=log_form)
    value, grad = nca_value_and_grad_candidates(z, labels, candidates, native=True, **kwargs)
    ref, ref_grad = nca_value_and_grad_candidates(z, labels, candidates, native=False, **kwargs)
    assert float(value) == pytest.approx(brute_force(z, candidates, log_form), rel=1e-10, abs=1e-10)
    torch.testing.assert_close(value, ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("log_form", [False, True])
def test_gradient_matches_central_differences(log_form):
    z, labels, candidates = problem(n=40, d=3, k=4, seed=2)
    _, grad = nca_value_and_grad_candidates(z, labels, candidates, log_form=log_form, native=True)
    eps = 1e-6
    for i, c in [(0, 0), (7, 2), (19, 1), (39, 0)]:
        plus, minus = z.clone(), z.clone()
        plus[i, c] += eps
        minus[i, c] -= eps
        f_plus, _ = nca_value_and_grad_candidates(
            plus, labels, candidates, log_form=log_form, native=True
        )
        f_minus, _ = nca_value_and_grad_candidates(
            minus, labels, candidates, log_form=log_form, native=True
        )
        numeric = float(f_plus - f_minus) / (2 * eps)
        assert float(grad[i, c]) == pytest.approx(numeric, rel=1e-6, abs=1e-8)


@pytest.mark.parametrize("log_form", [False, True])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_a_row_without_any_candidate_scores_0_and_moves_nothing(log_form, dtype):
    """Row 3 has no same-class candidate and row 11 no candidate at all (every logit -inf):
    both score 0 and add no gradient, in the kernel and the torch path alike, and no NaN
    from their empty softmaxes reaches the others' values or gradients."""
    z, labels, candidates = problem(n=40, d=3, k=4, seed=9, dtype=dtype)
    candidates[11] = -1
    value, grad = nca_value_and_grad_candidates(
        z, labels, candidates, log_form=log_form, native=True
    )
    ref, ref_grad = nca_value_and_grad_candidates(
        z, labels, candidates, log_form=log_form, native=False
    )
    assert torch.isfinite(ref_grad).all() and torch.isfinite(ref)
    tol = 1e-10 if dtype == torch.float64 else 1e-4
    assert float(ref) == pytest.approx(brute_force(z, candidates, log_form), rel=tol, abs=tol)
    torch.testing.assert_close(value, ref, rtol=tol, atol=tol)
    torch.testing.assert_close(grad, ref_grad, rtol=tol, atol=tol)
    # the two rows add nothing: the sum over the other rows is the same value and gradient
    others = torch.tensor([i for i in range(40) if i not in (3, 11)])
    for native in (True, False):
        part, part_grad = nca_value_and_grad_candidates(
            z, labels, candidates, log_form=log_form, rows=others, native=native
        )
        torch.testing.assert_close(part, ref, rtol=tol, atol=tol)
        torch.testing.assert_close(part_grad, ref_grad, rtol=tol, atol=tol)


def test_query_rows_and_a_row_table_give_the_torch_paths_answer():
    z, labels, candidates = problem(n=200, seed=3)
    rows = torch.tensor([5, 17, 17, 3, 150, 199])  # a repeated row counts twice
    for table in (candidates, RowTable(candidates[rows.unique()], rows.unique(), 200)):
        value, grad = nca_value_and_grad_candidates(
            z, labels, table, log_form=False, rows=rows, native=True
        )
        ref, ref_grad = nca_value_and_grad_candidates(
            z, labels, table, log_form=False, rows=rows, native=False
        )
        assert float(value) == pytest.approx(brute_force(z, candidates, False, rows=rows))
        torch.testing.assert_close(value, ref, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(grad, ref_grad, rtol=1e-9, atol=1e-11)


def test_thread_splits_give_the_same_answer():
    z, _, candidates = problem(n=5000, d=8, k=8, seed=4)
    rows = torch.arange(5000)
    one = native_candidates.value_and_grad(z, rows, candidates, k_same=8, log_form=True, threads=1)
    two = native_candidates.value_and_grad(z, rows, candidates, k_same=8, log_form=True, threads=2)
    torch.testing.assert_close(one[0], two[0], rtol=1e-12, atol=1e-9)
    torch.testing.assert_close(one[1], two[1], rtol=1e-12, atol=1e-12)


def test_float32_agrees_with_float64():
    z, labels, candidates = problem(n=300, seed=6)
    value64, grad64 = nca_value_and_grad_candidates(
        z, labels, candidates, log_form=False, native=True
    )
    value32, grad32 = nca_value_and_grad_candidates(
        z.float(), labels, candidates, log_form=False, native=True
    )
    assert float(value32) == pytest.approx(float(value64), rel=1e-5)
    torch.testing.assert_close(grad32.double(), grad64, rtol=1e-4, atol=1e-5)


def test_far_apart_points_stay_finite_in_both_forms():
    """Every same-class candidate beyond exp's range of the nearest other-class one: log p_i
    is exact, not -inf, as in the torch path."""
    z, labels, candidates = problem(n=60, d=2, k=3, seed=7, scale=40.0)
    for log_form in (False, True):
        value, grad = nca_value_and_grad_candidates(
            z, labels, candidates, log_form=log_form, native=True
        )
        ref, ref_grad = nca_value_and_grad_candidates(
            z, labels, candidates, log_form=log_form, native=False
        )
        assert torch.isfinite(value) and torch.isfinite(grad).all()
        torch.testing.assert_close(value, ref, rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(grad, ref_grad, rtol=1e-8, atol=1e-9)


def test_the_torch_path_answers_where_the_kernel_must_not_run(monkeypatch):
    z, _, candidates = problem()
    assert native_candidates.usable(z, candidates.shape[1])
    too_many = native_candidates._load(z.dtype)[1] + 1
    assert not native_candidates.usable(z, too_many)
    assert not native_candidates.usable(z.to(torch.float16), candidates.shape[1])
    bad = z.clone()
    bad[0, 0] = float("nan")
    assert not native_candidates.usable(bad, candidates.shape[1])
    monkeypatch.setenv("NCA_KNN_NATIVE", "0")
    assert not native_candidates.usable(z, candidates.shape[1])
