"""The statistics a fit needs besides the objective, computed from row shards.

In a data-parallel fit (``training.distributed.ranks``) each rank holds rows [start, stop) of the
training set; these functions give every rank the same standardisation, initial map,
class list and k-NN accuracies that a single process would compute from all the rows, by
reducing small per-shard summaries (sums, D x D scatter matrices, k-NN lists), never the rows:

* moments: mean and variance per feature from all-reduced sums (two passes: the mean
  first, then centred squares, as numpy's var does), hence both standardisations;
* PCA: the top eigenvectors of the all-reduced D x D covariance, signed as scikit-learn
  signs its components (largest-magnitude entry positive);
* LDA: the generalised eigenvectors of the all-reduced between- and within-class scatter,
  S_b v = lambda S_w v (Fisher's criterion; scikit-learn's "eigen" solver);
* k-NN accuracy of query rows: each rank's k nearest among its own references, gathered
  and merged by (distance, global index) -- exactly the lists of one search over all rows;
* the soft-neighbour score of held-out rows: each rank's sums of p_i at every temperature,
  all-reduced.

Every figure that steers the fit is broadcast from rank 0 at the end, so ranks cannot
disagree by rounding.
"""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp
import torch
import torch.distributed as dist

from service.core.knn import decide
from training.distributed.ranks import ProcessGroup, broadcast_from_rank0, gather_rows
from training.evaluation.evaluate import nearest_references
from training.numerics import (
    evenly_spaced_rows,
    fisher_directions,
    fisher_directions_of_rows,
    principal_axes,
)


def _device(group: ProcessGroup) -> torch.device:
    """Where collective buffers live: NCCL reduces CUDA tensors only."""
    return (
        torch.device("cuda", torch.cuda.current_device())
        if group.backend == "nccl"
        else (torch.device("cpu"))
    )


def all_reduce_sum(values: np.ndarray, group: ProcessGroup) -> np.ndarray:
    """Elementwise sum over ranks of a float64 array, the same bits on every rank."""
    t = torch.as_tensor(np.ascontiguousarray(values, dtype=np.float64), device=_device(group))
    if group.is_distributed:
        dist.all_reduce(t)
        broadcast_from_rank0(t, group)
    return t.cpu().numpy()


def total_rows(n_local: int, group: ProcessGroup) -> int:
    return int(all_reduce_sum(np.array([n_local]), group)[0])


def union_classes(y_shard: np.ndarray, group: ProcessGroup) -> np.ndarray:
    """The sorted labels present on any rank (labels of any type numpy can sort)."""
    if not group.is_distributed:
        return np.unique(y_shard)
    parts: list = [None] * group.world_size
    dist.all_gather_object(parts, np.unique(y_shard).tolist())
    return np.unique(np.concatenate([np.asarray(p) for p in parts if len(p)]))


def gather_array(rows: np.ndarray, n: int, group: ProcessGroup) -> np.ndarray:
    """Every rank's rows (N_r, ...) of a numpy array concatenated in rank order -> (N, ...),
    N cut by ``shard_bounds``; through the device the backend reduces on (CUDA for NCCL)."""
    t = torch.as_tensor(np.ascontiguousarray(rows), device=_device(group))
    return gather_rows(t, n, group).cpu().numpy()


def gather_labels(y_shard: np.ndarray, n: int, group: ProcessGroup) -> np.ndarray:
    """Every rank's class indices (N_r,) concatenated in rank order -> (N,) int64."""
    return gather_array(np.asarray(y_shard, dtype=np.int64), n, group)


# the bytes of one float64 block of rows read, converted and reduced at once (8 MiB): under
# the size glibc's allocator maps afresh, and page-faults through, for every block
# (benchmarks/README.md, "Page faults, repeated products and the finish's first step")
BLOCK_BYTES = 8 << 20


def block_rows(n_features: int) -> int:
    """Rows in one of ``blocks``' float64 blocks of ``n_features`` columns."""
    return max(1, BLOCK_BYTES // (8 * max(1, n_features)))


def blocks(X: np.ndarray, rows: np.ndarray | None = None, min_rows: int = 1):
    """The rows of X (or of X[rows]) in float64 blocks of max(``block_rows``, ``min_rows``)
    rows, each a copy the caller may change: a memory map or a float32 array is read and
    converted a block at a time, never whole (memory O(BLOCK_BYTES), or O(min_rows D)), and
    X itself is never written."""
    n = len(X) if rows is None else len(rows)
    step = max(block_rows(X.shape[1]), min_rows)
    for start in range(0, n, step):
        part = slice(start, min(start + step, n))
        yield np.array(X[part] if rows is None else X[rows[part]], dtype=np.float64, copy=True)


def moments(
    X_shard: np.ndarray, n: int, group: ProcessGroup, rows: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """(mean (D,), variance (D,)) of all N rows, from this rank's (N_r, D) (its ``rows`` of
    X_shard when given), in float64 over blocks: the mean first, then centred squares, as
    numpy's var does."""
    total = np.zeros(X_shard.shape[1])
    for block in blocks(X_shard, rows):
        total += block.sum(0)
    mean = all_reduce_sum(total, group) / n
    squares = np.zeros(X_shard.shape[1])
    for block in blocks(X_shard, rows):
        block -= mean
        squares += (block * block).sum(0)
    return mean, all_reduce_sum(squares, group) / n


def varying_features(X_shard, group: ProcessGroup, rows: np.ndarray | None = None) -> int:
    """How many features take more than one value over all N rows (every rank's (N_r, D)
    X_shard, or its ``rows`` of it, dense or CSR): each row is compared with rank 0's first
    row, exactly (no rounding), a block of rows at a time. 0 means every distance between
    rows is 0."""
    if sp.issparse(X_shard):  # a sparse fit is one process: its column ranges, zeros counted
        X_rows = X_shard if rows is None else X_shard[rows]
        low = X_rows.min(axis=0).toarray().ravel()
        high = X_rows.max(axis=0).toarray().ravel()
        return int(np.count_nonzero(low != high))
    n_local = len(X_shard) if rows is None else len(rows)
    first = np.zeros(X_shard.shape[1])
    if group.rank == 0 and n_local:
        first = np.asarray(X_shard[0 if rows is None else rows[0]], dtype=np.float64)
    first = all_reduce_sum(first, group)  # (D,) rank 0's first row on every rank
    differs = np.zeros(X_shard.shape[1])
    for block in blocks(X_shard, rows):
        differs += (block != first).any(axis=0)
    return int(np.count_nonzero(all_reduce_sum(differs, group)))


def per_feature_scale(mean: np.ndarray, var: np.ndarray) -> np.ndarray:
    """scale (D,) = the standard deviation of each feature; constant features get 1."""
    scale = np.sqrt(var)
    tiny = scale <= 10 * np.finfo(np.float64).eps * np.maximum(1.0, np.abs(mean))
    return np.where(tiny, 1.0, scale)


def global_scale(mean: np.ndarray, var: np.ndarray) -> np.ndarray:
    """scale (D,): one shared value, the root mean of the feature variances (1 when every
    feature is constant), so the centred data have unit mean variance per feature while the
    features keep their relative scales (pixels stay pixels; a quiet border pixel stays
    quiet)."""
    shared = float(np.sqrt(np.mean(var)))
    if not shared > 10 * np.finfo(np.float64).eps * max(1.0, float(np.abs(mean).max(initial=0))):
        shared = 1.0  # every feature constant
    return np.full(len(mean), shared)


def standardizer(name: str, X_shard, n: int, group, rows=None) -> tuple[np.ndarray, np.ndarray]:
    """mean and scale (D,) of the "feature" or "global" standardisation of all rows."""
    mean, var = moments(X_shard, n, group, rows)
    if name == "feature":
        return mean, per_feature_scale(mean, var)
    return mean, global_scale(mean, var)


def standardized(
    X: np.ndarray, mean: np.ndarray, scale: np.ndarray, rows: np.ndarray | None = None
) -> np.ndarray:
    """(X[rows] - mean) / scale as a new float32 array (n, D), filled a block at a time:
    the only full copy of the data a fit makes (the objective reads it in float32)."""
    n = len(X) if rows is None else len(rows)
    out = np.empty((n, X.shape[1]), dtype=np.float32)
    start = 0
    for block in blocks(X, rows):
        block -= mean
        block /= scale
        out[start : start + len(block)] = block
        start += len(block)
    return out


def gather_uneven(rows: np.ndarray, group: ProcessGroup) -> np.ndarray:
    """Small arrays of any length per rank, concatenated in rank order on every rank."""
    if not group.is_distributed:
        return rows
    parts: list = [None] * group.world_size
    dist.all_gather_object(parts, rows)
    return np.concatenate(parts)


def knn_lists(
    queries: np.ndarray,
    references: np.ndarray,
    first_index: int,
    k: int,
    group: ProcessGroup,
    exclude: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """(squared distances (Q, k), global indices (Q, k)) of each query's k nearest among all
    ranks' references; this rank holds references with global indices first_index + 0..N_r-1
    (minus those in ``exclude``, global indices). Queries are the same on every rank. Ties go
    to the smaller global index, as in one search over all rows."""
    keep = np.arange(len(references))
    if exclude is not None:
        keep = np.setdiff1d(keep, np.asarray(exclude) - first_index)
    m = min(k, len(keep))
    q = len(queries)
    dist_local = np.full((q, k), np.inf)
    index_local = np.full((q, k), -1, dtype=np.int64)
    if m:
        d, i = nearest_references(queries, references[keep], m)
        dist_local[:, :m], index_local[:, :m] = d, keep[i] + first_index
    if not group.is_distributed:
        return dist_local, index_local
    parts_d: list = [None] * group.world_size
    parts_i: list = [None] * group.world_size
    dist.all_gather_object(parts_d, dist_local)
    dist.all_gather_object(parts_i, index_local)
    all_d, all_i = np.concatenate(parts_d, 1), np.concatenate(parts_i, 1)  # (Q, P k)
    order = np.lexsort((all_i, all_d), axis=1)[:, :k]  # by distance, then global index
    rows = np.arange(q)[:, None]
    return all_d[rows, order], all_i[rows, order]


# choosing between them (choose_standardizer): training rows that score each
# standardisation, the reference rows they are classified among, at most, and the margin
# "global" must beat "feature" by
CHOICE_QUERIES = 2048
CHOICE_REFERENCES = 16384
CHOICE_MARGIN = 0.005


def choose_standardizer(
    X_shard: np.ndarray,
    y_all: np.ndarray,
    start: int,
    n_classes: int,
    group: ProcessGroup,
    ks: tuple[int, ...] = (1, 5),
    rows: np.ndarray | None = None,
) -> tuple[str, dict[str, float]]:
    """Per-feature or one shared scale, whichever kNN on the inputs does better with.

    Of the N training rows (this rank's X_shard holds global rows [start, start + N_r), or
    its ``rows`` of X_shard when given), CHOICE_QUERIES evenly spaced rows (at most half) are
    classified by the mean over ``ks`` of k-NN accuracy among at most CHOICE_REFERENCES
    other evenly spaced rows, once per standardisation (its statistics from those
    references); "global" is chosen only when it beats "feature" by CHOICE_MARGIN.
    Per-feature scaling suits features in different units; when they share one (pixels),
    it inflates near-constant features to the weight of informative ones and kNN suffers
    (``benchmarks/README.md``, "What limits accuracy: USPS at d = 32, one setting at a time").
    The cost does not grow with N: O(CHOICE_QUERIES x CHOICE_REFERENCES x D). Returns
    (name, {name: score}), the same on every rank."""
    n = len(y_all)
    local = len(X_shard) if rows is None else len(rows)
    stop = start + local
    queries = evenly_spaced_rows(n, min(CHOICE_QUERIES, n // 2))
    others = np.setdiff1d(np.arange(n), queries)
    references = others[evenly_spaced_rows(len(others), CHOICE_REFERENCES)]
    my_queries = queries[(queries >= start) & (queries < stop)] - start
    my_refs = references[(references >= start) & (references < stop)] - start
    local_rows = np.arange(local) if rows is None else rows
    ks = tuple(k for k in ks if k <= len(references)) or (1,)
    scores = {}
    mean, var = moments(X_shard, len(references), group, local_rows[my_refs])
    scales = {"feature": per_feature_scale(mean, var), "global": global_scale(mean, var)}
    for name, scale in scales.items():  # each standardisation's statistics from the references
        z_queries = gather_uneven(standardized(X_shard, mean, scale, local_rows[my_queries]), group)
        z_refs = standardized(X_shard, mean, scale, local_rows[my_refs])
        first = int(np.searchsorted(references, start))  # this rank's first reference
        d, i = knn_lists(z_queries, z_refs, first, max(ks), group)
        labels = y_all[references[i]]
        accuracies = [
            float(
                np.mean(decide(labels[:, :k], d[:, :k], n_classes, "majority")[0] == y_all[queries])
            )
            for k in ks
        ]
        scores[name] = float(np.mean(accuracies))
    chosen = "global" if scores["global"] >= scores["feature"] + CHOICE_MARGIN else "feature"
    return chosen, scores


def _signed_rows(vectors: np.ndarray) -> np.ndarray:
    """Rows (d, D) signed so that each one's largest-magnitude entry is positive (the
    convention of scikit-learn's svd_flip for PCA components)."""
    top = np.argmax(np.abs(vectors), axis=1)
    signs = np.sign(vectors[np.arange(len(vectors)), top])
    return vectors * np.where(signs == 0, 1.0, signs)[:, None]


def pca_components(
    Xs_shard: np.ndarray, n: int, n_components: int, group: ProcessGroup
) -> np.ndarray:
    """The top n_components principal axes (d, D) of all rows: eigenvectors of the
    all-reduced covariance (1/N) sum_i (x_i - mean)(x_i - mean)^T, largest eigenvalue first.
    Where the data has fewer directions than d, the rest are eigenvectors of eigenvalue ~0:
    orthonormal, completing the basis. With fewer rows than features (N < D) every rank
    gathers the centred rows (N x D, less than the D x D covariance) and takes their right
    singular vectors (``numerics.principal_axes``): O(N^2 D), not the O(D^3) of an
    eigendecomposition (50 rows of 5,000 features: 10 s an eigh, here)."""
    mean, _ = moments(Xs_shard, n, group)
    if n < Xs_shard.shape[1]:
        centred = gather_array(np.asarray(Xs_shard, dtype=np.float64) - mean, n, group)
        return _signed_rows(principal_axes(centred, n_components))
    scatter = np.zeros((Xs_shard.shape[1], Xs_shard.shape[1]))
    # blocks of at least D rows: each block's (D, D) product is a temporary as large
    for block in blocks(Xs_shard, min_rows=Xs_shard.shape[1]):
        block -= mean
        scatter += block.T @ block
    covariance = all_reduce_sum(scatter, group) / n  # (D, D)
    _, vectors = np.linalg.eigh(covariance)  # ascending eigenvalues
    return _signed_rows(vectors[:, ::-1][:, :n_components].T)


def lda_components(
    Xs_shard: np.ndarray,
    y_shard: np.ndarray,
    n: int,
    n_classes: int,
    n_components: int,
    group: ProcessGroup,
) -> np.ndarray:
    """Fisher's discriminant directions (d, D) of all rows: the top generalised
    eigenvectors of S_b v = lambda S_w v, with the between-class scatter
    S_b = sum_c n_c (mu_c - mu)(mu_c - mu)^T and the within-class scatter
    S_w = sum_i (x_i - mu_{y_i})(x_i - mu_{y_i})^T reduced over ranks; scaled so that the
    within-class covariance S_w / N is the identity along them. S_w gets a ridge of 1e-6 of
    its mean eigenvalue, so rank-deficient data (D > N) still has a solution. With fewer
    rows than features every rank gathers the rows and labels (N x D, less than a D x D
    scatter) and solves in their span (``numerics.fisher_directions_of_rows``)."""
    n_features = Xs_shard.shape[1]
    if n < n_features:
        rows = gather_array(np.asarray(Xs_shard, dtype=np.float64), n, group)  # (N, D)
        labels = gather_labels(y_shard, n, group)  # (N,)
        directions = fisher_directions_of_rows(rows, labels, n_classes, n_components)
        return _signed_rows(directions)
    counts = all_reduce_sum(np.bincount(y_shard, minlength=n_classes), group)  # (C,)
    sums = np.zeros((n_classes, n_features))
    step = max(block_rows(n_features), n_features)  # rows a block: as pca_components'
    starts = range(0, len(y_shard), step)
    for start, block in zip(starts, blocks(Xs_shard, min_rows=n_features), strict=True):
        labels = y_shard[start : start + len(block)]
        sums += np.eye(n_classes)[labels].T @ block  # (C, D)
    class_sums = all_reduce_sum(sums, group)
    class_means = class_sums / np.maximum(counts, 1)[:, None]
    mean = class_sums.sum(0) / n
    scatter = np.zeros((n_features, n_features))
    for start, block in zip(starts, blocks(Xs_shard, min_rows=n_features), strict=True):
        block -= class_means[y_shard[start : start + len(block)]]
        scatter += block.T @ block
    s_w = all_reduce_sum(scatter, group)  # (D, D)
    between = (class_means - mean) * np.sqrt(counts)[:, None]
    s_b = between.T @ between
    return _signed_rows(fisher_directions(s_b, s_w, n, n_components))


def held_out_neighbours(
    z_references: np.ndarray, z_queries: np.ndarray, m: int
) -> tuple[np.ndarray, np.ndarray]:
    """This rank's held-out rows' min(m, N) nearest references, as
    ``evaluation.evaluate.nearest_references`` finds them: (squared distances (Q_r, m)
    float64 nearest first, indices (Q_r, m)); empty arrays for a rank without rows."""
    m = min(m, len(z_references))
    if not len(z_queries):
        return np.zeros((0, m)), np.zeros((0, m), dtype=np.int64)
    return nearest_references(z_queries, z_references, m)


def knn_accuracy(
    neighbours: tuple[np.ndarray, np.ndarray],
    y_references: np.ndarray,
    y_queries: np.ndarray,
    n_classes: int,
    ks: tuple[int, ...],
    rule: str,
    n_queries_total: int,
    group: ProcessGroup,
) -> dict[int, float]:
    """k-NN accuracy over every rank's queries, each rank's ``neighbours``
    (``held_out_neighbours``, at least max(ks) of them) voting with ``rule``
    (``service.core.knn.decide``): the per-rank counts of correct answers are summed."""
    d2, idx = neighbours
    labels = np.asarray(y_references)[idx]  # (Q_r, m)
    ks = tuple(k for k in ks if k <= d2.shape[1])
    correct = np.zeros(len(ks))
    if len(d2):
        for i, k in enumerate(ks):
            predicted = decide(labels[:, :k], d2[:, :k], n_classes, rule)[0]
            correct[i] = float(np.sum(predicted == y_queries))
    correct = all_reduce_sum(correct, group)
    return {k: float(c / n_queries_total) for k, c in zip(ks, correct, strict=True)}


# the held-out soft-neighbour score (``soft_neighbour_score``): the nearest references a
# held-out row's soft vote spreads over, and the temperatures tried, as multiples of t0
# (a quarter-octave grid from t0 / 8 to 8 t0)
SOFT_NEIGHBOURS = 64
SOFT_TEMPERATURES = tuple(2.0 ** (h / 4) for h in range(-12, 13))


def soft_neighbour_score(
    z_references: np.ndarray,
    y_references: np.ndarray,
    z_queries: np.ndarray,
    y_queries: np.ndarray,
    n_queries_total: int,
    group: ProcessGroup,
    neighbours: tuple[np.ndarray, np.ndarray] | None = None,
) -> float:
    """The held-out soft-neighbour score of an embedding, blind to its scale as k-NN is:

        S = max_t (1/Q) sum_i p_i(t),
        p_i(t) = sum_{j in M_i, y_j = y_i} e^{-t d_ij} / sum_{j in M_i} e^{-t d_ij},

    over the Q held-out rows of every rank (each rank's own (Q_r, d) against the same (N, d)
    references), M_i the SOFT_NEIGHBOURS references nearest row i and d_ij their squared
    distances: NCA's p_i (the probability that a row's stochastic neighbour has its class)
    at temperature 1/t, truncated to the nearest references. t runs over SOFT_TEMPERATURES
    times t0 = 1 / (the geometric mean over held-out rows of the nearest positive squared
    distance: a row's exact duplicates among the references are passed over), so
    S(c A) = S(A) for any c > 0: a penalty that shrinks the map scores as its neighbours
    do. Unlike the k-NN accuracy of the same rows, S moves with every neighbour's distance,
    not only when a row's vote flips, so it sees the gain of a fit that 4,096 held-out rows'
    accuracy cannot (``benchmarks/README.md``, "The soft-neighbour score judges the
    stages"). ``neighbours``: this rank's ``held_out_neighbours`` when already found (at
    least SOFT_NEIGHBOURS of them or all N; the nearest SOFT_NEIGHBOURS are used)."""
    if neighbours is None:
        neighbours = held_out_neighbours(z_references, z_queries, SOFT_NEIGHBOURS)
    d2, idx = (part[:, :SOFT_NEIGHBOURS] for part in neighbours)  # (Q_r, m) nearest first
    same = np.asarray(y_references)[idx] == np.asarray(y_queries)[:, None]  # (Q_r, m)
    nearest = d2[:, 0]  # (Q_r,)
    # each row's nearest positive squared distance (inf: all m neighbours at 0): a row with
    # an exact duplicate among the references still sets t0 in the map's units
    first_positive = np.where(d2 > 0, d2, np.inf).min(1)  # (Q_r,)
    positive = first_positive[np.isfinite(first_positive)]
    log_sum, count = all_reduce_sum(np.array([np.log(positive).sum(), len(positive)]), group)
    t0 = float(np.exp(-log_sum / count)) if count else 1.0  # no positive gap: t is moot
    gaps = d2 - nearest[:, None]  # (Q_r, m) >= 0: the nearest neighbour's weight is 1
    sums = np.zeros(len(SOFT_TEMPERATURES))  # (T,) sum over this rank's rows of p_i(t)
    for i, factor in enumerate(SOFT_TEMPERATURES):
        weights = np.exp(-t0 * factor * gaps)  # (Q_r, m)
        sums[i] = np.sum((weights * same).sum(1) / weights.sum(1))
    return float(all_reduce_sum(sums, group).max() / max(1, n_queries_total))
