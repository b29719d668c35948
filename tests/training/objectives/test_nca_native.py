"""The native exact-NCA kernel (training/objectives/native.py, training/objectives/kernels/nca_exact.c).

Its values and gradients against brute-force numpy (eqs 1-2 of the paper with an explicit
N x N matrix), against the torch path, against central finite differences, across thread
splits and row subsets; when it must not be used (huge, non-finite, unsupported tensors) the
torch path answers. The libraries are built at install (setup.py): every level built for this
CPU computes the same values, the best level the CPU runs is the one loaded, a library the
install did not build warns and falls back, and a fit with no compiler on PATH loads them.
"""

from __future__ import annotations

import ctypes
import json
import platform
import shutil
import subprocess
import sys
import sysconfig
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.training.problems import brute_force_p
from training.objectives import native
from training.objectives.nca_kernel import nca_value_and_grad


@pytest.fixture(scope="module", autouse=True)
def built_at_install():
    # the project's install (make install: pip install -e .) builds the kernels; a source that
    # does not compile or a library that does not load fails here, it is never skipped
    assert native.kernel(torch.float64) is not None
    assert native.kernel(torch.float32) is not None


def data(n, d, n_classes, seed=0, scale=1.0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(n, d, generator=g, dtype=dtype) * scale
    labels = torch.arange(n) % n_classes
    labels = labels[torch.randperm(n, generator=g)]
    return z, labels


def brute_force(z, labels, log_form, rows=None):
    """sum over rows of p_i (or log p_i) from an explicit N x N softmax, float64 numpy."""
    z, y = z.double().numpy(), labels.numpy()
    _, p_i, _ = brute_force_p(z, y, np.eye(z.shape[1]))
    has_same = np.bincount(y)[y] >= 2  # a class of one scores 0
    scores = np.where(has_same, np.log(np.where(has_same, p_i, 1.0)) if log_form else p_i, 0.0)
    return scores.sum() if rows is None else scores[rows.numpy()].sum()


@pytest.mark.parametrize("log_form", [False, True])
@pytest.mark.parametrize(
    "n, d, n_classes",
    [(2, 1, 1), (37, 3, 4), (203, 17, 5), (300, 32, 3), (64, 40, 7)],
)
def test_value_equals_brute_force_and_gradient_equals_torch_path(n, d, n_classes, log_form):
    z, labels = data(n, d, n_classes)
    value, grad = nca_value_and_grad(z, labels, log_form=log_form, native=True)
    reference, reference_grad = nca_value_and_grad(z, labels, log_form=log_form, native=False)
    assert float(value) == pytest.approx(brute_force(z, labels, log_form), rel=1e-12, abs=1e-12)
    torch.testing.assert_close(value, reference, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, reference_grad, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("log_form", [False, True])
def test_gradient_matches_central_differences(log_form):
    z, labels = data(23, 3, 3, seed=1)
    _, grad = nca_value_and_grad(z, labels, log_form=log_form, native=True)
    eps = 1e-6
    for i, k in [(0, 0), (5, 2), (11, 1), (22, 0)]:
        plus, minus = z.clone(), z.clone()
        plus[i, k] += eps
        minus[i, k] -= eps
        f_plus, _ = nca_value_and_grad(plus, labels, log_form=log_form, native=True)
        f_minus, _ = nca_value_and_grad(minus, labels, log_form=log_form, native=True)
        numeric = float(f_plus - f_minus) / (2 * eps)
        assert float(grad[i, k]) == pytest.approx(numeric, rel=1e-6, abs=1e-8)


def test_singleton_classes_score_zero_and_rows_subset():
    z, labels = data(150, 6, 4, seed=2)
    labels[[3, 70]] = torch.tensor([9, 10])  # two classes of one point each
    rows = torch.tensor([3, 0, 149, 70, 12, 13, 88])
    for log_form in (False, True):
        value, grad = nca_value_and_grad(z, labels, log_form=log_form, rows=rows, native=True)
        ref, ref_grad = nca_value_and_grad(z, labels, log_form=log_form, rows=rows, native=False)
        assert float(value) == pytest.approx(brute_force(z, labels, log_form, rows), rel=1e-12)
        torch.testing.assert_close(grad, ref_grad, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(value, ref, rtol=1e-12, atol=1e-12)


def test_a_row_listed_twice_counts_twice_on_both_paths(monkeypatch):
    monkeypatch.setattr(native, "ROWS_PER_THREAD", 1)  # the repeats land in different threads
    z, labels = data(60, 4, 3, seed=8)
    rows = torch.tensor([5, 5, 7, 30, 5, 59])
    once = torch.tensor([5, 7, 30, 59])
    for use_native in (True, False):
        twice, grad = nca_value_and_grad(z, labels, log_form=False, rows=rows, native=use_native)
        single, grad_single = nca_value_and_grad(
            z, labels, log_form=False, rows=once, native=use_native
        )
        alone, grad_alone = nca_value_and_grad(
            z, labels, log_form=False, rows=torch.tensor([5]), native=use_native
        )
        torch.testing.assert_close(twice, single + 2 * alone, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(grad, grad_single + 2 * grad_alone, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_thread_splits_give_the_same_answer(threads, monkeypatch):
    """Parts split inside a class run and across blocks; every split sums to one answer."""
    monkeypatch.setattr(native, "ROWS_PER_THREAD", 1)
    z, labels = data(171, 9, 2, seed=3)
    order = torch.argsort(labels, stable=True)
    zs, ys = z[order], labels[order]
    n0 = int((ys == 0).sum())
    query = torch.arange(171)
    start = torch.where(query < n0, 0, n0)
    end = torch.where(query < n0, n0, 171)
    one = native.exact_value_and_grad(zs, query, start, end, log_form=True, threads=1)
    many = native.exact_value_and_grad(zs, query, start, end, log_form=True, threads=threads)
    torch.testing.assert_close(many[0], one[0], rtol=1e-13, atol=0)
    torch.testing.assert_close(many[1], one[1], rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("min_rows, budget", [(8, 0), (16, 0), (24, 0), (16, 2**30)])
def test_block_sizes_give_the_same_answer(min_rows, budget, monkeypatch):
    """Blocks of 8, 16, 24 and the most rows (256) per block: class runs of 171 and 129 rows
    cut at different places, one answer, equal to the torch path's."""
    z, labels = data(300, 9, 2, seed=5)
    expected = nca_value_and_grad(z, labels, log_form=False, native=False)
    monkeypatch.setattr(native, "MIN_BLOCK_ROWS", min_rows)
    monkeypatch.setattr(native, "SCRATCH_BYTES", budget)
    got = nca_value_and_grad(z, labels, log_form=False, native=True)
    torch.testing.assert_close(got[0], expected[0], rtol=1e-12, atol=0)
    torch.testing.assert_close(got[1], expected[1], rtol=1e-10, atol=1e-12)


def test_block_rows_fill_the_scratch_budget_within_bounds():
    mib = 2**20
    # 60k float32 references, classes of 6k: 32 MiB / (4 x 66k) = 127 -> 120 rows
    assert native.block_rows_for(60000, 6000, 4, 256) == 120
    assert native.block_rows_for(1000, 500, 8, 256) == 256  # small N: the most allowed
    assert native.block_rows_for(10**7, 10**6, 4, 256) == native.MIN_BLOCK_ROWS  # huge N
    rows = native.block_rows_for(200_000, 20_000, 4, 256)
    assert (
        rows % native.ROWS == 0
        and rows * 4 * 220_000 <= native.SCRATCH_BYTES < (rows + 8) * 4 * 220_000
    )
    assert native.SCRATCH_BYTES == 32 * mib


def test_float32_agrees_with_float64():
    z, labels = data(500, 32, 10, seed=4)
    for log_form in (False, True):
        v64, g64 = nca_value_and_grad(z, labels, log_form=log_form, native=True)
        v32, g32 = nca_value_and_grad(z.float(), labels, log_form=log_form, native=True)
        assert float(v32) == pytest.approx(float(v64), rel=1e-5)
        assert float((g32.double() - g64).norm() / g64.norm()) < 1e-5


def test_same_class_far_beyond_exp_range_stays_exact():
    """Three tight clusters ~32 apart, each one point of class 0 and one of class 1: every
    point's same-class neighbours are ~1,000 (squared distance) beyond its nearest point, so
    p_i ~ exp(-1000) underflows while log p_i must not (the same-class block's own max)."""
    g = torch.Generator().manual_seed(5)
    centres = torch.tensor([[0.0, 0.0], [0.0, 32.0], [32.0, 0.0]], dtype=torch.float64)
    z = centres.repeat_interleave(2, 0) + 0.1 * torch.randn(6, 2, generator=g, dtype=torch.float64)
    labels = torch.tensor([0, 1, 0, 1, 0, 1])
    value, grad = nca_value_and_grad(z, labels, log_form=True, native=True)
    ref, ref_grad = nca_value_and_grad(z, labels, log_form=True, native=False)
    assert torch.isfinite(value) and torch.isfinite(grad).all()
    assert float(value) < -6 * 900  # every p_i below exp(-900), and still exact:
    assert float(value) == pytest.approx(float(ref), rel=1e-12)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-9, atol=1e-9)
    f_value, _ = nca_value_and_grad(z, labels, log_form=False, native=True)
    assert float(f_value) == 0.0  # f underflows to 0, as in the torch path


@pytest.mark.parametrize(
    "make",
    [
        lambda z: z * 1e200,  # logits would overflow
        lambda z: torch.where(torch.arange(z.numel()).view(z.shape) == 3, float("nan"), z),
        lambda z: z.half(),  # no half-precision kernel
    ],
    ids=["huge", "nan", "float16"],
)
def test_unusable_tensors_take_the_torch_path(make):
    z, labels = data(40, 4, 3, seed=6)
    bad = make(z)
    assert not native.usable(bad)
    if bad.dtype == torch.float64 and torch.isfinite(bad).all():
        value, grad = nca_value_and_grad(bad, labels, log_form=False)
        ref, ref_grad = nca_value_and_grad(bad, labels, log_form=False, native=False)
        torch.testing.assert_close(value, ref, equal_nan=True)
        torch.testing.assert_close(grad, ref_grad, equal_nan=True)


def test_environment_switch_turns_it_off(monkeypatch):
    monkeypatch.setenv("NCA_KNN_NATIVE", "0")
    assert native.kernel(torch.float32) is None
    assert not native.usable(torch.ones(3, 2))
    monkeypatch.setenv("NCA_KNN_NATIVE", "1")
    assert native.kernel(torch.float32) is not None


def test_the_best_level_this_cpu_runs_is_loaded():
    levels = native.levels.levels_for(platform.machine())
    runnable = [name for name, _flags, needs in levels if set(needs) <= native.cpu_flags()]
    for library in ("nca_exact_f32", "nca_exact_f64", "nca_candidates_f32", "knca_linear_f64"):
        level, path = native.library_file(library)
        assert level == runnable[0] and path.is_file(), (library, level, runnable)


def level_library(library: str, level: str) -> ctypes.CDLL:
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    return ctypes.CDLL(str(native.KERNEL_DIR / f"{library}_{level}{suffix}"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_every_level_built_for_this_cpu_computes_the_same_values(dtype, monkeypatch):
    """The baseline x86-64 library (what a CPU without AVX2 loads) against the best level:
    the same value and gradient (a wrong -march, or a source that depends on one, differs)."""
    levels = native.levels.levels_for(platform.machine())
    runnable = [name for name, _flags, needs in levels if set(needs) <= native.cpu_flags()]
    z, labels = data(300, 7, 4, seed=11, dtype=dtype)
    order = torch.argsort(labels, stable=True)
    results = []
    for level in runnable:
        monkeypatch.setattr(
            native,
            "cpu_flags",
            lambda level=level: frozenset(
                next(needs for name, _f, needs in levels if name == level)
            ),
        )
        native.load_library.cache_clear()
        native._load.cache_clear()
        try:
            assert native.library_file(f"nca_exact_{native.FLAVOURS[dtype]}")[0] == level
            results.append(nca_value_and_grad(z[order], labels[order], log_form=False))
        finally:
            native.load_library.cache_clear()
            native._load.cache_clear()
    tol = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-10, atol=1e-12)
    for value, grad in results[1:]:
        torch.testing.assert_close(value, results[0][0], **tol)
        torch.testing.assert_close(grad, results[0][1], **tol)
    assert len(results) == len(runnable)


def test_a_library_the_install_did_not_build_warns_and_the_torch_path_answers(
    tmp_path, monkeypatch
):
    monkeypatch.setattr(native, "KERNEL_DIR", tmp_path)  # an install without the libraries
    native.load_library.cache_clear()
    native._load.cache_clear()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert native.kernel(torch.float32) is None
        assert any("nca_exact_f32 was not built by this install" in str(w.message) for w in caught)
        z, labels = data(30, 3, 3, seed=7, dtype=torch.float32)
        value, _ = nca_value_and_grad(z, labels, log_form=False)
        ref, _ = nca_value_and_grad(z, labels, log_form=False, native=False)
        torch.testing.assert_close(value, ref)
    finally:
        native.load_library.cache_clear()
        native._load.cache_clear()


def test_a_fit_with_no_compiler_on_path_runs_the_kernels_built_at_install(tmp_path):
    """Nothing is compiled at run time: with PATH holding only the interpreter's folder (no
    gcc, no cc) and CC naming nothing, every kernel a fit uses is the C one."""
    script = (
        "import json, warnings; from sklearn.datasets import make_blobs; "
        "from training import NCA; X, y = make_blobs(300, n_features=6, centers=3, "
        "random_state=0); warnings.simplefilter('error'); "
        "a = NCA(n_components=2, max_iter=3, n_candidates=4, random_state=0).fit(X, y); "
        "b = NCA(n_components=2, max_iter=2, objective='knca-majority', k=3, n_candidates=4, "
        "random_state=0).fit(X, y); print(json.dumps([a.kernels_, b.kernels_]))"
    )
    env = {
        "PATH": str(Path(sys.executable).parent),
        "CC": str(tmp_path / "no-such-compiler"),
        "HOME": str(tmp_path),
        "OMP_NUM_THREADS": "1",
    }
    assert shutil.which("gcc", path=env["PATH"]) is None
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    fitted = json.loads(done.stdout.strip().splitlines()[-1])
    assert fitted == [{"nca_exact": "c", "nca_candidates": "c"}, {"knca": "c"}]
