"""When the nearest neighbour is far away (Barber, ch. 14.3.1): calibrate "far" on held-out data.

A k-NN answer for a query far from every reference is a guess dressed as a prediction. What
"far" means is measured, not assumed: each validation point (held out of training, so it is
as new to the references as a query) is at some squared Euclidean distance from its nearest
reference in the learned space, the same distance the service reports for neighbours. The
quantiles of those distances go into the manifest (``outlier_calibration``); a query whose
nearest reference is farther than the q-quantile is, by construction, rarer than a fraction
1 - q of in-distribution queries. The offline evaluation reports the rate of such queries
on the test split and the accuracy on flagged and unflagged points.
"""

from __future__ import annotations

import numpy as np

from service.knn import exact_knn

QUANTILES = (0.5, 0.9, 0.95, 0.99, 0.999)
DEFAULT_QUANTILE = 0.99


def nearest_sq_distances(z_references: np.ndarray, z_queries: np.ndarray) -> np.ndarray:
    """(n,) squared Euclidean distance of each query to its nearest reference."""
    if len(z_queries) == 0:
        return np.empty(0)
    dist, _ = exact_knn(np.asarray(z_queries), np.asarray(z_references), 1)
    return dist[:, 0]


def calibrate(z_references: np.ndarray, z_validation: np.ndarray) -> dict | None:
    """The manifest's ``outlier_calibration``: quantiles of the validation points' nearest-
    reference squared distances (None without validation points)."""
    d = nearest_sq_distances(z_references, z_validation)
    if len(d) == 0:
        return None
    return {
        "distance": "squared Euclidean to the nearest reference, in the learned space",
        "source": "validation split",
        "n": len(d),
        "quantiles": {str(q): float(np.quantile(d, q)) for q in QUANTILES},
        "max": float(d.max()),
    }


def outlier_report(
    calibration: dict | None,
    z_references: np.ndarray,
    z_test: np.ndarray,
    correct: np.ndarray,
    quantile: float = DEFAULT_QUANTILE,
) -> dict | None:
    """Test points beyond the calibrated ``quantile``: their rate, and accuracy on flagged
    and unflagged points (``correct`` (n,) bool: the served prediction was right)."""
    if calibration is None or len(z_test) == 0:
        return None
    threshold = calibration["quantiles"][str(quantile)]
    flagged = nearest_sq_distances(z_references, z_test) > threshold

    def accuracy(mask):
        return float(correct[mask].mean()) if mask.any() else None

    return {
        "quantile": quantile,
        "threshold": threshold,
        "n_flagged": int(flagged.sum()),
        "rate": float(flagged.mean()),
        "accuracy_flagged": accuracy(flagged),
        "accuracy_unflagged": accuracy(~flagged),
    }
