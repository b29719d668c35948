"""Cost as N grows: Flat, IVF and HNSW over N = 60k, 250k and 1M references at d = 32, each
approximate index at the setting that meets the label-agreement target; and the time to a
ready server with and without the prebuilt index in the artifact.

Synthetic references (a 10-class mixture in a 16-dim subspace of 32 dimensions). Flat's cost
does not depend on where the points came from; an IVF's or HNSW's does (clustered real data
needs fewer probes: ``search_raw_vs_projected.py`` on real digits). For each N and index:
build time (FAISS train + add), load time of the serialised index, index bytes and the
process RSS growth while building, single-query latency (median of 300 queries, one thread)
and batched throughput (batches of 64, one thread), all through
``service.search.index.search_with_recheck``; label agreement with exact search on 2k test queries
(k = 5, majority), the setting (or two-stage plan) tuned on 5k validation queries as
``python -m service.search.tuning`` tunes it (Wilson lower bound at 95 %).

Then, at the largest N: ``python -m service`` started on an artifact without and with
``index.faiss`` (IVF, tuned), seconds until /readyz answers 200 (median of 3).

Usage: python benchmarks/index_cost.py [--sizes 60000,250000,1000000] [--skip-ready]
Writes benchmarks/results/index_cost.json and index_cost.png (q/s against N).
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import faiss
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness.data import synthetic
from harness.report import machine, median, print_table, save_json
from harness.servers import free_port

from service.search.index import IndexParams, build_index, configure, search_with_recheck
from service.search.tuning import answer_queries, tune

ROOT = Path(__file__).resolve().parents[1]
K, RULE, BATCH, TARGET = 5, "majority", 64, 0.998
N_VAL, N_TEST = 5000, 2000


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def single_query_us(index, refs, labels, queries, plan) -> float:
    times = []
    for row in queries[:300]:
        t = time.perf_counter()
        search_with_recheck(index, refs, labels, 10, row[None, :], K, plan, threads=1)
        times.append(time.perf_counter() - t)
    return 1e6 * median(times)


def batched_qps(index, refs, labels, queries, plan) -> float:
    t = time.perf_counter()
    for start in range(0, len(queries), BATCH):
        batch = queries[start : start + BATCH]
        search_with_recheck(index, refs, labels, 10, batch, K, plan, threads=1)
    return len(queries) / (time.perf_counter() - t)


def measure(n: int) -> list[dict]:
    X, y = synthetic(n + N_VAL + N_TEST, n_features=32, seed=3, latent=16)
    refs, labels = np.ascontiguousarray(X[:n]), y[:n]
    val, y_val = X[n : n + N_VAL], y[n : n + N_VAL]
    test, y_test = X[n + N_VAL :], y[n + N_VAL :]
    n_classes = int(y.max()) + 1
    rows = []
    exact = None
    for kind in ("flat", "ivf", "hnsw"):
        params = IndexParams(kind=kind)
        before = rss_mib()
        t = time.perf_counter()
        index = build_index(refs, params)
        build_seconds = time.perf_counter() - t
        grown = rss_mib() - before
        setting, plan = "", params
        if kind != "flat":
            chosen, _trials, _ = tune(
                index, kind, refs, labels, n_classes, val, y_val, k=K, rule=RULE, target=TARGET
            )
            if chosen is None:
                print(f"N={n} {kind}: no setting reaches {TARGET}", flush=True)
                continue
            name = "nprobe" if kind == "ivf" else "ef_search"
            plan = chosen.plan(kind)
            configure(index, plan)
            setting = f"{name}={chosen.value}"
            if chosen.recheck_margin:
                setting += f", margin<{chosen.recheck_margin}: {chosen.recheck_value}"
        data = faiss.serialize_index(index)
        t = time.perf_counter()
        loaded = faiss.deserialize_index(data)
        load_seconds = time.perf_counter() - t
        del loaded
        answers = answer_queries(index, refs, labels, n_classes, test, K, RULE, plan)
        if kind == "flat":
            exact = answers
        row = {
            "n": n,
            "index": kind,
            "setting": setting,
            "build_seconds": build_seconds,
            "load_seconds": load_seconds,
            "index_mib": len(data) / 2**20,
            "rss_growth_mib": grown,
            "single_query_us": single_query_us(index, refs, labels, test, plan),
            "batched_queries_per_second": batched_qps(index, refs, labels, test, plan),
            "label_agreement": float(np.mean(answers.predicted == exact.predicted)),
            "accuracy_delta_points": 100
            * float(np.mean(answers.predicted == y_test) - np.mean(exact.predicted == y_test)),
        }
        rows.append(row)
        print(row, flush=True)
        del index
    return rows


def seconds_to_ready(artifact: Path) -> float:
    import httpx

    port = free_port()
    env = {**os.environ, "NCAKNN_LOG_LEVEL": "warning", "PYTHONPATH": str(ROOT)}
    started = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "service", "--model", str(artifact), "--port", str(port)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        while proc.poll() is None:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1).status_code == 200:
                    return time.perf_counter() - started
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"the server exited with {proc.returncode}")
    finally:
        proc.terminate()
        proc.wait(60)


def ready_times(n: int) -> dict:
    from service.core.artifact import write_artifact
    from service.search.tuning import index_artifact

    X, y = synthetic(n + N_VAL, n_features=32, seed=3, latent=16)
    rng = np.random.default_rng(0)
    work = Path(tempfile.mkdtemp(prefix="ncaknn-ready-"))
    common = dict(
        projection=np.eye(32, 64, dtype=np.float32)
        + 0.01 * rng.normal(size=(32, 64)).astype(np.float32),
        offset=np.zeros(32, np.float32),
        embeddings=X[:n],
        labels=y[:n].astype(np.int32),
        classes=list(range(10)),
        mean=np.zeros(64),
        scale=np.ones(64),
        default_k=K,
        validation_embeddings=X[n:],
        validation_labels=y[n:].astype(np.int32),
    )
    plain = write_artifact(work / "plain", **common)
    indexed = work / "indexed"
    index_artifact(plain, "ivf", target=TARGET, out=indexed, log=lambda m: None)
    # the same IVF, built at startup (NCAKNN_INDEX_TYPE=ivf, the tuned nprobe) or loaded
    nprobe = __import__("service.core.artifact", fromlist=["read_artifact"]).read_artifact(indexed)
    nprobe = nprobe.manifest["index"]["params"]["nprobe"]
    os.environ["NCAKNN_NPROBE"] = str(nprobe)
    out = {"n": n, "nprobe": nprobe}
    for name, path, kind in (
        ("flat", plain, "flat"),
        ("ivf_built_at_start", plain, "ivf"),
        ("ivf_prebuilt", indexed, "auto"),
    ):
        os.environ["NCAKNN_INDEX_TYPE"] = kind
        out[f"{name}_seconds_to_ready"] = median([seconds_to_ready(path) for _ in range(3)])
        print(name, out[f"{name}_seconds_to_ready"], flush=True)
    os.environ.pop("NCAKNN_INDEX_TYPE")
    os.environ.pop("NCAKNN_NPROBE")
    return out


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for kind in ("flat", "ivf", "hnsw"):
        pts = [(r["n"], r["batched_queries_per_second"]) for r in rows if r["index"] == kind]
        if pts:
            ax.plot(*zip(*pts, strict=True), marker="o", label=kind)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("references N (d = 32)")
    ax.set_ylabel("queries / s (batches of 64, 1 thread)")
    ax.set_title(f"search throughput vs N (approximate at label agreement >= {TARGET})")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=120)
    tmp.replace(path)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", default="60000,250000,1000000")
    parser.add_argument("--skip-ready", action="store_true")
    args = parser.parse_args()
    faiss.omp_set_num_threads(os.cpu_count() or 1)  # builds use every core; searches set 1
    sizes = [int(s) for s in args.sizes.split(",")]
    rows = []
    for n in sizes:
        rows.extend(measure(n))
    print_table(
        rows,
        [
            "n",
            "index",
            "setting",
            "build_seconds",
            "load_seconds",
            "index_mib",
            "rss_growth_mib",
            "single_query_us",
            "batched_queries_per_second",
            "label_agreement",
            "accuracy_delta_points",
        ],
    )
    ready = None if args.skip_ready else ready_times(max(sizes))
    print(ready)
    out = save_json(
        "index_cost.json",
        {
            "machine": machine(),
            "target_label_agreement": TARGET,
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "rows": rows,
            "ready": ready,
        },
    )
    plot(rows, out.with_name("index_cost.png"))
    print(f"wrote {out} and index_cost.png")


if __name__ == "__main__":
    main()
