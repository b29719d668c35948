"""Exact NCA's row pass in C (training/objectives/native_rows.py,
training/objectives/kernels/nca_exact_rows.c).

The pass itself against numpy in float64 (the exps, the cut below exp(-70), the own column,
the sums, a row with no finite logit), every level built for this CPU and every thread split
giving the same floats; the exact objective through it against the float64 brute force, the
torch path and central differences, far rows (a class beyond exp's range) in both forms, and
the cases in which the torch path must answer instead.
"""

from __future__ import annotations

import platform

import numpy as np
import pytest
import torch

from training.objectives import native, native_rows, nca_kernel
from training.objectives.nca_kernel import nca_value_and_grad

from .test_objectives import brute_force_score, exact_data

EXP_CUT = -69.9996


@pytest.fixture(scope="module", autouse=True)
def built_at_install():
    # the project's install builds the kernels (setup.py): a library missing fails, never skips
    assert native_rows._load() is not None


def pass_inputs(b=40, n=300, d=6, seed=0, scale=1.0):
    """(dots (b, n) float32 z_i.z_j, sq (n,), own (b,), z (n, d)) for the first b points."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(n, d, generator=g) * scale
    own = torch.arange(b) * 3 % n
    dots = (z[own] @ z.T).contiguous()
    return dots, (z * z).sum(1), own, z


def numpy_pass(dots, sq, own, s, e):
    """The row pass in float64 from the same float32 dot products: (exps (b, n), their
    row sums, their block sums, each exp's tolerance). In float32 the argument
    2 z_i.z_j - ||z_j||^2 - ||z_i||^2 of exp is rounded at each of its two steps, by up to
    half an ulp of the larger of its terms, which moves exp by that relative amount; exp
    itself adds an ulp or two."""
    twice, norms = 2.0 * dots.double().numpy(), sq.double().numpy()[None, :]
    shift = sq.double().numpy()[own.numpy()][:, None]  # ||z_i||^2 (b, 1)
    shifted = twice - norms - shift
    shifted[np.arange(len(own)), own.numpy()] = -np.inf
    exps = np.where(shifted < EXP_CUT, 0.0, np.exp(shifted))
    scale = np.abs(twice) + norms + shift
    return exps, exps.sum(1), exps[:, s:e].sum(1), exps * (scale + 4.0) * 2.0**-23


@pytest.mark.parametrize("scale", [0.3, 1.0, 4.0])
def test_the_pass_gives_the_exps_and_their_sums(scale):
    dots, sq, own, _ = pass_inputs(scale=scale)
    expected, row_sum, block_sum, tolerance = numpy_pass(dots, sq, own, 50, 170)
    got = dots.clone()
    s_all, s_block = native_rows.exp_rows(got, sq, own, (50, 170))
    assert got[torch.arange(len(own)), own].eq(0).all()  # e_ii = 0
    assert (np.abs(got.double().numpy() - expected) <= tolerance).all()
    # rows whose nearest point lies beyond squared distance 20 get NaN sums, and only those
    far = expected.max(1) < np.exp(-20.0)
    assert np.array_equal(np.isnan(s_all.numpy()), far)
    assert np.array_equal(np.isnan(s_block.numpy()), far)
    assert far.any() == (scale == 4.0)  # at this scale some rows are that far
    # the sums: within the exps' own tolerances, plus float32's additions
    near = ~far
    sum_tolerance = tolerance.sum(1) + 1e-6 * row_sum
    assert (np.abs(s_all.numpy() - row_sum) <= sum_tolerance)[near].all()
    block_tolerance = tolerance[:, 50:170].sum(1) + 1e-6 * block_sum
    assert (np.abs(s_block.numpy() - block_sum) <= block_tolerance)[near].all()
    # every exp kept is at least exp(EXP_CUT): no subnormal float reaches the products
    kept = got[got > 0]
    assert float(kept.min()) >= np.exp(EXP_CUT) * 0.999
    assert (got <= 1.0 + 1e-5).all()  # exp(-||z_i - z_j||^2), rounding aside


def test_a_row_with_no_finite_logit_gets_nan_sums_and_the_others_are_untouched():
    dots, sq, own, _ = pass_inputs(b=4)
    dots[2] = float("inf")
    reference = dots.clone()
    s_all, s_block = native_rows.exp_rows(dots, sq, own, (0, 100))
    assert torch.isnan(s_all[2]) and torch.isnan(s_block[2])
    assert torch.isfinite(s_all[[0, 1, 3]]).all()
    fine, _, _, tolerance = numpy_pass(reference[[0, 1, 3]], sq, own[[0, 1, 3]], 0, 100)
    assert (np.abs(dots[[0, 1, 3]].double().numpy() - fine) <= tolerance).all()


def test_thread_splits_give_the_same_floats(monkeypatch):
    dots, sq, own, _ = pass_inputs(b=64, n=1000)
    results = []
    for threads in (1, 2, 3):
        monkeypatch.setattr(torch, "get_num_threads", lambda threads=threads: threads)
        got = dots.clone()
        sums = native_rows.exp_rows(got, sq, own, (100, 400))
        results.append((got, *sums))
    for other in results[1:]:
        for a, b in zip(results[0], other, strict=True):
            assert torch.equal(a, b)


def test_every_level_built_for_this_cpu_computes_the_same_floats(monkeypatch):
    """The same vector operations in the same order at every width (16, 8, 4 lanes): the
    levels with FMA (AVX-512, AVX2) give the same floats, bit for bit, and the baseline (a
    CPU without AVX, exp's multiply-adds unfused) the same within an ulp or two. Only the
    levels this CPU runs are compared: on an AVX2 machine the FMA pair is one level, and
    elsewhere than x86-64 there is one level and nothing to compare."""
    levels = native.levels.levels_for(platform.machine())
    runnable = [name for name, _flags, needs in levels if set(needs) <= native.cpu_flags()]
    dots, sq, own, _ = pass_inputs(b=16, n=1003, scale=2.0)  # 1003: a tail past the lanes
    results = []
    for level in runnable:
        needs = next(needs for name, _f, needs in levels if name == level)
        monkeypatch.setattr(native, "cpu_flags", lambda needs=needs: frozenset(needs))
        native.load_library.cache_clear()
        native_rows._load.cache_clear()
        try:
            assert native.library_file("nca_exact_rows_f32")[0] == level
            got = dots.clone()
            results.append((got, *native_rows.exp_rows(got, sq, own, (7, 300))))
        finally:
            native.load_library.cache_clear()
            native_rows._load.cache_clear()
    assert len(results) == len(runnable)
    fused = [result for level, result in zip(runnable, results, strict=True) if level != "x86_64"]
    for other in fused[1:]:
        for a, b in zip(fused[0], other, strict=True):
            assert torch.equal(a, b)
    for other in results[1:]:
        for a, b in zip(results[0], other, strict=True):
            torch.testing.assert_close(a, b, rtol=5e-7, atol=0.0)


@pytest.mark.parametrize("log_form", [False, True])
@pytest.mark.parametrize("chunk", [None, 7])
def test_the_objective_through_it_equals_the_brute_force_and_the_torch_path(log_form, chunk):
    z, labels = exact_data(260, 9, 4, seed=5)
    rows = torch.arange(0, 260, 2)
    expected, expected_grad = brute_force_score(z, labels, log_form, rows)
    z32 = z.float()
    value, grad = nca_value_and_grad(
        z32, labels, log_form=log_form, rows=rows, chunk_size=chunk, native=True
    )
    by_torch, grad_by_torch = nca_value_and_grad(
        z32, labels, log_form=log_form, rows=rows, chunk_size=chunk, native=False
    )
    assert float(value) == pytest.approx(expected, rel=1e-6)
    torch.testing.assert_close(grad.double(), expected_grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(value, by_torch, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad, grad_by_torch, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("log_form", [False, True])
def test_its_gradient_matches_central_differences(log_form):
    """In float32 through the row pass, against differences of the float64 objective."""
    z, labels = exact_data(60, 3, 3, seed=8)
    _, grad = nca_value_and_grad(z.float(), labels, log_form=log_form, native=True)
    step = 1e-6
    for i, k in [(0, 0), (17, 2), (59, 1)]:
        plus, minus = z.clone(), z.clone()
        plus[i, k] += step
        minus[i, k] -= step
        f_plus, _ = nca_value_and_grad(plus, labels, log_form=log_form)
        f_minus, _ = nca_value_and_grad(minus, labels, log_form=log_form)
        numeric = float(f_plus - f_minus) / (2 * step)
        assert float(grad[i, k]) == pytest.approx(numeric, rel=1e-3, abs=1e-4)


@pytest.mark.parametrize("log_form", [False, True])
def test_a_class_far_beyond_exps_range_stays_exact(log_form):
    """Class 2 lies 30 units from the rest at this scale: its rows' same-class exps are
    ordinary, but a row of class 0 placed among class 2 has p_i far below float range; those
    rows are taken again from their logits (_far_rows), g stays finite and equals float64."""
    g = torch.Generator().manual_seed(3)
    z = torch.randn(90, 2, generator=g, dtype=torch.float64)
    labels = torch.arange(90) % 3
    z[labels == 2] += 30.0
    z[0] += 30.0  # a class-0 point inside class 2: its own class is ~30 units away
    expected, expected_grad = nca_value_and_grad(z, labels, log_form=log_form)
    value, grad = nca_value_and_grad(z.float(), labels, log_form=log_form, native=True)
    assert torch.isfinite(value) and torch.isfinite(grad).all()
    assert float(value) == pytest.approx(float(expected), rel=1e-5, abs=1e-5)
    torch.testing.assert_close(grad.double(), expected_grad, rtol=1e-3, atol=1e-4)


def test_the_torch_path_answers_where_the_pass_must_not_run(monkeypatch):
    monkeypatch.delenv("NCA_KNN_NATIVE", raising=False)
    z = torch.randn(30, 3)
    assert native_rows.usable(z)
    assert not native_rows.usable(z.double())  # float32 only
    assert not native_rows.usable(torch.empty(0, 3))
    bad = z.clone()
    bad[4, 1] = float("nan")
    assert not native_rows.usable(bad)  # a NaN dot product would become e_ij = 0
    monkeypatch.setenv("NCA_KNN_NATIVE", "0")
    assert not native_rows.usable(z)
    with pytest.raises(ValueError, match="contiguous 2-D float32"):
        native_rows.exp_rows(torch.ones(4, 6).T, torch.ones(4), torch.zeros(6), (0, 2))


@pytest.mark.parametrize("log_form", [False, True])
@pytest.mark.parametrize("crowd", [1, 4000])
def test_a_row_far_from_its_class_keeps_its_same_class_mass(log_form, crowd):
    """Row 0's nearest point (squared distance 19.9) is of another class, its own class
    lies at 60.9 and beyond 70: through the C pass the exps beyond 70 are cut absolutely,
    below e^-50 of the row's sum, which would thin p_i by up to a third (a hostile review
    found value and gradient 20-30% off); such a row is recomputed, and matches float64."""
    z = torch.tensor(
        [[0.0], [19.9**0.5], [-(60.9**0.5)]] + [[-(70.01**0.5)]] * crowd, dtype=torch.float64
    )
    labels = torch.tensor([0, 1, 0] + [0] * crowd)
    rows = torch.tensor([0])
    expected, expected_grad = nca_value_and_grad(z, labels, log_form=log_form, rows=rows)
    value, grad = nca_value_and_grad(z.float(), labels, log_form=log_form, rows=rows, native=True)
    assert float(value) == pytest.approx(float(expected), rel=2e-5)
    scale = float(expected_grad.abs().max())
    torch.testing.assert_close(grad.double(), expected_grad, rtol=1e-4, atol=1e-4 * scale)


def test_an_argument_beyond_exps_range_flags_the_row():
    """2 z_i.z_j - ||z_j||^2 - ||z_i||^2 is at most 0 but for rounding, which at ||z|| of
    thousands can pass 88, where 2^n wraps: the row's sums are NaN (recomputed), never the
    finite garbage of a wrapped exponent."""
    dots = torch.zeros(3, 20)
    dots[1, 1] = 177.0 / 2  # an argument of 177
    dots[2, 3] = 89.5 / 2
    s_all, s_block = native_rows.exp_rows(dots, torch.zeros(20), torch.tensor([0, 0, 0]), (0, 5))
    assert torch.isfinite(s_all[0]) and torch.isnan(s_all[1:]).all()
    assert torch.isnan(s_block[1:]).all()


def test_forcing_the_pass_on_embeddings_it_must_not_take_is_refused():
    z, labels = exact_data(40, 3, 2, seed=1)
    bad = z.float()
    bad[3, 0] = float("inf")
    with pytest.raises(ValueError, match="native=True needs finite float32"):
        nca_value_and_grad(bad, labels, log_form=False, native=True)
    with pytest.raises(ValueError, match="native=True needs finite float32"):
        nca_value_and_grad(z, labels, log_form=False, native=True)  # float64


@pytest.mark.parametrize(
    "own, block, sq, message",
    [
        (torch.tensor([0, 6]), (0, 2), None, r"own must hold 2 column indices in \[0, 6\)"),
        (torch.tensor([0, -1]), (0, 2), None, "own must hold"),
        (torch.tensor([0]), (0, 2), None, "own must hold 2"),
        (torch.tensor([0, 1]), (0, 7), None, r"the block \[0, 7\) must lie within the 6"),
        (torch.tensor([0, 1]), (3, 2), None, r"the block \[3, 2\)"),
        (torch.tensor([0, 1]), (-1, 2), None, r"the block \[-1, 2\)"),
        (torch.tensor([0, 1]), (0, 2), torch.ones(6, dtype=torch.float64), "sq must be float32"),
        (torch.tensor([0, 1]), (0, 2), torch.ones(5), r"sq must be float32 of shape \(6,\)"),
    ],
)
def test_the_wrapper_checks_what_the_c_source_trusts(own, block, sq, message):
    # a bad index reached the C source as an out-of-bounds write (a hostile review)
    dots = torch.ones(2, 6)
    with pytest.raises(ValueError, match=message):
        native_rows.exp_rows(dots, torch.ones(6) if sq is None else sq, own, block)


def test_the_default_exact_path_takes_the_c_pass(monkeypatch):
    monkeypatch.delenv("NCA_KNN_NATIVE", raising=False)
    calls = []
    pass_itself = native_rows.exp_rows

    def counted(*args, **kwargs):
        calls.append(args[0].shape[0])
        return pass_itself(*args, **kwargs)

    monkeypatch.setattr(native_rows, "exp_rows", counted)
    z, labels = exact_data(90, 4, 3, seed=2)
    nca_value_and_grad(z.float(), labels, log_form=False)  # native=None
    assert sum(calls) == 90  # every row went through it
    calls.clear()
    nca_value_and_grad(z, labels, log_form=False)  # float64: the torch path
    assert calls == []


def test_a_tiny_block_factor_puts_no_subnormal_float_into_the_products():
    """Row 0 holds all but 1e-12 of its mass in its class (p_i = 1 - 1e-12, so the block's
    factor (p_i - 1) / p_i is -1e-12) and has a same-class point at squared distance 65 (a
    kept e_ij of 6e-29): their product, 6e-41, would be a subnormal float in U, which the
    products pay a microcode assist for on an Intel Xeon. A float32 p_i rounds to 1 and
    makes the factor 0; so does the C path (a reader's review found it did not)."""
    z = torch.tensor([[0.0], [0.1], [65.0**0.5], [-(27.63**0.5)]])  # class 0, 0, 0, 1
    q = torch.tensor([0])
    sq = (z * z).sum(1)
    dots = (z[q] @ z.T).contiguous()  # (1, 4)
    recompute = lambda far: None  # noqa: E731 (no row is far here)
    nca_kernel._native_scores_and_row_scale(dots, sq, q, 0, 3, False, recompute)
    units = dots[0]
    tiny = float(torch.finfo(torch.float32).tiny)
    assert not ((units != 0) & (units.abs() < tiny)).any(), units.tolist()
    assert units[3] > 0  # the other class's e_ij is kept as it is
