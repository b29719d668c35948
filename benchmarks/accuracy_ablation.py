"""What limits test accuracy: one setting changed at a time from the estimator's defaults.

USPS (7,291 / 2,007, the papers' data set) at d = 32, test 1-NN and 5-NN accuracy (majority
vote, FAISS exact search), against kNN on the inputs (raw pixels and per-feature standardised)
and scikit-learn's NeighborhoodComponentsAnalysis at the same d (on raw pixels and on
per-feature standardised inputs). One fit per row (the fits are deterministic given the seed);
seconds are wall time on this machine. Falls back to scikit-learn's digits (d = 16) when
../shared/data/usps.npz is absent.

Usage: python benchmarks/accuracy_ablation.py [--sklearn]
Writes benchmarks/results/accuracy_ablation.json.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from candidate_quality import digits_set, knn_accuracy, usps_set
from harness.data import USPS_PATH
from harness.report import machine, print_table, save_json

from training import NCA
from training.model.options import with_options

# (label, parameters changed from the defaults)
SETTINGS = [
    ("defaults", {}),
    ("max_iter=25", {"max_iter": 25}),
    ("max_iter=50", {"max_iter": 50}),
    ("max_iter=200", {"max_iter": 200}),
    ("objective=nca-log (g)", {"objective": "nca-log"}),
    # kNCA at the served k, on 32 candidates per kind and exact (2-3 minutes a fit since its
    # float64 fast path runs in C)
    ("knca-majority k=5, 32 cand.", {"objective": "knca-majority", "k": 5, "n_candidates": 32}),
    ("knca-all k=5, 32 cand.", {"objective": "knca-all", "k": 5, "n_candidates": 32}),
    ("knca-majority k=5, exact", {"objective": "knca-majority", "k": 5, "n_candidates": None}),
    ("knca-all k=5, exact", {"objective": "knca-all", "k": 5, "n_candidates": None}),
    ("init=pca", {"init": "pca"}),
    # init="lda" is not a setting at d = 32 on 10 classes: LDA gives at most C - 1 = 9 axes
    ("init=identity", {"init": "identity"}),
    ("init=random", {"init": "random"}),
    ("l2=0 (the default before)", {"l2": 0.0}),
    ("l2=1e-4", {"l2": 1e-4}),
    ("l2=1e-3", {"l2": 1e-3}),
    ("l2=1e-2", {"l2": 1e-2}),
    ("l2=1e-1", {"l2": 1e-1}),
    ("early_stopping (10% held out)", {"early_stopping": True}),
    ("standardize=feature", {"standardize": "feature"}),
    ("standardize=global", {"standardize": "global"}),
    ("n_candidates=32 (large-N path)", {"n_candidates": 32}),
]


def scores(z_train, y_train, z_test, y_test, n_classes) -> dict:
    return {
        f"acc_{k}nn": knn_accuracy(z_train, y_train, z_test, y_test, k, n_classes) for k in (1, 5)
    }


def standardised(X, Xt):
    mean, std = X.mean(0), X.std(0)
    std[std == 0] = 1.0
    return (X - mean) / std, (Xt - mean) / std


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sklearn", action="store_true", help="also scikit-learn's NCA (slow)")
    args = parser.parse_args()
    if USPS_PATH.is_file():
        name, d, (X, y, Xt, yt) = "usps", 32, usps_set()
    else:
        name, d, (X, y, Xt, yt) = "digits", 16, digits_set()
    n_classes = int(y.max()) + 1
    rows = [{"setting": "kNN on raw inputs", **scores(X, y, Xt, yt, n_classes)}]
    Xs, Xts = standardised(X, Xt)
    rows.append({"setting": "kNN on standardised inputs", **scores(Xs, y, Xts, yt, n_classes)})
    print_table(rows, ["setting", "acc_1nn", "acc_5nn"])
    if args.sklearn:
        from sklearn.neighbors import NeighborhoodComponentsAnalysis

        for label, (A, At) in (("raw", (X, Xt)), ("standardised", (Xs, Xts))):
            started = time.perf_counter()
            model = NeighborhoodComponentsAnalysis(n_components=d, random_state=0).fit(A, y)
            rows.append(
                {
                    "setting": f"scikit-learn NCA ({label} inputs)",
                    **scores(model.transform(A), y, model.transform(At), yt, n_classes),
                    "seconds": time.perf_counter() - started,
                    "n_iter": int(model.n_iter_),
                }
            )
            print(rows[-1], flush=True)
    for label, params in SETTINGS:
        started = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = NCA(**with_options(dict(n_components=d, random_state=0, **params))).fit(X, y)
        rows.append(
            {
                "setting": label,
                **scores(model.transform(X), y, model.transform(Xt), yt, n_classes),
                "seconds": time.perf_counter() - started,
                "n_iter": int(model.n_iter_),
                "stop_reason": model.stop_reason_,
                "standardization": model.standardization_,
                "init": model.init_used_,
            }
        )
        print(rows[-1], flush=True)
    columns = ["setting", "acc_1nn", "acc_5nn", "seconds", "n_iter", "stop_reason"]
    print_table(rows, [*columns, "standardization", "init"])
    save_json("accuracy_ablation.json", {"machine": machine(), "data": name, "d": d, "rows": rows})


if __name__ == "__main__":
    main()
