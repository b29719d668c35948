"""Data editing for k-NN (Barber, ch. 14.1): keep only the references that matter.

On the references' embeddings z (N, d) and labels y (N,):

1. (optional) Wilson editing: a reference is removed when the majority of its ``edit_k``
   nearest other references has another label (label noise, points deep in another class).
2. Condensing, Hart's condensed nearest neighbour generalised to k neighbours: starting from
   one reference per class, every reference whose ``check_k`` nearest kept references do not
   all carry its label is added, in passes over the set in a seeded random order, until a
   whole pass adds none. Candidates are tested in blocks of ``block`` rows against the kept set
   as it stands before the block (blocks of 1 are Hart's original order of additions; larger
   blocks keep a few more references and are much faster).

Guarantee (checked by ``tests/training/references/test_condense.py`` on random data): every
reference that was removed by condensing has its ``check_k`` nearest kept references all of
its own label, so the k-NN rule on the kept set classifies it correctly for every
k <= check_k, by majority or soft vote. Hart's 1-NN rule (check_k = 1) keeps far fewer
references and loses far more accuracy.

Prototypes (``prototypes``) replace selection by generation. Within each class, Lloyd's
k-means (k-means++ seeding) partitions the class's references into clusters S_1 ... S_m
(m from ``class_budget``: the class's share of round(N / reduction), at least one), each
prototype at its cluster's mean

    mu_j = (1 / |S_j|) sum_{i in S_j} z_i,

which minimises the within-class sum of squared distances locally but ignores the other
classes: these are ``references condense --refine none``, and the start from which the
default, ``--refine nca``, learns the prototypes with NCA's objective
(``training.references.learned``). A prototype is not a reference; its id is that of the
member of its cluster nearest it, so a neighbour id still names a real training example (the
one most like the prototype). What is guaranteed: the clusters partition each class (every
reference is represented by exactly one prototype of its class) and each prototype is its
cluster's mean. There is no per-reference guarantee like Hart's. At 3x fewer references the
cluster means lose about half a point of test accuracy on USPS and the 60k digits
(benchmarks/README.md, "Condensing: settings and seeds").
"""

from __future__ import annotations

import numpy as np

from service.core.knn import RERANK_MARGIN, decide, exact_knn, rerank, squared_distances
from training.evaluation.evaluate import torch_candidates


def class_budget(y: np.ndarray, reduction: float, floor: int = 1) -> dict[int, int]:
    """{class: prototypes} for the classes of y (N,): a total of round(N / reduction)
    prototypes (at least ``floor`` per class, or all its rows), shared in proportion to the
    classes' sizes.

    A class whose share N_c * T / N_rest is below ``floor`` keeps min(floor, N_c)
    prototypes, and the rest of the budget T is shared among the other classes in
    proportion to their sizes, again until every share is at least ``floor``
    (water-filling); no class gets more prototypes than it has rows. The total grows to the
    sum of the floors when they alone exceed round(N / reduction). The shares are rounded by largest
    remainder in exact integer arithmetic (ties to the lower class index), so the counts sum
    to the total exactly; a class's count is its share rounded down or up, not necessarily
    to the nearest."""
    classes, counts = np.unique(np.asarray(y), return_counts=True)
    rows = {int(c): int(n) for c, n in zip(classes, counts, strict=True)}
    floors = sum(min(floor, n) for n in rows.values())
    total = max(floors, min(len(y), round(len(y) / reduction)))
    budget: dict[int, int] = {}
    while True:  # fix the classes whose share is below the floor, or above their rows
        active = [c for c in rows if c not in budget]
        left = total - sum(budget.values())
        pool = sum(rows[c] for c in active)
        fixed = {c: min(floor, rows[c]) for c in active if rows[c] * left < floor * pool}
        if left > pool:  # more prototypes than rows left: every class keeps its rows
            fixed = {c: rows[c] for c in active}
        if not fixed:
            break
        budget.update(fixed)
    active = [c for c in rows if c not in budget]
    left = total - sum(budget.values())
    pool = sum(rows[c] for c in active)
    # share_c = rows_c * left / pool, split exactly into its floor and its remainder
    floors = {c: rows[c] * left // pool for c in active}
    remainders = {c: rows[c] * left % pool for c in active}
    spare = left - sum(floors.values())
    by_remainder = sorted(active, key=lambda c: (-remainders[c], c))
    for c in by_remainder[:spare]:
        floors[c] += 1
    budget.update(floors)
    return {c: budget[c] for c in rows}


def budget_record(y: np.ndarray, reduction: float, classes=None, made=None, floor: int = 1) -> dict:
    """What the manifest and the lineage say of ``class_budget(y, reduction, floor)``: the
    rule, the total, per class its rows and prototypes, and the classes whose proportional
    share (N_c * total / N) was below the floor and were raised to it ("raised_to_one" for
    the default floor of one; "floor" and "raised_to_floor" otherwise). classes: the names
    of the class indices in y (the indices themselves when None). made: the labels (M,) of
    the prototypes actually made, when they can be fewer than the budget (a class that
    editing left with fewer rows than its budget starts from its rows): the counts then say
    what was made."""
    budget = class_budget(y, reduction, floor)
    if made is not None:
        counted = np.bincount(np.asarray(made, dtype=np.int64), minlength=max(budget) + 1)
        budget = {c: int(counted[c]) for c in budget}
    values, counts = np.unique(np.asarray(y), return_counts=True)
    rows = {int(c): int(n) for c, n in zip(values, counts, strict=True)}
    total, n = sum(budget.values()), len(y)

    def name(c: int) -> str:
        return str(c if classes is None else list(classes)[c])

    raised = [name(c) for c in budget if rows[c] * total < floor * n]
    record = {
        "rule": "round(N / reduction) prototypes, shared in proportion to the classes' sizes; "
        + (
            "a class whose share is below one keeps one, the others share the rest"
            if floor == 1
            else f"a class whose share is below {floor} keeps {floor} (or all its rows), "
            "the others share the rest"
        ),
        "total": int(total),
        "per_class": {name(c): {"rows": rows[c], "prototypes": int(m)} for c, m in budget.items()},
    }
    if floor == 1:
        record["raised_to_one"] = raised
    else:
        record.update(floor=int(floor), raised_to_floor=raised)
    return record


def knn_within(
    z: np.ndarray, k: int, chunk_rows: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """``exact_knn(z, z, k)``, the k nearest rows of each row of a set among its own rows, with
    the float32 candidate step in torch (``training.evaluation.evaluate.torch_candidates``:
    one fused GEMM and ``torch.topk`` per block of rows); ``service.core.knn.rerank`` then
    orders the k + RERANK_MARGIN candidates by exact float64 distance, ties by smaller index,
    as ``exact_knn`` does. The torch step is used because ``exact_knn``'s numpy passes would
    be most of Wilson editing's time on large sets (benchmarks/README.md, "UCI letters, and
    the published figures beside ours"). ``chunk_rows``: rows per block of the float32 step.
    z (N, d) -> (distances (N, k) float64, indices (N, k) int64)."""
    n = len(z)
    if not 1 <= k <= n:
        raise ValueError(f"k must lie in [1, {n}] (the number of rows), got {k}")
    points = np.ascontiguousarray(z, dtype=np.float32)
    candidates = torch_candidates(points, points, min(n, k + RERANK_MARGIN), chunk_rows)
    return rerank(z, points, candidates, k)


def wilson_keep(z: np.ndarray, y: np.ndarray, n_classes: int, edit_k: int = 3) -> np.ndarray:
    """(N,) bool: references whose ``edit_k`` nearest others vote (majority) for their label."""
    n = len(z)
    if n <= edit_k:
        return np.ones(n, dtype=bool)
    dist, idx = knn_within(z, edit_k + 1)  # (N, k+1): self among them unless duplicates win
    others = idx != np.arange(n)[:, None]
    # the first edit_k entries that are not the point itself (stable: nearest first)
    pick = np.argsort(~others, axis=1, kind="stable")[:, :edit_k]
    rows = np.arange(n)[:, None]
    predicted, _ = decide(y[idx[rows, pick]], dist[rows, pick], n_classes, "majority")
    return predicted == y


def condensed_keep(
    z: np.ndarray, y: np.ndarray, *, check_k: int = 5, seed: int = 0, block: int = 256
) -> np.ndarray:
    """(N,) bool: the condensed set; every other reference has its ``check_k`` nearest kept
    references all of its label."""
    n = len(z)
    order = np.random.default_rng(seed).permutation(n)
    keep = np.zeros(n, dtype=bool)
    for c in np.unique(y):  # one seed per class: the first of the class in the order
        keep[order[y[order] == c][0]] = True
    while True:
        added = 0
        for start in range(0, n, block):
            candidates = order[start : start + block]
            candidates = candidates[~keep[candidates]]
            if not len(candidates):
                continue
            kept = np.flatnonzero(keep)
            k = min(check_k, len(kept))
            _, nearest = exact_knn(z[candidates], z[kept], k)  # (B, k)
            agree = (y[kept[nearest]] == y[candidates][:, None]).all(1)
            if k < check_k:  # too few kept references to vouch for anyone yet
                agree[:] = False
            keep[candidates[~agree]] = True
            added += int((~agree).sum())
        if added == 0:
            return keep


def condense(
    z: np.ndarray,
    y: np.ndarray,
    n_classes: int,
    *,
    check_k: int = 5,
    edit_k: int = 0,
    seed: int = 0,
    block: int = 256,
) -> tuple[np.ndarray, dict]:
    """Editing (when edit_k > 0) then condensing. Returns (keep (N,) bool, counts)."""
    edited = wilson_keep(z, y, n_classes, edit_k) if edit_k > 0 else np.ones(len(z), dtype=bool)
    survivors = np.flatnonzero(edited)
    kept = condensed_keep(z[survivors], y[survivors], check_k=check_k, seed=seed, block=block)
    keep = np.zeros(len(z), dtype=bool)
    keep[survivors[kept]] = True
    return keep, {
        "removed_by_editing": int((~edited).sum()),
        "removed_by_condensing": int((~kept).sum()),
    }


def _kmeans_plus_plus(x: np.ndarray, m: int, rng: np.random.Generator) -> np.ndarray:
    """(m, d) initial centres: each next centre drawn with probability proportional to the
    squared distance to the nearest centre chosen so far (Arthur & Vassilvitskii 2007)."""
    centres = np.empty((m, x.shape[1]), dtype=np.float64)
    centres[0] = x[rng.integers(len(x))]
    nearest = ((x - centres[0]) ** 2).sum(1)  # (n,)
    for j in range(1, m):
        total = nearest.sum()
        pick = rng.choice(len(x), p=nearest / total) if total > 0 else rng.integers(len(x))
        centres[j] = x[pick]
        np.minimum(nearest, ((x - centres[j]) ** 2).sum(1), out=nearest)
    return centres


def kmeans(
    x: np.ndarray, m: int, *, seed: int = 0, iterations: int = 25
) -> tuple[np.ndarray, np.ndarray]:
    """Lloyd's k-means on x (n, d) with m <= n centres. Returns (centres (m', d) float64,
    assignment (n,) in [0, m')), where every centre is the mean of the points assigned to it
    (m' <= m: a centre left without points is dropped). Stops at a fixed point or after
    ``iterations`` assignment steps."""
    x = np.asarray(x, dtype=np.float64)
    rng = np.random.default_rng(seed)
    centres = _kmeans_plus_plus(x, m, rng)
    assignment = np.full(len(x), -1)
    for _ in range(iterations):
        new = _nearest(x, centres)  # (n,)
        if np.array_equal(new, assignment):
            break
        assignment = new
        centres = _cluster_means(x, assignment, len(centres))
    used = np.unique(assignment)  # drop centres no point chose
    relabel = np.full(len(centres), -1)
    relabel[used] = np.arange(len(used))
    assignment = relabel[assignment]
    return _cluster_means(x, assignment, len(used)), assignment


def _cluster_means(x: np.ndarray, assignment: np.ndarray, m: int) -> np.ndarray:
    """(m, d): the mean of each cluster's points (a cluster with none keeps the origin; the
    caller drops it)."""
    sums = np.zeros((m, x.shape[1]))
    np.add.at(sums, assignment, x)
    counts = np.bincount(assignment, minlength=m)[:, None]
    return sums / np.maximum(counts, 1)


def class_kmeans(
    z: np.ndarray, y: np.ndarray, budget: dict, *, seed: int = 0, iterations: int = 25
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``budget[c]`` k-means centres for each class c of y, the classes in sorted order; a
    class no larger than its budget starts from its rows as they are.

    z: (N, d), y: (N,). Returns (centres (M, d) float64, labels (M,) of y's dtype,
    assignment (N,) each row's centre)."""
    means, labels, assignment, offset = [], [], np.empty(len(z), dtype=np.int64), 0
    for c in np.unique(y):
        members = np.flatnonzero(y == c)
        m = budget[int(c)]
        if m >= len(members):
            mu, part = np.asarray(z[members], dtype=np.float64), np.arange(len(members))
        else:
            mu, part = kmeans(z[members], m, seed=seed, iterations=iterations)
        means.append(mu)
        labels.append(np.full(len(mu), c, dtype=y.dtype))
        assignment[members] = offset + part
        offset += len(mu)
    return np.concatenate(means), np.concatenate(labels), assignment


def prototypes(
    z: np.ndarray,
    y: np.ndarray,
    *,
    reduction: float = 3.0,
    seed: int = 0,
    iterations: int = 25,
    floor: int = 1,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per-class k-means prototypes, ``class_budget(y, reduction, floor)`` centres per class
    (``class_kmeans``).

    z: (N, d), y: (N,). Returns (centres (M, d) float32, labels (M,), representative (M,) the
    index of the member of each prototype's cluster nearest the prototype, assignment (N,)
    each reference's cluster)."""
    budget = class_budget(y, reduction, floor)
    means, labels, assignment = class_kmeans(z, y, budget, seed=seed, iterations=iterations)
    centres = means.astype(np.float32)
    d2 = ((np.asarray(z, dtype=np.float64) - centres[assignment]) ** 2).sum(1)  # (N,)
    order = np.lexsort((d2, assignment))  # by cluster, nearest first
    representative = order[np.r_[True, assignment[order][1:] != assignment[order][:-1]]]
    return centres, labels, representative, assignment


def _nearest(queries: np.ndarray, references: np.ndarray, max_floats: int = 2**24) -> np.ndarray:
    """(n,) the index of each query's nearest reference: (n, d), (M, d). Queries go in chunks
    whose (chunk, M) distance block holds at most ``max_floats`` float32 values (64 MiB), so
    memory does not grow with n x M."""
    out = np.empty(len(queries), dtype=np.int64)
    chunk = max(1, max_floats // max(1, len(references)))
    for start in range(0, len(queries), chunk):
        block = queries[start : start + chunk]
        out[start : start + chunk] = squared_distances(block, references).argmin(1)
    return out
