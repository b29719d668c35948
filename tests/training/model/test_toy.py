"""Toy problems with known answers."""

from __future__ import annotations

import numpy as np
import pytest
from sklearn.decomposition import PCA
from sklearn.neighbors import KNeighborsClassifier

from tests.conftest import make_rings
from training import NCA


def test_three_point_collapse():
    """Two same-class points and a third, other-class point at their midpoint.

    The third point has no same-class neighbour, so p_3 = 0. For the pair, A x_3 is the
    midpoint of A x_1 and A x_2 for every A, so d_13 = d_12 / 4 and
    p_1 = p_2 = 1 / (1 + exp(3 d_12 / 4)), maximised (= 1/2) by d_12 -> 0: the map collapses
    all three points onto one, and f -> 1.
    """
    rng = np.random.default_rng(42)
    two = rng.normal(size=(2, 5))
    X = np.vstack([two, two.mean(axis=0, keepdims=True)])
    y = np.array([0, 0, 1])
    nca = NCA(init="identity", max_iter=200, tol=1e-10, options=dict(standardize=False)).fit(X, y)
    Z = nca.transform(X)
    np.testing.assert_allclose(Z - Z[2], 0.0, atol=1e-3)
    assert nca.objective_value_ * 3 == pytest.approx(1.0, abs=1e-4)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_concentric_rings_nca_finds_the_rings_pca_does_not(seed):
    """The paper's rings: NCA's 2-D map (started from PCA's) separates the classes."""
    X, y = make_rings(100, noise_std=10.0, seed=seed)
    X_test, y_test = make_rings(100, noise_std=10.0, seed=seed + 100)
    nca = NCA(n_components=2, init="pca", random_state=seed, max_iter=200).fit(X, y)
    nca_acc = KNeighborsClassifier(1).fit(nca.transform(X), y).score(nca.transform(X_test), y_test)
    pca = PCA(2).fit(X)
    pca_acc = KNeighborsClassifier(1).fit(pca.transform(X), y).score(pca.transform(X_test), y_test)
    assert nca_acc >= 0.95
    assert pca_acc < 0.6
