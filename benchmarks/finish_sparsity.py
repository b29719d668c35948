"""How much of the exact finish's work lies beyond exp's floor, and could a bound skip it?

The exact finish evaluates every query row against all N points: a (rows x N) GEMM for the
logits, exps, and two more GEMMs for the gradient. On a trained map most of those pairs are
so far beyond each row's nearest point that their weight exp(L_ij - m_i) is below exp(-80)
(EXP_FLOOR, where the exact path floored its exps until its row pass became a softmax) and
changes nothing. This measures, on the real digits under the map
the finish starts from (the default fit with ``exact_finish=0``, d = 32):

* the share of pairs (i, j) with L_ij - m_i above -10, -20, -40 and -80 (the floor), over
  2,048 random query rows, where L_ij = -||z_i - z_j||^2 and m_i is the row's maximum;
* whether tiles of points (k-means on z, T tiles, each a centre and a radius) could be
  skipped by the triangle inequality: a tile is beyond the floor for row i when
  (||z_i - c_t|| - r_t)^2 > ||z_i - z_nn(i)||^2 + 80. Per row, and per chunk of up to 256
  query rows of one class ordered by tile (a chunk can skip a tile only if all its rows can),
  the share of the N columns that would still be computed;
* at the unscaled map and at the scale the default fit's finish starts from (its
  ``stages_``' start_scale, a second fit): the share of pairs whose probability p_ij (the
  softmax over j != i) exceeds 1e-30, 1e-12 and 1e-6, what a kernel that skips small
  entries of U would keep; and the share of query rows whose same-class mass p_i falls
  below the row pass's floor (``nca_kernel.P_FLOOR``), which the kernel recomputes.

Prints the float32 GEMM rate; saves ``benchmarks/results/finish_sparsity.json``.

    taskset -c 0,1 python benchmarks/finish_sparsity.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import faiss
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness.report import machine, save_json

from training import NCA
from training.objectives.nca_kernel import P_FLOOR

MNIST = Path(__file__).resolve().parents[2] / "shared" / "data" / "mnist.npz"
FLOOR = 80.0  # -EXP_FLOOR: below this shifted logit a pair's weight is under exp(-80)
CHUNK = 256  # the exact path's query rows a chunk
PROBABILITIES = (1e-30, 1e-12, 1e-6)


def digits() -> tuple[np.ndarray, np.ndarray]:
    """The 60,000 training digits (N, 784) float32 and their labels (N,)."""
    with np.load(MNIST) as data:
        return data["X"].reshape(len(data["X"]), -1).astype(np.float32), data["y"].astype(np.int64)


def trained_embedding(seed: int) -> tuple[torch.Tensor, np.ndarray, float]:
    """z (N, 32) of the digits under the candidate stage's map, the labels, fit seconds."""
    X, y = digits()
    started = time.perf_counter()
    est = NCA(n_components=32, random_state=seed, options={"exact_finish": 0}).fit(X, y)
    seconds = time.perf_counter() - started
    return torch.as_tensor(est.transform(X), dtype=torch.float32), y, seconds


def floor_shares(z: torch.Tensor, rows: torch.Tensor) -> tuple[dict, torch.Tensor]:
    """{threshold: share of pairs with L - m above -threshold}, and each row's nearest squared
    distance (R, 1)."""
    d2 = torch.cdist(z[rows], z) ** 2  # (R, N)
    d2[torch.arange(len(rows)), rows] = float("inf")
    nearest = d2.min(1, keepdim=True).values  # (R, 1)
    beyond = d2 - nearest  # (R, N) = m_i - L_ij
    shares = {t: float((beyond < t).float().mean()) for t in (10.0, 20.0, 40.0, FLOOR)}
    return shares, nearest


def probability_shares(z: torch.Tensor, y: np.ndarray, rows: torch.Tensor, scale: float) -> dict:
    """At the map scaled by ``scale``: {threshold: share of pairs with p_ij above it} and the
    share of rows with p_i below P_FLOOR (float64, blocks of CHUNK rows)."""
    zs = z.double() * scale
    labels = torch.as_tensor(y)
    above = dict.fromkeys(PROBABILITIES, 0.0)
    far = 0
    for block in rows.split(CHUNK):
        d2 = torch.cdist(zs[block], zs) ** 2  # (B, N)
        d2[torch.arange(len(block)), block] = float("inf")
        log_p = torch.log_softmax(-d2, 1)  # (B, N) log p_ij
        for t in PROBABILITIES:
            above[t] += float((log_p > np.log(t)).double().sum())
        same = labels[None, :] == labels[block][:, None]  # (B, N)
        log_p_i = torch.logsumexp(log_p.masked_fill(~same, float("-inf")), 1)  # (B,)
        far += int((log_p_i < np.log(P_FLOOR)).sum())
    pairs = len(rows) * len(z)
    return {
        "scale": scale,
        "pair_shares_above": {f"{t:g}": above[t] / pairs for t in PROBABILITIES},
        "rows_below_floor": far / len(rows),
    }


def tile_shares(z, y, rows, nearest, n_tiles: int, seed: int) -> dict:
    """Share of columns still computed when tiles beyond the floor are skipped."""
    kmeans = faiss.Kmeans(z.shape[1], n_tiles, niter=10, seed=seed)
    kmeans.train(z.numpy())
    _, assign = kmeans.index.search(z.numpy(), 1)
    assign = torch.as_tensor(assign[:, 0])  # (N,) tile of each point
    centres = torch.as_tensor(kmeans.centroids)  # (T, d)
    radius = torch.zeros(n_tiles).scatter_reduce(
        0, assign, (z - centres[assign]).norm(dim=1), "amax"
    )  # (T,)
    size = torch.bincount(assign, minlength=n_tiles).float()  # (T,)
    bound = (torch.cdist(z[rows], centres) - radius).clamp_min(0) ** 2  # (R, T)
    skippable = bound > nearest + FLOOR  # (R, T)
    per_row = 1.0 - float((skippable.float() @ size).mean()) / len(z)
    labels = torch.as_tensor(y)[rows]
    order = torch.argsort(labels * n_tiles + assign[rows], stable=True)  # by class, then tile
    computed = 0.0
    for cls in labels.unique():
        in_class = order[labels[order] == cls]
        for start in range(0, len(in_class), CHUNK):
            chunk = in_class[start : start + CHUNK]
            computed += float((~skippable[chunk].all(0)).float() @ size) * len(chunk)
    return {
        "tiles": n_tiles,
        "computed_per_row": per_row,
        "computed_per_chunk": computed / len(rows) / len(z),
    }


def main() -> None:
    seed = 0
    z, y, fit_seconds = trained_embedding(seed)
    rows = torch.randperm(len(z), generator=torch.Generator().manual_seed(seed))[:2048]
    shares, nearest = floor_shares(z, rows)
    tiles = [tile_shares(z, y, rows, nearest, t, seed) for t in (64, 256, 1024)]
    default = NCA(n_components=32, random_state=seed).fit(*digits())
    start_scale = float(default.stages_[-1]["start_scale"])
    probabilities = [probability_shares(z, y, rows, scale) for scale in (1.0, start_scale)]
    print(f"candidate-stage fit of the digits: {fit_seconds:.1f} s")
    print(
        f"median nearest squared distance {float(nearest.median()):.1f}, "
        f"median squared distance {float((torch.cdist(z[rows[:256]], z) ** 2).median()):.1f}"
    )
    for threshold, share in shares.items():
        print(f"pairs with L - m above -{threshold:g}: {100 * share:.3f}%")
    for row in probabilities:
        shares_text = ", ".join(
            f"{100 * v:.2f}% above {k}" for k, v in row["pair_shares_above"].items()
        )
        print(
            f"at scale {row['scale']:.3f}: pairs' p_ij {shares_text}; "
            f"rows with p_i below {P_FLOOR:g}: {100 * row['rows_below_floor']:.3f}%"
        )
    for row in tiles:
        print(
            f"{row['tiles']:5d} tiles: columns still computed {100 * row['computed_per_row']:.1f}%"
            f" per row, {100 * row['computed_per_chunk']:.1f}% per chunk of {CHUNK}"
        )
    save_json(
        "finish_sparsity.json",
        {
            "command": "taskset -c 0,1 python benchmarks/finish_sparsity.py",
            "machine": machine(),
            "fit_seconds": fit_seconds,
            "seed": seed,
            "query_rows": len(rows),
            "pair_shares_above": {f"-{t:g}": s for t, s in shares.items()},
            "tiles": tiles,
            "finish_start_scale": start_scale,
            "probabilities": probabilities,
        },
    )


if __name__ == "__main__":
    main()
