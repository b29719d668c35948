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


def d_by_d(name, X, y, d):
    """The baseline's map from the D x D matrices, as computed with N >= D."""
    from training.evaluation.baselines import inverse_sqrt
    from training.numerics import fisher_directions

    centred = X - X.mean(0)
    if name == "pca":
        return np.linalg.eigh(centred.T @ centred)[1][:, ::-1][:, :d].T
    if name == "whitening":
        return inverse_sqrt(np.cov(X, rowvar=False))
    classes = np.unique(y)
    means = np.stack([X[y == c].mean(0) for c in classes])
    within = X - means[np.searchsorted(classes, y)]
    if name == "rca":
        per_class = [within[y == c].T @ within[y == c] / np.sum(y == c) for c in classes]
        return inverse_sqrt(np.mean(per_class, axis=0))
    between = (means - X.mean(0)) * np.sqrt(np.bincount(y))[:, None]
    return fisher_directions(between.T @ between, within.T @ within, len(X), d)


@pytest.mark.parametrize("name, d", [("pca", 6), ("lda", 2), ("whitening", 300), ("rca", 300)])
def test_with_fewer_rows_than_features_each_map_comes_from_the_rows_as_from_d_by_d(wide, name, d):
    """PCA (right singular vectors), LDA (solved in the rows' span with the same ridge) and
    the inverse square roots (the span's part plus the floor's on the rest) against the
    D x D problems they replace: the same maps, up to each row's sign."""
    import scipy.linalg

    X, y = wide
    expected = d_by_d(name, X, y, d)
    with pytest.MonkeyPatch.context() as patch:  # the wide maps: no D x D eigh
        for module in (np.linalg, scipy.linalg):
            real = module.eigh

            def eigh(a, *args, _real=real, **kwargs):
                assert np.shape(a)[0] <= 45, f"an eigh of a {np.shape(a)} matrix"
                return _real(a, *args, **kwargs)

            patch.setattr(module, "eigh", eigh)
        found = BASELINES[name](X, y, d)
    assert found.shape == expected.shape
    signs = np.sign(np.sum(found * expected, axis=1))[:, None]
    scale = np.abs(expected).max()
    np.testing.assert_allclose(signs * found, expected, rtol=1e-6, atol=1e-7 * scale)


def test_pca_past_the_rows_is_completed_by_orthonormal_axes_outside_their_span(wide):
    """d = 60 > 45 rows: the first 45 axes are the rows' (all but one with variance: the
    centred rows have rank 44), the rest orthonormal and orthogonal to every row."""
    X, y = wide
    A = pca(X, y, 60)
    np.testing.assert_allclose(A @ A.T, np.eye(60), atol=1e-10)
    centred = X - X.mean(0)
    np.testing.assert_allclose(centred @ A[45:].T, 0.0, atol=1e-8 * np.abs(centred).max())
