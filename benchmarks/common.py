"""Helpers shared by the benchmark scripts: synthetic data, peak memory, timing, output."""

from __future__ import annotations

import json
import os
import platform
import resource
import statistics
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
USPS_PATH = HERE.parent.parent / "shared" / "data" / "usps.npz"


def synthetic(n: int, n_features: int = 784, n_classes: int = 10, seed: int = 0, latent: int = 40):
    """Multimodal classes in a low-dimensional subspace of a high-dimensional space.

    Each class is a mixture of 3 Gaussian blobs in a `latent`-dim subspace (so the classes are
    not linearly separable by their means alone), embedded by a random orthonormal map into
    `n_features` dims, plus isotropic noise. Raw-input 1-NN accuracy is about 0.65 and PCA-32's
    about 0.72 at N = 10k, so there is room for a learned metric. Returns X (n, D) float32 and
    y (n,) int64.
    """
    rng = np.random.default_rng(seed)
    centres = rng.normal(0, 1.0, size=(n_classes, 3, latent))
    y = rng.integers(0, n_classes, n)
    mode = rng.integers(0, 3, n)
    z = centres[y, mode] + rng.normal(0, 1.5, size=(n, latent))
    basis, _ = np.linalg.qr(rng.normal(size=(n_features, latent)))
    X = z @ basis.T + rng.normal(0, 0.5, size=(n, n_features))
    return X.astype(np.float32), y


def peak_rss_mib() -> float:
    """Peak resident set size of this process so far (MiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def machine() -> dict:
    return {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "date": time.strftime("%Y-%m-%d"),
    }


def median(values):
    return statistics.median(values)


def save_json(name: str, payload: dict) -> Path:
    out = HERE / "results" / name
    out.parent.mkdir(exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(payload, indent=2, sort_keys=True, default=float))
    tmp.replace(out)
    return out


def print_table(rows: list[dict], columns: list[str]) -> None:
    widths = {c: max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in columns}
    print(" | ".join(c.ljust(widths[c]) for c in columns))
    print("-+-".join("-" * widths[c] for c in columns))
    for r in rows:
        print(" | ".join(_fmt(r.get(c)).ljust(widths[c]) for c in columns))


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "" if value is None else str(value)
