"""The full-set map on the digits: the served model's test error against the embedding
dimension d and the objective, fitted as the command line fits it.

Data (``--data``): ``mnist`` (default), the real MNIST digits (``../shared/data/mnist.npz``:
60,000 training rows, the 10,000 test rows, the published split); or ``usps784``,
``harness.data.usps_784(60_000, 1_000, 2_007)``: 60,000 rows of real USPS digits at MNIST's
size (zoomed and moved by small affine maps) and the 2,007 USPS test images moved the same
way. Each run is ``python -m training`` on that set (``training.job.run``: a 10% validation
split, the served k and the standardisation chosen on it, the defaults otherwise) with one
setting changed: d (``--n-components``) or the objective (``--objective``, ``--k``). The
served model's test error at its served k is what a client sees; the 1-NN and 5-NN errors,
the fit seconds (beside the machine's float32 GEMM rate, measured before each run) and the
stored bytes per reference (d float32 values: search cost grows with d too) are beside it.

A run is ``objective:d[:option...]``, the options ``no-early-stopping`` (the job's early
stopping on validation kNN accuracy turned off), ``l2=VALUE`` (``--l2``),
``finish=ITERATIONS`` (``--exact-finish``) and ``seed=N`` (``--seed``); ``raw`` is kNN on
the raw pixels (no map, D = 784 float32 per reference), the baseline a user has without
training; ``pca:d`` is kNN on the first d principal components of the training rows (no
labels used).

Usage: python benchmarks/full_set_map.py [--data mnist] [--runs nca:16,nca:32,nca:64]
       [--runs raw,pca:32,knca-majority:32,nca:32:l2=0.003:finish=0] [--name NAME]
Writes benchmarks/results/<name>.json (runs not asked for keep their last rows).
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
from harness.report import RESULTS, gemm_gflops, machine, print_table, save_json

from training.config import TrainConfig
from training.job import run

MNIST = Path(__file__).resolve().parents[2] / "shared" / "data" / "mnist.npz"
COLUMNS = ["objective", "d", "served_k", "test_error", "error_1nn", "error_5nn", "fit_s"]


def write_set(directory: Path, name: str) -> Path:
    """The digits as an .npz the job reads (X, y, X_test, y_test)."""
    if name == "mnist":
        if not MNIST.exists():
            raise SystemExit(f"{MNIST} is absent: --data mnist needs it")
        with np.load(MNIST) as data:
            X, y, X_test, y_test = data["X"], data["y"], data["X_test"], data["y_test"]
    else:
        sets = usps_784(60_000, 1_000, 2_007)
        if sets is None:
            raise SystemExit("../shared/data/usps.npz is absent: --data usps784 needs USPS")
        X, y, _, _, X_test, y_test = sets
    path = directory / "digits60k.npz"
    np.savez(path, X=X, y=y, X_test=X_test, y_test=y_test)
    return path


def pca_knn(data: Path, d: int) -> dict:
    """kNN on the first d principal components of the training rows (centred pixels)."""
    from training.evaluation.evaluate import knn_accuracies

    with np.load(data) as sets:
        X, y = sets["X"].astype(np.float32), sets["y"]
        X_test, y_test = sets["X_test"].astype(np.float32), sets["y_test"]
    started = time.perf_counter()
    mean = X.mean(0)
    _, _, vt = np.linalg.svd(X[::6] - mean, full_matrices=False)  # (D, D): axes of 10k rows
    z, z_test = (X - mean) @ vt[:d].T, (X_test - mean) @ vt[:d].T
    accuracy = knn_accuracies(z, y, z_test, y_test, int(y.max()) + 1, (1, 5))
    return {
        "objective": "PCA kNN",
        "d": d,
        "k": 1,
        "served_k": 1,
        "test_error": 1 - accuracy[1],
        "error_1nn": 1 - accuracy[1],
        "error_5nn": 1 - accuracy[5],
        "fit_s": time.perf_counter() - started,
        "bytes_per_reference": 4 * d,
        "n_references": len(y),
    }


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


def fit(data: Path, out: Path, objective: str, d: int, options: list[str]) -> dict:
    """One run of the job with ``objective`` (k = 5 for kNCA, the served k it trains for)
    at dimension ``d`` and the run's options (``no-early-stopping``, ``l2=VALUE``,
    ``finish=ITERATIONS``, ``seed=N``: the job's split and fit seed); its errors and fit
    seconds."""
    k = 5 if objective.startswith("knca") else 1
    settings = {}
    for option in options:
        if option == "no-early-stopping":
            settings["early_stopping"] = False
        elif option.startswith("l2="):
            settings["l2"] = option[3:]
        elif option.startswith("finish="):
            settings["exact_finish"] = option[7:]
        elif option.startswith("seed="):
            settings["seed"] = int(option[5:])
        else:
            raise SystemExit(
                f"--runs: unknown option {option!r}: no-early-stopping, l2=, finish=, seed="
            )
    config = TrainConfig(
        data=str(data),
        out=str(out),
        n_components=d,
        objective=objective,
        k=k,
        plots=False,
        quiet=True,
        **settings,
    )
    started = time.perf_counter()
    report = run(config, log=lambda *_: None)
    seconds = time.perf_counter() - started
    metrics = report["metrics"]
    accuracy = {int(key): value for key, value in metrics["test_accuracy"].items()}
    return {
        "objective": ", ".join([objective, *options]),
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
        "nearest_reference_distance": metrics.get("nearest_reference_distance"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", choices=("mnist", "usps784"), default="mnist")
    parser.add_argument("--runs", default="nca:32,nca:48,nca:64,knca-majority:32")
    parser.add_argument("--name", default=None, help="default: full_set_map_<data>")
    args = parser.parse_args()
    name = f"{args.name or 'full_set_map_' + args.data}.json"
    previous = RESULTS / name
    rows = json.loads(previous.read_text())["rows"] if previous.exists() else []
    with tempfile.TemporaryDirectory() as tmp:
        data = write_set(Path(tmp), args.data)
        for i, spec in enumerate(args.runs.split(",")):
            gemm = gemm_gflops()
            if spec == "raw":
                row = raw_knn(data)
            elif spec.startswith("pca:"):
                row = pca_knn(data, int(spec.split(":")[1]))
            else:
                objective, d, *options = spec.split(":")
                row = fit(data, Path(tmp) / f"model-{i}", objective, int(d), options)
            row["gemm_gflops"] = round(gemm, 1)
            rows = [r for r in rows if (r["objective"], r["d"]) != (row["objective"], row["d"])]
            rows.append(row)
            print(row, flush=True)
            save_json(name, {"machine": machine(), "data": args.data, "rows": rows})
    rows.sort(key=lambda r: (r["objective"], r["d"]))
    print_table(rows, [*COLUMNS, "gemm_gflops"])
    save_json(name, {"machine": machine(), "data": args.data, "rows": rows})


if __name__ == "__main__":
    main()
