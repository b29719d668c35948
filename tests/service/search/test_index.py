"""FAISS indexes against brute force, recall of the approximate ones, batch invariance."""

from __future__ import annotations

import numpy as np
import pytest

from service.core.artifact import read_artifact
from service.core.knn import exact_knn, exact_knn_centered, project
from service.search.index import (
    IndexParams,
    build_index,
    reference_norm_limit,
    search_references,
    search_with_recheck,
    vote_margin,
)


def search(index, refs, queries, k, **kw):
    result = search_references(index, refs, queries, k, **kw)
    return result.distances, result.indices


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
def test_approximate_index_recall_on_real_projected_data(model_artifact, params, floor):
    path, _, split = model_artifact
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


def brute_force_exact(queries, refs, k):
    """float64 per-pair distances, ties by index: the ground truth."""
    d2 = brute_force(queries, refs, k)
    order = np.lexsort((np.broadcast_to(np.arange(len(refs)), d2.shape), d2), axis=1)[:, :k]
    return np.take_along_axis(d2, order, 1), order


def test_ivf_probing_too_few_lists_is_filled_from_exact_search(rng):
    """An IVF with nprobe=1 over many small lists returns -1 for missing neighbours; the
    search must still give k real neighbours (the exact ones) and say so."""
    refs = rng.normal(size=(400, 8)).astype(np.float32)
    queries = rng.normal(size=(50, 8)).astype(np.float32)
    index = build_index(refs, IndexParams(kind="ivf", ivf_nlist=100, nprobe=1))
    k = 30
    _, raw = index.search(queries, k + 8)
    assert (raw < 0).any(), "the setting must make FAISS pad with -1 for this test to mean much"
    result = search_references(index, refs, queries, k)
    assert (result.indices >= 0).all() and result.underfilled_rows > 0
    underfilled = (raw[:, :k] < 0).any(axis=1)
    _, exact = brute_force_exact(queries[underfilled], refs, k)
    np.testing.assert_array_equal(result.indices[underfilled], exact)


@pytest.mark.parametrize("scale", [1e3, 1e10, 1e25, 3e38])
def test_far_queries_are_searched_exactly_in_float64(rng, scale):
    """Queries far beyond the data (where float32 FAISS distances lose every digit or
    overflow, and float64 ||q - r||^2 ties for every reference) get the exact neighbours,
    ranked by ||r||^2 - 2 q.r computed per pair (the well-conditioned form of the same
    order), and finite float64 distances."""
    refs = rng.normal(size=(3000, 16)).astype(np.float32)
    direction = rng.normal(size=(20, 16))
    direction /= np.linalg.norm(direction, axis=1, keepdims=True)
    queries = (direction * scale).astype(np.float32)
    index = build_index(refs, IndexParams(kind="flat"))
    result = search_references(index, refs, queries, 5, norm_limit=reference_norm_limit(refs))
    assert result.far_rows == 20
    q64, r64 = queries.astype(np.float64), refs.astype(np.float64)
    centre = r64.mean(axis=0)
    rc, qc = r64 - centre, q64 - centre
    s = (rc * rc).sum(1)[None, :] - 2 * np.einsum("nd,md->nm", qc, rc)
    expected_i = np.lexsort((np.broadcast_to(np.arange(len(refs)), s.shape), s), axis=1)[:, :5]
    np.testing.assert_array_equal(result.indices, expected_i)
    expected_d = brute_force(queries, refs, 5)
    assert np.isfinite(result.distances).all()
    np.testing.assert_allclose(
        result.distances, np.take_along_axis(expected_d, expected_i, 1), rtol=1e-12
    )


def test_exact_knn_centered_equals_brute_force_in_distribution(rng):
    refs = rng.normal(size=(1500, 8)).astype(np.float32) + 100.0  # data far from the origin
    queries = rng.normal(size=(40, 8)).astype(np.float32) + 100.0
    dist, idx = exact_knn_centered(queries, refs, 7, max_block=5000)  # several blocks
    expected_d, expected_i = brute_force_exact(queries, refs, 7)
    np.testing.assert_array_equal(idx, expected_i)
    np.testing.assert_allclose(dist, expected_d, rtol=1e-12)


def test_near_queries_do_not_take_the_fallback(rng):
    refs = rng.normal(size=(1000, 8)).astype(np.float32)
    index = build_index(refs, IndexParams(kind="flat"))
    result = search_references(index, refs, refs[:100], 3, norm_limit=reference_norm_limit(refs))
    assert result.far_rows == 0 and result.underfilled_rows == 0


@pytest.mark.parametrize(
    ("affinity", "cpu_max", "expected"),
    [
        ({0, 1, 2, 3}, "max 100000\n", 4),
        ({0, 1, 2, 3}, "150000 100000\n", 2),  # a 1.5-CPU limit: 2 cores to schedule on
        ({0, 1, 2, 3}, "50000 100000\n", 1),
        ({3}, "400000 100000\n", 1),  # taskset wins over a larger quota
        ({0, 1}, None, 2),  # no cgroup v2 file
    ],
)
def test_available_cores_follows_affinity_and_cgroup_quota(
    monkeypatch, tmp_path, affinity, cpu_max, expected
):
    import service.search.index as index_module

    path = tmp_path / "cpu.max"
    if cpu_max is not None:
        path.write_text(cpu_max)
    monkeypatch.setattr(index_module.os, "sched_getaffinity", lambda pid: affinity)
    monkeypatch.setattr(index_module, "CGROUP_CPU_MAX", str(path))
    assert index_module.available_cores() == expected


@pytest.mark.parametrize(
    ("neighbour_labels", "n_classes", "expected"),
    [
        ([[0, 0, 0, 0, 0]], 3, [5]),  # unanimous
        ([[2, 2, 2, 1, 1]], 3, [1]),
        ([[0, 1, 2, 3, 4]], 5, [0]),  # all different
        ([[0, 0, 1, 1, 2]], 3, [0]),  # tie for first
        ([[1, 1, 1, 1, 0], [2, 0, 2, 0, 2]], 3, [3, 1]),
        ([[0, 0, 0]], 1, [3]),  # one class
    ],
)
def test_vote_margin_is_top_count_minus_runner_up(neighbour_labels, n_classes, expected):
    labels = np.asarray(neighbour_labels, dtype=np.int64)
    np.testing.assert_array_equal(vote_margin(labels, n_classes), expected)


def recheck_setup(rng):
    """An IVF probing 1 of 64 lists over two overlapping classes: many split votes."""
    refs = rng.normal(size=(3000, 8)).astype(np.float32)
    labels = (refs[:, 0] + 0.7 * rng.normal(size=3000) > 0).astype(np.int64)
    queries = rng.normal(size=(300, 8)).astype(np.float32)
    index = build_index(refs, IndexParams(kind="ivf", ivf_nlist=64, nprobe=1))
    return refs, labels, queries, index


def test_recheck_searches_exactly_the_close_votes_again_wider(rng):
    refs, labels, queries, index = recheck_setup(rng)
    k, margin = 5, 3
    plan = IndexParams(kind="ivf", nprobe=1, recheck_margin=margin, recheck_nprobe=64)
    first = search_references(index, refs, queries, k)
    close = vote_margin(labels[first.indices], 2) < margin
    assert 0 < close.sum() < len(queries), "the toy must have both kinds of rows"
    result = search_with_recheck(index, refs, labels, 2, queries, k, plan)
    assert result.rechecked_rows == int((close & ~first.exact).sum())
    # decided rows keep the cheap answer; close ones get exhaustive probing = exact search
    np.testing.assert_array_equal(result.indices[~close], first.indices[~close])
    _, exact = brute_force_exact(queries[close], refs, k)
    np.testing.assert_array_equal(result.indices[close], exact)
    assert index.nprobe == 1  # the second stage never changes the shared index
    # rechecking every row (margin above k) is exact search
    everything = IndexParams(kind="ivf", nprobe=1, recheck_margin=k + 1, recheck_nprobe=64)
    full = search_with_recheck(index, refs, labels, 2, queries, k, everything)
    np.testing.assert_array_equal(full.indices, brute_force_exact(queries, refs, k)[1])


@pytest.mark.parametrize("kind", ["ivf", "hnsw"])
def test_a_rows_two_stage_answer_does_not_depend_on_its_batch(rng, kind):
    refs, labels, queries, _ = recheck_setup(rng)
    plan = IndexParams(
        kind=kind,
        ivf_nlist=64,
        nprobe=1,
        ef_search=8,
        recheck_margin=5,
        recheck_nprobe=8,
        recheck_ef_search=64,
    )
    index = build_index(refs, plan)
    together = search_with_recheck(index, refs, labels, 2, queries, 5, plan)
    assert together.rechecked_rows > 0
    for row in range(0, len(queries), 37):
        alone = search_with_recheck(index, refs, labels, 2, queries[row : row + 1], 5, plan)
        np.testing.assert_array_equal(alone.indices[0], together.indices[row])
        np.testing.assert_array_equal(alone.distances[0], together.distances[row])


def test_a_plan_without_a_second_stage_is_one_search(rng):
    refs, labels, queries, index = recheck_setup(rng)
    for plan in (
        IndexParams(kind="ivf", nprobe=1),  # no margin
        IndexParams(kind="ivf", nprobe=1, recheck_margin=3),  # no wider setting
        IndexParams(kind="flat", recheck_margin=3, recheck_nprobe=8),  # not an IVF
    ):
        assert plan.recheck_parameters() is None
        result = search_with_recheck(index, refs, labels, 2, queries, 5, plan)
        assert result.rechecked_rows == 0
        np.testing.assert_array_equal(
            result.indices, search_references(index, refs, queries, 5).indices
        )
