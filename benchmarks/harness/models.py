"""The artifacts the serving benchmarks load: D = 64 inputs, N = 60k references projected to
d = 32 (synthetic data, an NCA map learned on 5k of it), a 5k validation split, and the same
with the IVF index ``python -m service.search.tuning`` tunes on that split."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np

from harness.data import synthetic
from service.core.artifact import write_artifact
from service.search.tuning import index_artifact
from training import NCA


def build_models(directory: Path) -> tuple[Path, Path]:
    """(the plain artifact, the same with a tuned IVF index)."""
    X, y = synthetic(65000, n_features=64, seed=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        nca = NCA(n_components=32, max_iter=30, random_state=0).fit(X[:5000], y[:5000])
    plain = write_artifact(
        directory / "model",
        projection=nca.projection_,
        offset=nca.offset_,
        embeddings=nca.transform(X[:60000]),
        labels=y[:60000].astype(np.int32),
        classes=list(range(10)),
        mean=nca.mean_,
        scale=nca.scale_,
        default_k=5,
        validation_embeddings=nca.transform(X[60000:]),
        validation_labels=y[60000:].astype(np.int32),
    )
    indexed = directory / "model-ivf"
    index_artifact(plain, "ivf", out=indexed)
    return plain, indexed
