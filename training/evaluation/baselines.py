"""Baseline linear maps on standardised inputs, for the report's comparison.

Each returns A with z = x_std @ A.T:

* euclidean  A = I                          (D x D)
* whitening  A = Sigma^{-1/2}               (D x D), Sigma the training covariance
* pca        the top-d principal axes        (d x D)
* lda        the first min(d, C-1) LDA scalings
* rca        A = Sigma_w^{-1/2}             (D x D), Sigma_w the mean within-class covariance

Inverse square roots use the eigendecomposition with eigenvalues floored at
1e-6 * the largest, so rank-deficient data (constant features) stays finite. With fewer
training rows than features the two D x D maps are not computed (ValueError, which the
report records): their covariance is singular, and its O(D^3) decomposition would cost more
than the fit (50 rows of 5,000 features: 10 s each). PCA and LDA are computed there in the
span of the rows, at O(N^2 D).
"""

from __future__ import annotations

import numpy as np

from training.numerics import fisher_directions_of_rows, principal_axes


def inverse_sqrt(cov: np.ndarray, floor: float = 1e-6) -> np.ndarray:
    """Symmetric C^{-1/2} with eigenvalues floored at floor * max eigenvalue."""
    vals, vecs = np.linalg.eigh(cov)
    vals = np.maximum(vals, floor * max(vals.max(), np.finfo(np.float64).tiny))
    return (vecs / np.sqrt(vals)) @ vecs.T


def euclidean(X: np.ndarray, y: np.ndarray, d: int) -> np.ndarray:
    return np.eye(X.shape[1])


def _check_more_rows_than_features(X: np.ndarray, name: str) -> None:
    if X.shape[0] < X.shape[1]:
        raise ValueError(
            f"{name} not computed: fewer training rows ({X.shape[0]}) than features "
            f"({X.shape[1]}) leave its D x D covariance singular"
        )


def whitening(X: np.ndarray, y: np.ndarray, d: int) -> np.ndarray:
    _check_more_rows_than_features(X, "whitening")
    return inverse_sqrt(np.cov(X, rowvar=False).reshape(X.shape[1], X.shape[1]))


def pca(X: np.ndarray, y: np.ndarray, d: int) -> np.ndarray:
    """The top-d principal axes of the training rows, largest first
    (``numerics.principal_axes``: the D x D covariance's eigenvectors, or with fewer rows
    than features the rows' right singular vectors)."""
    return principal_axes(X - X.mean(axis=0), d)


def lda(X: np.ndarray, y: np.ndarray, d: int) -> np.ndarray:
    """The first min(d, C-1) Fisher directions, the within-class covariance the identity
    along them (``training.numerics.fisher_directions``, as LDA's scalings)."""
    classes, y_idx = np.unique(y, return_inverse=True)
    n_out = min(d, len(classes) - 1, X.shape[1])
    return fisher_directions_of_rows(X, y_idx, len(classes), n_out)


def rca(X: np.ndarray, y: np.ndarray, d: int) -> np.ndarray:
    _check_more_rows_than_features(X, "rca")
    n_features = X.shape[1]
    within = np.zeros((n_features, n_features))
    classes = np.unique(y)
    for c in classes:
        members = X[y == c]
        centred = members - members.mean(axis=0)
        within += centred.T @ centred / max(1, len(members))
    return inverse_sqrt(within / len(classes))


BASELINES = {
    "euclidean": euclidean,
    "whitening": whitening,
    "pca": pca,
    "lda": lda,
    "rca": rca,
}
