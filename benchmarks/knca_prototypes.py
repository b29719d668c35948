"""kNCA's k > 1 rule on learned prototypes, where the served k is above 1.

The learned reference set (``references condense --method prototypes``: NCA's f loss, the map
fixed, Wilson editing under noise) is trained for the 1-NN rule, yet validation sometimes
serves it at k > 1 (USPS with 25% label noise: k = 3 at 5%). Here the same prototypes are
then trained further on kNCA's exact expected accuracy of a k-vote won outright
("knca-majority", Tarlow et al. 2013) of the training rows against the prototypes (every
prototype a candidate of every row: ``training.objectives.neighbourhood.objective_sum`` on
[rows; prototypes] with candidate sets pointing at the prototypes), by L-BFGS with the
iteration of the best validation accuracy at that k kept, and served at that k.

Usage: python benchmarks/knca_prototypes.py [--set usps] [--noise 0.25] [--reduction 20]
Writes benchmarks/results/knca_prototypes.json. Needs ../shared/data/usps.npz.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import torch
from scipy.optimize import minimize

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness.report import machine, save_json
from learned_references import letters26, scores, usps, with_noise


def train_knca(z, y, prototypes, labels, k, z_val, y_val, n_classes, max_iter=100):
    """The prototypes moved to maximise kNCA-majority at k; the best validation iteration."""
    from training.evaluation.evaluate import knn_accuracies
    from training.objectives.neighbourhood import objective_sum
    from training.objectives.registry import make_objective
    from training.references.learned import _starting_log_scale

    root = float(np.sqrt(3.0 * np.exp(_starting_log_scale(z, prototypes))))  # the f fit's g
    n, m = len(z), len(labels)
    rows_z = torch.tensor(z * root, dtype=torch.float64)
    all_labels = torch.tensor(np.r_[y, labels], dtype=torch.long)
    candidates = torch.full((n + m, m), -1, dtype=torch.long)
    candidates[:n] = torch.arange(n, n + m)
    objective = make_objective("knca-majority", k, n_classes=n_classes)

    def loss_and_grad(theta):
        z_p = torch.tensor(theta.reshape(m, -1), requires_grad=True)
        value = (
            -objective_sum(
                torch.cat([rows_z, z_p]),
                all_labels,
                objective,
                rows=torch.arange(n),
                candidates=candidates,
            )
            / n
        )
        value.backward()
        return float(value.detach()), z_p.grad.numpy().ravel().copy()

    best = {"accuracy": -1.0, "theta": None, "iteration": [0]}

    def check(theta):
        best["iteration"][0] += 1
        if best["iteration"][0] % 10:
            return
        refs = (theta.reshape(m, -1) / root).astype(np.float32)
        accuracy = knn_accuracies(refs, labels, z_val, y_val, n_classes, (k,))[k]
        if accuracy > best["accuracy"]:
            best.update(accuracy=accuracy, theta=theta.copy())

    start = (prototypes * root).ravel()
    result = minimize(
        loss_and_grad,
        start,
        jac=True,
        method="L-BFGS-B",
        callback=check,
        options={"maxiter": max_iter},
    )
    theta = best["theta"] if best["theta"] is not None else result.x
    return (theta.reshape(m, -1) / root).astype(np.float32), int(result.nit)


def main() -> None:
    from training import NCA
    from training.evaluation.evaluate import knn_accuracies
    from training.references.compress import compress, edit_k_for

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--set", default="usps", choices=("usps", "letters26"))
    parser.add_argument("--noise", type=float, default=0.25)
    parser.add_argument("--reduction", type=float, default=20.0)
    args = parser.parse_args()
    X, y, X_val, y_val, X_test, y_test = {"usps": usps, "letters26": letters26}[args.set]()
    n_classes = int(y.max()) + 1
    y, y_val = with_noise(y, n_classes, args.noise, 1), with_noise(y_val, n_classes, args.noise, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        nca = NCA(n_components=32 if args.set == "usps" else 12, random_state=0).fit(X, y)
    z, z_val, z_test = nca.transform(X), nca.transform(X_val), nca.transform(X_test)
    common = (z_val, y_val, z_test, y_test, n_classes)
    full = scores(z, y, *common, fallback=3)
    learned = compress(
        z,
        y,
        reduction=args.reduction,
        n_classes=n_classes,
        rule="majority",
        edit_k=edit_k_for(full["served_k"]),
        x_val=z_val,
        y_val=y_val,
    )
    prototypes, labels = learned.fit.prototypes.astype(np.float64), learned.fit.labels
    rows = [
        {"method": "full set", **full},
        {"method": "learned (f loss, 1-NN)", **scores(prototypes, labels, *common, 1)},
    ]
    for k in (3, 5):
        started = time.perf_counter()
        moved, iterations = train_knca(z, y, prototypes, labels, k, z_val, y_val, n_classes)
        test = knn_accuracies(moved, labels, z_test, y_test, n_classes, (1, k))
        rows.append(
            {
                "method": f"then knca-majority, k = {k}",
                "test_at_k": test[k],
                "test_at_1": test[1],
                **{f"served_{key}": v for key, v in scores(moved, labels, *common, k).items()},
                "seconds": time.perf_counter() - started,
                "iterations": iterations,
            }
        )
    for row in rows:
        print(row)
    save_json(
        "knca_prototypes.json",
        {
            "machine": machine(),
            "set": args.set,
            "noise": args.noise,
            "reduction": args.reduction,
            "references": len(labels),
            "rows": rows,
        },
    )


if __name__ == "__main__":
    main()
