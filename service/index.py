"""FAISS indexes over the reference embeddings: build, configure, search.

``flat`` is exact. ``ivf`` (IVFFlat), ``hnsw`` (HNSWFlat) and ``ivfpq`` are approximate, with
their search parameter (nprobe / efSearch) settable. Every search fetches k + RERANK_MARGIN
candidates and re-ranks them exactly with :func:`service.knn.rerank`, so answers are ordered
by exact distance with ties broken by id, and do not depend on how requests were batched.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import faiss
import numpy as np

from service.knn import RERANK_MARGIN, rerank

SMALL_BATCH_ROWS = 16  # below this a search runs on one thread (OpenMP start-up costs more)

# FAISS Flat: batches of >= 16 queries use the BLAS path (one GEMM + selection); smaller ones
# the per-query SIMD path. The wheel's default threshold (128000 here) sends every batch down
# the per-query path: measured 0.5 ms/query against 0.14 ms/query with BLAS at 64-256 rows.
faiss.cvar.distance_compute_blas_threshold = SMALL_BATCH_ROWS


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
    elif kind in ("ivf", "ivfpq"):
        nlist = params.ivf_nlist or max(1, min(n // 39, int(4 * math.sqrt(n))))
        quantizer = faiss.IndexFlatL2(d)
        if kind == "ivf":
            index = faiss.IndexIVFFlat(quantizer, d, nlist)
        else:
            if d % params.pq_m:
                raise ValueError(f"pq_m={params.pq_m} must divide the embedding dimension d={d}")
            nbits = 8 if n >= 256 * 39 else max(1, int(math.log2(max(2, n // 39))))
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


def search(
    index: faiss.Index,
    references: np.ndarray,
    queries: np.ndarray,
    k: int,
    *,
    threads: int = 0,
) -> tuple[np.ndarray, np.ndarray]:
    """k nearest references of each query: (distances (n, k) float32, indices (n, k) int64).

    FAISS proposes k + RERANK_MARGIN candidates, ``rerank`` orders them exactly. Small
    batches search on one thread; larger ones on ``threads`` (0: all cores).
    """
    q = np.ascontiguousarray(queries, dtype=np.float32)
    m = min(index.ntotal, k + RERANK_MARGIN)  # HNSW widens its beam to m itself
    n_threads = 1 if len(q) < SMALL_BATCH_ROWS else (threads or os.cpu_count() or 1)
    faiss.omp_set_num_threads(n_threads)
    _, candidates = index.search(q, m)
    return rerank(q, references, candidates, k)
