"""The report's baseline maps, each checked by the property that defines it, computed
independently of the code under test (a constant or zero map fails every one of them)."""

from __future__ import annotations

import numpy as np
import pytest

from training.evaluation.baselines import BASELINES, euclidean, lda, pca, rca, whitening


@pytest.fixture(scope="module")
def data():
    """Three classes in 5 correlated features, with different within-class shapes."""
    rng = np.random.default_rng(0)
    mixing = rng.normal(size=(5, 5))
    y = np.repeat([0, 1, 2], 200)
    means = rng.normal(0, 3, size=(3, 5))
    X = rng.normal(size=(600, 5)) @ mixing + means[y]
    return X, y


def test_euclidean_is_the_identity(data):
    X, y = data
    np.testing.assert_array_equal(euclidean(X, y, 5), np.eye(5))


def test_whitening_makes_the_training_covariance_the_identity(data):
    X, y = data
    A = whitening(X, y, 5)
    np.testing.assert_allclose(np.cov(X @ A.T, rowvar=False), np.eye(5), atol=1e-8)
    np.testing.assert_allclose(A, A.T, atol=1e-10)  # the symmetric inverse square root


def test_rca_makes_the_mean_within_class_covariance_the_identity(data):
    X, y = data
    A = rca(X, y, 5)
    Z = X @ A.T
    within = np.mean(
        [np.cov(Z[y == c], rowvar=False, bias=True) for c in np.unique(y)], axis=0
    )  # the mean of the classes' covariances (1/n_c normalisation), by numpy
    np.testing.assert_allclose(within, np.eye(5), atol=1e-8)
    assert not np.allclose(np.cov(Z, rowvar=False), np.eye(5), atol=0.1)  # not whitening


def test_pca_keeps_the_top_principal_axes_orthonormal(data):
    X, y = data
    A = pca(X, y, 2)
    np.testing.assert_allclose(A @ A.T, np.eye(2), atol=1e-10)
    eigenvalues, eigenvectors = np.linalg.eigh(np.cov(X, rowvar=False))
    top = eigenvectors[:, ::-1][:, :2].T  # (2, D), by decreasing variance
    np.testing.assert_allclose(np.abs(A @ top.T), np.eye(2), atol=1e-8)  # up to sign
    variance = np.var(X @ A.T, axis=0, ddof=1)
    np.testing.assert_allclose(variance, eigenvalues[::-1][:2], rtol=1e-8)


def test_lda_maximises_between_over_within_class_scatter(data):
    X, y = data
    A = lda(X, y, 5)
    assert A.shape == (2, 5)  # at most C - 1 directions
    means = np.array([X[y == c].mean(axis=0) for c in range(3)])
    within = sum((X[y == c] - means[c]).T @ (X[y == c] - means[c]) for c in range(3))
    between = sum(200 * np.outer(m - X.mean(axis=0), m - X.mean(axis=0)) for m in means)
    # the leading generalised eigenvector of (between, within) by scipy-free numpy
    values, vectors = np.linalg.eig(np.linalg.solve(within, between))
    best = np.real(vectors[:, np.argmax(np.real(values))])

    def ratio(w):
        return (w @ between @ w) / (w @ within @ w)

    assert ratio(A[0]) == pytest.approx(ratio(best), rel=1e-6)
    assert ratio(A[0]) > 10 * ratio(np.ones(5))


def test_every_baseline_is_listed():
    assert set(BASELINES) == {"euclidean", "whitening", "pca", "lda", "rca"}


def test_lda_makes_the_within_class_scatter_per_row_the_identity_along_its_directions(data):
    X, y = data
    A = lda(X, y, 5)  # (2, D)
    means = np.array([X[y == c].mean(axis=0) for c in range(3)])
    centred = X - means[y]
    within_per_row = (A @ centred.T @ centred @ A.T) / len(X)  # (2, 2)
    # up to the ridge of 1e-6 of the mean eigenvalue that keeps S_w invertible
    np.testing.assert_allclose(within_per_row, np.eye(2), atol=1e-4)
    assert not np.allclose(np.linalg.norm(A, axis=1), 1.0)  # scaled, not merely unit vectors


@pytest.fixture(scope="module")
def wide():
    """Fewer rows than features: 45 rows of 300 features, three classes."""
    rng = np.random.default_rng(1)
    y = np.repeat([0, 1, 2], 15)
    X = rng.normal(size=(45, 300)) + rng.normal(0, 2, size=(3, 300))[y]
    return X, y


def test_with_fewer_rows_than_features_pca_is_the_covariances_top_eigenvectors(wide):
    """The rows' right singular vectors (O(N^2 D)) against the D x D covariance's
    eigenvectors (O(D^3)): the same axes, up to sign."""
    X, y = wide
    A = pca(X, y, 6)
    centred = X - X.mean(axis=0)
    _, vectors = np.linalg.eigh(centred.T @ centred)
    expected = vectors[:, ::-1][:, :6].T
    np.testing.assert_allclose(np.abs(A @ expected.T), np.eye(6), atol=1e-8)


def test_with_fewer_rows_than_features_lda_solves_in_the_span_as_in_the_whole_space(wide):
    """Fisher's directions from the rows' span equal those of the D x D generalised
    eigenproblem with the same ridge, up to sign, scaling included."""
    from training.numerics import fisher_directions

    X, y = wide
    A = lda(X, y, 2)
    means = np.stack([X[y == c].mean(0) for c in range(3)])
    between = (means - X.mean(0)) * np.sqrt(15)
    within = X - means[y]
    expected = fisher_directions(between.T @ between, within.T @ within, len(X), 2)
    for row, want in zip(A, expected, strict=True):
        sign = np.sign(row @ want)
        np.testing.assert_allclose(sign * row, want, rtol=1e-6, atol=1e-6 * np.abs(want).max())


@pytest.mark.parametrize("name", ["whitening", "rca"])
def test_with_fewer_rows_than_features_the_d_by_d_maps_are_refused_with_the_reason(wide, name):
    X, y = wide
    with pytest.raises(ValueError, match=rf"{name} not computed: fewer training rows \(45\)"):
        BASELINES[name](X, y, 6)
