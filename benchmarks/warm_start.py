"""Another objective started from the default NCA map, on the real digits (issue 58).

Fits ``NCA(n_components=32, random_state=SEED)`` on the 60,000 training digits, then fits
each ``--objectives`` entry with ``init=`` that map (the same standardisation: ``init``
acts on standardised inputs, and ``init_scale="auto"`` rescales it along its ray), and
scores 1-NN and 5-NN test error on the 10,000 test digits with ``real_digits.knn_errors``.
kNCA (Tarlow et al. 2013) is the method's own objective for a k > 1 vote; started where
NCA ended, it asks whether the served k's objective improves on NCA's map, not whether it
can find one from PCA (``full_set_map.py``'s kNCA rows).

Entries: ``knca-majority:5`` (objective ``knca-majority`` at k = 5), ``nca-log``, ... (an
objective name, and for kNCA its k after a colon).

Usage: taskset -c 0,1 python benchmarks/warm_start.py [--seed 0]
       [--objectives knca-majority:5,nca-log] [--name warm_start]
Writes benchmarks/results/<name>.json. Needs ../shared/data/mnist.npz.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness.report import gemm_gflops, machine, print_table, save_json
from real_digits import MNIST, knn_errors

from training import NCA


def fitted(params: dict, X, y, Xt, yt, gemm: float) -> tuple[NCA, dict]:
    """The fitted estimator and its row: seconds, GEMM rate before it, errors, stages."""
    started = time.perf_counter()
    model = NCA(n_components=32, **params).fit(X, y)
    seconds = time.perf_counter() - started
    errors = knn_errors(model.transform(X), y, model.transform(Xt), yt)
    stages = [
        f"{s['stage']}: {s['iterations']} it., kept {s['kept']}, {s['stop_reason']}"
        for s in model.stages_
    ]
    row = {
        "fit_seconds": round(seconds, 1),
        "gemm_gflops": gemm,
        "error_1nn": errors[1],
        "error_5nn": errors[5],
        "stages": "; ".join(stages),
    }
    return model, row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--objectives", default="knca-majority:5,nca-log")
    parser.add_argument("--name", default="warm_start")
    args = parser.parse_args()
    if not MNIST.exists():
        sys.exit(f"{MNIST} is absent: nothing to measure")
    data = np.load(MNIST)
    X, y = data["X"].astype(np.float32), data["y"]
    Xt, yt = data["X_test"].astype(np.float32), data["y_test"]
    nca, row = fitted({"random_state": args.seed}, X, y, Xt, yt, gemm_gflops())
    rows = [{"setting": "nca (defaults)", **row}]
    print(rows[-1], flush=True)
    for entry in args.objectives.split(","):
        objective, _, k = entry.partition(":")
        params = {"random_state": args.seed, "objective": objective, "init": nca.components_}
        if k:
            params["k"] = int(k)
        _, row = fitted(params, X, y, Xt, yt, gemm_gflops())
        rows.append({"setting": f"{entry}, started at the NCA map", **row})
        print(rows[-1], flush=True)
    print_table(rows, ["setting", "fit_seconds", "gemm_gflops", "error_1nn", "error_5nn"])
    save_json(
        f"{args.name}.json", {"machine": machine(gemm=False), "seed": args.seed, "rows": rows}
    )


if __name__ == "__main__":
    main()
