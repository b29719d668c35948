"""kNN search on raw inputs (D = 784) against the NCA-projected space (d = 32), through the
service's own search path (``service.search.index``: k + 8 FAISS candidates, exact re-rank).

Data (``--data``): ``usps`` (default when ../shared/data/usps.npz is present): real digits at
MNIST's size, USPS resampled to 28 x 28 (D = 784) and augmented to N = 60k references, with 5k
validation and 10k test queries drawn from held-out source images (``harness.data.usps_784``);
``synthetic``: the synthetic 784-dim set (Gaussian blobs in a 40-dim subspace plus isotropic
noise, a hard case for partition and graph indexes). The projection is an NCA map learned on
10k of the references. Everything runs on
one thread, in batches of 64 queries (as a busy service batches them), k = 5, majority rule.

1. Flat: raw D = 784 against projected d = 32, seconds for the 10k queries (median of 3).
2. Approximate indexes over the projection, each tuned as ``python -m service.search.tuning``
   tunes them: the cheapest nprobe / efSearch whose label agreement with exact search on the
   *validation* queries reaches the target (0.998). Then judged on the 10k *test* queries:
   label agreement with exact (projected Flat) search, accuracy delta, recall@5, and speed
   against raw-D Flat. The tuner also scores two-stage plans (every row at a cheap setting,
   rows with a close k-NN vote again at a wider one); when it picks one, the best one-stage
   setting is shown next to it.

Usage: python benchmarks/search_raw_vs_projected.py [--data usps|synthetic] [--n 60000]
       [--queries 10000]
Writes benchmarks/results/search_raw_vs_projected.json.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

import faiss
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness.data import USPS_PATH, synthetic, usps_784
from harness.report import machine, median, print_table, save_json

from service.core.knn import decide
from service.search.index import (
    IndexParams,
    build_index,
    configure,
    reference_norm_limit,
    search_with_recheck,
)
from service.search.tuning import answer_queries, recall_at_k, tune

K = 5
RULE = "majority"
BATCH = 64
TARGET = 0.998


def timed_batches(
    index, references, labels, queries, plan=None, repeats=3
) -> tuple[float, np.ndarray]:
    """(median seconds for all queries in batches of 64 on one thread, indices (n, K)), through
    the service's search (``search_with_recheck`` with ``plan``: one or two stages)."""
    limit = reference_norm_limit(references)
    plan = plan or IndexParams()
    n_classes = int(labels.max()) + 1
    times, indices = [], None
    for _ in range(repeats):
        found = []
        t = time.perf_counter()
        for start in range(0, len(queries), BATCH):
            batch = queries[start : start + BATCH]
            result = search_with_recheck(
                index, references, labels, n_classes, batch, K, plan, threads=1, norm_limit=limit
            )
            found.append(result.indices)
        times.append(time.perf_counter() - t)
        indices = np.concatenate(found)
    return median(times), indices


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--n", type=int, default=60000)
    parser.add_argument("--queries", type=int, default=10000)
    parser.add_argument("--validation", type=int, default=5000)
    parser.add_argument(
        "--data",
        choices=["usps", "synthetic"],
        default="usps" if USPS_PATH.exists() else "synthetic",
    )
    args = parser.parse_args()

    from training import NCA

    n, q, v = args.n, args.queries, args.validation
    if args.data == "usps":
        refs_raw, labels, val_raw, y_val, queries_raw, y_test = usps_784(n, v, q, seed=1)
    else:
        X, y = synthetic(n + q + v, seed=1)
        refs_raw, queries_raw, val_raw = X[:n], X[n : n + q], X[n + q :]
        labels, y_test, y_val = y[:n], y[n : n + q], y[n + q :]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        nca = NCA(n_components=32, max_iter=50, random_state=0).fit(
            refs_raw[:10000], labels[:10000]
        )
    refs = np.ascontiguousarray(nca.transform(refs_raw), dtype=np.float32)
    queries = np.ascontiguousarray(nca.transform(queries_raw), dtype=np.float32)
    val = np.ascontiguousarray(nca.transform(val_raw), dtype=np.float32)
    n_classes = int(labels.max()) + 1
    faiss.omp_set_num_threads(1)

    def predicted(indices: np.ndarray, space: np.ndarray, qs: np.ndarray) -> np.ndarray:
        d2 = ((space[indices] - qs[:, None, :]).astype(np.float64) ** 2).sum(axis=2)
        return decide(labels[indices], d2, n_classes, RULE)[0]

    rows = []
    raw_index = build_index(refs_raw, IndexParams(kind="flat"))
    raw_time, raw_idx = timed_batches(
        raw_index, refs_raw, labels, np.ascontiguousarray(queries_raw)
    )
    raw_pred = predicted(raw_idx, refs_raw, queries_raw)
    rows.append(
        {
            "index": "Flat",
            "space": f"raw D={refs_raw.shape[1]}",
            "seconds": raw_time,
            "speedup_vs_raw_flat": 1.0,
            "test_accuracy": float(np.mean(raw_pred == y_test)),
            "index_bytes": len(faiss.serialize_index(raw_index)),
        }
    )
    flat = build_index(refs, IndexParams(kind="flat"))
    flat_time, exact_idx = timed_batches(flat, refs, labels, queries)
    exact_pred = predicted(exact_idx, refs, queries)
    exact_acc = float(np.mean(exact_pred == y_test))
    rows.append(
        {
            "index": "Flat",
            "space": "projected d=32",
            "seconds": flat_time,
            "speedup_vs_raw_flat": raw_time / flat_time,
            "label_agreement": 1.0,
            "test_accuracy": exact_acc,
            "accuracy_delta_points": 0.0,
            "recall_at_5": 1.0,
            "index_bytes": len(faiss.serialize_index(flat)),
        }
    )
    # where the projected Flat time goes: the FAISS call alone, without the re-rank
    t = time.perf_counter()
    for start in range(0, q, BATCH):
        flat.search(queries[start : start + BATCH], K + 8)
    faiss_only = time.perf_counter() - t
    rows[-1]["faiss_call_seconds"] = faiss_only

    candidates = [
        ("ivf", dict(ivf_nlist=0)),
        ("ivf", dict(ivf_nlist=512)),
        ("ivf", dict(ivf_nlist=2048)),
        ("hnsw", dict(hnsw_m=16)),
        ("hnsw", dict(hnsw_m=32)),
    ]
    for kind, extra in candidates:
        params = IndexParams(kind=kind, **extra)
        t = time.perf_counter()
        index = build_index(refs, params)
        build_seconds = time.perf_counter() - t
        chosen, trials, _ = tune(
            index, kind, refs, labels, n_classes, val, y_val, k=K, rule=RULE, target=TARGET
        )
        name = "nprobe" if kind == "ivf" else "ef_search"
        if chosen is None:
            print(
                f"{kind} {extra}: target not reached (best {max(t.label_agreement for t in trials):.4f})"
            )
            continue
        # the tuner's choice, and the best one-stage setting for comparison
        one_stage = [t for t in trials if not t.recheck_margin and t.agreement_bound >= TARGET]
        shown = [chosen]
        if one_stage and chosen.recheck_margin:
            shown.append(min(one_stage, key=lambda t: t.microseconds_per_query))
        for trial in shown:
            plan = trial.plan(kind)
            configure(index, plan)
            seconds, idx = timed_batches(index, refs, labels, queries, plan)
            pred = answer_queries(index, refs, labels, n_classes, queries, K, RULE, plan).predicted
            label = f"IVF{index.nlist}" if kind == "ivf" else f"HNSW{params.hnsw_m}"
            setting = f"{name}={trial.value}"
            if trial.recheck_margin:
                setting += f", margin<{trial.recheck_margin}: {name}={trial.recheck_value}"
            rows.append(
                {
                    "index": label,
                    "space": f"projected d=32, {setting}",
                    "tuner_choice": trial is chosen,
                    "rechecked_fraction_validation": trial.rechecked_fraction,
                    "seconds": seconds,
                    "speedup_vs_raw_flat": raw_time / seconds,
                    "label_agreement": float(np.mean(pred == exact_pred)),
                    "validation_agreement": trial.label_agreement,
                    "test_accuracy": float(np.mean(pred == y_test)),
                    "accuracy_delta_points": 100 * (float(np.mean(pred == y_test)) - exact_acc),
                    "recall_at_5": recall_at_k(idx, exact_idx),
                    "index_bytes": len(faiss.serialize_index(index)),
                    "build_seconds": build_seconds,
                }
            )
            print(rows[-1], flush=True)
    for r in rows:
        r["bytes_ratio_vs_raw"] = rows[0]["index_bytes"] / r["index_bytes"]
    print_table(
        rows,
        [
            "index",
            "space",
            "tuner_choice",
            "seconds",
            "speedup_vs_raw_flat",
            "label_agreement",
            "accuracy_delta_points",
            "recall_at_5",
            "test_accuracy",
            "index_bytes",
            "build_seconds",
        ],
    )
    print(
        f"projected Flat: {flat_time:.3f} s, of which the FAISS call {faiss_only:.3f} s "
        f"(the rest: re-rank, norm checks)"
    )
    out = save_json(
        "search_raw_vs_projected.json",
        {
            "machine": machine(),
            "data": args.data,
            "n": n,
            "queries": q,
            "validation": v,
            "k": K,
            "rule": RULE,
            "batch": BATCH,
            "threads": 1,
            "target_label_agreement": TARGET,
            "rows": rows,
        },
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
