"""Which rule chooses the served k best for unseen rows: the k chosen on a validation split
against the test error at that k, over many random validation splits of real data.

For each data set and seed, a stratified ``--val-fraction`` of the training rows is held out
as the job holds it out; the rest are the references. The k-NN rule (majority, the
service's ``decide``) is scored on the validation rows for every k in K_VALUES, each rule
below picks a k from those scores, and the test error at the picked k (same references) is
compared with the best test error over K_VALUES and both votes, majority and soft (the
oracle, which no rule can see):

- ``best, ties to 1``: the highest validation accuracy, ties to the training k (1), else to
  the smallest k (``choose_k`` as it was before this benchmark);
- ``one-SE``: the largest k whose validation accuracy is within one standard error of the
  best, the error of the paired per-row difference (the one-standard-error rule of Hastie,
  Tibshirani and Friedman, ch. 7.10: among near-equals, the smoothest rule, here the
  largest k); ``half-SE`` the same within half an error;
- ``auto: best (vote, k)``: ``--decision-rule auto``, the vote (majority or soft) and k
  with the best validation accuracy (``choose_rule_and_k``);
- ``majority unless soft > 1 SE`` (and ``2 SE``): the majority vote at its best k, unless
  the soft vote at its best k wins on validation by more than one (two) paired standard
  errors of the per-row difference (``soft_beyond_noise``).

The first three vote by majority, so their regret includes what the soft vote would have
gained.

Data (the map is fixed, so the rule is judged alone): USPS (7,291 training, 2,007 test, raw
pixels); MNIST's first 10,000 training rows and its 10,000 test rows, in 50 principal
components of the training rows; UCI letters (``benchmarks/prepare_uci.py``; 16,000
training, 4,000 test) when prepared. Sets whose data is absent are skipped.

Usage: python benchmarks/k_choice.py [--seeds 20] [--val-fraction 0.1] [--name k_choice.json]
Writes benchmarks/results/NAME (default k_choice.json).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness.data import LETTERS_PATH
from harness.report import machine, print_table, save_json

from training.evaluation.evaluate import K_VALUES, choose_k, choose_rule_and_k, knn_predictions

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"


def sets() -> dict:
    """{name: (X_train, y_train, X_test, y_test)} for the data present here."""
    found = {}
    if (SHARED / "usps.npz").exists():
        d = np.load(SHARED / "usps.npz")
        found["usps"] = (d["X"], d["y"], d["X_test"], d["y_test"])
    if (SHARED / "mnist.npz").exists():
        d = np.load(SHARED / "mnist.npz")
        X, Xt = d["X"][:10_000].astype(np.float32), d["X_test"].astype(np.float32)
        mean = X.mean(0)
        _, _, vt = np.linalg.svd(X - mean, full_matrices=False)
        found["mnist10k-pca50"] = (
            (X - mean) @ vt[:50].T,
            d["y"][:10_000],
            (Xt - mean) @ vt[:50].T,
            d["y_test"],
        )
    if LETTERS_PATH.exists():
        d = np.load(LETTERS_PATH)
        X, y = d["X"].astype(np.float32), d["y"].astype(np.int64)
        found["letters"] = (X[:16000], y[:16000], X[16000:], y[16000:])
    return found


def stratified_holdout(y: np.ndarray, fraction: float, rng) -> np.ndarray:
    """A boolean mask of the held-out rows: ``fraction`` of each class, at least one."""
    held = np.zeros(len(y), dtype=bool)
    for c in np.unique(y):
        rows = np.flatnonzero(y == c)
        held[rng.choice(rows, max(1, round(fraction * len(rows))), replace=False)] = True
    return held


def one_se(correct: dict[int, np.ndarray], width: float) -> int:
    """The largest k within ``width`` paired standard errors of the best k's accuracy."""
    best = max(correct, key=lambda k: (correct[k].mean(), -k))
    n = len(correct[best])
    chosen = best
    for k, right in correct.items():
        diff = correct[best].astype(np.float64) - right
        se = diff.std(ddof=1) / np.sqrt(n) if n > 1 else 0.0
        if diff.mean() <= width * se and k > chosen:
            chosen = k
    return chosen


RULES = {
    "best, ties to 1": lambda correct: choose_k({k: c.mean() for k, c in correct.items()}, 1),
    "one-SE": lambda correct: one_se(correct, 1.0),
    "half-SE": lambda correct: one_se(correct, 0.5),
}
VOTES = ("majority", "soft")  # --decision-rule auto chooses between these with the k


def soft_beyond_noise(correct: dict[str, dict[int, np.ndarray]], width: float) -> tuple[str, int]:
    """The majority vote at its best k (``choose_k``, ties to 1), unless the soft vote at its
    best k is more accurate on the validation rows by more than ``width`` paired standard
    errors of the per-row difference: then the soft vote at that k."""
    ks = {vote: choose_k({k: c.mean() for k, c in correct[vote].items()}, 1) for vote in VOTES}
    diff = correct["soft"][ks["soft"]].astype(np.float64) - correct["majority"][ks["majority"]]
    n = len(diff)
    se = diff.std(ddof=1) / np.sqrt(n) if n > 1 else 0.0
    vote = "soft" if diff.mean() > width * se else "majority"
    return vote, ks[vote]


# majority unless soft wins by more than this many paired standard errors
PAIRED = {"majority unless soft > 1 SE": 1.0, "majority unless soft > 2 SE": 2.0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=20)
    parser.add_argument("--val-fraction", type=float, default=0.1)
    parser.add_argument("--name", default="k_choice.json", help="result file in results/")
    args = parser.parse_args()
    rows = []
    for name, (X, y, X_test, y_test) in sets().items():
        X, X_test = np.asarray(X, np.float32), np.asarray(X_test, np.float32)
        n_classes = int(max(y.max(), y_test.max())) + 1
        regrets = {rule: [] for rule in [*RULES, "auto: best (vote, k)", *PAIRED]}
        picks = {rule: [] for rule in regrets}
        for seed in range(args.seeds):
            held = stratified_holdout(y, args.val_fraction, np.random.default_rng(seed))
            refs, labels = X[~held], y[~held]
            val, test, test_error = {}, {}, {}
            for vote in VOTES:
                val[vote] = knn_predictions(refs, labels, X[held], n_classes, K_VALUES, vote)
                test[vote] = knn_predictions(refs, labels, X_test, n_classes, K_VALUES, vote)
                test_error[vote] = {k: float(np.mean(test[vote][k] != y_test)) for k in K_VALUES}
            correct = {k: val["majority"][k] == y[held] for k in K_VALUES}
            # the oracle: the best test error over both votes and every k
            oracle = min(min(by_k.values()) for by_k in test_error.values())
            for rule, pick in RULES.items():  # majority votes, k chosen by each rule
                k = pick(correct)
                picks[rule].append(k)
                regrets[rule].append(test_error["majority"][k] - oracle)
            accuracy = {
                vote: {k: float(np.mean(val[vote][k] == y[held])) for k in K_VALUES}
                for vote in VOTES
            }
            vote, k = choose_rule_and_k(accuracy, 1)
            picks["auto: best (vote, k)"].append(f"{vote}:{k}")
            regrets["auto: best (vote, k)"].append(test_error[vote][k] - oracle)
            by_vote = {v: {k: val[v][k] == y[held] for k in K_VALUES} for v in VOTES}
            for rule, width in PAIRED.items():
                vote, k = soft_beyond_noise(by_vote, width)
                picks[rule].append(f"{vote}:{k}")
                regrets[rule].append(test_error[vote][k] - oracle)
        for rule in regrets:
            r = 100 * np.asarray(regrets[rule])
            rows.append(
                {
                    "set": name,
                    "rule": rule,
                    "n_val": int(held.sum()),
                    "regret_median_points": float(np.median(r)),
                    "regret_mean_points": float(r.mean()),
                    "regret_max_points": float(r.max()),
                    "ks_picked": {str(k): picks[rule].count(k) for k in sorted(set(picks[rule]))},
                }
            )
            print(rows[-1], flush=True)
    print_table(
        rows,
        ["set", "rule", "n_val", "regret_median_points", "regret_mean_points", "regret_max_points"],
    )
    save_json(
        args.name,
        {
            "machine": machine(),
            "seeds": args.seeds,
            "val_fraction": args.val_fraction,
            "rows": rows,
        },
    )


if __name__ == "__main__":
    main()
