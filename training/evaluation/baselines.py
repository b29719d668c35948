"""Baseline linear maps on standardised inputs, for the report's comparison.

Each returns A with z = x_std @ A.T:

* euclidean  A = I                          (D x D)
* whitening  A = Sigma^{-1/2}               (D x D), Sigma the training covariance
* pca        the top-d principal axes        (d x D)
* lda        the first min(d, C-1) LDA scalings
* rca        A = Sigma_w^{-1/2}             (D x D), Sigma_w the mean within-class covariance

Inverse square roots use the eigendecomposition with eigenvalues floored at
1e-6 * the largest, so rank-deficient data (constant features, D > N) stays finite.
"""

from __future__ import annotations

import numpy as np

from training.numerics import fisher_directions


def inverse_sqrt(cov: np.ndarray, floor: float = 1e-6) -> np.ndarray:
    """Symmetric C^{-1/2} with eigenvalues floored at floor * max eigenvalue."""
    vals, vecs = np.linalg.eigh(cov)
    vals = np.maximum(vals, floor * max(vals.max(), np.finfo(np.float64).tiny))
    return (vecs / np.sqrt(vals)) @ vecs.T


def euclidean(X: np.ndarray, y: np.ndarray, d: int) -> np.ndarray:
    return np.eye(X.shape[1])


def whitening(X: np.ndarray, y: np.ndarray, d: int) -> np.ndarray:
    return inverse_sqrt(np.cov(X, rowvar=False).reshape(X.shape[1], X.shape[1]))


def pca(X: np.ndarray, y: np.ndarray, d: int) -> np.ndarray:
    """The top-d eigenvectors of the training covariance (D x D, from one GEMM, which is
    cheaper than an SVD of the centred N x D rows when N is large), largest first."""
    centred = X - X.mean(axis=0)
    _, vecs = np.linalg.eigh(centred.T @ centred)
    return vecs[:, ::-1][:, :d].T


def lda(X: np.ndarray, y: np.ndarray, d: int) -> np.ndarray:
    """The first min(d, C-1) Fisher directions, the within-class covariance the identity
    along them (``training.numerics.fisher_directions``, as LDA's scalings)."""
    classes, y_idx = np.unique(y, return_inverse=True)
    n_out = min(d, len(classes) - 1, X.shape[1])
    counts = np.bincount(y_idx)
    class_means = (np.eye(len(classes))[y_idx].T @ X) / counts[:, None]  # (C, D)
    centred = X - class_means[y_idx]
    between = (class_means - X.mean(axis=0)) * np.sqrt(counts)[:, None]
    return fisher_directions(between.T @ between, centred.T @ centred, len(X), n_out)


def rca(X: np.ndarray, y: np.ndarray, d: int) -> np.ndarray:
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
