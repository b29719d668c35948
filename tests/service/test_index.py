"""FAISS indexes against brute force, recall of the approximate ones, batch invariance."""

from __future__ import annotations

import numpy as np
import pytest

from service.artifact import read_artifact
from service.index import IndexParams, build_index, search
from service.knn import exact_knn, project


def brute_force(queries, references, k):
    d2 = ((queries[:, None, :].astype(np.float64) - references[None].astype(np.float64)) ** 2).sum(
        -1
    )
    return d2


def test_flat_equals_brute_force_numpy(rng):
    refs = rng.normal(size=(2000, 16)).astype(np.float32)
    queries = rng.normal(size=(300, 16)).astype(np.float32)
    index = build_index(refs, IndexParams(kind="flat"))
    dist, idx = search(index, refs, queries, 10)
    d2 = brute_force(queries, refs, 10)
    expected = np.argsort(d2, axis=1, kind="stable")[:, :10]
    # tie-tolerant: the k-th distance must match; the sets must match where no tie straddles k
    np.testing.assert_allclose(dist, np.take_along_axis(d2, expected, 1), rtol=1e-6)
    np.testing.assert_array_equal(idx, expected)


def test_flat_breaks_exact_ties_by_id():
    refs = np.array([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0], [0.0, -1.0], [5.0, 5.0]], np.float32)
    index = build_index(refs, IndexParams(kind="flat"))
    dist, idx = search(index, refs, np.zeros((1, 2), np.float32), 4)
    np.testing.assert_array_equal(idx, [[0, 1, 2, 3]])
    np.testing.assert_array_equal(dist, [[1, 1, 1, 1]])


def test_search_is_batch_invariant(rng):
    refs = rng.normal(size=(5000, 32)).astype(np.float32)
    queries = rng.normal(size=(200, 32)).astype(np.float32)
    for kind in ("flat", "hnsw"):
        index = build_index(refs, IndexParams(kind=kind))
        dist, idx = search(index, refs, queries, 5)
        for i in (0, 50, 199):
            d1, i1 = search(index, refs, queries[i : i + 1], 5)
            np.testing.assert_array_equal(i1[0], idx[i])
            np.testing.assert_array_equal(d1[0], dist[i])


def recall_at(k, approx_idx, exact_idx):
    hits = [len(set(a) & set(e)) for a, e in zip(approx_idx, exact_idx, strict=True)]
    return sum(hits) / (k * len(exact_idx))


@pytest.mark.parametrize(
    "params, floor",
    [
        (IndexParams(kind="ivf", nprobe=8), 0.95),
        (IndexParams(kind="hnsw", ef_search=64), 0.97),
        (IndexParams(kind="ivfpq", nprobe=8, pq_m=8), 0.5),
    ],
)
def test_approximate_index_recall_on_real_projected_data(digits_artifact, params, floor):
    path, _, split = digits_artifact
    art = read_artifact(path)
    refs = np.ascontiguousarray(art.embeddings)
    queries = project(split.X_test, art.projection, art.offset)
    _, exact = exact_knn(queries, refs, 5)
    index = build_index(refs, params)
    _, approx = search(index, refs, queries, 5)
    assert recall_at(5, approx, exact) >= floor


def test_ivfpq_rejects_pq_m_not_dividing_d(rng):
    with pytest.raises(ValueError, match="pq_m=5 must divide the embedding dimension d=16"):
        build_index(
            rng.normal(size=(500, 16)).astype(np.float32), IndexParams(kind="ivfpq", pq_m=5)
        )
