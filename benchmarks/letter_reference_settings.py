"""Learned reference sets on UCI letters at 2% kept: which learner setting closes the gap?

One NCA map (d = 12, the estimator's defaults, seed 0) on ``harness.data.letters``; then the
prototype learner (``training.references.learned.learn_prototypes``, the map fixed, k-means
seed 0) with one setting changed at a time from the command's defaults, and the test accuracy
of the 1-NN rule on the prototypes against the full set's:

* loss f (the default's first choice) and log;
* the softmax scale factor 1, 3 (the default) and 10;
* 500 L-BFGS iterations without the patience stop (the best on validation still kept);
* a budget weighted by each class's training error under the default's prototypes
  (N_c * (error_c + 0.01)^alpha, alpha 0.5 and 1, the same total);
* a per-prototype offset b_j >= 0 added to the squared distance (a power diagram; servable as
  one more coordinate, zero for every query), learned from the default's prototypes;
* the joint mode (prototypes and the 12 x 16 map, log loss, as the job's ``--prototypes``) and
  its d x d refinement (prototypes and a 12 x 12 matrix R on the embeddings, the map R A).

Train, validation and test accuracy are printed, so overfitting shows (train well above test).

Usage: python benchmarks/letter_reference_settings.py [--fraction 0.02]
Writes benchmarks/results/letter_reference_settings.json.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

import numpy as np
from scipy.optimize import minimize

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness.data import letters
from harness.report import machine, print_table, save_json

from training import NCA
from training.evaluation.evaluate import knn_accuracies
from training.references.condense import _nearest
from training.references.learned import (
    PrototypeProblem,
    class_budget,
    learn_prototypes,
    nearest_accuracy,
)

D_LETTERS = 12


def row(name, prototypes, labels, spaces, started) -> dict:
    """Accuracy of the 1-NN rule on ``prototypes`` for each (embeddings, labels) of spaces."""
    out = {"setting": name, "prototypes": len(labels), "seconds": time.perf_counter() - started}
    for split, (u, y) in spaces.items():
        out[split] = nearest_accuracy(u, y, np.asarray(prototypes, np.float32), labels)
    print(out, flush=True)
    return out


def with_offsets(z, y, zv, yv, zt, yt, fit, factor: float) -> tuple[np.ndarray, dict]:
    """The default's prototypes with one more coordinate c_j (offset b_j = c_j^2), started at
    factor / sqrt(g) and learned with the rest (f loss, scale fixed); queries get 0 there.
    The best on validation over 100 L-BFGS iterations is kept."""

    def pad(a):
        return np.hstack([a, np.zeros((len(a), 1), a.dtype)])

    zp, zvp, ztp = pad(z), pad(zv), pad(zt)
    start = np.hstack([fit.prototypes, np.full((len(fit.labels), 1), factor / np.sqrt(fit.scale))])
    problem = PrototypeProblem(
        zp, y, fit.labels, n_components=zp.shape[1], joint=False, loss="f", fixed_scale=True
    )
    best = {"accuracy": -1.0, "prototypes": start}

    def keep_best(theta):
        prototypes = theta[:-1].reshape(start.shape).astype(np.float32)
        accuracy = nearest_accuracy(zvp, yv, prototypes, fit.labels)
        if accuracy > best["accuracy"]:
            best.update(accuracy=accuracy, prototypes=prototypes)

    theta0 = np.concatenate([start.ravel(), [np.log(fit.scale)]])
    minimize(
        problem.loss_and_grad,
        theta0,
        jac=True,
        method="L-BFGS-B",
        callback=keep_best,
        options={"maxiter": 100},
    )
    return best["prototypes"], {"train": (zp, y), "validation": (zvp, yv), "test": (ztp, yt)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fraction", type=float, default=0.02)
    args = parser.parse_args()
    loaded = letters()
    if loaded is None:
        raise SystemExit("run benchmarks/prepare_uci.py first")
    X, y, X_val, y_val, X_test, y_test = loaded
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        nca = NCA(n_components=D_LETTERS, random_state=0).fit(X, y)
    z, zv, zt = nca.transform(X), nca.transform(X_val), nca.transform(X_test)
    spaces = {"train": (z, y), "validation": (zv, y_val), "test": (zt, y_test)}
    full = knn_accuracies(z, y, zt, y_test, 26, (1,))[1]
    print(f"full set 1-NN test accuracy {full:.4f}", flush=True)
    budget = class_budget(y, 1 / args.fraction)
    common = {"x_val": zv, "y_val": y_val}
    rows = []

    def learned(name, **settings):
        started = time.perf_counter()
        fit = learn_prototypes(z, y, reduction=settings.pop("budget", budget), **common, **settings)
        rows.append(row(name, fit.prototypes, fit.labels, spaces, started))
        return fit

    default = learned("default (f loss, scale 3)")
    learned("log loss", loss="log")
    learned("scale factor 1", scale_factor=1.0)
    learned("scale factor 10", scale_factor=10.0)
    learned("500 iterations, no patience (best on validation kept)", patience=0, max_iter=500)
    predicted = default.labels[_nearest(z.astype(np.float32), default.prototypes)]
    classes, counts = np.unique(y, return_counts=True)
    error = np.array([np.mean(predicted[y == c] != c) for c in classes])
    total = len(default.labels)
    for alpha in (0.5, 1.0):
        weight = counts * (error + 0.01) ** alpha
        weighted = np.maximum(1, np.round(weight / weight.sum() * total)).astype(int)
        learned(
            f"budget by training error, alpha {alpha}",
            budget={int(c): int(n) for c, n in zip(classes, weighted, strict=True)},
        )
    for factor in (0.3, 1.0):
        started = time.perf_counter()
        prototypes, padded = with_offsets(z, y, zv, y_val, zt, y_test, default, factor)
        rows.append(row(f"offsets, c0 = {factor}", prototypes, default.labels, padded, started))
    standardised = [((a - nca.mean_) / nca.scale_).astype(np.float32) for a in (X, X_val, X_test)]
    for name, x, start in (
        ("joint mode, 12 x 16 map", standardised, nca.components_),
        ("joint mode, 12 x 12 refinement", (z, zv, zt), np.eye(D_LETTERS)),
    ):
        started = time.perf_counter()
        fit = learn_prototypes(
            x[0],
            y,
            reduction=budget,
            projection=start,
            joint=True,
            x_val=x[1],
            y_val=y_val,
            loss="log",
        )
        a = fit.projection.astype(np.float32)
        joint_spaces = {"train": (x[0] @ a.T, y), "validation": (x[1] @ a.T, y_val)}
        joint_spaces["test"] = (x[2] @ a.T, y_test)
        rows.append(row(name, fit.prototypes, fit.labels, joint_spaces, started))
    for r in rows:
        r["test_change_points"] = 100 * (r["test"] - full)
    print_table(rows, ["setting", "prototypes", "train", "validation", "test", "seconds"])
    save_json(
        "letter_reference_settings.json",
        {"machine": machine(), "fraction": args.fraction, "full_test": full, "rows": rows},
    )


if __name__ == "__main__":
    main()
