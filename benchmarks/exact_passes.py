"""What one exact NCA evaluation spends its time on, pass by pass, against its floor.

The exact path (``training.objectives.nca_kernel._torch_value_and_grad``) takes a chunk of B
query rows of one class against all N points: one GEMM writes the (B, N) logits, the row
pass turns them into U (``_scores_and_row_scale``: torch's softmax of the row in place, the
same-class block's sum and scale), and two GEMMs and a GEMV read U back for the gradient
(``add_gradient_products``: over column tiles that stay in cache, each read of U from
memory serving all three; timed also as one tile, the three reading U in turn).
This times each of those on one chunk at the real digits' finish size (B = 256, N = 60,000,
d = 32), median of REPEATS, on the threads torch has (pin with taskset), and beside them the
alternatives (the synthetic rows' p_i lie far above the row pass's floor, so no row of
these runs is recomputed):

* **five passes**: the row's exps as the kernel took them before the softmax, a chain of
  torch's elementwise passes (row maximum, subtract, floor at EXP_FLOOR, exp, row sum; the
  floor keeps MKL's exp off its slow subnormal results);

* **fused C**: the five elementwise passes as one C loop a row at a time (the row's maximum,
  then exp(max(L - m, floor)) in place with the row sum in float64; a row of 60,000 floats
  stays in L2 between the two), compiled here with gcc at the best x86-64 level this CPU
  runs (``training/objectives/kernels/levels.py``), split over the rows on two threads, as
  the install-time kernels are; skipped when there is no gcc;
* **column tiles**: the same work in tiles of T columns that stay in cache, in two passes
  (the first for the rows' maxima and sums, the second recomputes the logits and takes the
  products), the order flash attention uses on a GPU;
* **memory**: a copy of the (B, N) buffer (one read and one write), the least any pass over
  it can cost.

The floor is the three products' arithmetic at the machine's float32 GEMM rate (printed):
2 B N (d + 1) + 4 B N d + 2 B N flops a chunk. Also one whole evaluation of the digits'
finish (17,895 query rows x 60,000), which is about 70 chunks, with its gradient and the
value alone; with ``--before TREE`` (another checkout, e.g. ``git worktree add /tmp/base
<commit>``) the same evaluations with that tree's kernel too, each in a fresh process, the
trees alternating for ``--rounds`` rounds, medians. Saves
``benchmarks/results/exact_passes.json``.

    taskset -c 0,1 python benchmarks/exact_passes.py [--before /tmp/base] [--rounds 3]
"""

from __future__ import annotations

import argparse
import ctypes
import inspect
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
# the checkout whose ``training`` is timed: this one, or --before's in its subprocesses
sys.path.insert(0, os.environ.get("EXACT_PASSES_TREE") or str(Path(__file__).parents[1]))

from harness.report import machine, save_json

from training.numerics import EXP_FLOOR
from training.objectives.kernels import levels
from training.objectives.native import cpu_flags
from training.objectives.nca_kernel import _scores_and_row_scale, nca_value_and_grad

B, N, D, CLASSES = 256, 60_000, 32, 10
FINISH_ROWS = 17_895  # 2^30 pairs / 60,000: the digits' finish
TILES = (2048, 4096, 8192)
REPEATS = 7

FUSED_SOURCE = r"""
#include <math.h>
#include <stdint.h>
#include <string.h>

/* exp(x) for x in [-88, 88]: x = n ln2 + r, |r| <= ln2 / 2, Cephes's polynomial for e^r,
   2^n added to the exponent bits; written so that gcc vectorises the loop below */
static inline float exp_poly(float x) {
    float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f; /* round(x log2 e) */
    float r = x - n * 0.693359375f - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    float y = p * r * r + r + 1.0f;
    int32_t bits, shift = (int32_t)n << 23;
    memcpy(&bits, &y, 4);
    bits += shift;
    memcpy(&y, &bits, 4);
    return y;
}

/* rows x cols at buf (row stride ld): m_i = max_j L_ij (0 when no entry is finite),
   L_ij <- exp(max(L_ij - m_i, floor_)), row_sum_i = sum_j of those in float64 */
void exp_rows(float *buf, int64_t rows, int64_t cols, int64_t ld, float floor_,
              double *row_max, double *row_sum) {
    for (int64_t i = 0; i < rows; i++) {
        float *row = buf + i * ld;
        float m = -INFINITY;
#pragma omp simd reduction(max : m)
        for (int64_t j = 0; j < cols; j++) m = row[j] > m ? row[j] : m;
        if (!isfinite(m)) m = 0.0f;
        double s = 0.0;
#pragma omp simd reduction(+ : s)
        for (int64_t j = 0; j < cols; j++) {
            float x = row[j] - m;
            float u = exp_poly(x < floor_ ? floor_ : x);
            row[j] = u;
            s += (double)u;
        }
        row_max[i] = m;
        row_sum[i] = s;
    }
}
"""


def median_ms(work, prepare=None) -> float:
    """The median of REPEATS timings of work() in milliseconds, prepare() untimed before each."""
    times = []
    for _ in range(REPEATS + 1):
        if prepare is not None:
            prepare()
        started = time.perf_counter()
        work()
        times.append(time.perf_counter() - started)
    return 1e3 * statistics.median(times[1:])  # the first one warms up


def fused_library(directory: Path) -> tuple[ctypes.CDLL, str] | None:
    """The fused C loop built at the best level this CPU runs, or None without gcc."""
    if shutil.which("gcc") is None:
        return None
    source = directory / "exp_rows.c"
    source.write_text(FUSED_SOURCE)
    for level, flags, needs in levels.levels_for(platform.machine()):
        if set(needs) <= cpu_flags():
            library = directory / f"exp_rows_{level}.so"
            command = ["gcc", "-O3", "-std=c99", "-fopenmp-simd", "-shared", "-fPIC", *flags]
            subprocess.run([*command, str(source), "-o", str(library), "-lm"], check=True)
            lib = ctypes.CDLL(str(library))
            p, i64 = ctypes.c_void_p, ctypes.c_int64
            lib.exp_rows.argtypes = [p, i64, i64, i64, ctypes.c_float, p, p]
            return lib, level
    return None


def fused_pass(lib, buf: torch.Tensor, row_max: torch.Tensor, row_sum: torch.Tensor) -> None:
    """The C loop over buf's rows, half of them on a second thread (ctypes drops the GIL)."""
    rows, cols = buf.shape
    half = rows // 2

    def part(lo: int, hi: int) -> None:
        lib.exp_rows(
            buf.data_ptr() + 4 * lo * cols,
            hi - lo,
            cols,
            cols,
            EXP_FLOOR,
            row_max.data_ptr() + 8 * lo,
            row_sum.data_ptr() + 8 * lo,
        )

    other = threading.Thread(target=part, args=(half, rows))
    other.start()
    part(0, half)
    other.join()


def digits_like(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(z (N, d), labels (N,)): class means a few units apart, rows spread around them:
    soft rows, as the finish sees."""
    labels = torch.randint(0, CLASSES, (N,), generator=g)
    z = torch.randn(CLASSES, D, generator=g)[labels] + torch.randn(N, D, generator=g)
    return z.contiguous(), labels


def one_evaluation() -> dict:
    """Seconds of one evaluation of the digits' finish size, with the gradient and the
    value alone (whichever ``training`` is on sys.path), on the torch row pass that this
    module times (``native=False`` in a tree that has the C row pass, so that two trees
    compare the same path; ``kernel_choice.py`` compares the two passes)."""
    z, labels = digits_like(torch.Generator().manual_seed(0))
    rows = torch.linspace(0, N - 1, FINISH_ROWS).long()
    torch_pass = {}
    if "native" in inspect.signature(nca_value_and_grad).parameters:
        torch_pass["native"] = False
    seconds = {}
    for name, with_grad in (("gradient_s", True), ("value_s", False)):
        started = time.perf_counter()
        nca_value_and_grad(
            z, labels, log_form=False, rows=rows, flex=False, with_grad=with_grad, **torch_pass
        )
        seconds[name] = time.perf_counter() - started
    return seconds


def evaluations_in_trees(before: Path | None, rounds: int) -> dict:
    """{tree: medians of one_evaluation's seconds}: this checkout ("after") and ``before``,
    each round a fresh process per tree, the trees alternating."""
    trees = {"after": Path(__file__).resolve().parents[1]}
    if before is not None:
        trees = {"before": before.resolve(), **trees}
    runs: dict[str, list[dict]] = {name: [] for name in trees}
    for _ in range(rounds if before is not None else 1):
        for name, tree in trees.items():
            env = {**os.environ, "EXACT_PASSES_TREE": str(tree)}
            command = [sys.executable, __file__, "--one-evaluation"]
            done = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True)
            if done.returncode != 0:
                raise RuntimeError(f"{tree}: exit {done.returncode}\n{done.stderr[-2000:]}")
            runs[name].append(json.loads(done.stdout.strip().splitlines()[-1]))
    return {
        name: {key: statistics.median(run[key] for run in done) for key in done[0]} | {"runs": done}
        for name, done in runs.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, help="another checkout to time an evaluation in")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--one-evaluation", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one_evaluation:
        print(json.dumps(one_evaluation()))
        return
    # here, not at the top: a --before tree's subprocess imports this file too
    from training.objectives.nca_kernel import PRODUCT_TILE, add_gradient_products

    facts = machine()
    rate = facts["gemm_gflops"]
    g = torch.Generator().manual_seed(0)
    labels = torch.randint(0, CLASSES, (N,), generator=g)
    # class means a few units apart, rows spread around them: soft rows, as the finish sees
    z = torch.randn(CLASSES, D, generator=g)[labels] + torch.randn(N, D, generator=g)
    z = z.contiguous()  # (N, d)
    zq = z[:B].contiguous()  # (B, d) one chunk's query rows
    neg_sq = -(z * z).sum(1)[None, :]  # (1, N)
    buf = torch.empty(B, N)  # (B, N) the logits, then U
    torch.addmm(neg_sq, zq, z.T, alpha=2.0, out=buf)
    logits = buf.clone()
    reset = lambda: buf.copy_(logits)  # noqa: E731
    row_max = logits.amax(1, keepdim=True)  # (B, 1)
    far_rows = lambda far: torch.addmm(neg_sq, zq[far], z.T, alpha=2.0)  # noqa: E731
    row_scale = torch.randn(B)
    col_total = torch.zeros(N)
    rows, grad_z = torch.arange(B), torch.zeros(N, D)  # the chunk's rows, a gradient (N, d)

    def chain() -> None:
        m = buf.amax(1, keepdim=True)
        buf.sub_(m).clamp_min_(EXP_FLOOR).exp_()
        buf.sum(1)

    passes = {
        "logits GEMM (addmm, K = d + 1)": median_ms(
            lambda: torch.addmm(neg_sq, zq, z.T, alpha=2.0, out=buf)
        ),
        "row max (amax)": median_ms(lambda: buf.amax(1), reset),
        "subtract the max (sub_)": median_ms(lambda: buf.sub_(row_max), reset),
        "floor (clamp_min_)": median_ms(lambda: buf.clamp_min_(EXP_FLOOR), reset),
        "exp_": median_ms(lambda: buf.exp_(), lambda: reset().sub_(row_max).clamp_min_(EXP_FLOOR)),
        "row sum": median_ms(lambda: buf.sum(1), reset),
        "softmax of the row, in place": median_ms(
            lambda: torch.ops.aten._softmax.out(buf, 1, False, out=buf), reset
        ),
        "the kernel's row pass (softmax, the block's sum and scale)": median_ms(
            lambda: _scores_and_row_scale(buf, 0, N // CLASSES, False, far_rows), reset
        ),
        "U @ (z - c) (B x N x d)": median_ms(lambda: buf @ z),
        "U^T @ (r (z_q - c)) (N x B x d)": median_ms(lambda: buf.T @ zq),
        "column sums U^T r (GEMV)": median_ms(lambda: col_total.addmv_(buf.T, row_scale)),
        # the kernel's products (add_gradient_products): the two GEMMs and the GEMV above
        # over column tiles that stay in cache, and as one tile (U read three times)
        f"the kernel's products, tiles of {PRODUCT_TILE}": median_ms(
            lambda: add_gradient_products(
                buf, row_scale[:, None], z, rows, grad_z, col_total, PRODUCT_TILE
            )
        ),
        "the kernel's products, one tile": median_ms(
            lambda: add_gradient_products(buf, row_scale[:, None], z, rows, grad_z, col_total, N)
        ),
    }
    elementwise_chain = median_ms(chain, reset)
    memory = median_ms(lambda: buf.copy_(logits))
    flops = 2 * B * N * (D + 1) + 4 * B * N * D + 2 * B * N
    floor_ms = flops / (rate * 1e9) * 1e3

    fused = None
    with tempfile.TemporaryDirectory() as tmp:
        built = fused_library(Path(tmp))
        if built is not None:
            lib, level = built
            maxima = torch.empty(B, dtype=torch.float64)
            sums = torch.empty(B, dtype=torch.float64)
            fused_ms = median_ms(lambda: fused_pass(lib, buf, maxima, sums), reset)
            reset()
            fused_pass(lib, buf, maxima, sums)
            reference = logits.sub(row_max).clamp_min_(EXP_FLOOR).exp_()
            relative = float(((buf - reference).abs() / reference).max())
            fused = {"level": level, "ms": fused_ms, "max_relative_error": relative}

    tiled = {}
    for tile in TILES:
        tile_buf = torch.empty(B, tile)
        grad_q, grad_z = torch.zeros(B, D), torch.zeros(N, D)
        m = torch.zeros(B, 1)

        def two_passes(tile=tile, tile_buf=tile_buf, grad_q=grad_q, grad_z=grad_z, m=m) -> None:
            for start in range(0, N, tile):  # pass 1: the rows' maxima and sums
                stop = min(N, start + tile)
                part = tile_buf[:, : stop - start]
                torch.addmm(neg_sq[:, start:stop], zq, z[start:stop].T, alpha=2.0, out=part)
                part.amax(1)
                part.sub_(m).clamp_min_(EXP_FLOOR).exp_().sum(1)
            for start in range(0, N, tile):  # pass 2: U again, and the products
                stop = min(N, start + tile)
                part = tile_buf[:, : stop - start]
                torch.addmm(neg_sq[:, start:stop], zq, z[start:stop].T, alpha=2.0, out=part)
                part.sub_(m).clamp_min_(EXP_FLOOR).exp_()
                grad_q.addmm_(part, z[start:stop])
                grad_z[start:stop].addmm_(part.T, zq)
                col_total[start:stop].addmv_(part.T, row_scale)

        tiled[tile] = median_ms(two_passes)

    # a chunk as the kernel runs it: the GEMM, the row pass, the three products
    kernel_passes = [
        "logits GEMM (addmm, K = d + 1)",
        "the kernel's row pass (softmax, the block's sum and scale)",
        f"the kernel's products, tiles of {PRODUCT_TILE}",
    ]
    one_chunk = sum(passes[name] for name in kernel_passes)
    evaluations = evaluations_in_trees(args.before, args.rounds)  # {tree: seconds}

    print(f"one chunk: {B} query rows x {N:,} points, d = {D}; median of {REPEATS}")
    for name, ms in passes.items():
        print(f"  {name:60s} {ms:7.2f} ms")
    print(f"  {'a chunk (GEMM, row pass, products)':60s} {one_chunk:7.2f} ms")
    print(
        f"  the five elementwise passes, chained (before the softmax): {elementwise_chain:.2f} ms"
    )
    if fused is None:
        print("  fused C: skipped (no gcc on PATH)")
    else:
        print(
            f"  the same fused in C ({fused['level']}): {fused['ms']:.2f} ms, "
            f"worst relative difference from torch {fused['max_relative_error']:.1e}"
        )
    print(f"  a copy of the (B, N) buffer (one read, one write): {memory:.2f} ms")
    for tile, ms in tiled.items():
        print(f"  column tiles of {tile}, two passes: {ms:.2f} ms")
    print(f"  floor: {flops / 1e9:.2f} GFLOP at {rate:.0f} GFLOP/s = {floor_ms:.2f} ms")
    for tree, seconds in evaluations.items():
        print(
            f"one evaluation of {FINISH_ROWS:,} rows x {N:,} ({tree}): with the gradient "
            f"{seconds['gradient_s']:.2f} s, the value alone {seconds['value_s']:.2f} s"
        )
    save_json(
        "exact_passes.json",
        {
            "command": "python benchmarks/exact_passes.py " + " ".join(sys.argv[1:]),
            "machine": facts,
            "chunk": {"rows": B, "points": N, "d": D, "repeats": REPEATS},
            "passes_ms": passes,
            "chunk_ms": one_chunk,
            "elementwise_chain_ms": elementwise_chain,
            "fused_c": fused,
            "buffer_copy_ms": memory,
            "column_tiles_two_passes_ms": tiled,
            "floor_ms": floor_ms,
            "evaluation": {"rows": FINISH_ROWS, "points": N, **evaluations},
        },
    )


if __name__ == "__main__":
    main()
