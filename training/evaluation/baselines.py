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
from sklearn.discriminant_analysis import LinearDiscriminantAnalysis


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
    centred = X - X.mean(axis=0)
    _, _, vt = np.linalg.svd(centred, full_matrices=False)
    return vt[:d]


def lda(X: np.ndarray, y: np.ndarray, d: int) -> np.ndarray:
    n_out = min(d, len(np.unique(y)) - 1, X.shape[1])
    model = LinearDiscriminantAnalysis(n_components=n_out).fit(X, y)
    return np.asarray(model.scalings_.T[:n_out])


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
