"""The audit a candidate-mode fit runs on itself: the exact objective and leave-one-out
k-NN accuracy of a fixed sample, against the candidate objective the optimiser sees."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from service.knn import decide
from training import NCA
from training.neighbourhood import objective_sum
from training.objective_registry import make_objective
from training.optimize import Problem


def blobs(n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    means = rng.normal(0, 1.0, (4, 6))
    y = rng.integers(0, 4, n)
    return means[y] + rng.normal(0, 1.0, (n, 6)), y


@pytest.mark.parametrize("objective, k", [("nca", 1), ("knca-all", 3)])
def test_audit_figures_equal_direct_computations(objective, k):
    X, y = blobs(300)
    Xt = torch.as_tensor(X, dtype=torch.float32)
    yt = torch.as_tensor(y)
    problem = Problem(
        Xt,
        yt,
        make_objective(objective, k, n_classes=4),
        transform="linear",
        n_components=3,
        n_candidates=5,
    )
    theta = np.random.default_rng(1).normal(size=(3, 6))
    problem.refresh_candidates(theta)
    rows = torch.arange(0, 300, 7)
    got = problem.audit(theta, rows)

    z = Xt @ torch.as_tensor(theta, dtype=torch.float32).T
    candidate = objective_sum(
        z, yt, problem.objective, rows=rows, candidates=problem.candidates, method="autograd"
    )
    assert got["sample_candidate_objective"] == pytest.approx(float(candidate) / len(rows), 1e-5)
    if objective == "nca":
        exact = objective_sum(z, yt, problem.objective, rows=rows, method="autograd")
        assert got["sample_exact_objective"] == pytest.approx(float(exact) / len(rows), 1e-5)
    else:
        assert "sample_exact_objective" not in got  # kNCA's exact objective is not cheap
    # leave-one-out k-NN accuracy by brute force in float64
    zz = X @ theta.T
    d2 = ((zz[rows.numpy(), None, :] - zz[None, :, :]) ** 2).sum(-1)  # (B, N)
    d2[np.arange(len(rows)), rows.numpy()] = np.inf
    idx = np.argsort(d2, axis=1, kind="stable")[:, :k]
    predicted, _ = decide(y[idx], np.take_along_axis(d2, idx, 1), 4, "majority")
    assert got["sample_loo_accuracy"] == pytest.approx(np.mean(predicted == y[rows.numpy()]))


def test_candidate_fits_record_the_audit_and_exact_fits_do_not():
    X, y = blobs(600)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        candidate = NCA(n_components=3, n_candidates=8, max_iter=12, random_state=0).fit(X, y)
        exact = NCA(n_components=3, n_candidates=None, max_iter=12, random_state=0).fit(X, y)
    audited = [r for r in candidate.history_ if "sample_exact_objective" in r]
    assert [r["iteration"] for r in audited] == [
        i for i in range(1, candidate.n_iter_ + 1) if i == 1 or i % 5 == 0
    ]
    assert all(0 <= r["sample_loo_accuracy"] <= 1 for r in audited)
    assert candidate.candidate_warning_ is None  # easy blobs: the two measures agree
    assert not any("sample_exact_objective" in r for r in exact.history_)
    assert exact.candidate_warning_ is None
