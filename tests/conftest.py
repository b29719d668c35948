"""Shared fixtures. Data sets come from scikit-learn or are generated; USPS is optional."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
USPS_PATH = ROOT.parent / "shared" / "data" / "usps.npz"


@pytest.fixture
def rng():
    return np.random.default_rng(0)


@pytest.fixture(scope="session")
def usps():
    """USPS digits (X, y, X_test, y_test), skipped when ../shared/data/usps.npz is absent."""
    if not USPS_PATH.is_file():
        pytest.skip(f"USPS data not found at {USPS_PATH}")
    with np.load(USPS_PATH, allow_pickle=False) as data:
        return data["X"], data["y"], data["X_test"], data["y_test"]


def make_rings(n_per_class: int, noise_std: float, seed: int):
    """The NCA paper's concentric rings: 5 classes on circles of radius 1..5 in (x1, x2),
    plus a third, high-variance Gaussian noise dimension unrelated to the class."""
    rng = np.random.default_rng(seed)
    X, y = [], []
    for c in range(5):
        angle = rng.uniform(0, 2 * np.pi, n_per_class)
        radius = (c + 1) + rng.normal(0, 0.05, n_per_class)
        noise = rng.normal(0, noise_std, n_per_class)
        X.append(np.column_stack([radius * np.cos(angle), radius * np.sin(angle), noise]))
        y.append(np.full(n_per_class, c))
    return np.vstack(X), np.concatenate(y)
