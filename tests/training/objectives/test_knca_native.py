"""kNCA's fast path in C (training/objectives/knca_native.py, training/objectives/kernels/knca_linear.c).

Its log P_i and Jacobian against the torch float64 programme (which test_knca.py checks
against the log programme and against enumerating every k-subset) on rows with padding,
classes absent from a row, i's own class absent and a single class; gradcheck of the autograd
wrapper; thread splits; whole objectives with the kernel on and off, exact and on candidates;
bad labels; the switch; and a failed build that falls back to the torch programme.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from training.objectives import knca_native
from training.objectives.knca import (
    KNCAObjective,
    NativeLinearLogProb,
    in_linear_range,
    linear_log_prob,
    present_classes,
)
from training.objectives.neighbourhood import nearest_candidates, objective_sum


@pytest.fixture(scope="module", autouse=True)
def built_at_install():
    # the project's install builds the kernels (setup.py): a library missing fails, never skips
    assert knca_native.usable(torch.zeros(1, 1))


def rows(variant, k, seed, b=60, m=25, n_classes=None):
    """Random rows for linear_log_prob: logits (B, M) with -inf padding, shift, compact labels,
    own, and the class count, with some rows missing classes or their own class."""
    n_classes = n_classes or (2 if variant == "all" else 6)  # "all": i's class is common
    rng = np.random.default_rng(seed)
    logits = torch.tensor(-rng.uniform(0, 8, size=(b, m)))
    valid = torch.tensor(rng.uniform(size=(b, m)) > 0.15)
    raw = torch.tensor(rng.integers(0, n_classes, size=(b, m)))
    raw[: b // 4] %= 3  # classes 3.. absent from these rows
    own = torch.tensor(rng.integers(0, n_classes, size=b))
    no_own = slice(b // 4, b // 3)  # i's own class absent from these rows
    raw[no_own] = torch.where(
        raw[no_own] == own[no_own, None], (own[no_own, None] + 1) % n_classes, raw[no_own]
    )
    logits = logits.masked_fill(~valid, float("-inf"))
    if variant == "all":
        labels, own_c, c = (raw != own[:, None]).long(), torch.zeros_like(own), 2
    else:
        labels, own_c, c = present_classes(raw, own, valid, n_classes)
    _, shift = in_linear_range(logits, k)
    return logits, shift, labels, own_c, c


def both(logits, shift, labels, own, c, k, variant, weights):
    """(log P, d sum(weights log P) / d logits) from the C and the torch programmes."""
    out = []
    for use_native in (True, False):
        x = logits.clone().requires_grad_()
        log_p = linear_log_prob(x, shift, labels, own, c, k, variant, native=use_native)
        (grad,) = torch.autograd.grad((log_p * weights).sum(), x)
        out.append((log_p.detach(), grad))
    return out


@pytest.mark.parametrize("variant", ["majority", "all"])
@pytest.mark.parametrize("k", [1, 2, 3, 4, 5, 7, 10])
def test_equals_the_torch_programme(variant, k):
    logits, shift, labels, own, c = rows(variant, k, seed=k)
    ref_p = linear_log_prob(logits, shift, labels, own, c, k, variant, native=False)
    kept = ref_p > -600  # rows below the floor are replaced by the log programme's
    weights = torch.tensor(np.random.default_rng(k).normal(size=len(kept))) * kept
    (p, g), (ref_p, ref_g) = both(logits, shift, labels, own, c, k, variant, weights)
    assert kept.float().mean() > 0.5
    torch.testing.assert_close(p[kept], ref_p[kept], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(g, ref_g, rtol=1e-9, atol=1e-12)
    assert (g[torch.isinf(logits)] == 0).all()  # padding gets no gradient


def test_own_class_absent_reads_as_below_the_floor_as_in_the_torch_programme():
    logits = torch.tensor([[0.0, -1.0, -2.0, -0.5]], dtype=torch.float64)
    labels = torch.tensor([[1, 1, 2, 2]])
    _, shift = in_linear_range(logits, 2)
    (p, g), (ref_p, ref_g) = both(logits, shift, labels, torch.tensor([0]), 3, 2, "majority", 1.0)
    assert float(p) < -600  # the caller sends such rows to the log programme
    torch.testing.assert_close(p, ref_p, rtol=1e-12, atol=0)
    torch.testing.assert_close(g, ref_g, rtol=1e-9, atol=1e-15)  # -d log Z, as there


def test_one_class_only_is_certain():
    logits = torch.tensor([[0.0, -1.0, -3.0]], dtype=torch.float64, requires_grad=True)
    labels = torch.zeros(1, 3, dtype=torch.long)
    _, shift = in_linear_range(logits, 2)
    log_p = linear_log_prob(logits, shift, labels, torch.tensor([0]), 1, 2, native=True)
    log_p.sum().backward()
    assert float(log_p.detach()) == pytest.approx(0.0, abs=1e-15)
    assert logits.grad.abs().max() < 1e-15


@pytest.mark.parametrize("variant", ["majority", "all"])
def test_wrapper_passes_gradcheck(variant):
    logits, shift, labels, own, c = rows(variant, 4, seed=11, b=8, m=9)
    assert torch.autograd.gradcheck(
        lambda x: NativeLinearLogProb.apply(x, shift, labels, own, c, 4, variant),
        (logits.clone().requires_grad_(),),
    )


@pytest.mark.parametrize("threads", [2, 3, 5])
def test_thread_splits_give_one_answer(threads):
    logits, shift, labels, own, c = rows("majority", 5, seed=3, b=700, m=30)
    one = knca_native.log_prob_and_jacobian(logits, shift, labels, own, c, 5, "majority", threads=1)
    many = knca_native.log_prob_and_jacobian(
        logits, shift, labels, own, c, 5, "majority", threads=threads
    )
    assert torch.equal(one[0], many[0]) and torch.equal(one[1], many[1])


def test_labels_outside_the_classes_are_refused():
    logits, shift, labels, own, c = rows("majority", 3, seed=4)
    bad = labels.clone()
    bad[5, 2] = c
    with pytest.raises(ValueError, match=rf"0\.\.{c - 1}"):
        knca_native.log_prob_and_jacobian(logits, shift, bad, own, c, 3, "majority")
    with pytest.raises(ValueError, match="variant"):
        knca_native.log_prob_and_jacobian(logits, shift, labels, own, c, 3, "most")


@pytest.mark.parametrize("variant", ["majority", "all"])
@pytest.mark.parametrize("mode", ["exact", "candidates"])
def test_whole_objective_with_and_without_the_kernel(variant, mode, monkeypatch):
    rng = np.random.default_rng(5)
    z = torch.tensor(rng.normal(size=(150, 4)) * 1.5, dtype=torch.float32)
    y = torch.tensor(rng.integers(0, 4, 150))
    cand = nearest_candidates(z, y, 8) if mode == "candidates" else None
    results = []
    for switch in ("1", "0"):
        monkeypatch.setenv("NCA_KNN_NATIVE", switch)
        assert knca_native.usable(z) == (switch == "1")
        for log_form in (False, True):
            zz = z.clone().requires_grad_()
            obj = KNCAObjective(variant, 5, log_form, n_classes=4)
            value = objective_sum(zz, y, obj, candidates=cand, chunk_size=64)
            value.backward()
            results.append((value.detach(), zz.grad))
    for (v_native, g_native), (v_torch, g_torch) in zip(results[:2], results[2:], strict=True):
        torch.testing.assert_close(v_native, v_torch, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(g_native, g_torch, rtol=1e-4, atol=1e-5)


def test_a_library_the_install_did_not_build_warns_and_the_torch_programme_answers(
    install_without_kernels,
):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert not knca_native.usable(torch.zeros(1, 1))
    assert any("knca_linear_f64 was not built" in str(w.message) for w in caught)
    logits, shift, labels, own, c = rows("majority", 3, seed=6)
    log_p = linear_log_prob(logits, shift, labels, own, c, 3)  # falls back, answers
    assert torch.isfinite(log_p).all()


# One USPS row (25% label noise, kNCA-majority k = 5 on 16 candidates per kind, d = 16)
# where the C pass's Jacobian overflowed: its own class (2) is 230 units of squared distance
# beyond the nearest others, P_i ~ exp(-685), below exp(LINEAR_LOG_FLOOR) but above the
# 1e-300 floor of num, so 1 / num times coefficients near exp(600) overflowed to NaN.
USPS_ROW_LOGITS = [
    -406.555359,
    -266.813171,
    -617.710205,
    -615.680969,
    -616.071655,
    -516.467285,
    -805.918152,
    -580.714417,
    -434.124268,
    -592.758667,
    -562.023438,
    -586.537048,
    -837.083923,
    -601.518738,
    -527.842834,
    -716.463379,
    -38.188843,
    -41.560364,
    -63.615295,
    -97.252441,
    -94.475342,
    -79.881348,
    -219.826172,
    -154.332214,
    -259.70343,
    -249.522156,
    -141.249512,
    -206.226562,
    -149.570984,
    -141.229614,
    -212.889648,
    -335.293335,
]
USPS_ROW_LABELS = [2] * 16 + [0, 0, 0, 0, 0, 0, 0, 1, 6, 0, 0, 0, 7, 9, 0, 0]


@pytest.mark.parametrize("log_form", [False, True])
def test_a_row_below_the_floor_leaves_the_gradient_finite(log_form, monkeypatch):
    """Such a row is recomputed by the log programme and its fast-path value is dropped; its
    Jacobian must not reach the gradient (0 * NaN = NaN poisoned every point it touched, and
    L-BFGS returned a NaN map). The gradient is finite and equals the torch programme's."""
    results = []
    for switch in ("1", "0"):
        monkeypatch.setenv("NCA_KNN_NATIVE", switch)
        neg = torch.tensor([USPS_ROW_LOGITS], dtype=torch.float32, requires_grad=True)
        obj = KNCAObjective("majority", 5, log_form, n_classes=10)
        labels = torch.tensor([USPS_ROW_LABELS])
        valid = torch.ones_like(labels, dtype=torch.bool)
        scores = obj.point_scores(neg, labels, torch.tensor([2]), valid)
        scores.sum().backward()
        results.append((scores.detach(), neg.grad))
    (v_native, g_native), (v_torch, g_torch) = results
    assert torch.isfinite(g_native).all()
    torch.testing.assert_close(v_native, v_torch)
    torch.testing.assert_close(g_native, g_torch)
