"""kNN search on raw inputs (D = 784) against the NCA-projected space (d = 32), with FAISS.

N = 60k references and 10k queries from the synthetic 784-dim set; the projection is an NCA
map learned on 10k of the references (so the projected data has real structure). Measures,
side by side in one run (median of 3): FAISS Flat search time for the 10k queries and index
bytes, raw against projected; and HNSW / IVF / IVF-PQ on the projected data, each with its
recall@5 against projected Flat and its speed-up over raw-D Flat.

Usage: python benchmarks/search_raw_vs_projected.py [--n 60000] [--queries 10000]
Writes benchmarks/results/search_raw_vs_projected.json.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from pathlib import Path

import faiss
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, median, print_table, save_json, synthetic

K = 5


def timed_search(index, queries, k, repeats=3):
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        _, idx = index.search(queries, k)
        times.append(time.perf_counter() - t)
    return median(times), idx


def recall(approx, exact):
    return float(
        np.mean([len(set(a) & set(e)) / len(e) for a, e in zip(approx, exact, strict=True)])
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--n", type=int, default=60000)
    parser.add_argument("--queries", type=int, default=10000)
    args = parser.parse_args()

    from training import NCA

    X, y = synthetic(args.n + args.queries, seed=1)
    refs_raw, queries_raw = X[: args.n], X[args.n :]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        nca = NCA(n_components=32, max_iter=50, random_state=0).fit(refs_raw[:10000], y[:10000])
    refs = nca.transform(refs_raw)
    queries = nca.transform(queries_raw)
    faiss.omp_set_num_threads(os.cpu_count() or 1)

    rows = []
    raw = faiss.IndexFlatL2(refs_raw.shape[1])
    raw.add(np.ascontiguousarray(refs_raw))
    raw_time, raw_idx = timed_search(raw, np.ascontiguousarray(queries_raw), K)
    rows.append(
        {
            "index": "Flat",
            "space": f"raw D={refs_raw.shape[1]}",
            "seconds": raw_time,
            "index_bytes": len(faiss.serialize_index(raw)),
            "speedup_vs_raw_flat": 1.0,
        }
    )
    flat = faiss.IndexFlatL2(32)
    flat.add(refs)
    flat_time, exact = timed_search(flat, queries, K)
    rows.append(
        {
            "index": "Flat",
            "space": "projected d=32",
            "seconds": flat_time,
            "index_bytes": len(faiss.serialize_index(flat)),
            "speedup_vs_raw_flat": raw_time / flat_time,
            "recall_at_5_vs_projected_flat": 1.0,
            "recall_at_5_vs_raw_flat": recall(exact, raw_idx),
        }
    )
    configs = []
    for ef in (16, 32, 64, 128):
        configs.append(
            ("HNSW32", f"efSearch={ef}", lambda: faiss.IndexHNSWFlat(32, 32), {"efSearch": ef})
        )
    nlist = 1024
    for nprobe in (1, 4, 8, 16, 32):
        configs.append(
            (
                "IVF1024,Flat",
                f"nprobe={nprobe}",
                lambda: faiss.IndexIVFFlat(faiss.IndexFlatL2(32), 32, nlist),
                {"nprobe": nprobe},
            )
        )
    for nprobe in (8, 32):
        configs.append(
            (
                "IVF1024,PQ8",
                f"nprobe={nprobe}",
                lambda: faiss.IndexIVFPQ(faiss.IndexFlatL2(32), 32, nlist, 8, 8),
                {"nprobe": nprobe},
            )
        )
    built: dict[str, tuple] = {}
    for name, setting, make, params in configs:
        if name not in built:
            index = make()
            t = time.perf_counter()
            if not index.is_trained:
                index.train(refs)
            index.add(refs)
            built[name] = (index, time.perf_counter() - t)
        index, build_seconds = built[name]
        if "efSearch" in params:
            index.hnsw.efSearch = params["efSearch"]
        if "nprobe" in params:
            index.nprobe = params["nprobe"]
        seconds, idx = timed_search(index, queries, K)
        rows.append(
            {
                "index": name,
                "space": f"projected d=32, {setting}",
                "seconds": seconds,
                "index_bytes": len(faiss.serialize_index(index)),
                "build_seconds": build_seconds,
                "speedup_vs_raw_flat": raw_time / seconds,
                "recall_at_5_vs_projected_flat": recall(idx, exact),
            }
        )
    for r in rows:
        r["bytes_ratio_vs_raw"] = rows[0]["index_bytes"] / r["index_bytes"]
    print_table(
        rows,
        [
            "index",
            "space",
            "seconds",
            "speedup_vs_raw_flat",
            "recall_at_5_vs_projected_flat",
            "index_bytes",
            "bytes_ratio_vs_raw",
            "build_seconds",
        ],
    )
    out = save_json(
        "search_raw_vs_projected.json",
        {"machine": machine(), "n": args.n, "queries": args.queries, "k": K, "rows": rows},
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
