"""Offline evaluation: kNN accuracy in an embedding, for several k, with the service's rule.

Queries are classified against the reference set (the training split) with the exact kNN
search and the decision rule of ``service.core.knn``: the same functions the service runs, so the
accuracy reported here is the accuracy served.
"""

from __future__ import annotations

import faiss
import numpy as np
import scipy.sparse as sp
import torch

from service.core.knn import RERANK_MARGIN, FarPrior, decide, rerank
from service.core.vocabulary import DecisionRule

K_VALUES = (1, 3, 5, 7, 9, 11, 13, 15)

# The soft vote at temperature t weighs the k nearest references by exp(-t d_j^2): the soft
# vote of the map multiplied by sqrt(t). t = 1 is the map's own scale, which NCA's objective
# calibrates on the training rows; a smaller t flattens the weights toward the majority
# vote. --decision-rule auto chooses among the majority vote and the soft vote at each of
# these temperatures (``SERVED_VOTES``); the artifact serves the service's soft rule on the
# map multiplied by sqrt(t) (benchmarks/README.md, "The soft vote's temperature").
SOFT_TEMPERATURES = (1.0, 0.5, 0.25)


def vote_name(rule: str, temperature: float = 1.0) -> str:
    """A vote's name in the curves and the report: the rule's name ("majority", "soft"), or
    "soft@t" for the soft vote at a temperature t other than 1."""
    return rule if temperature == 1.0 else f"{rule}@{temperature:g}"


def parse_vote(name: str) -> tuple[str, float]:
    """(the service's rule, the temperature t) of a vote's name (``vote_name``'s inverse):
    "majority" and "soft" are at t = 1, "soft@0.5" is the soft rule at t = 0.5."""
    rule, _, temperature = name.partition("@")
    return rule, float(temperature) if temperature else 1.0


# the votes --decision-rule auto chooses among, in the order ties go (majority first)
SERVED_VOTES = (
    DecisionRule.MAJORITY.value,
    *(vote_name(DecisionRule.SOFT.value, t) for t in SOFT_TEMPERATURES),
)


def knn_predictions(
    z_ref: np.ndarray,
    y_ref: np.ndarray,
    z_query: np.ndarray,
    n_classes: int,
    ks: tuple[int, ...] = K_VALUES,
    rule: str = "majority",
    outlier_threshold: float | None = None,
) -> dict[int, np.ndarray]:
    """Predicted class indices for each k: {k: (n_query,) int64}.

    z_ref: (N, d) reference embeddings, y_ref: (N,) class indices, z_query: (n, d).
    ``rule``: the service's rule, or a vote's name ("soft@0.5": ``parse_vote``). Values of k
    above N are dropped. One neighbour search serves every k. The
    ``soft_prior`` rule needs the outlier threshold
    (``training.evaluation.calibration.threshold_of``); its component is built from the
    references as the service builds it.
    """
    ks = tuple(k for k in ks if k <= len(z_ref))
    if len(z_query) == 0 or not ks:
        return {k: np.empty(0, dtype=np.int64) for k in ks}
    rule, temperature = parse_vote(rule)
    background = None
    if rule == DecisionRule.SOFT_PRIOR.value:
        if outlier_threshold is None:
            raise ValueError("rule 'soft_prior' needs outlier_threshold")
        background = FarPrior.of(z_ref, y_ref, n_classes).background(z_query, outlier_threshold)
    dist, idx = nearest_references(z_query, z_ref, max(ks))
    dist = dist * temperature if temperature != 1.0 else dist
    labels = y_ref[idx]
    return {k: decide(labels[:, :k], dist[:, :k], n_classes, rule, background)[0] for k in ks}


# from this many references the first pass is FAISS's, which is faster than torch's there,
# also inside a fit's one-thread BLAS limit (benchmarks/held_out_search.py,
# benchmarks/results/held_out_search.json)
FLAT_SEARCH_MIN_REFS = 16384


def nearest_references(
    z_query: np.ndarray, z_ref: np.ndarray, k: int, *, flat_search: bool | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """``service.core.knn.exact_knn``'s answer, (distances (n, k) float64, indices (n, k)):
    the k + RERANK_MARGIN nearest by a float32 pass, re-ranked pair by pair in float64, ties
    by smaller index. The float32 pass is FAISS's brute-force search (``IndexFlatL2``: BLAS
    and a heap per query on every core) from FLAT_SEARCH_MIN_REFS references, where
    torch's ``topk`` over (n, N) blocks costs more, else torch's (``flat_search`` overrides
    the choice); the re-rank makes both passes give the same neighbours."""
    if not 1 <= k <= len(z_ref):
        raise ValueError(f"k must lie in [1, {len(z_ref)}] (the number of references), got {k}")
    if flat_search is None:
        flat_search = len(z_ref) >= FLAT_SEARCH_MIN_REFS
    references = np.ascontiguousarray(z_ref, dtype=np.float32)
    m = min(len(references), k + RERANK_MARGIN)
    queries = np.ascontiguousarray(z_query, dtype=np.float32)
    if not flat_search:
        return rerank(z_query, references, torch_candidates(queries, references, m), k)
    index = faiss.IndexFlatL2(references.shape[1])
    index.add(references)
    _, candidates = index.search(queries, m)
    return rerank(z_query, references, candidates, k)


def torch_candidates(
    queries: np.ndarray, references: np.ndarray, m: int, block_rows: int | None = None
) -> np.ndarray:
    """The m nearest references of each query by a float32 pass in torch (n, m), unordered:
    per block of queries, ||r_j||^2 - 2 q_i.r_j (the squared distance less the query's own
    norm, which does not change its ranking) by one fused GEMM, then ``torch.topk``. Torch's
    own threads run it, also inside a fit's one-thread BLAS limit, where numpy's GEMM and
    ``argpartition`` would run on one thread.
    ``block_rows``: queries per block (default: SCORES_PER_TORCH_CHUNK scores at once)."""
    refs = torch.from_numpy(references)  # (N, d)
    norms = (refs * refs).sum(1)  # (N,)
    out = np.empty((len(queries), m), dtype=np.int64)
    step = block_rows or query_chunk(len(refs), SCORES_PER_TORCH_CHUNK)
    for start in range(0, len(queries), step):
        stop = start + step
        block = torch.from_numpy(queries[start:stop])  # (B, d)
        score = torch.addmm(norms[None, :], block, refs.T, alpha=-2.0)  # (B, N)
        out[start:stop] = torch.topk(score, m, dim=1, largest=False, sorted=False).indices.numpy()
    return out


SCORES_PER_CHUNK = 1 << 25  # query x reference distances held at once (256 MiB in float64)
SCORES_PER_TORCH_CHUNK = 1 << 24  # ... by the float32 torch pass (64 MiB: stays in cache)


def query_chunk(n_refs: int, scores: int = SCORES_PER_CHUNK) -> int:
    """Queries searched at once against ``n_refs`` references: at most ``scores`` distances
    (a chunk of 1,024 queries against 1M references would hold 8 GB)."""
    return max(8, min(1024, scores // max(1, n_refs)))


def knn_accuracies(
    z_ref: np.ndarray,
    y_ref: np.ndarray,
    z_query: np.ndarray,
    y_query: np.ndarray,
    n_classes: int,
    ks: tuple[int, ...] = K_VALUES,
    rule: str = "majority",
) -> dict[int, float]:
    """Accuracy for each k: {k: fraction of queries whose predicted class equals y_query}."""
    return knn_accuracies_by_rule(z_ref, y_ref, z_query, y_query, n_classes, ks, (rule,))[rule]


def knn_accuracies_by_rule(
    z_ref: np.ndarray,
    y_ref: np.ndarray,
    z_query: np.ndarray,
    y_query: np.ndarray,
    n_classes: int,
    ks: tuple[int, ...] = K_VALUES,
    rules: tuple[str, ...] = ("majority",),
) -> dict[str, dict[int, float]]:
    """{rule: {k: accuracy}} for each of ``rules`` (majority, soft, or a vote's name such as
    "soft@0.5": ``parse_vote``), from one neighbour search: the rules differ only in how the
    k nearest labels and distances vote. {rule: {}} without queries; values of k above N are
    dropped."""
    if any(parse_vote(rule)[0] == DecisionRule.SOFT_PRIOR.value for rule in rules):
        raise ValueError("rule 'soft_prior' needs outlier_threshold: use knn_predictions")
    ks = tuple(k for k in ks if k <= len(z_ref))
    if len(z_query) == 0 or not ks:
        return {rule: {} for rule in rules}
    dist, idx = nearest_references(z_query, z_ref, max(ks))
    return {rule: accuracies_at(y_ref[idx], dist, y_query, n_classes, ks, rule) for rule in rules}


def accuracies_at(labels, dist, y_query, n_classes: int, ks, vote: str) -> dict[int, float]:
    """{k: accuracy} of the vote's decision from the k nearest of each query: labels (n, m)
    and squared distances dist (n, m) of its neighbours in order, m >= max(ks); y_query
    (n,). The vote's temperature t (``parse_vote``) multiplies the distances."""
    rule, temperature = parse_vote(vote)
    dist = dist * temperature if temperature != 1.0 else dist
    return {
        k: float(np.mean(decide(labels[:, :k], dist[:, :k], n_classes, rule)[0] == y_query))
        for k in ks
    }


def choose_rule_and_k(
    val_accuracies: dict[str, dict[int, float]], fallback: int
) -> tuple[str, int]:
    """The (rule, k) with the best validation accuracy over every rule and k: the first rule
    (in the dict's order) that reaches the best, with ``choose_k``'s k for it. val_accuracies:
    {rule: {k: accuracy}}; an empty inner dict (no validation rows) gives the first rule
    and ``fallback``."""
    rules = list(val_accuracies)
    scored = [v for by_k in val_accuracies.values() for v in by_k.values()]
    if not scored:
        return rules[0], fallback
    best = max(scored)
    rule = next(r for r in rules if val_accuracies[r] and max(val_accuracies[r].values()) == best)
    return rule, choose_k(val_accuracies[rule], fallback)


def choose_k(val_accuracies: dict[int, float], fallback: int) -> int:
    """The k with the best validation accuracy: ``fallback`` (the training k) when it is among
    the best, else the smallest best k; ``fallback`` when there is no validation set."""
    if not val_accuracies:
        return fallback
    best = max(val_accuracies.values())
    if val_accuracies.get(fallback) == best:
        return fallback
    return min(k for k, acc in val_accuracies.items() if acc == best)


def sparse_knn_accuracies(
    X_ref: sp.csr_matrix,
    y_ref: np.ndarray,
    X_query: sp.csr_matrix,
    y_query: np.ndarray,
    n_classes: int,
    ks: tuple[int, ...] = K_VALUES,
    rule: str = "majority",
) -> dict[int, float]:
    """:func:`knn_accuracies` on sparse rows as they are (the Euclidean baseline of a sparse
    set): ||q - r||^2 = ||q||^2 + ||r||^2 - 2 q.r in float64, q.r by a sparse product, a
    chunk of queries at a time (query_chunk), ties by smaller index. X_ref (N, D) and
    X_query (n, D) CSR; y_ref (N,), y_query (n,) class indices."""
    ks = tuple(k for k in ks if k <= X_ref.shape[0])
    n = X_query.shape[0]
    if n == 0 or not ks:
        return {}
    m = max(ks)
    ref_sq = np.asarray(X_ref.multiply(X_ref).sum(axis=1)).ravel()  # (N,)
    query_sq = np.asarray(X_query.multiply(X_query).sum(axis=1)).ravel()  # (n,)
    ref_t = X_ref.T.tocsr()  # (D, N)
    idx = np.empty((n, m), dtype=np.int64)
    dist = np.empty((n, m), dtype=np.float64)
    chunk = query_chunk(X_ref.shape[0])
    for start in range(0, n, chunk):
        stop = min(n, start + chunk)
        dots = (X_query[start:stop] @ ref_t).toarray()  # (c, N)
        d2 = np.maximum(query_sq[start:stop, None] + ref_sq[None, :] - 2.0 * dots, 0.0)
        part = np.argpartition(d2, m - 1, axis=1)[:, :m] if m < d2.shape[1] else None
        if part is None:
            part = np.broadcast_to(np.arange(d2.shape[1]), d2.shape)
        part_d = np.take_along_axis(d2, part, axis=1)
        order = np.lexsort((part, part_d), axis=1)  # by distance, then by index
        idx[start:stop] = np.take_along_axis(part, order, axis=1)
        dist[start:stop] = np.take_along_axis(part_d, order, axis=1)
    return accuracies_at(y_ref[idx], dist, y_query, n_classes, ks, rule)
