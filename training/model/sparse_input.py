"""Sparse inputs (SciPy CSR or CSC, e.g. TF-IDF rows) through a fit without densifying them.

The fit reads X only through Z = X A^T (N, d) and, by autograd, the gradient
dA = (dL/dZ)^T X (d, D): with X a torch sparse CSR tensor both cost O(nnz d), so a sparse set
of N rows and D features never needs N x D memory (below: what it does need). What a dense fit does
differently:

* **No centring.** Standardising a feature subtracts its mean, which would fill every zero;
  sparse inputs are used as given (``standardization_`` "none", mean 0 and scale 1 in the
  artifact), as scikit-learn's ``StandardScaler(with_mean=False)`` would have them. Scale
  them beforehand (TF-IDF rows usually are: unit length).
* **The initial map** "auto" is the top right singular vectors of X (uncentred PCA, as
  ``TruncatedSVD``: a randomized SVD, O(nnz d) a pass) when d < min(N, D), else the
  identity's first rows.
* **Refused** with a ValueError naming the setting: ``standardize`` "feature" or "global",
  ``init="lda"`` (it needs the D x D within-class scatter), the diagonal transform,
  learned prototypes, a data-parallel fit, and ``n_components=None`` (d = D) above
  MAX_FULL_RANK_FEATURES features.
* **Memory** is O(nnz + N d) for the data and its embedding, plus about 25 float64 copies of
  the map (d x D): L-BFGS's history of 10 pairs, the gradient and the line search's points,
  and at the start the randomized SVD's D x (d + 10) working set. At d = 16 and D =
  2,000,000 that is some 6 GiB whatever N is: choose d with D in mind.

``transform`` of sparse rows is z = float32(float64(X) @ W.T + b), O(nnz d), the same
numbers as the dense rows would give.
"""

from __future__ import annotations

import warnings

import numpy as np
import scipy.sparse as sp
import torch
from sklearn.utils.extmath import randomized_svd

SPARSE_FORMATS = ["csr", "csc"]  # what validate_data keeps; other formats become CSR


def is_sparse(X) -> bool:
    return sp.issparse(X)


MAX_FULL_RANK_FEATURES = 1024  # n_components=None (d = D) on sparse X only up to this D


def check_settings(settings, distributed: bool, n_features: int) -> None:
    """ValueError for a setting a sparse X cannot take (the module docstring says why)."""
    if settings.n_components is None and n_features > MAX_FULL_RANK_FEATURES:
        gib = 25 * n_features * n_features * 8 / 2**30
        raise ValueError(
            f"n_components=None means d = D = {n_features} for this sparse X: a ({n_features}, "
            f"{n_features}) map and its optimiser's copies, about {gib:,.0f} GiB; give "
            "n_components (e.g. 32)"
        )
    refused = {
        "standardize": settings.standardize in ("feature", "global", True),
        "transformation": settings.transformation == "diagonal",
        "init": isinstance(settings.init, str) and settings.init == "lda",
        "prototypes": settings.prototypes is not None,
    }
    reasons = {
        "standardize": "centres every feature, which would make a sparse X dense; use 'none' "
        "or 'auto' (none for sparse input) and scale X beforehand",
        "transformation": "is not available for sparse X; use 'linear'",
        "init": "needs the D x D within-class scatter; use 'auto' or 'pca' (a truncated SVD) "
        "for sparse X",
        "prototypes": "learns prototypes from dense rows; densify X or fit without prototypes",
    }
    for name, is_refused in refused.items():
        if is_refused:
            raise ValueError(f"{name}={getattr(settings, name)!r} {reasons[name]}")
    if distributed:
        raise ValueError("a data-parallel fit takes dense rows; sparse X is fitted in one process")


def check_float32_range(X: sp.spmatrix, what: str) -> None:
    """ValueError naming the first stored value beyond float32's range, or non-finite."""
    data = X.data
    if not np.isfinite(data).all():
        raise ValueError(f"{what}: the sparse matrix stores NaN or infinite values")
    if data.dtype.itemsize > 4 and data.size and np.abs(data).max() > np.finfo(np.float32).max:
        raise ValueError(f"{what}: a stored value is beyond float32's range (|x| <= 3.4e38)")


def rows_float32(X: sp.spmatrix, rows: np.ndarray | None = None) -> sp.csr_matrix:
    """X (or its ``rows``) as CSR float32 with sorted indices: what the fit reads."""
    X = sp.csr_matrix(X if rows is None else X[rows], dtype=np.float32)
    X.sort_indices()
    return X


def initial_components(X: sp.csr_matrix, n_components: int, seed: int) -> tuple[np.ndarray, str]:
    """(A0 (d, D), the init's name) for "auto" / "pca": the top right singular vectors of X
    when d < min(N, D) (uncentred PCA), else the identity's first d rows."""
    n, D = X.shape
    if n_components >= min(n, D):
        return np.eye(n_components, D), "identity"
    _, _, vt = randomized_svd(X, n_components, n_iter=4, random_state=seed)  # (d, D)
    signs = np.sign(vt[np.arange(len(vt)), np.abs(vt).argmax(axis=1)])  # a fixed sign
    return vt * signs[:, None], "pca"


def torch_csr(X: sp.csr_matrix, device: torch.device) -> torch.Tensor:
    """X (N, D) as a torch sparse CSR float32 tensor on ``device`` (its invariants checked
    once here, O(nnz))."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta")
        return torch.sparse_csr_tensor(
            torch.from_numpy(X.indptr.astype(np.int64)),
            torch.from_numpy(X.indices.astype(np.int64)),
            torch.from_numpy(X.data.astype(np.float32)),
            size=X.shape,
            device=device,
            check_invariants=True,
        )


def project(X: sp.spmatrix, projection: np.ndarray, offset: np.ndarray) -> np.ndarray:
    """z = x @ W.T + b (n, d) float32 for sparse rows: inputs as float32, the product
    accumulated in float64 and rounded once (``service.core.knn.project`` on dense rows)."""
    X64 = sp.csr_matrix(X, dtype=np.float32).astype(np.float64)
    z = X64 @ np.asarray(projection, dtype=np.float32).astype(np.float64).T
    z += np.asarray(offset, dtype=np.float32)
    return np.asarray(z, dtype=np.float32)


def fingerprint_parts(X: sp.spmatrix) -> list[np.ndarray]:
    """The arrays that identify a sparse X for a checkpoint's fingerprint."""
    X = sp.csr_matrix(X)
    shape = np.asarray(X.shape, dtype=np.int64)
    return [shape, X.indptr, X.indices, X.data]
