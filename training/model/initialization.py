"""Initial transformations A (d, D) on standardised inputs.

``auto`` follows scikit-learn's rule: LDA when d <= min(D, C - 1), else PCA when
d < min(D, N), else the identity. ``pca`` takes the top-d principal axes, ``lda`` the
first d LDA scalings, ``identity`` the first d rows of I, ``random`` a standard normal
matrix; an explicit (d, D) array or an artifact directory (warm start) is used as given.

PCA and LDA can find fewer directions than d when the data has low rank (7 points in 3
dimensions with 5 classes; 200 points on a plane): the missing rows are completed by
:func:`complete_rows` (principal axes of what the found rows leave unexplained, then any
orthonormal directions), so every ordering of N, D, C and d gets a (d, D) map.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from sklearn.decomposition import PCA
from sklearn.discriminant_analysis import LinearDiscriminantAnalysis

from service.core.artifact import read_artifact

INIT_NAMES = ("auto", "pca", "lda", "identity", "random")


def resolve_auto(n_components: int, n_features: int, n_samples: int, n_classes: int) -> str:
    """scikit-learn's rule, except that LDA also needs more samples than classes."""
    if n_components <= min(n_features, n_classes - 1) and n_samples > n_classes:
        return "lda"
    if n_components < min(n_features, n_samples):
        return "pca"
    return "identity"


def complete_rows(
    found: np.ndarray, X: np.ndarray, n_components: int, rng: np.random.Generator
) -> np.ndarray:
    """found (r, D) rows extended to (n_components, D).

    Extra rows: the principal axes of the residual X - X Q Q^T (Q an orthonormal basis of
    the found rows' span), largest variance first; if the residual has too few directions,
    orthonormal directions completing the basis (QR of a random matrix projected off it).
    """
    found = np.asarray(found, dtype=np.float64).reshape(-1, X.shape[1])
    missing = n_components - len(found)
    if missing <= 0:
        return found[:n_components]
    n_features = X.shape[1]
    basis = np.linalg.qr(found.T)[0] if len(found) else np.zeros((n_features, 0))  # (D, r)
    residual = X - (X @ basis) @ basis.T
    residual = residual - residual.mean(axis=0)
    _, singular, vt = np.linalg.svd(residual, full_matrices=False)
    tol = max(residual.shape) * np.finfo(np.float64).eps * (singular[0] if len(singular) else 0)
    extra = vt[singular > tol][:missing]  # (<= missing, D)
    rows = np.vstack([found, extra])
    while len(rows) < n_components:
        span = np.linalg.qr(rows.T)[0] if len(rows) else np.zeros((n_features, 0))
        v = rng.standard_normal(n_features)
        v -= span @ (span.T @ v)
        norm = np.linalg.norm(v)
        if norm > 1e-8:
            rows = np.vstack([rows, v / norm])
    return rows


def checked_array_init(init: np.ndarray, n_features: int, n_components: int) -> np.ndarray:
    """A copy of an array init A (d, D) as float64, checked as scikit-learn checks it."""
    A = np.asarray(init, dtype=np.float64)
    if A.ndim != 2:
        raise ValueError(f"init must be a 2-D array (n_components, n_features), got {A.shape}")
    if A.shape[1] != n_features:
        raise ValueError(
            f"The input dimensionality ({A.shape[1]}) of the given linear transformation "
            f"`init` must match the dimensionality of the given inputs `X` ({n_features})."
        )
    if A.shape[0] > A.shape[1]:
        raise ValueError(
            f"The output dimensionality ({A.shape[0]}) of the given linear transformation "
            f"`init` cannot be greater than its input dimensionality ({A.shape[1]})."
        )
    if A.shape[0] != n_components:
        raise ValueError(
            "The preferred dimensionality of the projected space `n_components` "
            f"({n_components}) does not match the output dimensionality of the given linear "
            f"transformation `init` ({A.shape[0]})!"
        )
    if not np.all(np.isfinite(A)):
        raise ValueError("init: contains NaN or Inf")
    return A.copy()


def check_lda(n_components: int, n_samples: int, n_features: int, n_classes: int) -> None:
    """ValueError unless LDA can give d components: d <= min(D, C - 1), and N > C."""
    if n_components > min(n_features, n_classes - 1):
        raise ValueError(
            f"init='lda' gives at most min(n_features, n_classes - 1) = "
            f"{min(n_features, n_classes - 1)} components, n_components={n_components}"
        )
    if n_samples <= n_classes:
        raise ValueError(
            f"init='lda' needs more samples than classes, got n_samples={n_samples} and "
            f"{n_classes} classes; use init='pca'"
        )


def lda_components(
    X: np.ndarray, y: np.ndarray, n_components: int, rng: np.random.Generator
) -> np.ndarray:
    """LDA's most discriminative directions (d, D), completed by ``complete_rows`` when LDA
    finds fewer than d (rank-deficient data). Needs d <= min(D, C - 1) and N > C."""
    check_lda(n_components, *X.shape, len(np.unique(y)))
    lda = LinearDiscriminantAnalysis(n_components=n_components).fit(X, y)
    found = np.asarray(lda.scalings_.T[:n_components], dtype=np.float64)  # may be < d rows
    return complete_rows(found, X, n_components, rng)


def initial_components(
    init,
    X: np.ndarray,
    y: np.ndarray,
    n_components: int,
    *,
    random_state: np.random.Generator,
    scale: np.ndarray | None = None,
) -> tuple[np.ndarray, str]:
    """Return (A (d, D) float64, the name of the rule used).

    X: (N, D) standardised training inputs, y: (N,) class indices. ``scale`` (D,) is the
    current standardisation, used to carry a warm-start artifact's map over unchanged on raw
    inputs: A = W_old * scale.
    """
    n_samples, n_features = X.shape
    if isinstance(init, (str, Path)) and str(init) not in INIT_NAMES:
        artifact = read_artifact(init)
        if artifact.n_features_in != n_features:
            raise ValueError(
                f"init={str(init)!r}: the artifact expects {artifact.n_features_in} features, "
                f"the data has {n_features}"
            )
        s = np.ones(n_features) if scale is None else scale
        init = np.asarray(artifact.projection, dtype=np.float64) * s[None, :]
        name = "artifact"
    elif isinstance(init, np.ndarray):
        name = "array"
    else:
        name = str(init)
    if isinstance(init, np.ndarray):
        return checked_array_init(init, n_features, n_components), name

    if name == "auto":
        name = resolve_auto(n_components, n_features, n_samples, len(np.unique(y)))
    if name == "identity":
        return np.eye(n_components, n_features), name
    if name == "random":
        return random_state.standard_normal((n_components, n_features)), name
    if name == "pca":
        seed = int(random_state.integers(2**31 - 1))
        pca = PCA(n_components=min(n_components, n_samples, n_features), random_state=seed)
        found = pca.fit(X).components_
        return complete_rows(found, X, n_components, random_state), name
    if name == "lda":
        return lda_components(X, y, n_components, random_state), name
    raise ValueError(
        f"init must be one of {INIT_NAMES}, an array of shape (n_components, n_features) "
        f"or an artifact directory, got {init!r}"
    )
