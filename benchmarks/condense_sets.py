"""Condensing the reference set (``python -m training references condense``): references
kept and test accuracy before and after, for editing and condensing settings, over seeds.

Sets (the issue's two): USPS (the papers' data: 6,564 references, d = 32, the job's
defaults) and a 60k x 784 set of real digits (``harness.data.usps_784``: USPS at MNIST's size,
augmented to 60,000 references; validation and test queries from held-out images).
Each model is trained once with the estimator's defaults at d = 32; every setting is then
condensed with ``--seeds`` seeds (the order in which candidates are visited); accuracy is
the model's served rule at its default k on the test split. Medians over seeds, with the
range. Rows of a set not run keep their values from the last run that had it.

Usage: python benchmarks/condense_sets.py [--seeds 3] [--sets usps,usps784]
       [--methods hart,prototypes]
Writes benchmarks/results/condense_sets.json. Needs ../shared/data/usps.npz.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness.data import USPS_PATH, usps_784
from harness.report import RESULTS, machine, median, print_table, save_json

# condense_references keyword arguments: Hart's condensing (after Wilson editing when edit_k
# > 0), then per-class k-means prototypes, as cluster means and learned with NCA's objective
# (the default; the GLVQ rows of the results file predate the removal of --refine glvq)
SETTINGS = [
    {"edit_k": 0},
    {"edit_k": 0, "check_k": 6},
    {"edit_k": 3},
    {"edit_k": 5},
    {"edit_k": 5, "check_k": 6},
    {"edit_k": 7},
    {"method": "prototypes", "reduction": 3.0, "refine": "none"},
    {"method": "prototypes", "reduction": 3.0, "refine": "nca"},
]


def train(out: Path, X, y, X_val, y_val) -> Path:
    """The estimator's defaults at d = 32, written as an artifact with its validation split
    and the outlier calibration (as the training job writes it)."""
    from service.core.artifact import write_artifact
    from training import NCA
    from training.evaluation.calibration import calibrate
    from training.evaluation.evaluate import K_VALUES, choose_k, knn_accuracies

    classes = np.unique(y)
    y_idx, yv_idx = np.searchsorted(classes, y), np.searchsorted(classes, y_val)
    nca = NCA(n_components=32, random_state=0).fit(X, y_idx)
    z, zv = nca.transform(X), nca.transform(X_val)
    val = knn_accuracies(z, y_idx, zv, yv_idx, len(classes), K_VALUES)
    return write_artifact(
        out,
        projection=nca.projection_,
        offset=nca.offset_,
        embeddings=z,
        labels=y_idx.astype(np.int32),
        classes=classes.tolist(),
        mean=nca.mean_,
        scale=nca.scale_,
        default_k=choose_k(val, fallback=3),
        validation_embeddings=zv,
        validation_labels=yv_idx.astype(np.int32),
        metadata={"outlier_calibration": calibrate(z, zv)},
    )


def condense_grid(
    name: str, model: Path, X_test, y_test, seeds: int, tmp: Path, methods: set[str]
) -> list[dict]:
    from service.core.artifact import read_artifact
    from training.references.versions import condense_references

    k = read_artifact(model).default_k
    rows = []
    for setting in SETTINGS:
        method = setting.get("method", "hart")
        if method not in methods:
            continue
        kept, before, after, seconds = [], [], [], []
        for seed in range(seeds):
            started = time.perf_counter()
            entry = condense_references(
                model,
                out=tmp / f"{name}-{len(rows)}-{seed}",
                seed=seed,
                **setting,
                X_test=X_test,
                y_test=y_test,
            )
            seconds.append(time.perf_counter() - started)
            kept.append(entry["rows_after"])
            test = entry["accuracy"]["test"]
            before.append(test["before"][str(k)])
            after.append(test["after"][str(k)])
        n = entry["rows_before"]
        deltas = [100 * (a - b) for a, b in zip(after, before, strict=True)]
        rows.append(
            {
                "set": name,
                "k": k,
                "method": method,
                "edit_k": setting.get("edit_k", ""),
                "check_k": entry["settings"].get("check_k", ""),
                "refine_epochs": entry["settings"].get("refine_epochs", ""),
                "references": n,
                "kept": int(median(kept)),
                "fewer_x": round(n / median(kept), 2),
                "test_before": round(before[0], 4),
                "test_after": round(median(after), 4),
                "delta_points": round(median(deltas), 2),
                "delta_range": [round(min(deltas), 2), round(max(deltas), 2)],
                "seconds": round(median(seconds), 1),
            }
        )
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--sets", default="usps,usps784")
    parser.add_argument("--methods", default="hart,prototypes")
    args = parser.parse_args()
    if not USPS_PATH.exists():
        sys.exit(f"needs {USPS_PATH}")
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    results = []
    methods = set(args.methods.split(","))
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        if "usps" in args.sets.split(","):
            data = np.load(USPS_PATH)
            X, y = data["X"].astype(np.float32), data["y"]
            rng = np.random.default_rng(0)
            order = rng.permutation(len(y))
            val, ref = order[: len(y) // 10], order[len(y) // 10 :]
            model = train(tmp / "usps", X[ref], y[ref], X[val], y[val])
            results += condense_grid(
                "usps",
                model,
                data["X_test"].astype(np.float32),
                data["y_test"],
                args.seeds,
                tmp,
                methods,
            )
        if "usps784" in args.sets.split(","):
            X, y, X_val, y_val, X_test, y_test = usps_784(60_000, 2_000, 4_000)
            model = train(tmp / "usps784", X, y, X_val, y_val)
            results += condense_grid("usps784", model, X_test, y_test, args.seeds, tmp, methods)
    print_table(
        results,
        [
            "set",
            "k",
            "method",
            "edit_k",
            "check_k",
            "refine_epochs",
            "kept",
            "fewer_x",
            "test_before",
            "test_after",
            "delta_points",
            "delta_range",
            "seconds",
        ],
    )
    # rows of sets not run this time are kept from the last run that had them
    path = RESULTS / "condense_sets.json"
    ran = {row["set"] for row in results}
    earlier = json.loads(path.read_text())["rows"] if path.exists() else []
    rows = [row for row in earlier if row["set"] not in ran] + results
    save_json("condense_sets.json", {"machine": machine(), "rows": rows})


if __name__ == "__main__":
    main()
