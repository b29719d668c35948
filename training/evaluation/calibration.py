"""When the nearest neighbour is far away (Barber, ch. 14.3.1): calibrate "far" on held-out data.

A k-NN answer for a query far from every reference is a guess dressed as a prediction. What
"far" means is measured, not assumed: each validation point (held out of training, so it is
as new to the references as a query) is at some squared Euclidean distance from its nearest
reference in the learned space, the same distance the service reports for neighbours. The
quantiles of those distances go into the manifest (``outlier_calibration``); a query whose
nearest reference is farther than the q-quantile is, by construction, rarer than a fraction
1 - q of in-distribution queries. The offline evaluation reports the rate of such queries
on the test split and the accuracy on flagged and unflagged points, with the same
functions the service flags with (``service.core.knn.outlier_threshold`` / ``outlier_flags``),
and what the ``soft_prior`` rule (``service.core.knn.FarPrior``) does to the confidence of the
flagged points.

The quantile function is stored on a grid (:data:`QUANTILES`), dense in the tail where
thresholds are chosen; the service interpolates it linearly in q between grid points, so
any quantile in [0.5, 0.999] can be asked for per request.
"""

from __future__ import annotations

import numpy as np

from service.core.artifact import parse_outlier_calibration
from service.core.knn import FarPrior, decide, outlier_flags, outlier_threshold
from service.core.vocabulary import DecisionRule
from training.evaluation.evaluate import nearest_references

SOFT, SOFT_PRIOR = DecisionRule.SOFT.value, DecisionRule.SOFT_PRIOR.value

QUANTILES = (0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.96, 0.97, 0.98, 0.99, 0.995, 0.999)
DEFAULT_QUANTILE = 0.99


def nearest_sq_distances(z_references: np.ndarray, z_queries: np.ndarray) -> np.ndarray:
    """(n,) squared Euclidean distance of each query to its nearest reference."""
    if len(z_queries) == 0:
        return np.empty(0)
    dist, _ = nearest_references(np.asarray(z_queries), np.asarray(z_references), 1)
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


def threshold_of(calibration: dict, quantile: float = DEFAULT_QUANTILE) -> float:
    """The squared distance beyond which a point is flagged at ``quantile`` (as served)."""
    return outlier_threshold(parse_outlier_calibration(calibration)["quantiles"], quantile)


def outlier_report(
    calibration: dict | None,
    z_references: np.ndarray,
    y_references: np.ndarray,
    z_test: np.ndarray,
    y_test: np.ndarray,
    n_classes: int,
    k: int,
    rule: str,
    quantile: float = DEFAULT_QUANTILE,
) -> dict | None:
    """Test points beyond the calibrated ``quantile``: their rate, the served rule's
    accuracy on flagged and unflagged points, and on the flagged ones the mean top
    probability under ``soft`` and under ``soft_prior`` (how confident the answers far
    from the data are, and how much the prior rule tempers them), with k neighbours."""
    if calibration is None or len(z_test) == 0:
        return None
    threshold = threshold_of(calibration, quantile)
    k = min(k, len(z_references))
    dist, idx = nearest_references(np.asarray(z_test), np.asarray(z_references), k)
    labels = np.asarray(y_references)[idx]
    flagged = outlier_flags(dist, threshold)
    background = FarPrior.of(z_references, y_references, n_classes).background(z_test, threshold)
    decisions = {
        name: decide(labels, dist, n_classes, name, background if name == SOFT_PRIOR else None)
        for name in {rule, SOFT, SOFT_PRIOR}
    }
    correct = decisions[rule][0] == np.asarray(y_test)

    def mean(values, mask):
        return float(values[mask].mean()) if mask.any() else None

    return {
        "quantile": quantile,
        "threshold": threshold,
        "k": k,
        "rule": rule,
        "n_flagged": int(flagged.sum()),
        "rate": float(flagged.mean()),
        "accuracy_flagged": mean(correct, flagged),
        "accuracy_unflagged": mean(correct, ~flagged),
        "soft_prior_accuracy_flagged": mean(decisions[SOFT_PRIOR][0] == y_test, flagged),
        "confidence_flagged": {
            name: mean(decisions[name][1].max(axis=1), flagged) for name in (SOFT, SOFT_PRIOR)
        },
    }
