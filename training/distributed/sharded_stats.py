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
  and merged by (distance, global index) -- exactly the lists of one search over all rows.

Every figure that steers the fit is broadcast from rank 0 at the end, so ranks cannot
disagree by rounding.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from service.core.knn import decide, exact_knn
from training.data.datasets import global_scale, per_feature_scale
from training.distributed.ranks import ProcessGroup, broadcast_from_rank0, gather_rows
from training.numerics import evenly_spaced_rows


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


def moments(X_shard: np.ndarray, n: int, group: ProcessGroup) -> tuple[np.ndarray, np.ndarray]:
    """(mean (D,), variance (D,)) of all N rows, from this rank's (N_r, D)."""
    mean = all_reduce_sum(X_shard.sum(0), group) / n
    var = all_reduce_sum(((X_shard - mean) ** 2).sum(0), group) / n
    return mean, var


def standardizer(name: str, X_shard, n: int, group) -> tuple[np.ndarray, np.ndarray]:
    """mean and scale (D,) of the "feature" or "global" standardisation of all rows."""
    mean, var = moments(X_shard, n, group)
    if name == "feature":
        return mean, per_feature_scale(mean, var)
    return mean, global_scale(mean, var)


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
        d, i = exact_knn(queries, references[keep], m)
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


def choose_standardizer(
    X_shard: np.ndarray,
    y_all: np.ndarray,
    start: int,
    n_classes: int,
    group: ProcessGroup,
    ks: tuple[int, ...] = (1, 5),
) -> tuple[str, dict[str, float]]:
    """``training.data.datasets.choose_standardizer`` over all ranks' rows: the same evenly spaced
    query rows (gathered: CHOICE_QUERIES x D), references everywhere else, the same scores."""
    from training.data.datasets import CHOICE_MARGIN, CHOICE_QUERIES

    n = len(y_all)
    stop = start + len(X_shard)
    n_queries = min(CHOICE_QUERIES, n // 2)
    queries = evenly_spaced_rows(n, n_queries)
    mine = queries[(queries >= start) & (queries < stop)]
    ks = tuple(k for k in ks if k <= n - len(queries)) or (1,)
    scores = {}
    for name in ("feature", "global"):
        # the statistics of the references only, as the single-process rule
        is_reference = np.ones(len(X_shard), dtype=bool)
        is_reference[mine - start] = False
        n_ref = n - len(queries)
        mean, scale = standardizer(name, X_shard[is_reference], n_ref, group)
        z = ((X_shard - mean) / scale).astype(np.float32)
        z_queries = gather_uneven(z[mine - start], group)  # (Q, D) in global order
        d, i = knn_lists(z_queries, z, start, max(ks), group, exclude=queries)
        labels = y_all[i]
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
    orthonormal, completing the basis."""
    mean, _ = moments(Xs_shard, n, group)
    centred = Xs_shard - mean
    covariance = all_reduce_sum(centred.T @ centred, group) / n  # (D, D)
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
    its mean eigenvalue, so rank-deficient data (D > N) still has a solution."""
    import scipy.linalg

    n_features = Xs_shard.shape[1]
    one_hot = np.eye(n_classes)[y_shard]  # (N_r, C)
    counts = all_reduce_sum(one_hot.sum(0), group)  # (C,)
    class_sums = all_reduce_sum(one_hot.T @ Xs_shard, group)  # (C, D)
    class_means = class_sums / np.maximum(counts, 1)[:, None]
    mean = class_sums.sum(0) / n
    within = Xs_shard - class_means[y_shard]
    s_w = all_reduce_sum(within.T @ within, group)  # (D, D)
    between = (class_means - mean) * np.sqrt(counts)[:, None]
    s_b = between.T @ between
    ridge = 1e-6 * max(np.trace(s_w) / n_features, np.finfo(np.float64).tiny)
    _, vectors = scipy.linalg.eigh(s_b, s_w + ridge * np.eye(n_features))
    top = vectors[:, ::-1][:, :n_components].T * np.sqrt(n)  # v^T (S_w / N) v = 1
    return _signed_rows(top)


def knn_accuracy(
    z_references: np.ndarray,
    y_references: np.ndarray,
    z_queries: np.ndarray,
    y_queries: np.ndarray,
    n_classes: int,
    ks: tuple[int, ...],
    rule: str,
    n_queries_total: int,
    group: ProcessGroup,
) -> dict[int, float]:
    """k-NN accuracy over every rank's queries (each rank's own (Q_r, d) against the same
    (N, d) references): the per-rank counts of correct answers are summed."""
    from training.evaluation.evaluate import knn_predictions

    ks = tuple(k for k in ks if k <= len(z_references))
    predictions = knn_predictions(z_references, y_references, z_queries, n_classes, ks, rule)
    correct = np.array([float(np.sum(predictions[k] == y_queries)) for k in ks])
    correct = all_reduce_sum(correct, group)
    return {k: float(c / n_queries_total) for k, c in zip(ks, correct, strict=True)}
