"""Is the USPS 5-NN gap to scikit-learn's NCA real? A paired bootstrap, and l2 chosen on
validation.

1. Our defaults and scikit-learn's NeighborhoodComponentsAnalysis at d = 32 on USPS; test
   1-NN and 5-NN predictions (scikit-learn's KNeighborsClassifier for both), and a paired
   bootstrap of the accuracy difference over the 2,007 test digits (2,000 resamples, 95%
   interval), with the digits only one of the two gets right.
2. l2 in {0, 1e-4, 1e-3, 1e-2, 3e-2 (the default)}: validation accuracy on a stratified 20% of the training set
   (fit on the other 80%), and test accuracy of the fit on the whole training set, to see
   whether a validation choice would transfer.

Needs ../shared/data/usps.npz. Usage: python benchmarks/usps_gap.py   (about 2 minutes)
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
from sklearn.model_selection import train_test_split
from sklearn.neighbors import KNeighborsClassifier, NeighborhoodComponentsAnalysis

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import USPS_PATH

from training import NCA


def correct(z_train, y_train, z_test, y_test, k: int) -> np.ndarray:
    """(n_test,) bool: whether k-NN on the projected points gets each test point right."""
    return KNeighborsClassifier(k).fit(z_train, y_train).predict(z_test) == y_test


def main() -> None:
    if not USPS_PATH.is_file():
        sys.exit(f"USPS data not found at {USPS_PATH}")
    with np.load(USPS_PATH, allow_pickle=False) as d:
        X, y, X_test, y_test = d["X"], d["y"], d["X_test"], d["y_test"]
    ours = NCA(n_components=32, random_state=0).fit(X, y)
    theirs = NeighborhoodComponentsAnalysis(n_components=32, random_state=0).fit(X, y)
    rng = np.random.default_rng(0)
    for k in (1, 5):
        a = correct(ours.transform(X), y, ours.transform(X_test), y_test, k)
        b = correct(theirs.transform(X), y, theirs.transform(X_test), y_test, k)
        resamples = (rng.integers(0, len(y_test), len(y_test)) for _ in range(2000))
        lo, hi = np.percentile([a[i].mean() - b[i].mean() for i in resamples], [2.5, 97.5])
        print(
            f"{k}-NN: ours {a.mean():.4f}, scikit-learn {b.mean():.4f}, difference "
            f"{a.mean() - b.mean():+.4f}, 95% interval [{lo:+.4f}, {hi:+.4f}]; only ours right "
            f"{int((a & ~b).sum())}, only scikit-learn's {int((~a & b).sum())}"
        )
    X_fit, X_val, y_fit, y_val = train_test_split(X, y, test_size=0.2, stratify=y, random_state=0)
    print("\nl2 | validation 1-NN | validation 5-NN | test 1-NN | test 5-NN")
    for l2 in (0.0, 1e-4, 1e-3, 1e-2, 3e-2):
        part = NCA(n_components=32, random_state=0, l2=l2).fit(X_fit, y_fit)
        whole = NCA(n_components=32, random_state=0, l2=l2).fit(X, y)
        val = [
            correct(part.transform(X_fit), y_fit, part.transform(X_val), y_val, k).mean()
            for k in (1, 5)
        ]
        test = [
            correct(whole.transform(X), y, whole.transform(X_test), y_test, k).mean()
            for k in (1, 5)
        ]
        print(f"{l2:g} | {val[0]:.4f} | {val[1]:.4f} | {test[0]:.4f} | {test[1]:.4f}")


if __name__ == "__main__":
    main()
