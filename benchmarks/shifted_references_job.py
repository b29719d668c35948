"""Shifted references through the CLI: the job fits the real digits, ``references add`` adds
each of its training rows moved one pixel in 8 directions, and the served model is scored on
the test digits before and after.

The route ``docs/training.md`` gives for the best setting measured ("The best setting
measured"): ``python -m training --data digits.npz ...`` on the 60,000 training digits with
the 10,000 test digits as its test split, then the shifted copies (``real_digits.py``'s
``shifted_digits``, all eight directions) of the rows the artifact holds as references: its
training split, found as the job finds it (``training.data.datasets.stratified_split`` with
the job's seed and ``--val-size``, checked against the artifact's fingerprint of its
training rows), so no validation row has a twin among the references.
Then ``python -m training references add``. Each model is scored on the test digits by the
served rule at the served k (the manifest's), and by the majority vote at k = 1 and 5, all
through ``training.evaluation.evaluate.knn_predictions`` on the artifact's embeddings.

    taskset -c 0,1 python benchmarks/shifted_references_job.py [--options "--n-components 64
        --l2 0.003 --exact-finish 0"] [--seed 0] [--name shifted_references_job]

Prints the float32 GEMM rate; writes benchmarks/results/<name>.json. Its temporary folder
holds about 1.5 GB (the digits' .npz and the 432,008 shifted copies').
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness.report import gemm_gflops, machine, print_table, save_json
from real_digits import DIAGONALS, MNIST, SHIFTS, shifted_digits

from service.core.artifact.read import read_artifact
from service.core.knn import project
from training.data.datasets import fingerprint_from_row_digests, row_digests, stratified_split
from training.evaluation.evaluate import knn_predictions

HERE = Path(__file__).resolve().parents[1]
VAL_SIZE = 0.1  # the job's --val-size (its default)


def test_errors(model_dir: Path, X_test: np.ndarray, y_test: np.ndarray) -> dict:
    """The served model's test error: its rule at its k, and the majority vote at 1 and 5."""
    artifact = read_artifact(model_dir)
    classes = artifact.manifest["classes"]
    index_of = {str(c): i for i, c in enumerate(classes)}  # the manifest's order, any labels
    y = np.array([index_of[str(c)] for c in y_test])
    z_test = project(X_test, artifact.projection, artifact.offset)  # as the service embeds
    z_ref = artifact.embeddings
    k, rule = int(artifact.manifest["default_k"]), artifact.manifest["decision_rule"]
    served = knn_predictions(z_ref, artifact.labels, z_test, len(classes), (k,), rule)[k]
    majority = knn_predictions(z_ref, artifact.labels, z_test, len(classes), (1, 5))
    return {
        "references": len(z_ref),
        "served_k": k,
        "served_rule": rule,
        "err_served": float(np.mean(served != y)),
        "err_1nn": float(np.mean(majority[1] != y)),
        "err_5nn": float(np.mean(majority[5] != y)),
    }


def run(command: list[str]) -> None:
    """Run a CLI step in the checkout; on failure, stop with its stderr."""
    done = subprocess.run(command, cwd=HERE, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)}: exit {done.returncode}\n{done.stderr[-3000:]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--options", default="--n-components 64 --l2 0.003 --exact-finish 0")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--name", default="shifted_references_job")
    args = parser.parse_args()
    for option in ("--val-size", "--prototypes", "--test-size"):  # the split rebuilt below
        if option in args.options:
            raise SystemExit(
                f"--options may not set {option}: the script rebuilds the default split"
            )
    if not MNIST.exists():
        print(f"{MNIST} absent: nothing to measure")
        return
    data = np.load(MNIST)
    X, y, X_test, y_test = data["X"], data["y"], data["X_test"], data["y_test"]
    python = sys.executable
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        folder = Path(folder)
        np.savez(folder / "digits.npz", X=X, y=y, X_test=X_test, y_test=y_test)
        gemm = gemm_gflops()
        command = [python, "-m", "training", "--data", str(folder / "digits.npz")]
        command += [*shlex.split(args.options), "--seed", str(args.seed), "--no-plots"]
        command += ["--out", str(folder / "model")]
        started = time.perf_counter()
        run(command)
        job_s = time.perf_counter() - started
        rows.append(
            {
                "model": "job",
                "job_s": job_s,
                "gemm_gflops": gemm,
                **test_errors(folder / "model", X_test, y_test),
            }
        )
        # the job's training split: the rows its artifact holds as references
        _, y_idx = np.unique(y, return_inverse=True)
        train_rows, _val_rows = stratified_split(y_idx, (VAL_SIZE,), args.seed)
        # ... the same rows: the artifact's fingerprint of its training rows and labels
        record = read_artifact(folder / "model").manifest["data"]
        ours = fingerprint_from_row_digests(
            row_digests(X[train_rows].astype(np.float64)), y[train_rows]
        )
        if record["n_train"] != len(train_rows) or record["fingerprint_sha256"] != ours:
            raise SystemExit("the rebuilt split is not the job's training split")
        moved, labels = shifted_digits(X[train_rows], y[train_rows], SHIFTS + DIAGONALS)
        n = len(train_rows)
        np.savez(folder / "shifted.npz", X=moved[n:], y=labels[n:])  # the copies alone
        command = [python, "-m", "training", "references", "add", "--model", str(folder / "model")]
        command += ["--data", str(folder / "shifted.npz"), "--out", str(folder / "shifted_model")]
        started = time.perf_counter()
        run(command)
        add_s = time.perf_counter() - started
        errors = test_errors(folder / "shifted_model", X_test, y_test)
        rows.append({"model": "+ 8 shifts", "job_s": add_s, "gemm_gflops": gemm, **errors})
    for row in rows:
        row.update(options=args.options, seed=args.seed)
    print_table(
        rows,
        [
            "model",
            "references",
            "served_k",
            "served_rule",
            "err_served",
            "err_1nn",
            "err_5nn",
            "job_s",
            "gemm_gflops",
        ],
    )
    command = "python benchmarks/shifted_references_job.py " + " ".join(sys.argv[1:])
    save_json(f"{args.name}.json", {"command": command, "machine": machine(), "rows": rows})


if __name__ == "__main__":
    main()
