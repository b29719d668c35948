"""The exact NCA kernel's time per evaluation against its rows per block.

``nca_exact.c`` handles query rows in blocks of one class; each block streams z, zt and the
gradient share grad_t (N x d each) through memory once per step, so at large N more rows per
block cost less per row. This times ``native.exact_value_and_grad`` (value and gradient,
every row a query, float32, the default threads) on the 60k x 784 digits (``common.usps_784``)
projected to d = 32, for each rows-per-block setting forced through ``native.MIN_BLOCK_ROWS``
and ``native.SCRATCH_BYTES``, and for the default choice (``native.block_rows_for``). The map is
a saved model's (``--model DIR``, e.g. the usps784 model ``learned_references.py
--save-models`` writes) or a random one scaled to unit-variance embeddings.

Usage: taskset -c 0,1 python benchmarks/kernel_block_rows.py [--sizes 60000,20000]
       [--rows 16,32,64,128,256] [--repeats 3] [--model DIR]
Writes benchmarks/results/kernel_block_rows.json. Run it alone.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, print_table, save_json, usps_784

from training.objectives import native


def embedded(n: int, model: str | None) -> tuple[torch.Tensor, np.ndarray]:
    """(z (n, 32) float32 sorted by class, the sorted labels)."""
    X, y, *_ = usps_784(60000, 1000, 2007)
    X, y = X[:n].astype(np.float64), y[:n]
    if model:
        from service.core.artifact import read_artifact

        projection = np.asarray(read_artifact(model).projection, dtype=np.float64)
    else:
        projection = np.random.default_rng(0).normal(size=(32, X.shape[1]))
        projection /= (X @ projection.T).std()
    order = np.argsort(y, kind="stable")
    return torch.as_tensor((X @ projection.T)[order], dtype=torch.float32), y[order]


def time_evaluation(z: torch.Tensor, labels: np.ndarray, repeats: int) -> list[float]:
    start = torch.as_tensor(np.searchsorted(labels, labels, "left"))
    end = torch.as_tensor(np.searchsorted(labels, labels, "right"))
    query = torch.arange(len(labels))
    native.exact_value_and_grad(z, query, start, end, log_form=False)  # build and warm up
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        native.exact_value_and_grad(z, query, start, end, log_form=False)
        times.append(time.perf_counter() - started)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="60000,20000")
    parser.add_argument("--rows", default="16,32,64,128,256")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model")
    args = parser.parse_args()
    if native.kernel(torch.float32) is None:
        sys.exit("the native kernel is not available here (no C compiler, or NCA_KNN_NATIVE=0)")
    rows = []
    for n in (int(s) for s in args.sizes.split(",")):
        z, labels = embedded(n, args.model)
        npad = -(-n // native.TILE) * native.TILE
        longest = int(np.bincount(labels).max())
        default = native.block_rows_for(npad, longest, 4, native.kernel(torch.float32)[1])
        settings = [(int(r), f"{r}") for r in args.rows.split(",")] + [(None, "default")]
        for block_rows, name in settings:
            saved = native.MIN_BLOCK_ROWS, native.SCRATCH_BYTES
            if block_rows is not None:  # exactly block_rows: the floor, and no budget above it
                native.MIN_BLOCK_ROWS, native.SCRATCH_BYTES = block_rows, 0
            try:
                times = time_evaluation(z, labels, args.repeats)
            finally:
                native.MIN_BLOCK_ROWS, native.SCRATCH_BYTES = saved
            rows.append(
                {
                    "n": n,
                    "setting": name,
                    "rows_per_block": block_rows or default,
                    "seconds": statistics.median(times),
                    "all": times,
                }
            )
            print(rows[-1], flush=True)
    print_table(rows, ["n", "setting", "rows_per_block", "seconds"])
    save_json("kernel_block_rows.json", {"machine": machine(), "rows": rows})


if __name__ == "__main__":
    main()
