"""Cost of kNCA against NCA on the same candidate sets: seconds per epoch (one objective and
gradient over every point), k = 5 and 10, median of 7 repeats, side by side in one run; then
exact kNCA (every point a neighbour) against exact NCA at N = --exact-n (median of 3).

Data: USPS when ../shared/data/usps.npz is present, else the synthetic 784-dim set (N = 7291);
the exact part uses the synthetic 784-dim set. Candidates: each point's 32 nearest same-class
and 32 nearest other-class points. Projection: a fixed random A (d = 32).

Usage: python benchmarks/knca_cost.py [--exact-n 5000] [--no-save]
Writes benchmarks/results/knca_cost.json (unless --no-save, for runs of other code trees).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness.data import USPS_PATH, synthetic
from harness.report import machine, median, print_table, save_json


def epoch_seconds(z, y, objective, candidates, repeats=7):
    """Median seconds of one evaluation with its gradient, after one untimed warm-up run (the
    first run in a process pays for first allocations and thread start-up: measured 0.046 s
    against 0.027-0.030 s for NCA's epoch, which inflated its cost and shrank every ratio)."""
    from training.objectives.neighbourhood import objective_sum

    times = []
    for repeat in range(repeats + 1):
        zz = z.clone().requires_grad_()
        t = time.perf_counter()
        value = objective_sum(zz, y, objective, candidates=candidates)
        value.backward()
        if repeat:
            times.append(time.perf_counter() - t)
    return median(times)


def projected(X: np.ndarray) -> torch.Tensor:
    """Standardised X times a fixed random (32, D) map: (N, 32) float32."""
    X = (X - X.mean(0)) / np.maximum(X.std(0), 1e-12)
    A = np.random.default_rng(0).normal(size=(32, X.shape[1])) / np.sqrt(X.shape[1])
    return torch.tensor(X @ A.T, dtype=torch.float32)


def exact_rows(n: int) -> list[dict]:
    """Exact NCA and kNCA (every other point a neighbour) at N = n on the synthetic set."""
    from training.objectives.knca import KNCAObjective
    from training.objectives.nca import NCAObjective

    X, y = synthetic(n)
    z, yt = projected(X), torch.tensor(y)
    objectives = [("nca", 1, NCAObjective(False))] + [
        (f"knca-{variant}", k, KNCAObjective(variant, k, False, n_classes=10))
        for k in (5, 10)
        for variant in ("majority", "all")
    ]
    rows = [
        {"objective": name, "k": k, "seconds_per_epoch": epoch_seconds(z, yt, obj, None, 3)}
        for name, k, obj in objectives
    ]
    for r in rows:
        r["ratio_vs_nca"] = r["seconds_per_epoch"] / rows[0]["seconds_per_epoch"]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--exact-n", type=int, default=5000, help="N of the exact part (0: skip)")
    parser.add_argument("--no-save", action="store_true", help="print only")
    args = parser.parse_args()
    from training.objectives.knca import KNCAObjective
    from training.objectives.nca import NCAObjective
    from training.objectives.neighbourhood import nearest_candidates

    if USPS_PATH.is_file():
        with np.load(USPS_PATH, allow_pickle=False) as d:
            X, y, name = d["X"], d["y"], "usps"
    else:
        X, y = synthetic(7291)
        name = "synthetic"
    z, yt = projected(X), torch.tensor(y)
    candidates = nearest_candidates(z, yt, 32)
    rows = [
        {
            "objective": "nca",
            "k": 1,
            "seconds_per_epoch": epoch_seconds(z, yt, NCAObjective(False), candidates),
        }
    ]
    nca = rows[0]["seconds_per_epoch"]
    for k in (5, 10):
        for variant in ("majority", "all"):
            s = epoch_seconds(z, yt, KNCAObjective(variant, k, False, n_classes=10), candidates)
            rows.append({"objective": f"knca-{variant}", "k": k, "seconds_per_epoch": s})
    for r in rows:
        r["ratio_vs_nca"] = r["seconds_per_epoch"] / nca
    print(f"data: {name}, N = {len(X)}, candidates per point = {candidates.shape[1]}")
    print_table(rows, ["objective", "k", "seconds_per_epoch", "ratio_vs_nca"])
    exact = exact_rows(args.exact_n) if args.exact_n else []
    if exact:
        print(f"\nexact (every point a neighbour): synthetic, N = {args.exact_n}")
        print_table(exact, ["objective", "k", "seconds_per_epoch", "ratio_vs_nca"])
    if args.no_save:
        return
    save_json(
        "knca_cost.json",
        {
            "machine": machine(),
            "data": name,
            "n": len(X),
            "candidates": int(candidates.shape[1]),
            "rows": rows,
            "exact_n": args.exact_n,
            "exact_rows": exact,
        },
    )


if __name__ == "__main__":
    main()
