"""Data-parallel evaluation (training.distributed.ranks) on this machine: P = 1 and 2 processes.

Each rank is one process with one torch thread, pinned to its own core, holding only its row
shard of a synthetic 784-dim set (read from a memory-mapped .npy). One evaluation is the
objective and its gradient in A (d = 32): ``ShardedProblem.loss_and_grad``, the call L-BFGS
makes. Reported per N, mode and P: seconds per evaluation (median of the repeats, rank 0's
clock), peak RSS per rank (VmHWM, the larger of the ranks), the bytes each collective moves
per evaluation (from the tensor shapes: what one rank sends and receives), and the parallel
efficiency T_1 / (P T_P). Then, on paper, the same evaluation at N = 1M on 8 GPUs.

Usage: python benchmarks/distributed_scale.py [--sizes 20000,60000] [--repeats 3]
Writes benchmarks/results/distributed_scale.json. Runs alone: it uses both cores.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from harness.data import synthetic
from harness.report import machine, median, peak_rss_mib, print_table, save_json

D, DIM = 784, 32
FLOAT32 = 4


def collective_bytes(n: int, p: int, d: int = DIM, n_features: int = D) -> dict[str, float]:
    """Bytes one rank sends plus receives per evaluation, ring algorithms: an all-gather of
    (N, d) moves (P-1)/P of it each way; an all-reduce of S bytes 2 (P-1)/P S each way."""
    if p == 1:
        return {"all_gather_z": 0.0, "all_reduce_grad_z": 0.0, "all_reduce_grad_a": 0.0}
    share = (p - 1) / p
    z = n * d * FLOAT32
    a = d * n_features * FLOAT32
    return {
        "all_gather_z": 2 * share * z,
        "all_reduce_grad_z": 2 * 2 * share * z,
        "all_reduce_grad_a": 2 * 2 * share * a + 2 * share * (a + FLOAT32),  # + the broadcast
    }


def _worker(rank, world_size, rendezvous, data_path, labels_path, mode, repeats, out_path):
    import torch
    import torch.distributed as dist

    from training.distributed.ranks import ProcessGroup
    from training.numerics import shard_bounds
    from training.objectives.registry import make_objective
    from training.optim.sharded_problem import ShardedProblem

    os.sched_setaffinity(0, {rank % os.cpu_count()})
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=world_size)
    group = ProcessGroup(rank, world_size, "gloo")
    y = np.load(labels_path)
    n = len(y)
    start, stop = shard_bounds(n, rank, world_size)
    shard = np.array(np.load(data_path, mmap_mode="r")[start:stop])  # (N_r, D): only these rows
    problem = ShardedProblem(
        torch.from_numpy(shard),
        torch.from_numpy(y),
        make_objective("nca", 1, n_classes=10),
        group=group,
        transform="linear",
        n_components=DIM,
        n_candidates=None if mode == "exact" else 32,
    )
    theta = np.random.default_rng(0).normal(size=(DIM, D)).ravel() / np.sqrt(D)
    if mode != "exact":
        problem.refresh_candidates(theta)
    times = []
    for _ in range(repeats):
        dist.barrier()
        t = time.perf_counter()
        loss, _, _ = problem.loss_and_grad(theta)
        times.append(time.perf_counter() - t)
    peak = torch.tensor([peak_rss_mib()], dtype=torch.float64)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    if rank == 0:
        np.save(out_path, np.array([median(times), float(peak[0]), loss]))
    dist.destroy_process_group()


def run(n, world_size, mode, repeats, data_path, labels_path, tmp):
    import torch.multiprocessing as mp

    out = Path(tmp) / f"r{n}_{world_size}_{mode}.npy"
    rendezvous = f"file://{tmp}/rdzv_{n}_{world_size}_{mode}"
    mp.spawn(
        _worker,
        args=(world_size, rendezvous, data_path, labels_path, mode, repeats, str(out)),
        nprocs=world_size,
        join=True,
    )
    seconds, peak, loss = np.load(out)
    return float(seconds), float(peak), float(loss)


# Assumed GPU and interconnect (NVIDIA A100 80GB SXM datasheet: FP32 19.5 TFLOP/s without
# tensor cores -- torch's default for float32 matmul -- and HBM2e at 2,039 GB/s; NCCL's
# nccl-tests report all-reduce bus bandwidths of about 230 GB/s over NVLink 3 in a DGX A100)
GPU_FP32_FLOPS = 19.5e12
GPU_MEMORY_BYTES_PER_S = 2.039e12
NVLINK_BUS_BYTES_PER_S = 230e9
# the exact kernel's passes over each (row, point) float: GEMM write, max, subtract, floor, exp,
# sum, scale, the same-class block, two GEMM reads, column sums (training/objectives/nca_kernel.py)
PASSES_PER_PAIR = 12


def projection_1m_8_gpus() -> dict:
    """One exact evaluation at N = 1M on P = 8 GPUs, on paper: each rank's N/P x N pairs
    cost 3 GEMMs of 2 d flops each and PASSES_PER_PAIR float32 memory passes; the time is
    the larger of the two (they overlap at best), plus the collectives at NVLink speed."""
    n, p = 1_000_000, 8
    pairs = n * n / p
    compute = 3 * 2 * DIM * pairs / GPU_FP32_FLOPS
    memory = PASSES_PER_PAIR * FLOAT32 * pairs / GPU_MEMORY_BYTES_PER_S
    moved = sum(collective_bytes(n, p).values())
    return {
        "n": n,
        "gpus": p,
        "gemm_seconds": compute,
        "memory_seconds": memory,
        "collective_bytes_per_rank": moved,
        "collective_seconds": moved / NVLINK_BUS_BYTES_PER_S,
        "seconds_per_evaluation": max(compute, memory) + moved / NVLINK_BUS_BYTES_PER_S,
        "assumptions": {
            "gpu_fp32_flops": GPU_FP32_FLOPS,
            "gpu_memory_bytes_per_s": GPU_MEMORY_BYTES_PER_S,
            "nvlink_all_reduce_bus_bytes_per_s": NVLINK_BUS_BYTES_PER_S,
            "passes_per_pair": PASSES_PER_PAIR,
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="20000,60000")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--modes", default="exact,candidates")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in [int(s) for s in args.sizes.split(",")]:
            X, y = synthetic(n)
            X = (X - X.mean(0)) / X.std(0).clip(1e-6)
            data_path, labels_path = f"{tmp}/X{n}.npy", f"{tmp}/y{n}.npy"
            np.save(data_path, X.astype(np.float32))
            np.save(labels_path, y)
            del X
            for mode in args.modes.split(","):
                single = None
                for p in (1, 2):
                    seconds, peak, loss = run(n, p, mode, args.repeats, data_path, labels_path, tmp)
                    single = single or seconds
                    moved = collective_bytes(n, p)
                    rows.append(
                        {
                            "n": n,
                            "mode": mode,
                            "ranks": p,
                            "seconds_per_evaluation": seconds,
                            "speed_up": single / seconds,
                            "efficiency": single / (p * seconds),
                            "peak_rss_mib_per_rank": peak,
                            "collective_mib_per_rank": sum(moved.values()) / 2**20,
                            "loss": loss,
                        }
                    )
                    print_table(rows[-1:], list(rows[-1]))
    print()
    print_table(
        rows,
        [
            "n",
            "mode",
            "ranks",
            "seconds_per_evaluation",
            "speed_up",
            "efficiency",
            "peak_rss_mib_per_rank",
            "collective_mib_per_rank",
            "loss",
        ],
    )
    projection = projection_1m_8_gpus()
    print("\nN = 1M on 8 GPUs, exact mode, per evaluation (on paper):", projection)
    save_json(
        "distributed_scale.json",
        {"machine": machine(), "rows": rows, "projection_1m_8_gpus": projection},
    )


if __name__ == "__main__":
    main()
