"""Which l2 should the estimator default to? Stratified 5-fold cross-validation on training data.

For each data set, each l2 in ``--l2`` and scikit-learn's NeighborhoodComponentsAnalysis (the
reference a user would otherwise pick; on raw inputs and behind a StandardScaler), fit on four folds and predict the fifth with 1-NN and
5-NN (majority vote, scikit-learn's KNeighborsClassifier), so every training point is
predicted once by a model that did not see it. Test sets are never touched: the choice of a
default must not be tuned on the figures it is later judged by. Printed per data set: the
cross-validated accuracy of each setting, and its paired difference to l2 = 0 with a 95%
bootstrap interval over the out-of-fold predictions (2,000 resamples). Then the rule that
picks the default: among the l2 values never significantly worse than l2 = 0 (no interval
entirely below zero, on any set at either k), the one with the largest gain averaged over
the data sets and k = 1, 5.

Data: USPS's 7,291 training digits (skipped when ../shared/data/usps.npz is absent),
scikit-learn's digits, wine, breast cancer and iris, and the hard synthetic set of
``candidate_quality.py`` (4,000 points, 40 features, 10 overlapping classes) clean and with
25% of its labels resampled. d = min(32, D), defaults otherwise; every set is under
AUTO_EXACT_MAX_SAMPLES, so every fit is on the exact objective, the path where l2="auto"
applies the chosen value (on candidate sets it is 0: see the estimator's docstring).

Usage: python benchmarks/default_l2.py [--sets usps,digits,...] [--l2 0,1e-4,...] [--no-sklearn]
(about 10 minutes on 2 cores with every set)
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from functools import partial
from pathlib import Path

import numpy as np
from sklearn.datasets import load_breast_cancer, load_digits, load_iris, load_wine
from sklearn.model_selection import StratifiedKFold
from sklearn.neighbors import KNeighborsClassifier, NeighborhoodComponentsAnalysis
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler

sys.path.insert(0, str(Path(__file__).resolve().parent))
from candidate_quality import NOISE, hard_set, resample_labels
from common import USPS_PATH, machine, median, print_table, save_json

from training import NCA

KS = (1, 5)
N_FOLDS = 5
N_RESAMPLES = 2000


def load_sets() -> dict:
    """name -> loader returning the training part (X (N, D), y (N,)) of each data set."""

    def usps():
        with np.load(USPS_PATH, allow_pickle=False) as d:
            return d["X"], d["y"].astype(np.int64)

    def hard(noise: float):
        X, y, _, _ = hard_set()
        return X, (resample_labels(y, noise, 10, seed=1) if noise else y)

    return {
        "usps": usps,
        "digits": lambda: load_digits(return_X_y=True),
        "wine": lambda: load_wine(return_X_y=True),
        "breast_cancer": lambda: load_breast_cancer(return_X_y=True),
        "iris": lambda: load_iris(return_X_y=True),
        "hard": lambda: hard(0.0),
        "hard_noisy": lambda: hard(NOISE),
    }


def out_of_fold(make_model, X, y) -> tuple[dict, float]:
    """{k: (N,) bool, whether each point's k-NN prediction is right} and the median fit s."""
    right = {k: np.zeros(len(y), dtype=bool) for k in KS}
    seconds = []
    folds = StratifiedKFold(N_FOLDS, shuffle=True, random_state=0)
    for fit_rows, held_rows in folds.split(X, y):
        started = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # ConvergenceWarning: the budget is part of a default
            model = make_model().fit(X[fit_rows], y[fit_rows])
        seconds.append(time.perf_counter() - started)
        z_fit, z_held = model.transform(X[fit_rows]), model.transform(X[held_rows])
        for k in KS:
            knn = KNeighborsClassifier(k).fit(z_fit, y[fit_rows])
            right[k][held_rows] = knn.predict(z_held) == y[held_rows]
    return right, median(seconds)


def paired_interval(a: np.ndarray, b: np.ndarray, rng: np.random.Generator) -> tuple:
    """95% bootstrap interval of mean(a) - mean(b) over the same resampled points."""
    picks = rng.integers(0, len(a), (N_RESAMPLES, len(a)))
    differences = a[picks].mean(axis=1) - b[picks].mean(axis=1)
    return tuple(np.percentile(differences, [2.5, 97.5]))


def compared_settings(d: int, l2_values: list[float], with_sklearn: bool) -> dict:
    """label -> a function making an unfitted model: ours at each l2, and scikit-learn's."""
    settings = {
        f"ours l2={value:g}": partial(NCA, n_components=d, l2=value, random_state=0)
        for value in l2_values
    }
    if with_sklearn:
        theirs = partial(NeighborhoodComponentsAnalysis, n_components=d, random_state=0)
        settings["scikit-learn NCA"] = theirs
        settings["scikit-learn NCA, standardised"] = lambda: make_pipeline(
            StandardScaler(), theirs()
        )
    return settings


def choose(rows: list[dict], l2_values: list[float]) -> float:
    """Print each l2's mean gain over l2 = 0 (data sets x k) and its significant losses, and
    return the l2 the rule picks: the largest mean gain among those with no significant loss."""
    print("l2 | mean gain over l2=0 (sets x k = 1, 5) | significantly worse on")
    eligible = {}
    for value in l2_values:
        mine = [r for r in rows if r["setting"] == f"ours l2={value:g}"]
        gain = float(np.mean([r[f"gain {k}"] for r in mine for k in KS]))
        worse = [f"{r['data']} {k}-NN" for r in mine for k in KS if r[f"worse {k}"]]
        print(f"{value:g} | {gain:+.4f} | {', '.join(worse) or '-'}")
        if not worse:
            eligible[value] = gain
    choice = max(eligible, key=eligible.get)
    print(f"chosen: l2 = {choice:g}")
    return choice


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sets", default="usps,digits,wine,breast_cancer,iris,hard,hard_noisy")
    parser.add_argument("--l2", default="0,1e-4,3e-4,1e-3,3e-3,1e-2,3e-2,1e-1,3e-1")
    parser.add_argument("--no-sklearn", action="store_true")
    parser.add_argument("--no-save", action="store_true")
    args = parser.parse_args()
    l2_values = [float(v) for v in args.l2.split(",")]
    if 0.0 not in l2_values:
        sys.exit("--l2 must include 0: every setting is compared with it")
    loaders = load_sets()
    rows = []
    for name in args.sets.split(","):
        if name not in loaders:
            sys.exit(f"--sets: unknown data set {name!r}; expected some of {sorted(loaders)}")
        if name == "usps" and not USPS_PATH.is_file():
            print(f"usps skipped: {USPS_PATH} not found")
            continue
        X, y = loaders[name]()
        X, y = np.asarray(X, dtype=np.float64), np.asarray(y, dtype=np.int64)
        d = min(32, X.shape[1])
        settings = compared_settings(d, l2_values, with_sklearn=not args.no_sklearn)
        results = {label: out_of_fold(make, X, y) for label, make in settings.items()}
        baseline = results["ours l2=0"][0]
        rng = np.random.default_rng(0)
        for label, (right, seconds) in results.items():
            row = {"data": name, "N": len(y), "d": d, "setting": label, "fit s": seconds}
            for k in KS:
                low, high = paired_interval(right[k], baseline[k], rng)
                row[f"{k}-NN"] = float(right[k].mean())
                gain = float(right[k].mean() - baseline[k].mean())
                row[f"{k}-NN vs l2=0"] = f"{gain:+.4f} [{low:+.4f}, {high:+.4f}]"
                row[f"gain {k}"], row[f"worse {k}"] = gain, bool(high < 0)
            rows.append(row)
        columns = [
            "data",
            "N",
            "d",
            "setting",
            "fit s",
            "1-NN",
            "1-NN vs l2=0",
            "5-NN",
            "5-NN vs l2=0",
        ]
        print_table([r for r in rows if r["data"] == name], columns)
        print(flush=True)
    choice = choose(rows, l2_values)
    if not args.no_save:
        save_json(
            "default_l2.json",
            {
                "machine": machine(),
                "folds": N_FOLDS,
                "l2": l2_values,
                "rows": rows,
                "choice": choice,
            },
        )


if __name__ == "__main__":
    main()
