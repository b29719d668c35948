"""Candidate sets found without an N x N scan: each point's K nearest same-class and K
nearest other-class points in the current embedding, searched approximately in an
inverted-file index (FAISS ``IndexIVFFlat``) when an exact scan would cost too much.

The exact search (``training.objectives.neighbourhood.nearest_candidates``) compares every
point with every other: O(N^2 d), too slow at a million points
(``benchmarks/README.md``, "Training at any N"). An IVF index splits the points into
``nlist`` cells around k-means centroids and compares a query with the points of its
``nprobe`` nearest cells only: O(N (nlist + nprobe N / nlist) d), linear in N for
nlist ~ sqrt(N).

* **Same class**: one index per class over its points, searched by its own points for K + 1
  neighbours (the point itself is dropped); a class of at most ``FLAT_MAX_ROWS`` points is
  searched exactly (``IndexFlatL2``).
* **Other classes**: one index over all points, the points in class order so that a class
  is an id range; a class's points search it with a selector that excludes their own range.

The recall is measured, not assumed: ``held_mass`` compares the neighbour mass, under the
objective's softmax weights, that approximate sets hold with what exact sets hold on sample
rows, and ``CandidateSearch`` doubles ``nprobe`` for the next refresh while that ratio is
below ``MIN_MASS_RATIO``. Below ``APPROX_MIN_SAMPLES`` points, on a CUDA device (where the
exact scan in blocks is fast), and with ``kind="exact"`` the exact search is used.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import faiss
import numpy as np
import torch

from training.numerics import class_runs
from training.objectives.neighbourhood import nearest_candidates

APPROX_MIN_SAMPLES = 50_000  # "auto": exact below this many points
FLAT_MAX_ROWS = 4096  # a class this small is searched exactly
# nlist = LISTS_PER_SQRT * sqrt(n): fewer, larger lists hold more of the exact sets' neighbour
# mass in the same time (on 1M points of benchmarks/scale.py's set at nprobe 16, sqrt(n) lists
# held 0.83 of it, 4 sqrt(n) lists 0.69)
LISTS_PER_SQRT = 1
TRAIN_ROWS_PER_LIST = 64  # k-means sees at most this many points per list
DEFAULT_NPROBE = 16
MAX_NPROBE = 256
MIN_MASS_RATIO = 0.95  # approximate sets must hold this fraction of the exact sets' mass


def _ivf(vectors: np.ndarray, seed: int):
    """An IndexIVFFlat over ``vectors`` (n, d) float32 (ids 0..n-1), or a flat index when n
    is small; k-means on at most TRAIN_ROWS_PER_LIST points per list, seeded."""
    n, d = vectors.shape
    if n <= FLAT_MAX_ROWS:
        index = faiss.IndexFlatL2(d)
        index.add(vectors)
        return index
    # FAISS wants at least 39 training points per centroid
    nlist = max(1, min(int(LISTS_PER_SQRT * math.sqrt(n)), n // 39))
    index = faiss.index_factory(d, f"IVF{nlist},Flat", faiss.METRIC_L2)  # owns its quantizer
    index.cp.seed = seed
    index.cp.niter = 10
    n_train = min(n, TRAIN_ROWS_PER_LIST * nlist)
    if n_train < n:
        vectors_seen = vectors[np.random.default_rng(seed).choice(n, n_train, replace=False)]
    else:
        vectors_seen = vectors
    index.train(np.ascontiguousarray(vectors_seen))
    index.add(vectors)
    return index


def _search(index, queries: np.ndarray, k: int, nprobe: int, selector=None) -> np.ndarray:
    """(n, k) ids of the k nearest (-1 where fewer are found)."""
    if k <= 0 or len(queries) == 0:
        return np.full((len(queries), max(k, 0)), -1, dtype=np.int64)
    if isinstance(index, faiss.IndexIVF):
        params = faiss.SearchParametersIVF(nprobe=min(nprobe, index.nlist), sel=selector)
        _, ids = index.search(queries, k, params=params)
    elif selector is not None:
        _, ids = index.search(queries, k, params=faiss.SearchParameters(sel=selector))
    else:
        _, ids = index.search(queries, k)
    return ids


@dataclass
class CandidateSearch:
    """Where candidate sets come from: ``kind`` "exact" or "ivf" (or "auto": ivf from
    APPROX_MIN_SAMPLES points on the CPU); ``nprobe`` of the IVF searches, raised by
    ``tune`` when a refresh's sets held too little of the exact sets' mass."""

    kind: str = "auto"
    nprobe: int = DEFAULT_NPROBE
    seed: int = 0
    history: list[dict] = field(default_factory=list)  # one record per measured refresh

    def approximate(self, z: torch.Tensor) -> bool:
        if self.kind == "exact":
            return False
        if self.kind == "ivf":
            return True
        return z.device.type == "cpu" and z.shape[0] >= APPROX_MIN_SAMPLES

    def find(self, z: torch.Tensor, labels: torch.Tensor, k: int, rows=None) -> torch.Tensor:
        """(N, 2K) or, with ``rows`` (B,), (B, 2K) candidate indices: K same-class, then K
        other-class, nearest first, -1 padding (the layout of ``nearest_candidates``)."""
        if not self.approximate(z):
            return nearest_candidates(z, labels, k, rows=rows)
        return ivf_candidates(z, labels, k, self.nprobe, self.seed, rows=rows)

    def tune(self, mass_ratio: float, refresh: int) -> None:
        """Record the measured ratio; double nprobe (up to MAX_NPROBE) when it fell short."""
        self.history.append({"refresh": refresh, "nprobe": self.nprobe, "mass_ratio": mass_ratio})
        if mass_ratio < MIN_MASS_RATIO:
            self.nprobe = min(MAX_NPROBE, self.nprobe * 2)


@torch.no_grad()
def ivf_candidates(
    z: torch.Tensor, labels: torch.Tensor, k: int, nprobe: int, seed: int, rows=None
) -> torch.Tensor:
    """``nearest_candidates`` by IVF search (see the module docstring): z (N, d) on the CPU,
    labels (N,) -> (N or B, 2K) int64."""
    n = z.shape[0]
    k = min(k, n - 1)
    labels_np = labels.cpu().numpy()
    order = np.argsort(labels_np, kind="stable")  # class-sorted position -> point
    zs = np.ascontiguousarray(z.detach().cpu().numpy()[order], dtype=np.float32)  # (N, d)
    position = np.empty(n, dtype=np.int64)
    position[order] = np.arange(n)
    asked = np.arange(n) if rows is None else rows.cpu().numpy()  # (B,) points, answer order
    slot = np.full(n, -1, dtype=np.int64)  # sorted position -> row of the answer
    slot[position[asked]] = np.arange(len(asked))
    out = np.full((len(asked), 2 * k), -1, dtype=np.int64)  # sorted positions, (B, 2K)
    everything = _ivf(zs, seed)
    for s, e in class_runs(torch.as_tensor(labels_np[order])):
        queries = np.flatnonzero(slot[s:e] >= 0) + s  # sorted positions in this class
        if len(queries) == 0:
            continue
        answer = slot[queries]
        k_same, k_other = min(k, e - s - 1), min(k, n - (e - s))
        if k_same > 0:
            own = _ivf(zs[s:e], seed)  # ids within the class: sorted position - s
            found = _search(own, zs[queries], k_same + 1, nprobe)
            found = _drop_self(found, queries - s, k_same)
            out[answer, :k_same] = np.where(found >= 0, found + s, -1)
        if k_other > 0:
            inside = faiss.IDSelectorRange(s, e)
            outside = faiss.IDSelectorNot(inside)
            found = _search(everything, zs[queries], k_other, nprobe, outside)
            out[answer, k : k + k_other] = found
    picked = np.where(out >= 0, order[np.clip(out, 0, n - 1)], -1)  # sorted positions -> points
    return torch.as_tensor(picked, device=z.device)


def _drop_self(found: np.ndarray, own: np.ndarray, k: int) -> np.ndarray:
    """found (B, k + 1) ids, own (B,) each query's id: the first k ids other than its own."""
    keep = found != own[:, None]
    # a row that did not find itself keeps its first k; one that did keeps the other k
    ranks = np.cumsum(keep, axis=1)
    out = np.full((len(found), k), -1, dtype=np.int64)
    rows, cols = np.nonzero(keep & (ranks <= k))
    out[rows, ranks[rows, cols] - 1] = found[rows, cols]
    return out


def held_mass(log_p: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
    """sum_{j in C_i} p_ij for each row: log_p (B, N) log neighbour probabilities, candidates
    (B, M) with -1 padding -> (B,)."""
    picked = log_p.gather(1, candidates.clamp_min(0)).masked_fill(candidates < 0, float("-inf"))
    return torch.exp(torch.logsumexp(picked, dim=1))
