"""Cost of kNCA against NCA on the same candidate sets: seconds per epoch (one objective and
gradient over every point), k = 5 and 10, median of 7 repeats, side by side in one run.

Data: USPS when ../shared/data/usps.npz is present, else the synthetic 784-dim set (N = 7291).
Candidates: each point's 32 nearest same-class and 32 nearest other-class points.

Usage: python benchmarks/knca_cost.py     Writes benchmarks/results/knca_cost.json.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import USPS_PATH, machine, median, print_table, save_json, synthetic


def epoch_seconds(z, y, objective, candidates, repeats=7):
    """Median seconds of one evaluation with its gradient, after one untimed warm-up run (the
    first run in a process pays for first allocations and thread start-up: measured 0.046 s
    against 0.027-0.030 s for NCA's epoch, which inflated its cost and shrank every ratio)."""
    from training.neighbourhood import objective_sum

    times = []
    for repeat in range(repeats + 1):
        zz = z.clone().requires_grad_()
        t = time.perf_counter()
        value = objective_sum(zz, y, objective, candidates=candidates)
        value.backward()
        if repeat:
            times.append(time.perf_counter() - t)
    return median(times)


def main() -> None:
    from training.knca import KNCAObjective
    from training.neighbourhood import nearest_candidates
    from training.objectives import NCAObjective

    if USPS_PATH.is_file():
        with np.load(USPS_PATH, allow_pickle=False) as d:
            X, y, name = d["X"], d["y"], "usps"
    else:
        X, y = synthetic(7291)
        name = "synthetic"
    X = (X - X.mean(0)) / np.maximum(X.std(0), 1e-12)
    rng = np.random.default_rng(0)
    A = rng.normal(size=(32, X.shape[1])) / np.sqrt(X.shape[1])
    z = torch.tensor(X @ A.T, dtype=torch.float32)
    yt = torch.tensor(y)
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
    save_json(
        "knca_cost.json",
        {
            "machine": machine(),
            "data": name,
            "n": len(X),
            "candidates": int(candidates.shape[1]),
            "rows": rows,
        },
    )


if __name__ == "__main__":
    main()
