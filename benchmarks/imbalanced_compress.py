"""Imbalanced classes compress: UCI's Shuttle (43,500 training rows of 9 features in 7 classes
of 34,108, 37, 132, 6,748, 2,458, 6 and 11 rows; 14,500 test rows), trained by the job and
compressed with ``references condense --method prototypes`` at 5% and 2% kept, each with
the floors of prototypes per class that ``--floors`` lists (``--min-per-class``).

``--data shuttle`` (the default) reads the real set that ``benchmarks/prepare_uci.py`` writes;
``--data synthetic`` makes a set of the same shape instead: each class a Gaussian mixture of
3 clusters in 9 dimensions, centres drawn with ``--spread`` (classes overlap a little). What
is measured is what the budget does: every class keeps at least its floor of prototypes
(the rule before refused: "--reduction=20 is above the size of class 5"), the total is
round(N / reduction), and the small classes' test recall before and after.

Usage: python benchmarks/imbalanced_compress.py [--data shuttle|synthetic] [--floors 1,3]
Writes benchmarks/results/imbalanced_compress[_synthetic].json.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness.data import shuttle
from harness.report import machine, print_table, save_json

SHUTTLE_TRAIN = (34108, 37, 132, 6748, 2458, 6, 11)
SHUTTLE_TEST = (11478, 13, 39, 2155, 809, 4, 2)


def shuttle_like(counts, centres, seed):
    """(X (n, 9) float32, y (n,)): each class's rows around its 3 cluster centres."""
    rng = np.random.default_rng(seed)
    y = np.repeat(np.arange(len(counts)), counts)
    cluster = rng.integers(0, 3, len(y))
    X = centres[y, cluster] + rng.normal(size=(len(y), 9))
    order = rng.permutation(len(y))
    return X[order].astype(np.float32), y[order]


def recall(predicted, y, c) -> float:
    rows = y == c
    return float((predicted[rows] == c).mean()) if rows.any() else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", choices=("shuttle", "synthetic"), default="shuttle")
    parser.add_argument("--spread", type=float, default=4.0, help="synthetic only")
    parser.add_argument(
        "--floors", default="1", help="prototypes per class at least (--min-per-class), each"
    )
    args = parser.parse_args()
    from service.core.artifact import read_artifact
    from service.core.knn import decide, exact_knn, project
    from training.config import TrainConfig
    from training.job import run
    from training.references.versions import condense_references

    if args.data == "shuttle":
        real = shuttle()
        if real is None:
            raise SystemExit("run benchmarks/prepare_uci.py first (or pass --data synthetic)")
        X, y, X_test, y_test = real
    else:
        centres = np.random.default_rng(0).normal(scale=args.spread, size=(7, 3, 9))
        X, y = shuttle_like(SHUTTLE_TRAIN, centres, 1)
        X_test, y_test = shuttle_like(SHUTTLE_TEST, centres, 2)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / f"{args.data}.npz"
        np.savez(data, X=X, y=y, X_test=X_test, y_test=y_test)
        out = Path(tmp) / "model"
        started = time.perf_counter()
        run(TrainConfig(data=str(data), out=str(out), plots=False, quiet=True), log=lambda *_: None)
        fit_s = time.perf_counter() - started
        versions = [("full", out, None)]
        for floor in (int(f) for f in args.floors.split(",")):
            for reduction in (20, 50):
                path = Path(tmp) / f"r{reduction}-floor{floor}"
                started = time.perf_counter()
                condense_references(
                    out, out=path, method="prototypes", reduction=reduction, min_per_class=floor
                )
                name = f"{100 / reduction:g}% kept, floor {floor}"
                versions.append((name, path, time.perf_counter() - started))
        for name, path, seconds in versions:
            artifact = read_artifact(path)
            z_test = project(X_test, artifact.projection, artifact.offset)
            # the artifact's labels are indices into its classes (here 0..6 in order)
            k = min(artifact.default_k, len(artifact.labels))
            distances, indices = exact_knn(z_test, np.asarray(artifact.embeddings), k)
            labels = np.asarray(artifact.labels)[indices]
            predicted, _ = decide(labels, distances, 7, artifact.decision_rule)
            budget = (artifact.manifest.get("reference_set") or {}).get("budget")
            rows.append(
                {
                    "version": name,
                    "references": len(artifact.labels),
                    "served_k": artifact.default_k,
                    "test_accuracy": float((predicted == y_test).mean()),
                    **{f"recall_{c}": recall(predicted, y_test, c) for c in (1, 2, 5, 6)},
                    "per_class": np.bincount(np.asarray(artifact.labels), minlength=7).tolist(),
                    "raised": (budget.get("raised_to_one") or budget.get("raised_to_floor"))
                    if budget
                    else [],
                    "seconds": seconds if seconds is not None else fit_s,
                }
            )
            print(rows[-1], flush=True)
    print_table(
        rows,
        ["version", "references", "test_accuracy", "recall_1", "recall_5", "recall_6", "per_class"],
    )
    name = (
        "imbalanced_compress.json"
        if args.data == "shuttle"
        else "imbalanced_compress_synthetic.json"
    )
    setting = {"data": args.data, **({"spread": args.spread} if args.data == "synthetic" else {})}
    save_json(name, {"machine": machine(), **setting, "rows": rows})


if __name__ == "__main__":
    main()
