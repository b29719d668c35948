"""FAISS indexes over the reference embeddings: build, configure, search.

``flat`` is exact. ``ivf`` (IVFFlat), ``hnsw`` (HNSWFlat) and ``ivfpq`` are approximate, with
their search parameter (nprobe / efSearch) settable. Every search fetches k + RERANK_MARGIN
candidates and re-ranks them exactly with :func:`service.core.knn.rerank`, so answers are ordered
by exact distance with ties broken by id, and do not depend on how requests were batched.

An approximate index can search in two stages (:func:`search_with_recheck`): every row with
the cheap setting, then again with a wider one (``recheck_nprobe`` / ``recheck_ef_search``)
only the rows whose k neighbours' vote is close (margin between the two most frequent
labels below ``recheck_margin``). A unanimous vote almost never changes when a missed
neighbour is found, a split one often does, so effort goes where the answer is uncertain.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import faiss
import numpy as np

from service.core.knn import RERANK_MARGIN, exact_knn_centered, rerank
from service.core.vocabulary import IVF_KINDS

SMALL_BATCH_ROWS = 16  # below this a search runs on one thread (OpenMP start-up costs more)

# FAISS's exhaustive search (Flat, and an IVF's coarse quantizer) has two paths: one GEMM
# followed by selection ("BLAS"), or a SIMD scan per query. Measured on one core, 60k x 32
# references, k = 13: 1 query 840 us BLAS / 240 us scan, 4 queries 277 / 256 us a query,
# 8: 285 / 313, 64: 116 / 393. The wheel's default threshold sends everything to the scan and
# the global knob does not split batches where it says, so each search sets it for its own
# batch (a search in another thread may see the other setting: slower, never different).
BLAS_MIN_ROWS = 8
BLAS_ALWAYS, BLAS_NEVER = 0, 1 << 30


# FAISS's k-means wants at least 39 training points per centroid (it warns below that):
# an IVF gets at most N / 39 lists, and PQ codes 8 bits (256 centroids per sub-space) only
# from 256 x 39 points on, fewer bits below.
MIN_POINTS_PER_CENTROID = 39
IVF_LISTS_PER_SQRT_N = 4  # nlist = 4 sqrt(N), FAISS's rule of thumb for IVF at this scale
PQ_MAX_BITS = 8

CGROUP_CPU_MAX = "/sys/fs/cgroup/cpu.max"  # "<quota> <period>" or "max <period>"


def available_cores() -> int:
    """The cores this process can use: its CPU affinity (taskset, cpusets), capped by a
    cgroup v2 CPU quota (a Kubernetes CPU limit), at least 1."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    try:
        with open(CGROUP_CPU_MAX) as f:
            quota, period = f.read().split()[:2]
        if quota != "max":
            cores = min(cores, math.ceil(int(quota) / int(period)))
    except (OSError, ValueError):
        pass
    return max(1, cores)


@dataclass
class IndexParams:
    kind: str = "flat"
    ivf_nlist: int = 0
    nprobe: int = 16
    hnsw_m: int = 32
    ef_construction: int = 80
    ef_search: int = 64
    pq_m: int = 8
    search_threads: int = 0
    # second stage (0 = off): rows whose vote margin is below recheck_margin are searched
    # again with nprobe = recheck_nprobe (IVF) or efSearch = recheck_ef_search (HNSW)
    recheck_margin: int = 0
    recheck_nprobe: int = 0
    recheck_ef_search: int = 0

    def recheck_parameters(self) -> faiss.SearchParameters | None:
        """FAISS per-call parameters of the second stage, None when it is off."""
        if self.recheck_margin <= 0:
            return None
        if self.kind in IVF_KINDS and self.recheck_nprobe > 0:
            return faiss.SearchParametersIVF(nprobe=self.recheck_nprobe)
        if self.kind == "hnsw" and self.recheck_ef_search > 0:
            return faiss.SearchParametersHNSW(efSearch=self.recheck_ef_search)
        return None

    def describe(self) -> dict:
        """The parameters that apply to this kind of index (GET /v1/model's ``index``)."""
        applies = {
            "flat": (),
            "ivf": ("ivf_nlist", "nprobe"),
            "ivfpq": ("ivf_nlist", "nprobe", "pq_m"),
            "hnsw": ("hnsw_m", "ef_search", "ef_construction"),
        }[self.kind]
        out = {"kind": self.kind, **{name: getattr(self, name) for name in applies}}
        if self.recheck_parameters() is not None:
            out.update({k: v for k, v in vars(self).items() if k.startswith("recheck_") and v})
        return out


def build_index(embeddings: np.ndarray, params: IndexParams) -> faiss.Index:
    """A FAISS index over embeddings (N, d) float32, trained where the type needs it."""
    x = np.ascontiguousarray(embeddings, dtype=np.float32)
    n, d = x.shape
    kind = params.kind
    if kind == "flat":
        index = faiss.IndexFlatL2(d)
    elif kind == "hnsw":
        index = faiss.IndexHNSWFlat(d, params.hnsw_m)
        index.hnsw.efConstruction = params.ef_construction
    elif kind in IVF_KINDS:
        nlist = params.ivf_nlist or max(
            1, min(n // MIN_POINTS_PER_CENTROID, int(IVF_LISTS_PER_SQRT_N * math.sqrt(n)))
        )
        quantizer = faiss.IndexFlatL2(d)
        if kind == "ivf":
            index = faiss.IndexIVFFlat(quantizer, d, nlist)
        else:
            if d % params.pq_m:
                raise ValueError(f"pq_m={params.pq_m} must divide the embedding dimension d={d}")
            trainable = n // MIN_POINTS_PER_CENTROID  # most centroids k-means can fit
            nbits = min(PQ_MAX_BITS, max(1, int(math.log2(max(2, trainable)))))
            index = faiss.IndexIVFPQ(quantizer, d, nlist, params.pq_m, nbits)
        index.train(x)  # the Python wrapper keeps `quantizer` alive with the index
    else:
        raise ValueError(f"index type must be flat, ivf, hnsw or ivfpq, got {kind!r}")
    index.add(x)
    configure(index, params)
    return index


def configure(index: faiss.Index, params: IndexParams) -> None:
    """Apply search-time parameters (nprobe, efSearch)."""
    if isinstance(index, faiss.IndexIVF):
        index.nprobe = min(params.nprobe, index.nlist)
    if isinstance(index, faiss.IndexHNSW):
        index.hnsw.efSearch = params.ef_search


def index_kind(index: faiss.Index) -> str:
    if isinstance(index, faiss.IndexHNSW):
        return "hnsw"
    if isinstance(index, faiss.IndexIVFPQ):
        return "ivfpq"
    if isinstance(index, faiss.IndexIVF):
        return "ivf"
    return "flat"


# A query whose norm exceeds FAR_FACTOR x the largest reference norm is searched exactly in
# float64 (``exact_knn_centered``): FAISS ranks by the float32 sum ||q||^2 + ||r||^2 - 2 q.r,
# whose rounding error (~2^-24 ||q||^2) outgrows the gaps between references as q moves away
# (at 1e25 it overflows). Within 4x the data's own scale the error stays within 16x what
# in-distribution queries see, which the re-rank margin absorbs.
FAR_FACTOR = 4.0


@dataclass(frozen=True)
class SearchResult:
    """k nearest references of n queries, with how many rows needed the exact fallback."""

    distances: np.ndarray  # (n, k) float64 squared distances, ascending
    indices: np.ndarray  # (n, k) int64 reference rows, all valid (>= 0)
    far_rows: int = 0  # searched exactly: too far from the data for float32 FAISS
    underfilled_rows: int = 0  # searched exactly: the index proposed fewer than k references
    rechecked_rows: int = 0  # searched a second time, wider (see search_with_recheck)
    exact: np.ndarray | None = None  # (n,) bool, rows answered by the exact fallback


def reference_norm_limit(references: np.ndarray) -> float:
    """Queries with a larger norm than this are too far away for float32 FAISS."""
    norms = np.linalg.norm(np.asarray(references, dtype=np.float64), axis=1)
    return FAR_FACTOR * float(norms.max(initial=0.0)) + 1e-6


def search_references(
    index: faiss.Index,
    references: np.ndarray,
    queries: np.ndarray,
    k: int,
    *,
    threads: int = 0,
    norm_limit: float = np.inf,
    search_parameters: faiss.SearchParameters | None = None,
) -> SearchResult:
    """k nearest references of each query, never fewer than k real ones.

    queries: (n, d) finite float32, references: (N, d), 1 <= k <= N. FAISS proposes
    k + RERANK_MARGIN candidates and ``rerank`` orders them exactly. Rows FAISS cannot serve
    are searched exactly instead (``exact_knn_centered``): rows whose norm exceeds
    ``norm_limit`` and rows for which the index returned fewer than k candidates (an IVF
    probing too few lists pads with -1). Small batches search on one thread; larger ones on
    ``threads`` (0: all cores). ``search_parameters`` override the index's own nprobe /
    efSearch for this call only (the index object is never changed while it serves).
    """
    q = np.ascontiguousarray(queries, dtype=np.float32)
    n = len(q)
    distances = np.empty((n, k), dtype=np.float64)
    indices = np.empty((n, k), dtype=np.int64)
    far = np.linalg.norm(q.astype(np.float64), axis=1) > norm_limit  # (n,)
    near = np.flatnonzero(~far)
    underfilled = np.zeros(n, dtype=bool)
    if len(near):
        m = min(index.ntotal, k + RERANK_MARGIN)  # HNSW widens its beam to m itself
        n_threads = 1 if len(near) < SMALL_BATCH_ROWS else (threads or available_cores())
        faiss.omp_set_num_threads(n_threads)
        faiss.cvar.distance_compute_blas_threshold = (
            BLAS_ALWAYS if len(near) >= BLAS_MIN_ROWS else BLAS_NEVER
        )
        q_near = q if len(near) == n else q[near]
        _, candidates = index.search(q_near, m, params=search_parameters)
        d_near, i_near = rerank(q_near, references, candidates, k)
        distances[near], indices[near] = d_near, i_near
        underfilled[near[(i_near < 0).any(axis=1)]] = True
    exact = np.flatnonzero(far | underfilled)
    if len(exact):
        distances[exact], indices[exact] = exact_knn_centered(q[exact], references, k)
    return SearchResult(
        distances, indices, int(far.sum()), int(underfilled.sum()), exact=far | underfilled
    )


def vote_margin(neighbour_labels: np.ndarray, n_classes: int) -> np.ndarray:
    """How decided each row's vote is: count of the most frequent label among its k
    neighbours minus the count of the second (k for a unanimous vote, 0 for a tie).

    neighbour_labels: (n, k) class indices in [0, n_classes)  ->  (n,) int64.
    """
    n, k = neighbour_labels.shape
    counts = np.zeros((n, n_classes), dtype=np.int64)
    np.add.at(counts, (np.repeat(np.arange(n), k), neighbour_labels.reshape(-1)), 1)
    if n_classes == 1:
        return counts[:, 0]
    top_two = np.partition(counts, n_classes - 2, axis=1)[:, -2:]  # (n, 2)
    return top_two.max(axis=1) - top_two.min(axis=1)


def search_with_recheck(
    index: faiss.Index,
    references: np.ndarray,
    labels: np.ndarray,
    n_classes: int,
    queries: np.ndarray,
    k: int,
    params: IndexParams,
    *,
    threads: int = 0,
    norm_limit: float = np.inf,
) -> SearchResult:
    """``search_references``, then the rows with a close vote searched again, wider.

    labels: (N,) class indices of the references. A row whose ``vote_margin`` is below
    ``params.recheck_margin`` is searched again with ``params.recheck_parameters()`` and
    takes that answer. Each row's answer depends on that row alone (both stages and the
    margin are per row), so batching still cannot change an answer.
    """
    first = search_references(index, references, queries, k, threads=threads, norm_limit=norm_limit)
    wider = params.recheck_parameters()
    if wider is None:
        return first
    close = vote_margin(labels[first.indices], n_classes) < params.recheck_margin  # (n,)
    unsure = np.flatnonzero(close & ~first.exact)  # exact rows cannot improve
    if not len(unsure):
        return first
    q = np.ascontiguousarray(queries, dtype=np.float32)
    second = search_references(
        index,
        references,
        q[unsure],
        k,
        threads=threads,
        norm_limit=norm_limit,
        search_parameters=wider,
    )
    distances, indices = first.distances.copy(), first.indices.copy()
    distances[unsure], indices[unsure] = second.distances, second.indices
    exact = first.exact.copy()
    exact[unsure] = second.exact
    return SearchResult(
        distances,
        indices,
        first.far_rows,
        first.underfilled_rows + second.underfilled_rows,
        len(unsure),
        exact,
    )


def search(model, z: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """A loaded model's search: z (n, d) finite -> (squared distances (n, k) float64,
    reference rows (n, k)).

    ``model`` is a ``service.engine.model.LoadedModel``: its index, references, labels and
    search plan. Always k real references per row (``search_references``); rows with a close
    vote searched again, wider, when the plan has a recheck stage; ``model.on_fallback`` is
    told how many rows took the exact fallback."""
    plan = model.search_plan
    result = search_with_recheck(
        model.index,
        model.embeddings,
        model.labels,
        len(model.classes),
        z,
        k,
        plan,
        threads=plan.search_threads,
        norm_limit=model.norm_limit,
    )
    if model.on_fallback is not None and (result.far_rows or result.underfilled_rows):
        model.on_fallback(result.far_rows, result.underfilled_rows)
    return result.distances, result.indices


def index_bytes(index: faiss.Index) -> int:
    """The memory a FAISS index holds: a flat index's codes (N x d float32: its own copy of
    the references), else its serialised size (a copy made for the count)."""
    if isinstance(index, faiss.IndexFlat):
        return int(index.ntotal) * int(index.code_size)
    return len(faiss.serialize_index(index))
