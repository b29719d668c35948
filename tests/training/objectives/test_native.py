"""Loading the native kernels (training/objectives/native.py, training/objectives/kernels/).

The libraries are built at install (setup.py): every level built for this CPU computes the same
values, the best level the CPU runs is the one loaded, the environment switch turns them off,
a library the install did not build warns and the torch path answers, and a fit with no
compiler on PATH loads them. Each kernel's values are tested in its own file
(test_native_candidates.py, test_knca_native.py, test_native_rows.py).
"""

from __future__ import annotations

import json
import platform
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from training.objectives import native, native_candidates
from training.objectives.nca_kernel import nca_value_and_grad_candidates
from training.objectives.neighbourhood import nearest_candidates

LIBRARIES = ("nca_candidates_f32", "nca_candidates_f64", "knca_linear_f64", "nca_exact_rows_f32")


@pytest.fixture(scope="module", autouse=True)
def built_at_install():
    # the project's install (make install: pip install -e .) builds the kernels; a source that
    # does not compile or a library that does not load fails here, it is never skipped
    for library in LIBRARIES:
        assert native.load_library(library) is not None, library


def data(n, d, n_classes, seed=0, dtype=torch.float64):
    """(z (n, d), labels (n,), candidates (n, 2 x 4)): random embeddings, shuffled classes."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(n, d, generator=g, dtype=dtype)
    labels = torch.arange(n) % n_classes
    labels = labels[torch.randperm(n, generator=g)]
    return z, labels, nearest_candidates(z, labels, 4)


def candidates_objective(z, labels, candidates, native_path):
    return nca_value_and_grad_candidates(z, labels, candidates, log_form=False, native=native_path)


def test_environment_switch_turns_it_off(monkeypatch):
    monkeypatch.setenv("NCA_KNN_NATIVE", "0")
    assert not native.enabled()
    assert not native_candidates.usable(torch.ones(3, 2), 2)
    monkeypatch.setenv("NCA_KNN_NATIVE", "1")
    assert native_candidates.usable(torch.ones(3, 2), 2)


def test_the_best_level_this_cpu_runs_is_loaded():
    levels = native.levels.levels_for(platform.machine())
    runnable = [name for name, _flags, needs in levels if set(needs) <= native.cpu_flags()]
    for library in LIBRARIES:
        level, path = native.library_file(library)
        assert level == runnable[0] and path.is_file(), (library, level, runnable)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_every_level_built_for_this_cpu_computes_the_same_values(dtype, monkeypatch):
    """The baseline x86-64 library (what a CPU without AVX2 loads) against the best level:
    the same value and gradient (a wrong -march, or a source that depends on one, differs)."""
    levels = native.levels.levels_for(platform.machine())
    runnable = [name for name, _flags, needs in levels if set(needs) <= native.cpu_flags()]
    z, labels, candidates = data(300, 7, 4, seed=11, dtype=dtype)
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
        native_candidates._load.cache_clear()
        try:
            assert native.library_file(f"nca_candidates_{native.FLAVOURS[dtype]}")[0] == level
            results.append(candidates_objective(z, labels, candidates, True))
        finally:
            native.load_library.cache_clear()
            native_candidates._load.cache_clear()
    tol = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-10, atol=1e-12)
    for value, grad in results[1:]:
        torch.testing.assert_close(value, results[0][0], **tol)
        torch.testing.assert_close(grad, results[0][1], **tol)
    assert len(results) == len(runnable)


def test_a_library_the_install_did_not_build_warns_and_the_torch_path_answers(request):
    z, labels, candidates = data(30, 3, 3, seed=7, dtype=torch.float32)
    by_c, grad_by_c = candidates_objective(z, labels, candidates, True)  # the install's C
    request.getfixturevalue("install_without_kernels")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert not native_candidates.usable(z, candidates.shape[1])
    message = "nca_candidates_f32 was not built by this install"
    assert any(message in str(w.message) for w in caught)
    value, grad = nca_value_and_grad_candidates(z, labels, candidates, log_form=False)
    torch.testing.assert_close(value, by_c, rtol=1e-5, atol=1e-6)  # torch answered
    torch.testing.assert_close(grad, grad_by_c, rtol=1e-4, atol=1e-5)


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
