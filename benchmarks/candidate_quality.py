"""Does training on candidate sets learn what exact training learns? Test kNN accuracy of
NCA / kNCA maps learned exactly (every point a neighbour) and on K nearest same- and
other-class candidates per point, on hard data, against kNN on the standardised inputs.

Data sets (train / test; labels of the training split resampled at random for the noisy
ones, test labels clean):

* ``hard``: 10 overlapping Gaussian classes, signal in 8 of 40 dimensions (4,000 training
  points, 6,000 test points so that a point of accuracy is outside the noise; Euclidean
  5-NN about 0.5), clean and with 25% label noise;
* ``digits``: scikit-learn's 8 x 8 digits, clean and with 25% label noise;
* ``usps``: USPS 16 x 16 (7,291 / 2,007), with 25% label noise, when
  ../shared/data/usps.npz is present.

Methods: the exact fit; candidate sets alone (round 1's fixed refreshes, the default watch
with 16 and 64 candidates, 16 drawn candidates), all with ``exact_finish=0``; and the
defaults on candidate sets, which end with 10 L-BFGS iterations on the exact objective
(``exact_finish="auto"``). With ``--knca`` the same for kNCA-majority k = 5, exact
included (about a minute per fit at N = 7,291), whose "auto" finish is 20 iterations
averaged over at most 2,048 evenly spaced query rows.

For every candidate fit the table also says whether its self-audit warned
(``NCA.candidate_warning_``) and the largest gap seen between the candidate objective and
the exact objective on the audit sample (NCA objectives).

Usage: python benchmarks/candidate_quality.py [--d 16] [--max-iter 40] [--sets hard,digits]
Writes benchmarks/results/candidate_quality.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness.data import USPS_PATH
from harness.report import RESULTS, machine, print_table, save_json

from service.core.knn import decide, exact_knn
from training import NCA
from training.distributed.ranks import current_group
from training.distributed.sharded_stats import standardizer
from training.model.options import with_options

NOISE = 0.25


def resample_labels(y: np.ndarray, fraction: float, n_classes: int, seed: int) -> np.ndarray:
    """A copy of y with ``fraction`` of the entries replaced by uniformly drawn classes."""
    rng = np.random.default_rng(seed)
    out = y.copy()
    hit = rng.random(len(y)) < fraction
    out[hit] = rng.integers(0, n_classes, hit.sum())
    return out


def hard_set(seed: int = 0):
    rng = np.random.default_rng(seed)
    n, n_features, n_classes = 10000, 40, 10
    means = np.zeros((n_classes, n_features))
    means[:, :8] = rng.normal(0, 1.05, (n_classes, 8))
    y = rng.integers(0, n_classes, n)
    X = means[y] + rng.normal(0, 1.0, (n, n_features))
    return X[:4000], y[:4000], X[4000:], y[4000:]


def digits_set(seed: int = 0):
    from sklearn.datasets import load_digits

    X, y = load_digits(return_X_y=True)
    order = np.random.default_rng(seed).permutation(len(y))
    X, y = X[order], y[order]
    return X[:1400], y[:1400], X[1400:], y[1400:]


def usps_set():
    with np.load(USPS_PATH, allow_pickle=False) as d:
        return d["X"], d["y"].astype(np.int64), d["X_test"], d["y_test"].astype(np.int64)


def knn_accuracy(z_train, y_train, z_test, y_test, k: int, n_classes: int) -> float:
    distances, indices = exact_knn(
        np.ascontiguousarray(z_test, np.float32), np.ascontiguousarray(z_train, np.float32), k
    )
    predicted, _ = decide(y_train[indices], distances, n_classes, "majority")
    return float(np.mean(predicted == y_test))


# (label, objective, k, parameters): exact, the round-1 candidate mode (a refresh every 10
# iterations, K fixed), candidate sets alone (refresh when the mass inside the candidates
# falls, K chosen from the data; no exact finish), and the defaults on candidate sets (the
# same, then exact_finish="auto": L-BFGS iterations on the exact objective, 5 since round 6,
# 10 when the figures in benchmarks/README.md were measured)
FIXED = {"refresh_tol": None, "candidate_mass": None}
ALONE = {"exact_finish": 0}
NCA_METHODS = [
    ("nca exact", "nca", 1, {"n_candidates": None}),
    ("nca 16 fixed", "nca", 1, {"n_candidates": 16, **FIXED, **ALONE}),
    ("nca 16", "nca", 1, {"n_candidates": 16, **ALONE}),
    ("nca 64", "nca", 1, {"n_candidates": 64, **ALONE}),
    ("nca 16 + exact finish (defaults)", "nca", 1, {"n_candidates": 16}),
]
# exact_finish="auto" for kNCA: 20 iterations averaged over at most 2,048 evenly spaced query
# rows (an exact kNCA pair costs ~20x an NCA one)
KNCA_METHODS = [
    ("knca-majority exact", "knca-majority", 5, {"n_candidates": None}),
    ("knca-majority 16 fixed", "knca-majority", 5, {"n_candidates": 16, **FIXED, **ALONE}),
    ("knca-majority 16", "knca-majority", 5, {"n_candidates": 16, **ALONE}),
    ("knca-majority 16 + exact finish (defaults)", "knca-majority", 5, {"n_candidates": 16}),
]


def fit(X, y, *, objective: str, k: int, params: dict, d: int, max_iter: int) -> tuple:
    started = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = NCA(
            **with_options(
                dict(
                    n_components=d,
                    objective=objective,
                    k=k,
                    max_iter=max_iter,
                    random_state=0,
                    **params,
                )
            )
        ).fit(X, y)
    return model, time.perf_counter() - started


def largest_gap(history: list[dict]) -> float | None:
    gaps = [
        r["sample_candidate_objective"] - r["sample_exact_objective"]
        for r in history
        if "sample_exact_objective" in r
    ]
    return max(gaps) if gaps else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--d", type=int, default=16)
    parser.add_argument("--max-iter", type=int, default=40)
    parser.add_argument("--sets", default="hard,digits,usps")
    parser.add_argument(
        "--knca", action="store_true", help="also kNCA-majority k = 5 (slow: exact kNCA)"
    )
    args = parser.parse_args()
    loaders = {"hard": hard_set, "digits": digits_set, "usps": usps_set}
    methods = NCA_METHODS + (KNCA_METHODS if args.knca else [])
    rows = []
    for name in args.sets.split(","):
        if name == "usps" and not USPS_PATH.is_file():
            print(f"usps skipped: {USPS_PATH} not found")
            continue
        X, y, X_test, y_test = loaders[name]()
        n_classes = int(max(y.max(), y_test.max())) + 1
        mean, scale = standardizer("feature", X, len(X), current_group())
        for noise in (0.0, NOISE):
            y_train = resample_labels(y, noise, n_classes, seed=1) if noise else y
            base = {"data": name, "noise": noise, "n_train": len(X)}
            for k in (1, 5):
                acc = knn_accuracy(
                    (X - mean) / scale, y_train, (X_test - mean) / scale, y_test, k, n_classes
                )
                rows.append({**base, "method": "Euclidean (standardised)", "k": k, "accuracy": acc})
            for label, objective, k_obj, params in methods:
                model, seconds = fit(
                    X,
                    y_train,
                    objective=objective,
                    k=k_obj,
                    params=params,
                    d=args.d,
                    max_iter=args.max_iter,
                )
                exact = params["n_candidates"] is None
                z, z_test = model.transform(X), model.transform(X_test)
                for k in (1, 5):
                    rows.append(
                        {
                            **base,
                            "method": label,
                            "k": k,
                            "accuracy": knn_accuracy(z, y_train, z_test, y_test, k, n_classes),
                            "seconds": seconds,
                            "warned": None if exact else model.candidate_warning_ is not None,
                            "largest_gap": largest_gap(model.history_),
                            "final_k": None if exact else model.n_candidates_,
                            "l2": model.l2_,
                            "finish_iter": model.exact_finish_iter_,
                        }
                    )
            print_table(
                [r for r in rows if r["data"] == name and r["noise"] == noise],
                [
                    "data",
                    "noise",
                    "method",
                    "k",
                    "accuracy",
                    "seconds",
                    "warned",
                    "largest_gap",
                    "final_k",
                    "l2",
                    "finish_iter",
                ],
            )
    ran = set(args.sets.split(","))
    kept = [r for r in previous_rows(args.d, args.max_iter) if r["data"] not in ran]
    save_json(
        "candidate_quality.json",
        {"machine": machine(), "d": args.d, "max_iter": args.max_iter, "rows": kept + rows},
    )


def previous_rows(d: int, max_iter: int) -> list[dict]:
    """The saved rows of the same d and iteration budget (kept for the sets not run now)."""
    path = RESULTS / "candidate_quality.json"
    if not path.is_file():
        return []
    saved = json.loads(path.read_text())
    return saved["rows"] if (saved["d"], saved["max_iter"]) == (d, max_iter) else []


if __name__ == "__main__":
    main()
