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

Guarantee (checked by ``tests/training/test_condense.py`` on random data): every reference
that was removed by condensing has its ``check_k`` nearest kept references all of its own
label, so the k-NN rule on the kept set classifies it correctly for every k <= check_k, by
majority or soft vote. Hart's 1-NN rule (check_k = 1) keeps far fewer references and loses
far more accuracy (measured: USPS, 12x fewer references and 3-4 points of test accuracy;
check_k = 5: 3.3x fewer and 0.4-0.9 points).
"""

from __future__ import annotations

import numpy as np

from service.knn import decide, exact_knn


def wilson_keep(z: np.ndarray, y: np.ndarray, n_classes: int, edit_k: int = 3) -> np.ndarray:
    """(N,) bool: references whose ``edit_k`` nearest others vote (majority) for their label."""
    n = len(z)
    if n <= edit_k:
        return np.ones(n, dtype=bool)
    dist, idx = exact_knn(z, z, edit_k + 1)  # (N, k+1): self among them unless duplicates win
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
