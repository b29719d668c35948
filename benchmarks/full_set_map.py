"""The full-set map on the 60k x 784 digits: the served model's test error against the
embedding dimension d and the objective, fitted as the command line fits it.

Data: ``harness.data.usps_784(60_000, 1_000, 2_007)``: 60,000 training rows of real digits
at MNIST's size (USPS, zoomed and moved by small affine maps) and the 2,007 USPS test
images, moved the same way (no test row comes from a training row's source image). Each run
is ``python -m training`` on that set (``training.job.run``: a 10% validation split, the
served k and the standardisation chosen on it, the defaults otherwise) with one setting
changed: d (``--n-components``) or the objective (``--objective``, ``--k``). The served
model's test error at its served k is what a client sees; the 1-NN and 5-NN errors, the fit
seconds and the stored bytes per reference (d float32 values: search cost grows with d too)
are beside it.

A run is ``objective:d`` or ``objective:d:no-early-stopping`` (the job's early stopping on
validation kNN accuracy turned off: L-BFGS runs until it converges or reaches max_iter);
``raw`` is kNN on the raw pixels (no map, D = 784 float32 per reference), the baseline a user
has without training.

Usage: python benchmarks/full_set_map.py [--runs nca:32,nca:48,nca:64,knca-majority:32]
       [--runs raw,nca:32:no-early-stopping]
Writes benchmarks/results/full_set_map.json (runs not asked for keep their last rows).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness.data import usps_784
from harness.report import RESULTS, machine, print_table, save_json

from training.config import TrainConfig
from training.job import run

NAME = "full_set_map.json"
COLUMNS = ["objective", "d", "served_k", "test_error", "error_1nn", "error_5nn", "fit_s"]


def write_set(directory: Path) -> Path:
    """The 60k digits as an .npz the job reads (X, y, X_test, y_test)."""
    sets = usps_784(60_000, 1_000, 2_007)
    if sets is None:
        raise SystemExit("../shared/data/usps.npz is absent: this benchmark needs USPS")
    X, y, _, _, X_test, y_test = sets
    path = directory / "digits60k.npz"
    np.savez(path, X=X, y=y, X_test=X_test, y_test=y_test)
    return path


def raw_knn(data: Path) -> dict:
    """kNN on the raw pixels: every training row a reference (the job's 10% validation rows
    included), the test errors at k = 1 and 5, the served k being 1."""
    from training.evaluation.evaluate import knn_accuracies

    with np.load(data) as sets:
        X, y, X_test, y_test = sets["X"], sets["y"], sets["X_test"], sets["y_test"]
    started = time.perf_counter()
    accuracy = knn_accuracies(X, y, X_test, y_test, int(y.max()) + 1, (1, 5))
    return {
        "objective": "raw kNN",
        "d": X.shape[1],
        "k": 1,
        "served_k": 1,
        "test_error": 1 - accuracy[1],
        "error_1nn": 1 - accuracy[1],
        "error_5nn": 1 - accuracy[5],
        "fit_s": 0.0,
        "job_s": time.perf_counter() - started,
        "bytes_per_reference": 4 * X.shape[1],
        "n_references": len(y),
    }


def fit(data: Path, out: Path, objective: str, d: int, early_stopping: bool = True) -> dict:
    """One run of the job with ``objective`` (k = 5 for kNCA, the served k it trains for)
    at dimension ``d``, with the job's early stopping or without; its errors and fit
    seconds."""
    k = 5 if objective.startswith("knca") else 1
    config = TrainConfig(
        data=str(data),
        out=str(out),
        n_components=d,
        objective=objective,
        k=k,
        early_stopping=early_stopping,
        plots=False,
        quiet=True,
    )
    started = time.perf_counter()
    report = run(config, log=lambda *_: None)
    seconds = time.perf_counter() - started
    metrics = report["metrics"]
    accuracy = {int(key): value for key, value in metrics["test_accuracy"].items()}
    return {
        "objective": objective if early_stopping else f"{objective}, no early stopping",
        "d": d,
        "k": k,
        "served_k": metrics["default_k"],
        "test_error": 1 - metrics["test_accuracy_at_default_k"],
        "error_1nn": 1 - accuracy[1],
        "error_5nn": 1 - accuracy[5],
        "fit_s": report["training"].get("fit_seconds", seconds),
        "job_s": seconds,
        "bytes_per_reference": 4 * d,
        "n_references": report["data"]["n_train"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", default="nca:32,nca:48,nca:64,knca-majority:32")
    args = parser.parse_args()
    previous = RESULTS / NAME
    rows = json.loads(previous.read_text())["rows"] if previous.exists() else []
    with tempfile.TemporaryDirectory() as tmp:
        data = write_set(Path(tmp))
        for i, spec in enumerate(args.runs.split(",")):
            if spec == "raw":
                row = raw_knn(data)
            else:
                objective, d, *option = spec.split(":")
                if option not in ([], ["no-early-stopping"]):
                    parser.error(f"--runs: {spec!r}: the only option is no-early-stopping")
                row = fit(data, Path(tmp) / f"model-{i}", objective, int(d), not option)
            rows = [r for r in rows if (r["objective"], r["d"]) != (row["objective"], row["d"])]
            rows.append(row)
            print(row, flush=True)
            save_json(NAME, {"machine": machine(), "rows": rows})
    rows.sort(key=lambda r: (r["objective"], r["d"]))
    print_table(rows, COLUMNS)
    save_json(NAME, {"machine": machine(), "rows": rows})


if __name__ == "__main__":
    main()
