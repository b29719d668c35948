"""Does a PCA pre-reduction before NCA lower the real digits' test error at d = 32?

A low-rank map learned on the top-p principal components is still one linear map of the
standardised inputs, A (32, p) P^T (p, 784), so it would cost the artifact nothing; the
question is only whether restricting A to the top principal subspace (a regulariser: the
pixels' low-variance directions are mostly noise) lowers kNN test error. This benchmark
fits ``NCA(n_components=32, random_state=seed)`` on the raw pixels and on their top-p
principal components (the components of every third training row, centred; p in --pcs,
0 = none) for each seed, one process per fit, run alone, and scores 1-NN and 5-NN test error
with ``real_digits.knn_errors``. The float32 GEMM rate is measured before each fit.

Usage: taskset -c 0,1 python benchmarks/pca_first_digits.py [--pcs 0,100] [--seeds 0,1,2]
Writes benchmarks/results/pca_first_digits.json (skipped when ../shared/data/mnist.npz is
absent).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness.report import gemm_gflops, machine, print_table, save_json
from real_digits import MNIST, knn_errors

HERE = Path(__file__).resolve().parents[1]


def one_fit(pcs: int, seed: int) -> dict:
    """One fit in this process: the top ``pcs`` components first (0: the raw pixels)."""
    sys.path.insert(0, str(HERE))
    from training import NCA

    data = np.load(MNIST)
    X, y, X_test, y_test = data["X"], data["y"], data["X_test"], data["y_test"]
    gemm = gemm_gflops()
    started = time.perf_counter()
    if pcs:
        mean = X.mean(axis=0)  # (784,)
        _, _, vt = np.linalg.svd(X[::3] - mean, full_matrices=False)
        P = vt[:pcs].T  # (784, pcs)
        X, X_test = (X - mean) @ P, (X_test - mean) @ P
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = NCA(n_components=32, random_state=seed).fit(X, y)
    seconds = time.perf_counter() - started
    errors = knn_errors(model.transform(X), y, model.transform(X_test), y_test)
    return {
        "pcs": pcs,
        "seed": seed,
        "err_1nn": errors[1],
        "err_5nn": errors[5],
        "fit_s": seconds,
        "n_iter": int(model.n_iter_),
        "gemm_gflops": gemm,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pcs", default="0,100")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # "pcs,seed": one fit, JSON out
    args = parser.parse_args()
    if args.one:
        pcs, seed = map(int, args.one.split(","))
        print(json.dumps(one_fit(pcs, seed)))
        return
    if not MNIST.exists():
        print(f"skipped: {MNIST} is absent")
        return
    rows = []
    for seed in map(int, args.seeds.split(",")):
        for pcs in map(int, args.pcs.split(",")):
            out = subprocess.run(
                [sys.executable, __file__, "--one", f"{pcs},{seed}"],
                check=True,
                capture_output=True,
                text=True,
            ).stdout
            rows.append(json.loads(out.strip().splitlines()[-1]))
            print(rows[-1], flush=True)
    summary = []
    for pcs in sorted({r["pcs"] for r in rows}):
        mine = [r for r in rows if r["pcs"] == pcs]
        summary.append(
            {
                "pcs": pcs,
                "seeds": len(mine),
                "err_5nn_median": statistics.median(r["err_5nn"] for r in mine),
                "err_5nn_range": f"{min(r['err_5nn'] for r in mine):.4f}-"
                f"{max(r['err_5nn'] for r in mine):.4f}",
                "err_1nn_median": statistics.median(r["err_1nn"] for r in mine),
                "fit_s_median": statistics.median(r["fit_s"] for r in mine),
            }
        )
    print_table(rows, ["pcs", "seed", "err_1nn", "err_5nn", "fit_s", "n_iter", "gemm_gflops"])
    print_table(summary, list(summary[0]))
    command = "taskset -c 0,1 python benchmarks/pca_first_digits.py " + " ".join(sys.argv[1:])
    save_json(
        "pca_first_digits.json",
        {"command": command, "machine": machine(), "rows": rows, "summary": summary},
    )


if __name__ == "__main__":
    main()
