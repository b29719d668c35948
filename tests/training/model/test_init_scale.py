"""The scale of the initial map (training.model.initialization): the mean log-likelihood
against a brute-force numpy softmax, the maximum found against a fine scan, equivariance under a
rescaled map, the maps that have no scale to choose, and the estimator's init_scale_."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.training.problems import blobs
from training import NCA
from training.model.initialization import calibrated, mean_log_likelihood


def problem(n=400, d=3, seed=0):
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 3, n)
    centres = rng.normal(0, 2.0, (3, d))
    return (centres[y] + rng.normal(0, 1.0, (n, d))).astype(np.float32), y


def brute_force(z, y, rows, s):
    """mean over rows of log sum_{j in C_i} p_ij, p_ij = softmax_{j != i}(-s^2 ||z_i - z_j||^2)."""
    z = z.astype(np.float64)
    total = 0.0
    for i in rows:
        d2 = ((z - z[i]) ** 2).sum(1) * s * s
        d2[i] = np.inf
        logits = -d2
        top = logits.max()
        p = np.exp(logits - top)
        same = (y == y[i]) & (np.arange(len(z)) != i)
        total += np.log(p[same].sum() / p.sum())
    return total / len(rows)


@pytest.mark.parametrize("s", [0.05, 0.5, 1.0, 3.0])
def test_the_mean_log_likelihood_equals_brute_force(s):
    z, y = problem()
    rows = np.arange(0, 400, 7)
    got = mean_log_likelihood(torch.tensor(z), torch.tensor(y), torch.tensor(rows), [s])[0]
    assert got == pytest.approx(brute_force(z, y, rows, s), rel=1e-5, abs=1e-6)


def test_the_scale_found_is_the_maximum_of_a_fine_scan():
    z, y = problem(seed=1)
    _, s = calibrated(np.eye(3), z, y)
    scan = np.exp(np.linspace(np.log(s / 8), np.log(s * 8), 97))
    rows = np.linspace(0, 399, 256).round().astype(int)
    values = [brute_force(z, y, np.unique(rows), t) for t in scan]
    best = scan[int(np.argmax(values))]
    assert s == pytest.approx(best, rel=2 ** (1 / 8))  # within the refinement's step
    assert brute_force(z, y, np.unique(rows), s) >= max(values) - 1e-3


def test_a_rescaled_map_gets_the_inverse_factor():
    z, y = problem(seed=2)
    A0 = np.eye(3)
    A1, s1 = calibrated(A0, z, y)
    A2, s2 = calibrated(4.0 * A0, 4.0 * z, y)
    assert s2 == pytest.approx(s1 / 4.0, rel=1e-6)
    np.testing.assert_allclose(A2, A1, rtol=1e-6)


def test_maps_without_a_scale_to_choose_come_back_unchanged():
    z, y = problem()
    A0 = np.ones((2, 3))
    assert calibrated(A0, np.zeros_like(z), y)[1] == 1.0  # every point at one place
    assert calibrated(A0, z, np.zeros_like(y))[1] == 1.0  # one class: p_i = 1 at any scale


def test_the_estimator_scales_the_maps_it_builds_and_only_those():
    X, y = blobs(300)
    auto = NCA(n_components=2, max_iter=1, random_state=0).fit(X, y)
    assert auto.init_scale_ != 1.0
    fixed = NCA(n_components=2, max_iter=1, random_state=0, options=dict(init_scale=2.0)).fit(X, y)
    assert fixed.init_scale_ == 2.0
    given = NCA(n_components=2, max_iter=1, init=np.ones((2, 6)), random_state=0).fit(X, y)
    assert given.init_scale_ == 1.0
    with pytest.raises(ValueError, match=r"init_scale=0 must be 'auto' or a finite real"):
        NCA(options=dict(init_scale=0)).fit(X, y)
