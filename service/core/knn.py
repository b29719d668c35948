"""The numpy-only kNN core shared by offline evaluation and online serving.

Used unchanged on both sides so that the accuracy the training report states is the
accuracy the service delivers:

* :func:`project`     z = x @ W.T + b (one GEMM), returned as float32.
* :func:`rerank`      exact distances of candidate neighbours, ordered by (distance, id).
* :func:`exact_knn`   brute-force k nearest references (GEMM candidates, then ``rerank``).
* :func:`decide`      neighbour labels and distances -> predicted class and probabilities.
* :func:`outlier_threshold`, :func:`outlier_flags`  "is the nearest neighbour far away?"
  against the calibrated quantiles of held-out nearest distances (Barber 14.3.1).
* :class:`FarPrior`   the fictitious per-class component of the ``soft_prior`` rule.

Batch invariance: a row's answer must not depend on which other rows share its batch (the
service merges concurrent requests). float32 GEMMs and FAISS's distance kernels round
differently for different batch shapes, so ``project`` accumulates in float64 before rounding
to float32, and final neighbour distances are recomputed per pair in float64 by ``rerank``
and ordered by (distance, id). Offline and online answers then agree to the bit, with one
known exception: BLAS's float64 sum runs in an order that depends on the batch's shape (one
row, a few, many), so a row whose sum cancels can embed differently in different batches (by one
float32 step when it cancels to within float32's rounding, by more when it cancels beyond
float64's precision: docs/service.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from service.core.vocabulary import RULES

# Extra candidates fetched (by float32 FAISS / GEMM distances) before the exact float64
# re-rank. float32 ranks two references wrongly only when their distances differ by less
# than its rounding error, so the true k nearest are among the first k + 8 unless more than
# 8 references sit within that error of the k-th: then both the offline evaluation
# (exact_knn) and the service (service.search.index) re-rank the same exact float64 distances with
# ties by id, and answer bit for bit the same however the queries were batched.
RERANK_MARGIN = 8


def project(x: np.ndarray, projection: np.ndarray, offset: np.ndarray) -> np.ndarray:
    """Embed raw inputs: z = x @ W.T + b.

    x: (n, D), projection W: (d, D) float32, offset b: (d,) float32  ->  z: (n, d) float32.
    Inputs are taken as float32 (the artifact's contract), the product is accumulated in
    float64 and rounded once, so a row's embedding does not depend on its batch.
    """
    x64 = np.asarray(x, dtype=np.float32).astype(np.float64)
    z = x64 @ np.asarray(projection, dtype=np.float32).astype(np.float64).T
    z += np.asarray(offset, dtype=np.float32)
    return z.astype(np.float32)


# coordinates of query-candidate differences held at once by ``rerank`` (2 MiB in float64):
# a block stays in cache, where one (n, m, d) array of the held-out checks' 4,096 x 80 x 32
# (84 MB) was mapped afresh and page-faulted on every call, 3-6x the time of its arithmetic
RERANK_BLOCK_VALUES = 1 << 18


def rerank(
    queries: np.ndarray, references: np.ndarray, candidates: np.ndarray, k: int
) -> tuple[np.ndarray, np.ndarray]:
    """The k nearest of each query's candidates, by exact distance, ties by smaller id.

    queries: (n, d), references: (N, d), candidates: (n, m) int64 reference indices (-1 =
    none, as FAISS pads)  ->  (distances (n, min(k, m)) float64, indices (n, min(k, m)) int64).
    Squared distances are computed pair by pair in float64 and returned as such (a float32
    cast would overflow for far-away queries), so the result depends only on the pair (the
    queries are taken RERANK_BLOCK_VALUES / (m d) rows at a time, which changes no pair's
    arithmetic). Rows with fewer than k valid candidates are padded with (inf, -1).
    """
    q = np.asarray(queries, dtype=np.float32)
    cand = np.asarray(candidates, dtype=np.int64)
    refs = np.asarray(references, dtype=np.float32)
    n, m = cand.shape
    step = max(1, RERANK_BLOCK_VALUES // max(1, m * refs.shape[1]))
    if n <= step:
        return _rerank_block(q, refs, cand, k)
    width = min(k, m)
    out_d = np.empty((n, width), dtype=np.float64)
    out_i = np.empty((n, width), dtype=np.int64)
    for start in range(0, n, step):
        part = slice(start, start + step)
        out_d[part], out_i[part] = _rerank_block(q[part], refs, cand[part], k)
    return out_d, out_i


def _rerank_block(
    q: np.ndarray, refs: np.ndarray, cand: np.ndarray, k: int
) -> tuple[np.ndarray, np.ndarray]:
    """``rerank`` on one block of queries q (b, d) float32 and their candidates (b, m)."""
    q = q.astype(np.float64)
    rows = np.arange(len(cand))[:, None]  # (b, 1)
    if cand.size == 0 or cand.min() >= 0:  # every candidate real: the common, fast case
        diff = refs[cand].astype(np.float64) - q[:, None, :]
        d2 = np.einsum("nmd,nmd->nm", diff, diff)  # (b, m)
        order = np.lexsort((cand, d2), axis=1)[:, :k]
        out_d = d2[rows, order]
        # a distance beyond float64 is no neighbour, as in the padded case below (so a row's
        # answer does not depend on whether its block holds a padded row)
        return out_d, np.where(np.isfinite(out_d), cand[rows, order], -1)
    valid = cand >= 0
    safe = np.where(valid, cand, 0)
    diff = refs[safe].astype(np.float64) - q[:, None, :]
    d2 = np.einsum("nmd,nmd->nm", diff, diff)  # (b, m)
    d2 = np.where(valid, d2, np.inf)
    ids = np.where(valid, cand, np.iinfo(np.int64).max)
    order = np.lexsort((ids, d2), axis=1)[:, :k]
    out_d = d2[rows, order]
    out_i = np.where(np.isfinite(out_d), cand[rows, order], -1)
    return out_d, out_i


def squared_distances(queries: np.ndarray, references: np.ndarray) -> np.ndarray:
    """||q_i - r_j||^2 = ||q_i||^2 + ||r_j||^2 - 2 q_i.r_j, clipped at 0.

    queries: (n, d), references: (N, d)  ->  (n, N) float32.
    """
    q = np.asarray(queries, dtype=np.float32)
    r = np.asarray(references, dtype=np.float32)
    d2 = (q * q).sum(axis=1)[:, None] + (r * r).sum(axis=1)[None, :]
    d2 -= 2.0 * (q @ r.T)
    np.maximum(d2, 0.0, out=d2)
    return d2


def exact_knn(
    queries: np.ndarray,
    references: np.ndarray,
    k: int,
    *,
    chunk_size: int = 1024,
) -> tuple[np.ndarray, np.ndarray]:
    """The k nearest references of each query by squared Euclidean distance.

    queries: (n, d), references: (N, d)  ->  (distances (n, k) float64, indices (n, k) int64),
    each row sorted by increasing distance, ties by increasing index. The k + RERANK_MARGIN
    nearest by a float32 GEMM are re-ranked exactly by :func:`rerank`. Memory: O(chunk * N).
    """
    n_refs = len(references)
    if not 1 <= k <= n_refs:
        raise ValueError(f"k must lie in [1, {n_refs}] (the number of references), got {k}")
    n = len(queries)
    m = min(n_refs, k + RERANK_MARGIN)
    out_d = np.empty((n, k), dtype=np.float64)
    out_i = np.empty((n, k), dtype=np.int64)
    for start in range(0, n, chunk_size):
        block = queries[start : start + chunk_size]
        d2 = squared_distances(block, references)
        if m < n_refs:
            part = np.argpartition(d2, m - 1, axis=1)[:, :m]
        else:
            part = np.broadcast_to(np.arange(n_refs), d2.shape)
        dist, idx = rerank(block, references, part, k)
        out_d[start : start + chunk_size] = dist
        out_i[start : start + chunk_size] = idx
    return out_d, out_i


def exact_knn_centered(
    queries: np.ndarray,
    references: np.ndarray,
    k: int,
    *,
    max_block: int = 1 << 22,
) -> tuple[np.ndarray, np.ndarray]:
    """Exact k nearest references in float64, well conditioned for queries of any magnitude.

    With c the references' mean, ||q - r||^2 = ||q - c||^2 + s(r) where
    s(r) = ||r - c||^2 - 2 (q - c).(r - c). The first term is the same for every reference,
    so candidates are ranked by s alone: no ||q||^2 term whose rounding would swamp the
    differences between references when q is far away (the failure of the float32
    ||q||^2 + ||r||^2 - 2 q.r form; in float64 too, ||q - r||^2 of a query at 1e25 is the
    same number for every reference). The k + RERANK_MARGIN best by a GEMM of s are then
    ordered by s recomputed pair by pair (batch-invariant), ties by smaller index; the
    distances returned are the per-pair float64 ||q - r||^2. Blocks of at most
    ``max_block`` scores bound the memory.
    queries: (n, d) finite, references: (N, d) -> ((n, k) float64, (n, k) int64).
    """
    n_refs = len(references)
    if not 1 <= k <= n_refs:
        raise ValueError(f"k must lie in [1, {n_refs}] (the number of references), got {k}")
    refs = np.asarray(references, dtype=np.float32)
    centre = refs.mean(axis=0, dtype=np.float64)
    q = np.asarray(queries, dtype=np.float32).astype(np.float64) - centre
    m = min(n_refs, k + RERANK_MARGIN)
    ref_rows = max(1, min(n_refs, max_block // max(1, min(len(q), 1024))))
    best_s = np.full((len(q), 0), np.inf)
    best_i = np.empty((len(q), 0), dtype=np.int64)
    for start in range(0, n_refs, ref_rows):
        block = refs[start : start + ref_rows].astype(np.float64) - centre  # (b, d)
        s = (block * block).sum(axis=1)[None, :] - 2.0 * (q @ block.T)  # (n, b)
        cand_s = np.concatenate([best_s, s], axis=1)
        cand_i = np.concatenate(
            [best_i, np.broadcast_to(np.arange(start, start + len(block)), s.shape)], axis=1
        )
        if cand_s.shape[1] > m:
            keep = np.argpartition(cand_s, m - 1, axis=1)[:, :m]
            cand_s = np.take_along_axis(cand_s, keep, axis=1)
            cand_i = np.take_along_axis(cand_i, keep, axis=1)
        best_s, best_i = cand_s, cand_i
    # per pair, in float64: s (the order) and ||q - r||^2 (the distance reported)
    r_c = refs[best_i].astype(np.float64) - centre  # (n, m, d)
    s_pair = np.einsum("nmd,nmd->nm", r_c, r_c) - 2.0 * np.einsum("nd,nmd->nm", q, r_c)
    order = np.lexsort((best_i, s_pair), axis=1)[:, :k]
    out_i = np.take_along_axis(best_i, order, axis=1)
    diff = (
        refs[out_i].astype(np.float64)
        - np.asarray(queries, np.float32).astype(np.float64)[:, None, :]
    )
    return np.einsum("nkd,nkd->nk", diff, diff), out_i


def outlier_threshold(quantiles: dict[float, float], quantile: float) -> float:
    """The squared nearest-reference distance beyond which a query is an outlier at
    ``quantile``: the calibrated quantile function (``quantiles``, {q: distance} sorted by q,
    from ``service.core.artifact.parse_outlier_calibration``) interpolated linearly in q between
    its stored points. ``quantile`` must lie within the stored range."""
    qs = np.fromiter(quantiles, dtype=np.float64)
    if not qs[0] <= quantile <= qs[-1]:
        raise ValueError(
            f"outlier quantile must lie in [{qs[0]:g}, {qs[-1]:g}] (the calibrated range), "
            f"got {quantile!r}"
        )
    values = np.fromiter(quantiles.values(), dtype=np.float64)
    return float(np.interp(quantile, qs, values))


def outlier_flags(neighbor_distances: np.ndarray, threshold: float) -> np.ndarray:
    """(n,) bool: the nearest neighbour (column 0 of the ascending (n, k) squared
    distances) is farther than ``threshold``."""
    return np.asarray(neighbor_distances)[:, 0] > threshold


@dataclass(frozen=True)
class Background:
    """The fictitious component evaluated at n queries: it adds class_priors[c] *
    exp(log_mass[i]) to class c's score of query i (see :class:`FarPrior`)."""

    class_priors: np.ndarray  # (C,) float64, sums to 1
    log_mass: np.ndarray  # (n,) float64

    def rows(self, selected) -> Background:
        return Background(self.class_priors, self.log_mass[selected])


@dataclass(frozen=True)
class FarPrior:
    """Barber 14.3.1's remedy for a nearest neighbour far away, in the learned space.

    The soft rule is the Parzen classifier of Barber 14.3 with kernel exp(-||z - r||^2)
    (variance 1/2 in the learned space, NCA's own scale) and priors N_c / N, restricted to
    the k nearest references: P(c | z) = S_c / S with S_c = sum_{j <= k, y_j = c} e^{-d_j}.
    Each class gets one more component, the same for every class, at the references'
    mean mu with a large variance s^2 and weight pi_c = N_c / N::

        score_c(z) = S_c(z) + pi_c * exp(-tau - (||z - mu||^2 - rho^2) / (2 s^2))

    * rho^2 = mean ||r - mu||^2 over the references (their spread), s^2 = max(rho^2, 1):
      as wide as the data, and wider than the data kernel's 1/2, which makes the component
      outlast every data term along any ray leaving the data;
    * tau = the calibrated outlier threshold (the q-quantile of held-out points' squared
      distance to their nearest reference): at the data's typical radius the component
      weighs exactly as much as one neighbour at the outlier threshold.

    Then P = lambda * soft + (1 - lambda) * pi with lambda = S / (S + background): for a
    query whose nearest neighbour is well inside the threshold lambda = 1 - O(e^{d_1 - tau}),
    so the rule is the soft rule; beyond the data lambda falls monotonically to 0 (each
    data term decays like e^{-t^2}, the component like e^{-t^2 / (2 s^2)}), so the
    probabilities tend to the class priors, not to a confident guess.
    """

    centre: np.ndarray  # (d,) float64, mu
    radius_sq: float  # rho^2
    variance: float  # s^2
    class_priors: np.ndarray  # (C,) float64, N_c / N

    @classmethod
    def of(cls, references: np.ndarray, labels: np.ndarray, n_classes: int) -> FarPrior:
        """From the reference embeddings (N, d) and their class indices (N,)."""
        refs = np.asarray(references, dtype=np.float32)
        centre = refs.mean(axis=0, dtype=np.float64)
        spread = refs.astype(np.float64) - centre  # (N, d)
        radius_sq = float(np.einsum("nd,nd->n", spread, spread).mean())
        counts = np.bincount(np.asarray(labels, dtype=np.int64), minlength=n_classes)
        return cls(centre, radius_sq, max(radius_sq, 1.0), counts / counts.sum())

    def background(self, z: np.ndarray, threshold: float) -> Background:
        """The component at queries z (n, d), for the outlier threshold tau."""
        diff = np.asarray(z, dtype=np.float32).astype(np.float64) - self.centre  # (n, d)
        r2 = np.einsum("nd,nd->n", diff, diff)
        return Background(
            self.class_priors, -threshold - (r2 - self.radius_sq) / (2 * self.variance)
        )


def _check_decision_inputs(labels, dists, rule: str, background) -> None:
    if labels.ndim != 2 or labels.shape != dists.shape:
        raise ValueError(
            f"neighbor_labels and neighbor_distances must both be (n, k); got "
            f"{labels.shape} and {dists.shape}"
        )
    if rule not in RULES:
        raise ValueError(f"rule must be one of {RULES}, got {rule!r}")
    if rule == "soft_prior" and (background is None or len(background.log_mass) != len(labels)):
        raise ValueError("rule 'soft_prior' needs the background component of every row")
    if len(labels) and labels.shape[1] == 0:
        raise ValueError("decide needs at least one neighbour per query (k >= 1)")


def _majority_with_nearest_tie_break(scores, rows, cols, k: int) -> np.ndarray:
    """argmax of the votes (scores (n, C), integers), ties to the class whose nearest member
    comes first in the neighbour list."""
    n, n_classes = scores.shape
    # first_rank[i, c]: position of the nearest neighbour of class c (k when absent).
    first_rank = np.full((n, n_classes), k, dtype=np.int64)
    ranks = np.broadcast_to(np.arange(k), (n, k)).reshape(-1)
    np.minimum.at(first_rank, (rows, cols), ranks)
    # votes dominate (steps of k + 1); among equal votes the earliest class wins.
    key = scores.astype(np.int64) * (k + 1) + (k - first_rank)
    return key.argmax(axis=1)


def decide(
    neighbor_labels: np.ndarray,
    neighbor_distances: np.ndarray,
    n_classes: int,
    rule: str = "majority",
    background: Background | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """The kNN decision rule.

    neighbor_labels: (n, k) int class indices, neighbor_distances: (n, k) squared distances,
    each row sorted nearest first. Returns (predicted class index (n,) int64,
    class probabilities (n, n_classes) float64).

    * ``majority``: probabilities are vote fractions votes_c / k; the prediction is the class
      with most votes, ties broken in favour of the tied class whose nearest member comes
      first in the neighbour list (deterministic; it reduces to 1-NN on a full tie).
    * ``soft``: the NCA rule restricted to the k retrieved neighbours,
      P(c) = sum_{j: y_j = c} exp(-d_j) / sum_j exp(-d_j) (computed with the minimum
      distance subtracted); the prediction is argmax P(c), ties to the smaller index.
    * ``soft_prior``: the soft rule with the fictitious component of :class:`FarPrior`
      (``background``, required): P(c) = (S_c + pi_c B) / (S + B). Both terms are scaled
      by exp(-max(-d_1, log B)) first, so neither overflows however far the query is; with
      B = 0 it computes exactly what ``soft`` computes.
    """
    labels = np.asarray(neighbor_labels)
    dists = np.asarray(neighbor_distances, dtype=np.float64)
    _check_decision_inputs(labels, dists, rule, background)
    n, k = labels.shape
    if n == 0:
        return np.empty(0, dtype=np.int64), np.empty((0, n_classes), dtype=np.float64)
    rows = np.repeat(np.arange(n), k)  # (n k,)
    cols = labels.reshape(-1).astype(np.int64)  # (n k,)
    extra = None
    if rule == "majority":
        weights = np.ones((n, k), dtype=np.float64)
    elif rule == "soft":
        weights = np.exp(-(dists - dists.min(axis=1, keepdims=True)))
    else:  # soft_prior: scale so that the larger of e^{-d_1} and B becomes 1
        log_mass = np.asarray(background.log_mass, dtype=np.float64)  # (n,)
        shift = np.maximum(-dists.min(axis=1), log_mass)  # (n,)
        weights = np.exp(-dists - shift[:, None])
        extra = np.exp(log_mass - shift)[:, None] * background.class_priors[None, :]  # (n, C)
    scores = np.zeros((n, n_classes), dtype=np.float64)
    np.add.at(scores, (rows, cols), weights.reshape(-1))
    if extra is not None:
        scores += extra
    proba = scores / scores.sum(axis=1, keepdims=True)
    if rule == "majority":
        predicted = _majority_with_nearest_tie_break(scores, rows, cols, k)
    else:
        predicted = proba.argmax(axis=1)
    return predicted.astype(np.int64), proba
