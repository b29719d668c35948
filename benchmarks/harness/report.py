"""What a benchmark reports: the machine, medians, peak memory, a printed table, and the
raw JSON in ``benchmarks/results/`` (written to a temporary file, then renamed)."""

from __future__ import annotations

import json
import os
import platform
import resource
import statistics
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[1] / "results"  # where save_json writes


def peak_rss_mib() -> float:
    """Peak resident set size of this process so far (MiB): VmHWM, which starts afresh at
    exec. (getrusage's ru_maxrss survives fork + exec on Linux, so a worker started by a
    parent that once held 750 MiB would report at least 750 MiB.)"""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


GEMM_SIZE = 2048  # the float32 product n x n by n x n whose rate states the machine's speed
GEMM_THREADS = 2


def gemm_gflops(repeats: int = 5) -> float:
    """The machine's float32 GEMM rate now, in GFLOP/s: the median of ``repeats`` timed
    2048 x 2048 by 2048 x 2048 products (2 n^3 flops each) in torch on two threads (numpy's
    BLAS where torch is absent), after one untimed product. This machine's speed moves from
    day to day, so every timing a benchmark reports is printed beside this rate, measured in
    the same run."""
    try:
        import torch
    except ImportError:  # the serving benchmarks' environment may lack torch
        torch = None
    n = GEMM_SIZE
    if torch is not None:
        threads = torch.get_num_threads()
        torch.set_num_threads(GEMM_THREADS)
        a, b = torch.randn(n, n), torch.randn(n, n)
        product = torch.mm
    else:
        import numpy as np

        rng = np.random.default_rng(0)
        a = rng.standard_normal((n, n), dtype=np.float32)
        b = rng.standard_normal((n, n), dtype=np.float32)
        product = np.matmul
    product(a, b)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        product(a, b)
        times.append(time.perf_counter() - started)
    if torch is not None:
        torch.set_num_threads(threads)
    return 2 * n**3 / statistics.median(times) / 1e9


def machine(gemm: bool = True) -> dict:
    """Where and when a benchmark ran, with the float32 GEMM rate measured now
    (``gemm_gflops``; ``gemm=False`` leaves it out)."""
    out = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "date": time.strftime("%Y-%m-%d"),
    }
    if gemm:
        out["gemm_gflops"] = round(gemm_gflops(), 1)
    return out


def print_machine(facts: dict) -> None:
    """One line: the GEMM rate the timings above were measured beside."""
    rate = facts.get("gemm_gflops")
    if rate is not None:
        print(
            f"machine: float32 GEMM {rate:.1f} GFLOP/s (torch, 2 threads, 2048^3), {facts['date']}"
        )


def median(values):
    return statistics.median(values)


def save_json(name: str, payload: dict) -> Path:
    """Write ``payload`` to ``results/name`` (a temporary file, then a rename), and print the
    machine's GEMM rate of its ``machine`` record under the table the benchmark printed, so
    that every benchmark's timings are read beside the rate measured in the same run."""
    if isinstance(payload.get("machine"), dict):
        print_machine(payload["machine"])
    out = RESULTS / name
    out.parent.mkdir(exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(payload, indent=2, sort_keys=True, default=float))
    tmp.replace(out)
    return out


def print_table(rows: list[dict], columns: list[str]) -> None:
    widths = {c: max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in columns}
    print(" | ".join(c.ljust(widths[c]) for c in columns))
    print("-+-".join("-" * widths[c] for c in columns))
    for r in rows:
        print(" | ".join(_fmt(r.get(c)).ljust(widths[c]) for c in columns))


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "" if value is None else str(value)
