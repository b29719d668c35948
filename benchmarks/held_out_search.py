"""The held-out rows' neighbour search: torch's pass against FAISS's flat search, by N.

A fit scores its held-out rows at every check (the soft-neighbour score over each row's 64
nearest references, ``training.distributed.sharded_stats``), and the job scores its
validation and test rows once more at the end; both search with
``training.evaluation.evaluate.nearest_references``. Its float32 first pass is either
torch's (a GEMM and ``torch.topk`` per block of queries) or FAISS's ``IndexFlatL2``, chosen
by ``FLAT_SEARCH_MIN_REFS``; the float64 re-rank makes both give the same neighbours. This
times both, inside the fit's one-thread BLAS limit (``threadpool_limits(1, "blas")``, as
``NCA.fit`` sets it), for 4,096 queries against N references in d = 32 (k = 64), median of
3, and prints the float32 GEMM rate; saves ``benchmarks/results/held_out_search.json``.

    taskset -c 0,1 python benchmarks/held_out_search.py
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import numpy as np
from threadpoolctl import threadpool_limits

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness.report import machine, save_json

from training.evaluation.evaluate import FLAT_SEARCH_MIN_REFS, nearest_references

SIZES = (4096, 16384, 32768, 54001, 131072)
QUERIES, D, K, REPEATS = 4096, 32, 64, 3


def median_seconds(queries: np.ndarray, references: np.ndarray, flat: bool) -> float:
    times = []
    for _ in range(REPEATS):
        started = time.perf_counter()
        nearest_references(queries, references, K, flat_search=flat)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    rng = np.random.default_rng(0)
    queries = rng.normal(size=(QUERIES, D)).astype(np.float32)
    rows = []
    with threadpool_limits(1, user_api="blas"):
        for n in SIZES:
            references = rng.normal(size=(n, D)).astype(np.float32)
            torch_s = median_seconds(queries, references, flat=False)
            faiss_s = median_seconds(queries, references, flat=True)
            rows.append({"references": n, "torch_s": torch_s, "faiss_s": faiss_s})
            print(
                f"N = {n:7d}: torch {torch_s:.3f} s, FAISS flat {faiss_s:.3f} s, "
                f"torch / FAISS {torch_s / faiss_s:.2f}"
            )
    print(f"FLAT_SEARCH_MIN_REFS = {FLAT_SEARCH_MIN_REFS}")
    save_json(
        "held_out_search.json",
        {
            "command": "taskset -c 0,1 python benchmarks/held_out_search.py",
            "machine": machine(),
            "queries": QUERIES,
            "d": D,
            "k": K,
            "flat_search_min_refs": FLAT_SEARCH_MIN_REFS,
            "rows": rows,
        },
    )


if __name__ == "__main__":
    main()
