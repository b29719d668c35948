"""The shared kNN core: projection, exact search, decision rule."""

from __future__ import annotations

import numpy as np
import pytest

from service.core.knn import decide, exact_knn, project, rerank, squared_distances


def test_project_is_affine_map_in_float32(rng):
    x = rng.normal(size=(7, 5))
    W = rng.normal(size=(3, 5)).astype(np.float32)
    b = rng.normal(size=3).astype(np.float32)
    z = project(x, W, b)
    assert z.dtype == np.float32 and z.shape == (7, 3)
    np.testing.assert_allclose(z, x @ W.T.astype(np.float64) + b, rtol=1e-5, atol=1e-5)


def test_exact_knn_matches_naive_sort(rng):
    q = rng.normal(size=(13, 4)).astype(np.float32)
    r = rng.normal(size=(50, 4)).astype(np.float32)
    dist, idx = exact_knn(q, r, 6, chunk_size=4)
    naive = ((q[:, None, :].astype(np.float64) - r[None]) ** 2).sum(-1)
    expect = np.argsort(naive, axis=1, kind="stable")[:, :6]
    np.testing.assert_array_equal(idx, expect)
    np.testing.assert_allclose(dist, np.take_along_axis(naive, expect, 1), rtol=1e-4, atol=1e-5)
    assert np.all(np.diff(dist, axis=1) >= 0)


def test_exact_knn_with_k_equal_to_n_and_ties_by_index():
    r = np.zeros((4, 2), np.float32)
    _dist, idx = exact_knn(np.zeros((1, 2), np.float32), r, 4)
    np.testing.assert_array_equal(idx, [[0, 1, 2, 3]])
    with pytest.raises(ValueError, match=r"k must lie in \[1, 4\]"):
        exact_knn(r, r, 5)


def test_squared_distances_are_never_negative(rng):
    x = rng.normal(size=(10, 3)).astype(np.float32) * 1e3
    assert (squared_distances(x, x) >= 0).all()


def test_majority_vote_and_vote_fractions():
    labels = np.array([[0, 1, 1], [2, 2, 0]])
    dists = np.array([[0.1, 0.2, 0.3], [0.1, 0.2, 0.3]])
    pred, proba = decide(labels, dists, 3, "majority")
    np.testing.assert_array_equal(pred, [1, 2])
    np.testing.assert_allclose(proba, [[1 / 3, 2 / 3, 0], [1 / 3, 0, 2 / 3]])


def test_majority_tie_goes_to_class_of_nearest_neighbour():
    # classes 2 and 0 tie with 2 votes each; the nearest neighbour is of class 2.
    labels = np.array([[2, 0, 0, 2, 1], [0, 2, 2, 0, 1]])
    dists = np.arange(5.0)[None].repeat(2, 0)
    pred, _ = decide(labels, dists, 3, "majority")
    np.testing.assert_array_equal(pred, [2, 0])


def test_k1_majority_is_nearest_label():
    labels = np.array([[4], [1]])
    pred, proba = decide(labels, np.zeros((2, 1)), 5)
    np.testing.assert_array_equal(pred, [4, 1])
    assert proba.sum(1).tolist() == [1.0, 1.0]


def test_soft_rule_is_softmax_of_negative_squared_distances():
    labels = np.array([[0, 1, 1]])
    dists = np.array([[1.0, 1.5, 2.0]])
    pred, proba = decide(labels, dists, 2, "soft")
    w = np.exp(-dists[0])
    np.testing.assert_allclose(proba[0], [w[0] / w.sum(), (w[1] + w[2]) / w.sum()])
    assert pred[0] == int(np.argmax(proba[0]))


def test_soft_rule_is_stable_for_large_distances():
    pred, proba = decide(np.array([[0, 1]]), np.array([[1e4, 1e4 + 1]]), 2, "soft")
    assert np.isfinite(proba).all() and pred[0] == 0


def test_decide_rejects_bad_arguments():
    with pytest.raises(ValueError, match="rule must be one of"):
        decide(np.zeros((1, 1), int), np.zeros((1, 1)), 2, "vote")
    with pytest.raises(ValueError, match=r"must both be \(n, k\)"):
        decide(np.zeros((1, 2), int), np.zeros((1, 3)), 2)


def test_project_does_not_depend_on_the_batch(rng):
    W = rng.normal(size=(32, 784)).astype(np.float32)
    b = rng.normal(size=32).astype(np.float32)
    X = rng.normal(size=(300, 784)).astype(np.float32)
    full = project(X, W, b)
    for i in range(0, 300, 37):
        np.testing.assert_array_equal(project(X[i : i + 1], W, b)[0], full[i])
        np.testing.assert_array_equal(project(X[i : i + 5], W, b), full[i : i + 5])


def test_rerank_orders_by_exact_distance_then_id_and_pads():
    refs = np.array([[0.0], [1.0], [1.0], [3.0]], np.float32)
    q = np.array([[0.9], [0.0]], np.float32)
    cand = np.array([[3, 2, 1, 0], [3, -1, -1, -1]])
    dist, idx = rerank(q, refs, cand, 3)
    np.testing.assert_array_equal(idx, [[1, 2, 0], [3, -1, -1]])
    np.testing.assert_allclose(dist[0], [0.01, 0.01, 0.81], rtol=1e-6)
    assert np.isinf(dist[1, 1:]).all()


def test_rerank_in_blocks_gives_each_row_its_own_answer(rng, monkeypatch):
    """Queries reranked a few rows per block (a short last block, padded rows in several
    blocks) get bit for bit the answer each row gets alone."""
    from service.core import knn

    refs = rng.normal(size=(40, 3)).astype(np.float32)
    q = rng.normal(size=(11, 3)).astype(np.float32)
    cand = rng.integers(0, 40, size=(11, 6))
    cand[[5, 6, 10], -2:] = -1  # padded rows in the second and third blocks, not the first
    monkeypatch.setattr(knn, "RERANK_BLOCK_VALUES", 4 * 6 * 3)  # 4 rows a block
    dist, idx = knn.rerank(q, refs, cand, 5)
    assert dist.shape == idx.shape == (11, 5)
    for i in range(11):
        d1, i1 = knn.rerank(q[i : i + 1], refs, cand[i : i + 1], 5)
        np.testing.assert_array_equal(i1[0], idx[i])
        np.testing.assert_array_equal(d1[0], dist[i])
    assert (idx[[5, 6, 10], 4] == -1).all() and np.isinf(dist[[5, 6, 10], 4]).all()
    # an infinite query has no neighbour, in a block with padded rows (4-7) or without
    # (rows 0-3): its row is (inf, -1) either way
    q[[2, 5]] = np.inf
    dist, idx = knn.rerank(q, refs, cand, 5)
    assert (idx[[2, 5]] == -1).all() and np.isinf(dist[[2, 5]]).all()
    # more neighbours asked for than candidates: min(k, m) columns
    assert knn.rerank(q, refs, cand, 9)[0].shape == (11, 6)


def test_exact_knn_is_batch_invariant(rng):
    q = rng.normal(size=(50, 8)).astype(np.float32)
    r = rng.normal(size=(500, 8)).astype(np.float32)
    dist, idx = exact_knn(q, r, 5)
    for i in (0, 17, 49):
        d1, i1 = exact_knn(q[i : i + 1], r, 5)
        np.testing.assert_array_equal(i1[0], idx[i])
        np.testing.assert_array_equal(d1[0], dist[i])
