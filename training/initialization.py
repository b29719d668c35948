"""Initial transformations A (d, D) on standardised inputs.

``auto`` follows scikit-learn's rule: LDA when d <= min(D, C - 1), else PCA when
d < min(D, N), else the identity. ``pca`` takes the top-d principal axes, ``lda`` the
first d LDA scalings, ``identity`` the first d rows of I, ``random`` a standard normal
matrix; an explicit (d, D) array or an artifact directory (warm start) is used as given.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

INIT_NAMES = ("auto", "pca", "lda", "identity", "random")


def resolve_auto(n_components: int, n_features: int, n_samples: int, n_classes: int) -> str:
    if n_components <= min(n_features, n_classes - 1):
        return "lda"
    if n_components < min(n_features, n_samples):
        return "pca"
    return "identity"


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
        from service.artifact import read_artifact

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
        A = np.asarray(init, dtype=np.float64)
        if A.ndim != 2 or A.shape[1] != n_features:
            raise ValueError(
                f"init: expected an array of shape (n_components, {n_features}), got {A.shape}"
            )
        if A.shape[0] != n_components:
            raise ValueError(
                f"init has {A.shape[0]} rows but n_components={n_components}; they must match"
            )
        if not np.all(np.isfinite(A)):
            raise ValueError("init: contains NaN or Inf")
        return A.copy(), name

    if name == "auto":
        name = resolve_auto(n_components, n_features, n_samples, len(np.unique(y)))
    if name == "identity":
        return np.eye(n_components, n_features), name
    if name == "random":
        return random_state.standard_normal((n_components, n_features)), name
    if name == "pca":
        from sklearn.decomposition import PCA

        seed = int(random_state.integers(2**31 - 1))
        pca = PCA(n_components=n_components, random_state=seed).fit(X)
        return np.asarray(pca.components_, dtype=np.float64), name
    if name == "lda":
        from sklearn.discriminant_analysis import LinearDiscriminantAnalysis

        n_classes = len(np.unique(y))
        if n_components > min(n_features, n_classes - 1):
            raise ValueError(
                f"init='lda' gives at most min(n_features, n_classes - 1) = "
                f"{min(n_features, n_classes - 1)} components, n_components={n_components}"
            )
        lda = LinearDiscriminantAnalysis(n_components=n_components).fit(X, y)
        return np.asarray(lda.scalings_.T[:n_components], dtype=np.float64), name
    raise ValueError(
        f"init must be one of {INIT_NAMES}, an array of shape (n_components, n_features) "
        f"or an artifact directory, got {init!r}"
    )
