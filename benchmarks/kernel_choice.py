"""Does each native kernel beat torch where the fit spends its time? (issue 56, target 5)

One evaluation (value and gradient) of each objective the default fit evaluates in C, on the
real MNIST training set (60,000 x 784, standardised, a d = 32 PCA map scaled as the fit
starts), with the C kernel (``native=True``) and with torch (``native=False``), side by side
in one run, median of ``--repeats``:

* NCA on candidate sets, every row against its K = 32 same-class and 32 other-class nearest
  points (the candidate stage);
* kNCA (majority, k = 5) on candidate sets, 8,192 rows;
* exact NCA on the finish's 2^30 pairs (2^30 / N evenly spaced query rows against all N
  points): its row pass in C (``nca_exact_rows.c``; the GEMMs in torch either way) against
  torch's softmax, with the map as it is and 4 times larger (where 5% of torch's exps are
  subnormal floats, each a microcode assist on an Intel Xeon).

Exact NCA had a whole C kernel before, ``nca_exact.c`` (the products too), removed in round 6
(``benchmarks/README.md``, "Which native kernels pay": torch / C 0.87-0.93 at this size on an
AVX-512 machine, 0.53 on an AVX2 one; ``results/kernel_choice_amd.json`` holds the latter).

Prints the float32 GEMM rate of the machine beside the timings; saves
``benchmarks/results/<--name>`` (default ``kernel_choice.json``).

    taskset -c 0,1 python benchmarks/kernel_choice.py [--repeats 5] [--rows 60000]
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
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness.report import gemm_gflops, save_json

from training.objectives import knca, native_candidates
from training.objectives.nca_kernel import nca_value_and_grad, nca_value_and_grad_candidates

MNIST = Path(__file__).resolve().parents[2] / "shared" / "data" / "mnist.npz"


def median_seconds(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def embedding(n_rows: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """z (N, d) float32 of the real digits under a PCA map at the scale of the median
    nearest-neighbour distance 1, and labels (N,)."""
    with np.load(MNIST) as data:
        X, y = data["X"][:n_rows].astype(np.float32), data["y"][:n_rows].astype(np.int64)
    X -= X.mean(0)
    X /= X.std() + 1e-6
    _, _, vt = np.linalg.svd(X[:8192], full_matrices=False)
    z = torch.from_numpy(np.ascontiguousarray(X @ vt[:d].T))
    sample = z[:2048]
    dist = torch.cdist(sample, z[:20000])
    dist[torch.arange(2048), torch.arange(2048)] = float("inf")
    z /= dist.min(1).values.median()
    return z.contiguous(), torch.from_numpy(y)


def candidates_of(z: torch.Tensor, y: torch.Tensor, k: int) -> torch.Tensor:
    """(N, 2k): each row's k nearest same-class then k nearest other-class points."""
    n = z.shape[0]
    out = torch.empty((n, 2 * k), dtype=torch.int64)
    sq = (z * z).sum(1)
    for start in range(0, n, 2048):
        q = slice(start, min(start + 2048, n))
        d2 = sq[q, None] - 2 * z[q] @ z.T + sq[None, :]
        d2[torch.arange(d2.shape[0]), torch.arange(start, q.stop)] = float("inf")
        same = y[q, None] == y[None, :]
        out[q, :k] = d2.masked_fill(~same, float("inf")).topk(k, largest=False).indices
        out[q, k:] = d2.masked_fill(same, float("inf")).topk(k, largest=False).indices
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rows", type=int, default=60000)
    parser.add_argument("--d", type=int, default=32)
    parser.add_argument("--name", default="kernel_choice.json", help="results file name")
    args = parser.parse_args()
    torch.manual_seed(0)
    gemm = gemm_gflops()
    z, y = embedding(args.rows, args.d)
    n = z.shape[0]
    cands = candidates_of(z, y, 32)
    knca_rows = torch.arange(min(n, 8192))
    rows = []

    def measure(name, run):
        entry = {"objective": name}
        for path, flag in (("native", True), ("torch", False)):
            entry[f"{path}_s"] = median_seconds(lambda f=flag: run(f), args.repeats)
        entry["torch_over_native"] = entry["torch_s"] / entry["native_s"]
        rows.append(entry)
        print(
            f"{name:40s} native {entry['native_s']:7.3f} s   torch {entry['torch_s']:7.3f} s"
            f"   torch/native {entry['torch_over_native']:.2f}",
            flush=True,
        )

    assert native_candidates.usable(z, cands.shape[1])
    measure(
        f"NCA on candidates, {n} rows x 64",
        lambda f: nca_value_and_grad_candidates(z, y, cands, log_form=False, native=f),
    )
    # kNCA's per-row programme on the candidates' logits (the part its C kernel replaces)
    zq = z[knca_rows]
    logits = -((zq[:, None, :] - z[cands[knca_rows]]) ** 2).sum(-1)  # (B, 64)
    labels = y[cands[knca_rows]]
    n_classes = int(y.max()) + 1
    in_range, shift = knca.in_linear_range(logits, 5)
    keep = in_range.nonzero().squeeze(1)

    def knca_eval(flag: bool):
        leaf = logits[keep].clone().requires_grad_(True)
        log_p = knca.linear_log_prob(
            leaf, shift[keep], labels[keep], y[knca_rows][keep], n_classes, 5, native=flag
        )
        log_p.sum().backward()

    measure(f"kNCA majority k=5, {len(keep)} rows x 64 candidates", knca_eval)
    finish_rows = torch.from_numpy(np.linspace(0, n - 1, 2**30 // n).astype(np.int64))
    for scale in (1.0, 4.0):  # at 4 torch's softmax makes subnormal exps (5% of them)
        measure(
            f"exact NCA, {len(finish_rows)} rows x {n} points, map x {scale:g}",
            lambda f, s=scale: nca_value_and_grad(
                z * s, y, log_form=False, rows=finish_rows, native=f
            ),
        )
    print(f"float32 GEMM {gemm:.1f} GFLOP/s (torch, {torch.get_num_threads()} threads)")
    save_json(
        args.name,
        {"gemm_gflops": gemm, "rows": args.rows, "d": args.d, "results": rows},
    )


if __name__ == "__main__":
    main()
