"""Candidate sets, then the exact objective: does a short exact finish close the gap between
candidate-set training and exact training above AUTO_EXACT_MAX_SAMPLES?

On the synthetic 784-dimensional set of ``harness.data.synthetic`` (10 classes of 3 blobs each in a
40-dim subspace, 10,000 test points so that a point of accuracy is outside the noise),
d = 32, the estimator's defaults otherwise (max_iter = 100, l2 = "auto", standardised
inputs), for each N:

* exact: every point a neighbour (n_candidates=None; l2 = 0.03);
* candidate sets alone: the default candidate mode without the finish (exact_finish=0;
  l2 = 0, which "auto" is on nearest candidates);
* defaults: candidate sets, then exact_finish="auto" (L-BFGS iterations on the exact
  objective with l2 = 0.03: 10 from the candidate map when benchmarks/README.md's figures
  were measured, 5 from its best scale since round 6);
* a longer finish (exact_finish=20), to see whether 10 is enough;
* kNN on the raw (standardised) inputs.

With ``--objective knca-majority`` (k = 5) the same for kNCA, whose "auto" finish is 20
iterations averaged over 2,048 evenly spaced query rows (an exact kNCA pair costs ~20x an
NCA one), and whose longer finish is exact_finish=40. The exact kNCA fit at N = 20k takes
about 15 minutes here.

Usage: python benchmarks/exact_finish.py [--ns 20000,60000] [--test 10000]
                                         [--objective knca-majority --ns 20000]
Writes benchmarks/results/exact_finish.json (exact_finish_knca-majority.json for kNCA). Run
it alone (taskset -c 0,1): the exact NCA fit at N = 60k takes about 20 minutes here.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from candidate_quality import knn_accuracy
from harness.data import synthetic
from harness.report import machine, print_table, save_json

from training import NCA
from training.model.options import with_options

# (label, estimator parameters); the last row doubles the "auto" finish of the objective
METHODS = [
    ("exact", {"n_candidates": None}),
    ("candidate sets alone", {"exact_finish": 0}),
    ("defaults (candidates + exact finish)", {}),
]
LONGER_FINISH = {"nca": 20, "knca-majority": 40}
K = {"nca": 1, "knca-majority": 5}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ns", default="20000,60000")
    parser.add_argument("--test", type=int, default=10000)
    parser.add_argument("--d", type=int, default=32)
    parser.add_argument("--objective", choices=sorted(K), default="nca")
    args = parser.parse_args()
    longer = LONGER_FINISH[args.objective]
    methods = [*METHODS, (f"candidates + exact_finish={longer}", {"exact_finish": longer})]
    fixed = {"objective": args.objective, "k": K[args.objective]}
    rows = []
    for n in (int(v) for v in args.ns.split(",")):
        X, y = synthetic(n + args.test, seed=0)
        X_train, y_train, X_test, y_test = X[:n], y[:n], X[n:], y[n:]
        mean, scale = X_train.mean(0), X_train.std(0)
        raw = [
            knn_accuracy((X_train - mean) / scale, y_train, (X_test - mean) / scale, y_test, k, 10)
            for k in (1, 5)
        ]
        rows.append({"n": n, "method": "kNN on the inputs", "acc_1nn": raw[0], "acc_5nn": raw[1]})
        print_table(rows[-1:], ["n", "method", "acc_1nn", "acc_5nn"])
        for label, params in methods:
            started = time.perf_counter()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                model = NCA(
                    **with_options(dict(n_components=args.d, random_state=0, **fixed, **params))
                ).fit(X_train, y_train)
            seconds = time.perf_counter() - started
            z_train, z_test = model.transform(X_train), model.transform(X_test)
            acc = [knn_accuracy(z_train, y_train, z_test, y_test, k, 10) for k in (1, 5)]
            finish_seconds = [
                r["seconds"] for r in model.history_ if r.get("stage") == "exact finish"
            ]
            first_stage = [r["seconds"] for r in model.history_ if "stage" not in r]
            rows.append(
                {
                    "n": n,
                    "objective": args.objective,
                    "method": label,
                    "acc_1nn": acc[0],
                    "acc_5nn": acc[1],
                    "seconds": seconds,
                    "finish_seconds": (
                        finish_seconds[-1] - first_stage[-1] if finish_seconds else None
                    ),
                    "n_iter": model.n_iter_,
                    "finish_iter": model.exact_finish_iter_,
                    "l2": model.l2_,
                    "final_k": model.n_candidates_,
                    "audit_warned": model.candidate_warning_ is not None,
                }
            )
            print_table(
                rows[-1:],
                ["n", "method", "acc_1nn", "acc_5nn", "seconds", "finish_seconds", "n_iter"],
            )
    print_table(
        rows,
        ["n", "method", "acc_1nn", "acc_5nn", "seconds", "finish_seconds", "n_iter", "l2"],
    )
    name = "exact_finish.json" if args.objective == "nca" else f"exact_finish_{args.objective}.json"
    save_json(name, {"machine": machine(), "d": args.d, "objective": args.objective, "rows": rows})


if __name__ == "__main__":
    main()
