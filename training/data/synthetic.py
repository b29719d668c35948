"""A synthetic classification problem at any size: classes made of Gaussian clusters in a
low-dimensional subspace, plus isotropic noise in every feature, with a knob for how much the
classes overlap. It stands for the embeddings users bring (128-1,024 features, tens of
classes, several modes per class) and scales to millions of rows in bounded memory.

The distribution is fixed by ``seed``: each class c has ``clusters_per_class`` centres
mu_ck ~ N(0, I_s) in an s-dimensional latent space (s = ``subspace_dim``), and a random
orthonormal basis U (D, s) places that space among the D features. A row of class c is

    x = U (mu_ck + overlap * e) + noise * e',   k uniform, e ~ N(0, I_s), e' ~ N(0, I_D),

so ``overlap`` is the spread of a cluster relative to the spread of the centres (larger:
classes overlap more, and the Bayes error rises), and ``noise`` the spread of the D - s
directions that carry no class information (what Euclidean kNN on the raw features suffers
from and a learned map removes).

**Moving neighbourhoods** (``nuisance_dim`` > 0): every row also gets a *style*, one of
``nuisance_clusters`` centres nu_m ~ N(0, I_q) drawn independently of its class, placed by an
orthonormal basis V (D, q) orthogonal to U and scaled by ``nuisance_scale``:

    x = U (mu_ck + overlap * e) + nuisance_scale * V nu_m + noise * e'.

With many clusters per class (their centres drawn from one law, so the classes' clusters
interleave) and a nuisance spread above the centres', a row's nearest rows at the start share
its style, not its class; a map that learns to drop V's directions moves every neighbourhood,
so candidate sets found at the start are wrong later (what a fit at scale must keep up with).
The default ``nuisance_dim=0`` draws nothing more: the sample is the first formula's.

A sample is drawn with ``sample_seed``: training and test sets are two samples of one
distribution. Rows are drawn in blocks of ``BLOCK_ROWS`` with a generator per block, so a
sample does not depend on how it is consumed, and memory beyond the result is
O(BLOCK_ROWS D).
"""

from __future__ import annotations

import numpy as np

BLOCK_ROWS = 65536


def clustered_classes(
    n_samples: int,
    *,
    n_features: int = 128,
    n_classes: int = 20,
    clusters_per_class: int = 4,
    subspace_dim: int = 24,
    overlap: float = 0.6,
    noise: float = 0.3,
    seed: int = 0,
    sample_seed: int = 1,
    out: np.ndarray | None = None,
    nuisance_dim: int = 0,
    nuisance_clusters: int = 1,
    nuisance_scale: float = 0.0,
) -> tuple[np.ndarray, np.ndarray]:
    """(X (n, D) float32, y (n,) int64) drawn from the distribution ``seed`` names (see the
    module docstring); classes are equally likely. ``out``: an (n, D) float32 array to fill
    (a memory map for sets larger than memory), returned as X."""
    if n_samples < 1 or n_features < 1 or n_classes < 2 or clusters_per_class < 1:
        raise ValueError(
            f"n_samples={n_samples}, n_features={n_features}, n_classes={n_classes} and "
            f"clusters_per_class={clusters_per_class} must be >= 1, 1, 2 and 1"
        )
    if not 1 <= subspace_dim <= n_features:
        raise ValueError(f"subspace_dim={subspace_dim} must lie in [1, n_features={n_features}]")
    if overlap < 0 or noise < 0:
        raise ValueError(f"overlap={overlap} and noise={noise} must be >= 0")
    if not 0 <= nuisance_dim <= n_features - subspace_dim:
        raise ValueError(
            f"nuisance_dim={nuisance_dim} must lie in [0, n_features - subspace_dim = "
            f"{n_features - subspace_dim}]"
        )
    if nuisance_clusters < 1 or nuisance_scale < 0:
        raise ValueError(
            f"nuisance_clusters={nuisance_clusters} and nuisance_scale={nuisance_scale} must "
            "be >= 1 and >= 0"
        )
    law = np.random.default_rng(seed)
    centres = law.normal(size=(n_classes, clusters_per_class, subspace_dim))  # (C, K, s)
    basis, _ = np.linalg.qr(law.normal(size=(n_features, subspace_dim)))  # (D, s)
    styles = None
    if nuisance_dim:
        drawn = law.normal(size=(n_features, nuisance_dim))
        drawn -= basis @ (basis.T @ drawn)  # orthogonal to the class subspace
        nuisance_basis, _ = np.linalg.qr(drawn)  # (D, q)
        style_centres = law.normal(size=(nuisance_clusters, nuisance_dim))  # (M, q)
        styles = nuisance_scale * style_centres @ nuisance_basis.T  # (M, D)
    X = np.empty((n_samples, n_features), np.float32) if out is None else out
    if X.shape != (n_samples, n_features):
        raise ValueError(f"out has shape {X.shape}, expected {(n_samples, n_features)}")
    y = np.empty(n_samples, np.int64)
    for block, start in enumerate(range(0, n_samples, BLOCK_ROWS)):
        stop = min(start + BLOCK_ROWS, n_samples)
        draw = np.random.default_rng([sample_seed, block])
        labels = draw.integers(0, n_classes, stop - start)
        modes = draw.integers(0, clusters_per_class, stop - start)
        latent = centres[labels, modes] + overlap * draw.normal(size=(stop - start, subspace_dim))
        rows = latent @ basis.T + noise * draw.normal(size=(stop - start, n_features))
        if styles is not None:
            rows += styles[draw.integers(0, nuisance_clusters, stop - start)]
        X[start:stop] = rows
        y[start:stop] = labels
    return X, y
