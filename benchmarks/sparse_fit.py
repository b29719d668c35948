"""Sparse input (issue 59): the default fit on a sparse set, and beside it the dense path where
the dense copy fits in memory.

The data: text-like rows (10 classes; each row ``--nnz`` non-zeros, a tenth drawn from its
class's own vocabulary of 200 features, the rest from all ``--features``; values exponential,
rows scaled to unit length, as TF-IDF rows are), in float32. Each run is a fresh interpreter
(so its peak RSS is its own) fitting ``NCA(n_components=32, random_state=0)`` on the training
rows and scoring 5-NN on 5,000 test rows in the learned space (scikit-learn's brute force,
which takes sparse rows, for the raw-input baseline).

Runs (``--runs``): ``sparse:N:D`` fits the CSR matrix, ``dense:N:D`` its dense copy
(standardize none, as sparse rows are used). Prints the float32 GEMM rate; saves
``benchmarks/results/sparse_fit.json``.

    taskset -c 0,1 python benchmarks/sparse_fit.py \
        --runs sparse:20000:5000,dense:20000:5000,sparse:100000:50000
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import scipy.sparse as sp

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness.report import gemm_gflops, machine, peak_rss_mib, print_table, save_json

N_CLASSES = 10
VOCABULARY = 200  # features each class favours
N_TEST = 5000


def text_like(n: int, n_features: int, nnz: int, seed: int) -> tuple[sp.csr_matrix, np.ndarray]:
    """(X (n, D) CSR float32 with ``nnz`` non-zeros a row (duplicates summed), y (n,))."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, N_CLASSES, n)
    own = nnz // 10
    vocab = np.random.default_rng(0).choice(n_features, (N_CLASSES, VOCABULARY), replace=False)
    cols = np.empty((n, nnz), dtype=np.int64)
    cols[:, :own] = vocab[y[:, None], rng.integers(0, VOCABULARY, (n, own))]
    cols[:, own:] = rng.integers(0, n_features, (n, nnz - own))
    values = rng.exponential(1.0, (n, nnz)).astype(np.float32)
    rows = np.repeat(np.arange(n), nnz)
    X = sp.csr_matrix((values.ravel(), (rows, cols.ravel())), shape=(n, n_features))
    X.sum_duplicates()
    norms = np.sqrt(np.asarray(X.multiply(X).sum(axis=1)).ravel())
    X = sp.diags(1.0 / np.maximum(norms, 1e-12)).astype(np.float32) @ X
    return X.tocsr().astype(np.float32), y


def one_run(kind: str, n: int, n_features: int, nnz: int) -> dict:
    """One fit in this process."""
    from sklearn.neighbors import KNeighborsClassifier

    from training import NCA

    X, y = text_like(n + N_TEST, n_features, nnz, seed=1)
    X_train, y_train, X_test, y_test = X[:n], y[:n], X[n:], y[n:]
    options = {}
    if kind == "dense":
        X_train, X_test = X_train.toarray(), X_test.toarray()
        options = {"standardize": "none"}
    loaded_mib = peak_rss_mib()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        started = time.perf_counter()
        model = NCA(n_components=32, random_state=0, options=options).fit(X_train, y_train)
        fit_s = time.perf_counter() - started
    knn = KNeighborsClassifier(5).fit(model.transform(X_train), y_train)
    error = 1.0 - knn.score(model.transform(X_test), y_test)
    raw = KNeighborsClassifier(5, algorithm="brute").fit(X_train[:20000], y_train[:20000])
    raw_error = 1.0 - raw.score(X_test[:2000], y_test[:2000])
    return {
        "kind": kind,
        "n": n,
        "features": n_features,
        "nnz": int(X[:n].nnz if kind == "sparse" else X_train.size),  # stored values
        "fit_s": round(fit_s, 1),
        "peak_rss_mib": round(peak_rss_mib(), 0),
        "rss_before_fit_mib": round(loaded_mib, 0),
        "err_5nn_learned": round(100 * error, 2),
        "err_5nn_raw_20k": round(100 * raw_error, 2),
        "stages": [(s["stage"], s["iterations"], s.get("kept")) for s in model.stages_],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", default="sparse:20000:5000,dense:20000:5000")
    parser.add_argument("--nnz", type=int, default=50, help="non-zeros a row")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # kind:N:D, run in this process
    args = parser.parse_args()
    if args.one:
        kind, n, d = args.one.split(":")
        print(json.dumps(one_run(kind, int(n), int(d), args.nnz)))
        return
    rows = []
    for run in args.runs.split(","):
        gemm = gemm_gflops()
        done = subprocess.run(
            [sys.executable, __file__, "--one", run, "--nnz", str(args.nnz)],
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode != 0:
            rows.append({"run": run, "error": done.stderr.strip().splitlines()[-1:]})
            continue
        rows.append({"run": run, **json.loads(done.stdout.strip().splitlines()[-1]), "gemm": gemm})
    print_table(
        rows,
        ["run", "nnz", "fit_s", "peak_rss_mib", "err_5nn_learned", "err_5nn_raw_20k", "gemm"],
    )
    save_json("sparse_fit", {"machine": machine(), "nnz_per_row": args.nnz, "runs": rows})


if __name__ == "__main__":
    main()
