"""Sparse input (issue 59): the default fit on a sparse set, and beside it the dense path where
the dense copy fits in memory.

The data: text-like rows (10 classes; each row ``--nnz`` non-zeros, a tenth drawn from its
class's own vocabulary of 200 features, the rest from all ``--features``; values exponential,
rows scaled to unit length, as TF-IDF rows are), in float32. Each run is a fresh interpreter
(so its peak RSS is its own) fitting ``NCA(n_components=32, random_state=0)`` on the training
rows and scoring 5-NN on 5,000 test rows in the learned space (scikit-learn's brute force,
which takes sparse rows, for the raw-input baseline).

Runs (``--runs``): ``sparse:N:D`` fits the CSR matrix, ``dense:N:D`` its dense copy
(standardize none, as sparse rows are used); ``job:N:D`` runs the training job on the
matrix written by ``scipy.sparse.save_npz`` (``--data X.npz --labels y.npy``, its own split
and evaluation, N rows in all) and then embeds 1,000 of its rows as the service does, by
their non-zeros (``service.core.sparse.project_sparse``) and as dense rows
(``service.core.knn.project``), with the JSON body size of each form. Prints the float32
GEMM rate; saves ``benchmarks/results/sparse_fit.json`` (``--name``).

    taskset -c 0,1 python benchmarks/sparse_fit.py \
        --runs sparse:20000:5000,dense:20000:5000,sparse:100000:50000,job:100000:50000
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


def job_run(n: int, n_features: int, nnz: int) -> dict:
    """The training job on a save_npz file of n rows, then the service's two embeddings of
    1,000 of them, in this process."""
    import tempfile

    from service.config import Settings
    from service.core.knn import project
    from service.core.sparse import SparseRows, project_sparse
    from service.engine.model import load_model
    from training.config import TrainConfig
    from training.job import run

    X, y = text_like(n, n_features, nnz, seed=1)
    with tempfile.TemporaryDirectory() as tmp:
        sp.save_npz(f"{tmp}/X.npz", X)
        np.save(f"{tmp}/y.npy", y)
        loaded_mib = peak_rss_mib()
        config = TrainConfig(data=f"{tmp}/X.npz", labels=f"{tmp}/y.npy", out=f"{tmp}/model")
        config.quiet = True
        started = time.perf_counter()
        report = run(config, log=lambda *_: None)
        job_s = time.perf_counter() - started
        job_rss = peak_rss_mib()
        model = load_model(f"{tmp}/model", Settings(model_path=f"{tmp}/model"))
    rows = X[:1000]
    sparse_rows = SparseRows(
        rows.indptr.astype(np.int64), rows.indices.astype(np.int64), rows.data, n_features
    )
    dense = rows.toarray()
    timings = {}
    for name, embed in (
        ("sparse", lambda: project_sparse(sparse_rows, model.projection, model.offset)),
        ("dense", lambda: project(dense, model.projection, model.offset)),
    ):
        seconds = []
        for _ in range(5):
            started = time.perf_counter()
            embed()
            seconds.append(time.perf_counter() - started)
        timings[name] = float(np.median(seconds))
    sparse_json = json.dumps(
        {
            "sparse_instances": [
                {"indices": r.indices.tolist(), "values": r.data.tolist()} for r in rows
            ]
        }
    )
    dense_json = json.dumps({"instances": dense.tolist()})
    metrics = report["metrics"]
    k = metrics["default_k"]  # the accuracies' keys are ints until report.json is written
    return {
        "kind": "job",
        "n": n,
        "features": n_features,
        "nnz": int(X.nnz),
        "fit_s": round(report["training"]["fit_seconds"], 1),
        "job_s": round(job_s, 1),
        "peak_rss_mib": round(job_rss, 0),
        "rss_before_fit_mib": round(loaded_mib, 0),
        "err_served": round(100 * (1 - metrics["test_accuracy"][k]), 2),
        "served_k": k,
        "err_euclidean": round(
            100 * (1 - metrics["baselines"]["euclidean"]["test_accuracy"][k]), 2
        ),
        "embed_1000_sparse_ms": round(1000 * timings["sparse"], 2),
        "embed_1000_dense_ms": round(1000 * timings["dense"], 2),
        "json_bytes_per_row_sparse": len(sparse_json) // 1000,
        "json_bytes_per_row_dense": len(dense_json) // 1000,
    }


def one_run(kind: str, n: int, n_features: int, nnz: int) -> dict:
    """One fit in this process."""
    if kind == "job":
        return job_run(n, n_features, nnz)
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
    parser.add_argument("--name", default="sparse_fit", help="results/NAME.json")
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
    jobs = [row for row in rows if row.get("kind") == "job"]
    if jobs:
        print_table(jobs, [c for c in jobs[0] if c not in ("kind", "n", "features")])
    save_json(args.name, {"machine": machine(), "nnz_per_row": args.nnz, "runs": rows})


if __name__ == "__main__":
    main()
