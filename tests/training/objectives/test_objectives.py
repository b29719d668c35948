"""NCA objectives: gradients, closed forms, scikit-learn parity, chunking, candidate sets."""

from __future__ import annotations

import inspect
import math

import numpy as np
import pytest
import torch

from tests.training.problems import brute_force_p
from training import numerics
from training.objectives import nca_kernel
from training.objectives.nca import NCAObjective
from training.objectives.nca_kernel import nca_value_and_grad
from training.objectives.neighbourhood import nearest_candidates, objective_sum
from training.objectives.registry import make_objective


def problem(seed=0, n=24, D=5, d=3, n_classes=3, scale=0.5):
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, D))
    y = np.arange(n) % n_classes
    A = rng.normal(size=(d, D)) * scale
    return X, y, A


def value_and_grad(X, y, A, objective, **kw):
    Xt = torch.tensor(X, dtype=torch.float64)
    yt = torch.tensor(y)
    At = torch.tensor(A, dtype=torch.float64, requires_grad=True)
    value = objective_sum(Xt @ At.T, yt, objective, **kw)
    value.backward()
    return float(value.detach()), At.grad.numpy()


def closed_form_gradient(X, y, A, log_form):
    """Eq 5 (f) or eq 7 (g): 2A sum_i (...) with x_ij = x_i - x_j, in D x D outer products."""
    p_ij, p_i, same = brute_force_p(X, y, A)
    D = X.shape[1]
    total = np.zeros((D, D))
    for i in range(len(X)):
        x_ik = X[i] - X  # (N, D)
        all_term = (p_ij[i][:, None, None] * x_ik[:, :, None] * x_ik[:, None, :]).sum(0)
        same_term = ((p_ij[i] * same[i])[:, None, None] * x_ik[:, :, None] * x_ik[:, None, :]).sum(
            0
        )
        if log_form:
            total += all_term - same_term / p_i[i]
        else:
            total += p_i[i] * all_term - same_term
    return 2 * A @ total


METHODS = ["fused", "autograd"]


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("log_form", [False, True])
def test_gradcheck_float64(log_form, method):
    X, y, A = problem(n=12, D=4, d=2)
    Xt = torch.tensor(X)
    yt = torch.tensor(y)
    At = torch.tensor(A, requires_grad=True)
    objective = NCAObjective(log_form)
    assert torch.autograd.gradcheck(
        lambda a: objective_sum(Xt @ a.T, yt, objective, chunk_size=5, method=method),
        (At,),
        eps=1e-6,
        atol=1e-6,
    )


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("log_form", [False, True])
def test_value_and_gradient_equal_the_papers_closed_forms(log_form, method):
    X, y, A = problem(seed=1)
    value, grad = value_and_grad(X, y, A, NCAObjective(log_form), method=method)
    _, p_i, _ = brute_force_p(X, y, A)
    expected_value = np.log(p_i).sum() if log_form else p_i.sum()
    assert value == pytest.approx(expected_value, rel=1e-12)
    np.testing.assert_allclose(grad, closed_form_gradient(X, y, A, log_form), rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("method", METHODS)
def test_objective_and_gradient_equal_scikit_learn(method):
    from sklearn.neighbors import NeighborhoodComponentsAnalysis

    X, y, A = problem(seed=2, n=30, D=6, d=4)
    nca = NeighborhoodComponentsAnalysis(n_components=4)
    nca.n_iter_, nca.verbose = 1, 0
    same = y[:, None] == y[None, :]
    sk_loss, sk_grad = nca._loss_grad_lbfgs(A.ravel(), X, same, -1.0)
    value, grad = value_and_grad(X, y, A, NCAObjective(False), method=method)
    assert value == pytest.approx(-sk_loss, rel=1e-12)
    np.testing.assert_allclose(grad.ravel(), -sk_grad, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("objective", ["nca", "nca-log"])
def test_chunked_equals_unchunked(objective, method):
    X, y, A = problem(seed=3, n=37)
    obj = make_objective(objective)
    full_v, full_g = value_and_grad(X, y, A, obj, chunk_size=37, method=method)
    for chunk in (1, 5, 16):
        v, g = value_and_grad(X, y, A, obj, chunk_size=chunk, method=method)
        assert v == pytest.approx(full_v, rel=1e-12)
        np.testing.assert_allclose(g, full_g, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("log_form", [False, True])
def test_subset_of_rows_sums_their_scores_and_methods_agree(log_form):
    X, y, A = problem(seed=4)
    y[3] = 9  # a class of one: no same-class neighbour, scores 0
    _, p_i, _ = brute_force_p(X, y, A)
    rows = torch.tensor([7, 0, 3, 5, 11])
    v, g = value_and_grad(X, y, A, NCAObjective(log_form), rows=rows, method="fused", chunk_size=2)
    v2, g2 = value_and_grad(X, y, A, NCAObjective(log_form), rows=rows, method="autograd")
    keep = [7, 0, 5, 11]
    expected = np.log(p_i[keep]).sum() if log_form else p_i[keep].sum()
    assert v == pytest.approx(expected, rel=1e-12) and v2 == pytest.approx(expected, rel=1e-12)
    np.testing.assert_allclose(g, g2, rtol=1e-10, atol=1e-12)


def test_fused_kernel_is_finite_in_float32_for_far_apart_classes():
    # every same-class point is ~1e4 further than the nearest other-class point
    z = torch.tensor([[0.0], [100.0], [203.0], [300.0]], requires_grad=True)
    y = torch.tensor([0, 1, 0, 1])
    for log_form in (False, True):
        value = objective_sum(z, y, NCAObjective(log_form), method="fused")
        (grad,) = torch.autograd.grad(value, z)
        assert torch.isfinite(value) and torch.isfinite(grad).all()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("log_form", [False, True])
def test_fused_kernel_equals_autograd_when_rows_near_and_far_share_a_chunk(log_form, dtype):
    # rows whose nearest point is close (exp of the logits in range) and far (every exp
    # below float32's range without the row's own shift) in the same chunks of 5 rows:
    # squared nearest distances from ~0.1 to ~400
    rng = np.random.default_rng(3)
    z = rng.normal(size=(40, 3))
    z[::4] *= 12.0  # every fourth point far from the rest
    y = rng.integers(0, 3, size=40)
    zt = torch.tensor(z, dtype=dtype)
    yt = torch.tensor(y)
    results = []
    for method in ("fused", "autograd"):
        z_var = zt.clone().requires_grad_()
        value = objective_sum(z_var, yt, NCAObjective(log_form), method=method, chunk_size=5)
        (grad,) = torch.autograd.grad(value, z_var)
        results.append((float(value.detach()), grad.double().numpy()))
    nearest = ((z[:, None] - z[None]) ** 2).sum(-1) + np.diag(np.full(40, np.inf))
    assert nearest.min(1).max() > 30 > nearest.min(1).min()
    rtol = 1e-10 if dtype == torch.float64 else 2e-4
    assert results[0][0] == pytest.approx(results[1][0], rel=rtol)
    scale = np.abs(results[1][1]).max()
    np.testing.assert_allclose(results[0][1], results[1][1], rtol=rtol, atol=rtol * scale)


def subnormal(values: torch.Tensor) -> torch.Tensor:
    """Which float32 entries are subnormal (non-zero, below the smallest normal)."""
    return (values != 0) & (values.abs() < torch.finfo(torch.float32).tiny)


@pytest.mark.parametrize("log_form", [False, True])
def test_the_row_pass_leaves_no_subnormal_probability_in_float32(log_form):
    """Logits spread over 200 nats give exps below float32's normal range (a product over
    them ran 100x slower on an Intel Xeon): the row pass leaves none in U, on the block or
    off it, with the p_ij above TINY_P as they were and the rows' scores unchanged."""
    g = torch.Generator().manual_seed(4)
    logits = -200.0 * torch.rand(8, 300, generator=g)  # (8, 300) in (-200, 0]
    logits[:, 0] = 0.0  # each row's nearest: the rest reach exp(-200), far below 1e-38
    p = torch.softmax(logits.double(), 1)
    assert subnormal(p.float()).any()  # what the pass must clear
    u = logits.clone()
    value, r = nca_kernel._scores_and_row_scale(u, 0, 150, log_form, lambda far: logits[far])
    assert not subnormal(u).any() and not subnormal(u * r).any()
    p_block = p[:, :150].sum(1)  # (8,) p_i, float64
    expected = p_block.log().sum() if log_form else p_block.sum()
    assert float(value) == pytest.approx(float(expected), rel=1e-6)
    kept = p[:, 150:] >= numerics.TINY_P  # off the block U is p_ij
    torch.testing.assert_close(u[:, 150:][kept].double(), p[:, 150:][kept], rtol=1e-5, atol=0)
    assert (u[:, 150:][~kept] == 0).all()


@pytest.mark.parametrize("log_form", [False, True])
def test_a_row_whose_class_mass_is_tiny_keeps_its_score_and_block(log_form):
    """A row with one same-class p_ij of 2e-25 and 999 of 3.5e-31 (at or below TINY_P, which
    the row pass zeroes): p_i and the block's U agree with float64 to float32 precision. With
    the floor of the recomputation at 1e-25, where it stood before TINY_P, this row stayed on
    the row pass and lost 3e-3 of log p_i and of its block."""
    block = torch.full((1, 1000), math.log(3.5e-31), dtype=torch.float64)
    block[0, 0] = math.log(2e-25)
    others = torch.zeros((1, 1), dtype=torch.float64)  # one other-class point at the top
    logits = torch.cat([block, others], 1)  # (1, 1001): the block is columns [0, 1000)
    p = torch.softmax(logits, 1)
    p_i = p[:, :1000].sum(1)
    expected = float(p_i.log().sum() if log_form else p_i.sum())
    u = logits.float().contiguous()
    value, _ = nca_kernel._scores_and_row_scale(
        u, 0, 1000, log_form, lambda far: logits.float()[far]
    )
    assert float(value) == pytest.approx(expected, rel=1e-5)
    expected_block = (p_i - 1.0)[:, None] * p[:, :1000] / p_i[:, None]  # (p_i - 1) q_ij
    torch.testing.assert_close(u[:, :1000].double(), expected_block, rtol=1e-5, atol=0)


def test_zero_subnormal_keeps_nan_and_normal_values_and_leaves_float64_alone():
    values = torch.tensor([float("nan"), 1e-40, 3e-31, 5e-31, 0.25, float("inf")])
    out = numerics.zero_subnormal(values.clone())
    expected = torch.tensor([float("nan"), 0.0, 0.0, 5e-31, 0.25, float("inf")])
    torch.testing.assert_close(out, expected, equal_nan=True, rtol=0, atol=0)
    wide = values.double() * 1e-280  # float64 entries far below TINY_P: kept
    torch.testing.assert_close(numerics.zero_subnormal(wide.clone()), wide, equal_nan=True)


@pytest.mark.parametrize("log_form", [False, True])
def test_fused_candidate_kernel_equals_autograd(log_form):
    X, y, A = problem(seed=8, n=40, scale=1.0)
    y[5] = 7  # a class of one: its same-class block is all padding
    z = torch.tensor(X @ A.T)
    cand = nearest_candidates(z, torch.tensor(y), 4)
    obj = NCAObjective(log_form)
    for rows in (None, torch.tensor([5, 0, 9, 33, 12])):
        kw = dict(candidates=cand, rows=rows)
        v, g = value_and_grad(X, y, A, obj, method="fused", chunk_size=3, **kw)
        v2, g2 = value_and_grad(X, y, A, obj, method="autograd", **kw)
        assert v == pytest.approx(v2, rel=1e-12)
        np.testing.assert_allclose(g, g2, rtol=1e-10, atol=1e-12)


def test_fused_method_refuses_other_objectives():
    from training.objectives.nca import Objective

    z = torch.zeros(4, 2)
    y = torch.tensor([0, 0, 1, 1])
    with pytest.raises(ValueError, match="fused kernel computes NCA objectives only"):
        objective_sum(z, y, Objective(), method="fused")


def test_candidate_objective_approaches_exact_as_k_grows():
    X, y, A = problem(seed=5, n=60, D=6, d=3, scale=1.0)
    Xt, yt = torch.tensor(X), torch.tensor(y)
    At = torch.tensor(A)
    obj = NCAObjective(False)
    exact = float(objective_sum(Xt @ At.T, yt, obj))
    errors = []
    for k in (1, 4, 16, 59):
        cand = nearest_candidates(Xt @ At.T, yt, k)
        errors.append(abs(float(objective_sum(Xt @ At.T, yt, obj, candidates=cand)) - exact))
    assert errors[-1] < 1e-10
    assert errors[0] > errors[1] > errors[2] > errors[3]


def test_candidates_are_nearest_same_and_other_class_points():
    X, y, A = problem(seed=6, n=20)
    z = torch.tensor(X @ A.T)
    yt = torch.tensor(y)
    cand = nearest_candidates(z, yt, 3, chunk_size=7).numpy()
    d2 = ((X @ A.T)[:, None] - (X @ A.T)[None]) ** 2
    d2 = d2.sum(-1)
    for i in range(20):
        same = [j for j in np.argsort(d2[i]) if j != i and y[j] == y[i]][:3]
        other = [j for j in np.argsort(d2[i]) if y[j] != y[i]][:3]
        assert cand[i, :3].tolist() == same
        assert cand[i, 3:].tolist() == other


def test_candidates_pad_small_classes_with_minus_one():
    z = torch.tensor([[0.0], [1.0], [2.0], [3.0], [4.0]])
    y = torch.tensor([0, 0, 1, 1, 1])
    cand = nearest_candidates(z, y, 3)
    assert cand[0].tolist() == [1, -1, -1, 2, 3, 4]
    obj = NCAObjective(False)
    assert float(objective_sum(z, y, obj, candidates=cand)) == pytest.approx(
        float(objective_sum(z, y, obj)), rel=1e-6
    )


def test_point_without_same_class_neighbour_scores_zero_and_stays_finite():
    z = torch.tensor([[0.0, 0.0], [1.0, 0.0], [5.0, 5.0]], requires_grad=True)
    y = torch.tensor([0, 0, 1])
    for log_form in (False, True):
        value = objective_sum(z, y, NCAObjective(log_form))
        (grad,) = torch.autograd.grad(value, z)
        assert torch.isfinite(value) and torch.isfinite(grad).all()
    assert float(objective_sum(z.detach(), y, NCAObjective(False))) == pytest.approx(
        2 * 1.0, abs=1e-6
    )


def test_far_apart_points_do_not_underflow_in_log_form():
    # distances of 1e4: exp(-d) underflows in any linear-space implementation.
    z = torch.tensor([[0.0], [100.0], [203.0]], dtype=torch.float32, requires_grad=True)
    y = torch.tensor([0, 1, 0])
    value = objective_sum(z, y, NCAObjective(True))
    (grad,) = torch.autograd.grad(value, z)
    assert torch.isfinite(value) and torch.isfinite(grad).all()
    # log p_0 = -203^2 - log(exp(-100^2) + exp(-203^2)) = -(203^2 - 100^2); likewise
    # log p_2 = -(203^2 - 103^2); point 1 has no same-class neighbour and is left out.
    expected = -(203.0**2 - 100.0**2) - (203.0**2 - 103.0**2)
    assert float(value.detach()) == pytest.approx(expected, rel=1e-5)


def test_make_objective_validates_names_and_k():
    with pytest.raises(ValueError, match="objective must be one of"):
        make_objective("lmnn")
    with pytest.raises(ValueError, match="k must be 1"):
        make_objective("nca", k=3)


def test_candidates_of_chosen_rows_equal_those_rows_of_all_candidates():
    X, y, A = problem(seed=9, n=50)
    z, yt = torch.tensor(X @ A.T), torch.tensor(y)
    every = nearest_candidates(z, yt, 4, chunk_size=5)
    rows = torch.tensor([49, 3, 3, 17, 0, 28])  # any order, repeats allowed
    np.testing.assert_array_equal(
        nearest_candidates(z, yt, 4, rows=rows, chunk_size=2).numpy(), every[rows].numpy()
    )


def test_candidate_distance_backward_passes_gradcheck():
    from training.objectives.neighbourhood import CandidateNegSqDist

    rng = np.random.default_rng(11)
    z = torch.tensor(rng.normal(size=(9, 3)), requires_grad=True)
    rows = torch.tensor([4, 0, 7])
    # repeated candidates and rows that are each other's candidates
    cand = torch.tensor([[1, 1, 0, 8], [4, 2, 2, 7], [0, 4, 3, 1]])
    assert torch.autograd.gradcheck(lambda zz: CandidateNegSqDist.apply(zz, rows, cand), (z,))
    out = CandidateNegSqDist.apply(z, rows, cand)
    expected = -((z.detach()[rows][:, None] - z.detach()[cand]) ** 2).sum(-1)
    torch.testing.assert_close(out.detach(), expected)


def exact_data(n, d, n_classes, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(n, d, generator=g, dtype=dtype)
    labels = torch.arange(n) % n_classes
    return z, labels[torch.randperm(n, generator=g)]


def brute_force_score(z, labels, log_form, rows=None):
    """(sum over rows of p_i or log p_i, its gradient (N, d)) from an explicit N x N
    log-softmax (eqs 1-2) in float64, the gradient by autograd; a class of one scores 0."""
    z = z.detach().double().requires_grad_(True)
    d2 = ((z[:, None, :] - z[None, :, :]) ** 2).sum(-1)  # (N, N)
    eye = torch.eye(len(z), dtype=torch.bool)
    log_p_ij = torch.log_softmax(-d2.masked_fill(eye, float("inf")), 1)
    same = (labels[:, None] == labels[None, :]) & ~eye
    has_same = same.any(1)
    same[~has_same, 0] = True  # a stand-in so that no row's log-sum-exp is over nothing
    log_p = torch.logsumexp(log_p_ij.masked_fill(~same, float("-inf")), 1)  # (N,)
    scores = torch.where(has_same, log_p if log_form else log_p.exp(), 0.0)
    total = scores.sum() if rows is None else scores[rows].sum()
    total.backward()
    return float(total), z.grad


@pytest.mark.parametrize("log_form", [False, True])
@pytest.mark.parametrize(
    "n, d, n_classes, chunk",
    [(2, 1, 1, None), (37, 3, 4, 5), (203, 17, 5, None), (300, 32, 3, 64), (64, 40, 7, 1)],
)
def test_exact_path_equals_brute_force_at_any_chunk(n, d, n_classes, chunk, log_form):
    z, labels = exact_data(n, d, n_classes)
    value, grad = nca_value_and_grad(z, labels, log_form=log_form, chunk_size=chunk)
    expected, expected_grad = brute_force_score(z, labels, log_form)
    assert float(value) == pytest.approx(expected, rel=1e-12, abs=1e-12)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("tile", [1, 7, 64, 1000])
def test_the_gradient_products_over_column_tiles_equal_them_in_one_pass(tile):
    """add_gradient_products, tile by tile (the last tile short), against its formulas in
    one dense product: the chunk's rows get 2 r_i U_i z, every point 2 U^T (r z_q) and
    col_total U^T r, added to what the buffers held."""
    g = torch.Generator().manual_seed(3)
    n, b, d = 203, 11, 5
    units = torch.rand(b, n, generator=g, dtype=torch.float64)  # (B, N)
    row_scale = torch.randn(b, 1, generator=g, dtype=torch.float64)  # (B, 1)
    centred = torch.randn(n, d, generator=g, dtype=torch.float64)  # (N, d)
    q = torch.tensor([3, 4, 9, 20, 21, 22, 50, 51, 100, 150, 202])  # (B,)
    grad = torch.randn(n, d, generator=g, dtype=torch.float64)
    col_total = torch.randn(n, generator=g, dtype=torch.float64)
    expected_grad = grad + 2 * units.T @ (row_scale * centred[q])
    expected_grad[q] += 2 * row_scale * (units @ centred)
    expected_col = col_total + units.T @ row_scale[:, 0]
    nca_kernel.add_gradient_products(units, row_scale, centred, q, grad, col_total, tile)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(col_total, expected_col, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("tile", [0, -4096])
def test_the_gradient_products_refuse_a_tile_without_columns(tile):
    units, row_scale = torch.ones(2, 3), torch.ones(2, 1)
    grad, col_total = torch.zeros(3, 1), torch.zeros(3)
    with pytest.raises(ValueError, match=f"tile must be at least 1 column, got {tile}"):
        nca_kernel.add_gradient_products(
            units, row_scale, torch.ones(3, 1), torch.tensor([0, 1]), grad, col_total, tile
        )


@pytest.mark.parametrize("tile", [5, 64])
def test_the_exact_path_over_small_column_tiles_equals_brute_force(tile, monkeypatch):
    """The whole exact path with the products over tiles of a few columns (the default tile
    is wider than these problems) against the float64 brute force."""
    monkeypatch.setattr(nca_kernel, "PRODUCT_TILE", tile)
    z, labels = exact_data(203, 17, 5)
    _, grad = nca_value_and_grad(z, labels, log_form=False, chunk_size=16)
    _, expected_grad = brute_force_score(z, labels, False)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("log_form", [False, True])
def test_a_forward_pass_gives_the_value_of_a_pass_with_its_gradient_bit_for_bit(
    log_form, monkeypatch
):
    # the value alone (z built under no_grad: the finish's start scale, an objective at a
    # map) skips the gradient's products; the value it returns must be the same float, or the
    # start scale a fit picks would move with whether a pass asked for the gradient
    z, labels = exact_data(400, 12, 5, seed=3)
    z = z.float()
    rows = torch.arange(0, 400, 3)
    value, grad = nca_value_and_grad(z, labels, log_form=log_form, rows=rows, chunk_size=16)
    alone, no_grad = nca_value_and_grad(
        z, labels, log_form=log_form, rows=rows, chunk_size=16, with_grad=False
    )
    assert no_grad is None and grad is not None
    assert torch.equal(alone, value)
    # through the autograd function, as Problem.loss calls it: which pass ran is recorded
    torch_path = nca_kernel._torch_value_and_grad
    passes = []

    def recorded(*args, **kwargs):
        bound = inspect.signature(torch_path).bind(*args, **kwargs)
        passes.append(bound.arguments["with_grad"])
        return torch_path(*args, **kwargs)

    monkeypatch.setattr(nca_kernel, "_torch_value_and_grad", recorded)
    objective = NCAObjective(log_form)
    with torch.no_grad():
        forward = objective_sum(z, labels, objective, rows=rows, chunk_size=16)
    z_grad = z.clone().requires_grad_()
    with_graph = objective_sum(z_grad, labels, objective, rows=rows, chunk_size=16)
    with_graph.backward()
    assert passes == [False, True]
    assert torch.equal(forward, with_graph.detach())
    expected, expected_grad = brute_force_score(z.double(), labels, log_form, rows)
    assert float(forward) == pytest.approx(expected, rel=1e-5)
    torch.testing.assert_close(z_grad.grad.double(), expected_grad, rtol=1e-3, atol=1e-4)


def test_exact_path_scores_singletons_zero_and_counts_a_row_listed_twice_twice():
    z, labels = exact_data(150, 6, 4, seed=2)
    labels[[3, 70]] = torch.tensor([9, 10])  # two classes of one point each
    rows = torch.tensor([3, 0, 149, 70, 12, 13, 88])
    for log_form in (False, True):
        value, grad = nca_value_and_grad(z, labels, log_form=log_form, rows=rows)
        expected, expected_grad = brute_force_score(z, labels, log_form, rows)
        assert float(value) == pytest.approx(expected, rel=1e-12)
        torch.testing.assert_close(grad, expected_grad, rtol=1e-10, atol=1e-12)
    twice, grad = nca_value_and_grad(z, labels, log_form=False, rows=torch.tensor([5, 5, 7]))
    once, grad_once = nca_value_and_grad(z, labels, log_form=False, rows=torch.tensor([5, 7]))
    alone, grad_alone = nca_value_and_grad(z, labels, log_form=False, rows=torch.tensor([5]))
    torch.testing.assert_close(twice, once + alone, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, grad_once + grad_alone, rtol=1e-10, atol=1e-12)


def test_exact_path_in_float32_agrees_with_float64():
    z, labels = exact_data(500, 32, 10, seed=4)
    for log_form in (False, True):
        v64, g64 = nca_value_and_grad(z, labels, log_form=log_form)
        v32, g32 = nca_value_and_grad(z.float(), labels, log_form=log_form)
        assert float(v32) == pytest.approx(float(v64), rel=1e-5)
        assert float((g32.double() - g64).norm() / g64.norm()) < 1e-5


def test_exact_path_in_float32_keeps_its_precision_on_real_digits(usps):
    """USPS (7,291 x 256, standardised) under its top 32 principal axes at a tenth of their
    scale: the float32 gradient's worst entry within 5e-6 of the largest, against float64.
    Taken about the origin the column terms W^T z_q and colsum(W)_j z_j cancel and the worst
    entry is off by 1.5e-5 (g) and 2.1e-5 (f); about each class's mean, 1.1e-6 and 1.0e-6."""
    X = torch.as_tensor(usps[0], dtype=torch.float64)
    X = (X - X.mean(0)) / (X.std(0) + 1e-3)
    axes = torch.linalg.eigh(X.T @ X).eigenvectors[:, -32:]  # (256, 32)
    z = (X @ axes * 0.1).float()
    labels = torch.as_tensor(usps[1], dtype=torch.int64)
    for log_form in (False, True):
        _, g64 = nca_value_and_grad(z.double(), labels, log_form=log_form)
        _, g32 = nca_value_and_grad(z, labels, log_form=log_form)
        assert float((g32.double() - g64).abs().max() / g64.abs().max()) < 5e-6


def test_exact_log_score_stays_exact_far_beyond_exps_range():
    """Three tight clusters ~32 apart, each one point of class 0 and one of class 1: every
    point's same-class neighbours are ~1,000 (squared distance) beyond its nearest point, so
    p_i ~ exp(-1000) underflows while log p_i must not (the same-class block's own max)."""
    g = torch.Generator().manual_seed(5)
    centres = torch.tensor([[0.0, 0.0], [0.0, 32.0], [32.0, 0.0]], dtype=torch.float64)
    z = centres.repeat_interleave(2, 0) + 0.1 * torch.randn(6, 2, generator=g, dtype=torch.float64)
    labels = torch.tensor([0, 1, 0, 1, 0, 1])
    value, grad = nca_value_and_grad(z, labels, log_form=True)
    assert torch.isfinite(value) and torch.isfinite(grad).all()
    assert float(value) < -6 * 900  # every p_i below exp(-900), and still exact:
    expected, expected_grad = brute_force_score(z, labels, True)
    assert float(value) == pytest.approx(expected, rel=1e-12)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-9, atol=1e-9)
    f_value, _ = nca_value_and_grad(z, labels, log_form=False)
    assert float(f_value) == 0.0  # f underflows to 0


@pytest.mark.parametrize("log_form", [False, True])
def test_a_non_finite_embedding_reaches_the_value_or_gradient(log_form):
    """The exact path does not hide a NaN in z as a row that scores 0: the fit's finite check
    (training.optim.lbfgs.ProblemLoss) must see it."""
    g = torch.Generator().manual_seed(0)
    z = torch.randn(20, 3, generator=g, dtype=torch.float64)
    labels = torch.tensor([0, 1] * 10)
    z[4, 0] = float("nan")
    value, grad = nca_value_and_grad(z, labels, log_form=log_form, chunk_size=4, flex=False)
    assert not (torch.isfinite(value) and torch.isfinite(grad).all())


def floor_straddling_points():
    """Points in 2-D clusters on a circle of radius 30, each a class-0 point at its centre, a
    class-1 point 0.1 away and a class-0 point sqrt(D) away. The centre's p_i is about
    exp(-D) (D from 2 to 120): above the row pass's floor (P_FLOOR, about exp(-41.4)) for
    D <= 30; below it but within float32's normal range (exp(-87)) for D = 50, 70 and 80; below
    that range for 100 and 120. The class-1 points' same-class neighbours are a cluster away
    (p_i about exp(-400) or less: 0 in float32). Small norms keep float32 logits exact to
    about 1e-4."""
    gaps = torch.tensor([2.0, 30.0, 50.0, 70.0, 80.0, 100.0, 120.0], dtype=torch.float64)
    angles = torch.arange(len(gaps), dtype=torch.float64) * (2 * torch.pi / len(gaps))
    centres = 30.0 * torch.stack([angles.cos(), angles.sin()], 1)  # (7, 2)
    offsets = torch.stack([torch.zeros_like(gaps), torch.full_like(gaps, 0.1), gaps.sqrt()], 1)
    x = centres[:, None, :] + offsets[:, :, None] * torch.tensor([0.0, 1.0], dtype=torch.float64)
    labels = torch.tensor([0, 1, 0]).repeat(len(gaps))
    return x.reshape(-1, 2), labels


def all_points_as_candidates(labels: torch.Tensor) -> torch.Tensor:
    """(N, 2 W) candidate table in which every other point is a candidate: the same class in
    the first half, the others in the second, -1 padding (the candidate path then computes
    the exact objective)."""
    n = len(labels)
    same = [torch.nonzero((labels == labels[i]) & (torch.arange(n) != i))[:, 0] for i in range(n)]
    other = [torch.nonzero(labels != labels[i])[:, 0] for i in range(n)]
    width = max(max(len(s) for s in same), max(len(o) for o in other))
    candidates = torch.full((n, 2 * width), -1, dtype=torch.int64)
    for i in range(n):
        candidates[i, : len(same[i])] = same[i]
        candidates[i, width : width + len(other[i])] = other[i]
    return candidates


@pytest.mark.parametrize("dtype, rtol", [(torch.float64, 1e-10), (torch.float32, 2e-3)])
@pytest.mark.parametrize("log_form", [False, True])
def test_rows_on_both_sides_of_the_row_pass_floor_match_brute_force(
    log_form, dtype, rtol, monkeypatch
):
    """Rows whose same-class mass falls below the row pass's floor, and only those, are
    recomputed (nca_kernel._far_rows); both paths, one chunk holding rows either side of it,
    match a float64 brute force, value and gradient (the float32 cases fail without the
    recomputation: p_i = 0 makes the block's factor NaN)."""
    z64, labels = floor_straddling_points()
    z = z64.to(dtype)
    _, p_i, _ = brute_force_p(z64.numpy(), labels.numpy(), np.eye(2))  # float64, eqs 1-2
    below = int((p_i < nca_kernel.P_FLOOR).sum())
    assert below >= 9 and len(z) - below >= 9
    expected, expected_grad = brute_force_score(z, labels, log_form)
    recomputed = []
    far_rows = nca_kernel._far_rows

    def recording(logits, *args):
        recomputed.append(logits.shape[0])
        return far_rows(logits, *args)

    monkeypatch.setattr(nca_kernel, "_far_rows", recording)
    n = len(z)
    results = [
        nca_value_and_grad(z, labels, log_form=log_form, chunk_size=n, flex=False, native=False),
        nca_kernel.nca_value_and_grad_candidates(
            z,
            labels,
            all_points_as_candidates(labels),
            log_form=log_form,
            chunk_size=n,
            native=False,
        ),
    ]
    assert sum(recomputed) == 2 * below  # each path recomputed exactly the rows below
    if dtype == torch.float32:  # the C row pass: those rows and any whose nearest is far
        recomputed.clear()
        results.append(nca_value_and_grad(z, labels, log_form=log_form, chunk_size=n))
        assert sum(recomputed) >= below
    for value, grad in results:
        assert float(value) == pytest.approx(expected, rel=rtol, abs=rtol)
        scale = float(expected_grad.abs().max())
        torch.testing.assert_close(grad.double(), expected_grad, rtol=rtol, atol=rtol * scale)


@pytest.mark.parametrize("log_form", [False, True])
def test_the_recomputed_rows_equal_the_block_sum_in_float64(log_form, monkeypatch):
    """In float64 the block's sum is exact far below the floor (exp(-120) is a normal
    double), so the recomputed rows must give what the sum gives with no floor at all: the
    row pass's score, r and U row by row, and the candidate path's value and gradient with
    log-weights (which the recomputation must add again)."""
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(6, 10, generator=g, dtype=torch.float64)
    logits[::2, :4] -= 90.0  # every other row's block (columns 0-3) about exp(-90) of its mass
    logits[1, 7] = float("-inf")
    floor = nca_kernel.P_FLOOR
    outputs = {}
    for used in (floor, 0.0):
        monkeypatch.setattr(nca_kernel, "P_FLOOR", used)
        u = logits.clone()
        value, r = nca_kernel._scores_and_row_scale(u, 0, 4, log_form, lambda far: logits[far])
        outputs[used] = (float(value), r, u)
    (v1, r1, u1), (v0, r0, u0) = outputs[floor], outputs[0.0]
    assert v1 == pytest.approx(v0, rel=1e-12)
    torch.testing.assert_close(r1, r0, rtol=1e-12, atol=0)
    torch.testing.assert_close(u1, u0, rtol=1e-10, atol=1e-300)

    z64, labels = floor_straddling_points()
    candidates = all_points_as_candidates(labels)
    paths = {}
    for used in (floor, 0.0):
        monkeypatch.setattr(nca_kernel, "P_FLOOR", used)
        paths[used] = nca_kernel.nca_value_and_grad_candidates(
            z64, labels, candidates, log_form=log_form, native=False
        )
    assert float(paths[floor][0]) == pytest.approx(float(paths[0.0][0]), rel=1e-12)
    torch.testing.assert_close(paths[floor][1], paths[0.0][1], rtol=1e-10, atol=1e-12)


def test_the_row_pass_refuses_logits_it_cannot_write_in_place():
    rows = torch.zeros(4, 6)[:, ::2]  # (4, 3), not contiguous
    with pytest.raises(ValueError, match=r"shape \(4, 3\) must be contiguous"):
        nca_kernel._scores_and_row_scale(rows, 0, 1, False, recompute=None)
