"""Baseline linear maps on standardised inputs, for the report's comparison.

Each returns A with z = x_std @ A.T:

* euclidean  A = I                          (D x D)
* whitening  A = Sigma^{-1/2}               (D x D), Sigma the training covariance
* pca        the top-d principal axes        (d x D)
* lda        the first min(d, C-1) LDA scalings
* rca        A = Sigma_w^{-1/2}             (D x D), Sigma_w the mean within-class covariance

Inverse square roots use the eigendecomposition with eigenvalues floored at
1e-6 * the largest, so rank-deficient data (constant features, D > N) stays finite. With
fewer training rows than features every map is computed from the rows, at O(N^2 D + D^2 N),
never an O(D^3) decomposition of a D x D matrix (50 rows of 5,000 features: 10.6 s each):
PCA and LDA in the span of the rows, the inverse square roots as that span's part plus the
floor's value on the rest (``inverse_sqrt_of_rows``).
"""

from __future__ import annotations

import numpy as np

from training.numerics import fisher_directions_of_rows, principal_axes


def inverse_sqrt(cov: np.ndarray, floor: float = 1e-6) -> np.ndarray:
    """Symmetric C^{-1/2} with eigenvalues floored at floor * max eigenvalue."""
    vals, vecs = np.linalg.eigh(cov)
    vals = np.maximum(vals, floor * max(vals.max(), np.finfo(np.float64).tiny))
    return (vecs / np.sqrt(vals)) @ vecs.T


def inverse_sqrt_of_rows(rows: np.ndarray, floor: float = 1e-6) -> np.ndarray:
    """``inverse_sqrt`` of C = R^T R for rows R (m, D) with m < D, from R's SVD
    R = U S V^T: C's eigenvalues are S^2 on V's rows and 0 on the rest, all floored at
    f = floor * max eigenvalue, so C^{-1/2} = f^{-1/2} I + V^T (max(S^2, f)^{-1/2} - f^{-1/2}) V
    (D, D), at O(m^2 D + D^2 m)."""
    _, singular, vt = np.linalg.svd(rows, full_matrices=False)  # (m,), (m, D)
    values = singular**2
    least = floor * max(values.max(initial=0.0), np.finfo(np.float64).tiny)
    gains = 1.0 / np.sqrt(np.maximum(values, least)) - 1.0 / np.sqrt(least)  # (m,)
    return np.eye(rows.shape[1]) / np.sqrt(least) + (vt.T * gains) @ vt


def euclidean(X: np.ndarray, y: np.ndarray, d: int) -> np.ndarray:
    return np.eye(X.shape[1])


def whitening(X: np.ndarray, y: np.ndarray, d: int) -> np.ndarray:
    n, n_features = X.shape
    if n < n_features:  # np.cov's (X - mean)^T (X - mean) / (n - 1), from its rows
        return inverse_sqrt_of_rows((X - X.mean(axis=0)) / np.sqrt(max(n - 1, 1)))
    return inverse_sqrt(np.cov(X, rowvar=False).reshape(n_features, n_features))


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
    """The mean within-class covariance Sigma_w = (1/C) sum_c R_c^T R_c / n_c (R_c the
    class's centred rows) to the power -1/2: from its D x D matrix, or with fewer rows than
    features from the rows R_c / sqrt(C n_c) stacked (``inverse_sqrt_of_rows``)."""
    n_features = X.shape[1]
    classes = np.unique(y)
    centred = [X[y == c] - X[y == c].mean(axis=0) for c in classes]  # R_c (n_c, D)
    if X.shape[0] < n_features:
        scale = [np.sqrt(len(classes) * max(1, len(rows))) for rows in centred]
        return inverse_sqrt_of_rows(np.vstack([r / s for r, s in zip(centred, scale, strict=True)]))
    within = np.zeros((n_features, n_features))
    for rows in centred:
        within += rows.T @ rows / max(1, len(rows))
    return inverse_sqrt(within / len(classes))


BASELINES = {
    "euclidean": euclidean,
    "whitening": whitening,
    "pca": pca,
    "lda": lda,
    "rca": rca,
}
