"""Rows by their non-zeros (``sparse_instances``) on /v1/classify, /v1/embed and
/v1/neighbors: the same answers as the dense rows, whatever the order of a row's indices and
whatever the rows are batched with. The refusals are in test_bad_input_corpus.py."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from service.core import sparse
from service.core.knn import project
from service.core.sparse import SparseRows, project_sparse
from service.engine.infer import Query, infer, project_rows
from service.http.decode import SparseInstance
from service.wire.rows import to_sparse_rows
from tests.service.conftest import module_client

client = module_client()


def sparse_form(X: np.ndarray, shuffle_seed: int | None = None) -> list[dict]:
    """Each row of X (n, D) as {"indices", "values"} of its non-zeros (shuffled order when
    a seed is given)."""
    rng = np.random.default_rng(shuffle_seed)
    rows = []
    for row in X:
        nz = np.flatnonzero(row)
        if shuffle_seed is not None:
            nz = rng.permutation(nz)
        rows.append({"indices": nz.tolist(), "values": row[nz].tolist()})
    return rows


def thinned(X: np.ndarray, keep: float = 0.2, seed: int = 0) -> np.ndarray:
    """X with about 1 - keep of its values set to 0, the first row all zeros."""
    rng = np.random.default_rng(seed)
    out = np.where(rng.random(X.shape) < keep, X, 0.0).astype(np.float32)
    out[0] = 0.0
    return out


def csr_of(X: np.ndarray) -> SparseRows:
    nz = [np.flatnonzero(row) for row in X]
    indptr = np.concatenate([[0], np.cumsum([len(c) for c in nz])]).astype(np.int64)
    indices = np.concatenate(nz).astype(np.int64)
    values = np.concatenate([row[c] for row, c in zip(X, nz, strict=True)]).astype(np.float32)
    return SparseRows(indptr, indices, values, X.shape[1])


def test_the_sparse_projection_is_the_dense_one_to_float32_rounding():
    rng = np.random.default_rng(3)
    W = rng.normal(size=(7, 300)).astype(np.float32)
    b = rng.normal(size=7).astype(np.float32)
    X = thinned(rng.normal(size=(50, 300)) * 10, keep=0.05)
    X[7] = 0.0  # empty rows in the middle and at the start
    rows = csr_of(X)
    assert np.array_equal(rows.toarray(), X)
    z = project_sparse(rows, W, b)
    expected = project(X, W, b)
    assert z.dtype == np.float32 and z.shape == (50, 7)
    np.testing.assert_allclose(z, expected, rtol=2e-7, atol=1e-6)
    assert np.array_equal(z[0], b) and np.array_equal(z[7], b)  # no non-zero: z = b
    # a row's embedding does not depend on its batch
    assert np.array_equal(project_sparse(csr_of(X[20:21]), W, b), z[20:21])


@pytest.mark.parametrize("chunk", [1, 7, 40, 500])
def test_the_sparse_projection_in_blocks_is_the_same_bit_for_bit(monkeypatch, chunk):
    """Blocks of about ``chunk`` non-zeros (a row never split, rows longer than a block
    alone in theirs) give the embedding of one block: a row's sum is its own."""
    rng = np.random.default_rng(4)
    W = rng.normal(size=(5, 90)).astype(np.float32)
    b = rng.normal(size=5).astype(np.float32)
    X = thinned(rng.normal(size=(60, 90)), keep=0.15)
    X[30:33] = 0.0
    X[40] = rng.normal(size=90)  # one row longer than most blocks
    whole = project_sparse(csr_of(X), W, b)
    monkeypatch.setattr(sparse, "CHUNK_NONZEROS", chunk)
    blocks = []
    block = sparse._project_block
    rows = csr_of(X)

    def spy(rows, start, stop, projection, z):
        blocks.append((start, stop))
        block(rows, start, stop, projection, z)

    monkeypatch.setattr(sparse, "_project_block", spy)
    assert np.array_equal(project_sparse(rows, W, b), whole)
    assert blocks[0][0] == 0 and blocks[-1][1] == len(X)  # every row, in order, once
    assert all(a[1] == b_[0] for a, b_ in itertools.pairwise(blocks))
    for start, stop in blocks:  # within the bound, or a single row longer than it
        held = rows.indptr[stop] - rows.indptr[start]
        assert held <= chunk or stop == start + 1
    np.testing.assert_allclose(whole, project(X, W, b), rtol=2e-7, atol=1e-6)


def test_sparse_rows_get_the_dense_rows_answers(client, model_artifact):
    split = model_artifact[2]
    X = thinned(split.X_test[:40])
    body = {"return_neighbors": True, "k": 7}
    dense = client.post("/v1/classify", json={"instances": X.tolist(), **body})
    sparse = client.post("/v1/classify", json={"sparse_instances": sparse_form(X, 1), **body})
    assert dense.status_code == sparse.status_code == 200, sparse.text
    assert sparse.json() == dense.json()
    dense_n = client.post("/v1/neighbors", json={"instances": X.tolist()})
    sparse_n = client.post("/v1/neighbors", json={"sparse_instances": sparse_form(X)})
    assert sparse_n.json() == dense_n.json()
    z_dense = np.array(
        client.post("/v1/embed", json={"instances": X.tolist()}).json()["embeddings"]
    )
    z_sparse = np.array(
        client.post("/v1/embed", json={"sparse_instances": sparse_form(X, 2)}).json()["embeddings"]
    )
    np.testing.assert_allclose(z_sparse, z_dense, rtol=2e-7, atol=1e-6)


def test_the_npy_answer_of_sparse_rows_is_the_dense_rows(client, model_artifact):
    X = thinned(model_artifact[2].X_test[:5])
    npy = {"accept": "application/x-npy"}
    dense = client.post("/v1/classify", json={"instances": X.tolist()}, headers=npy)
    sparse = client.post("/v1/classify", json={"sparse_instances": sparse_form(X)}, headers=npy)
    assert sparse.status_code == 200 and sparse.content == dense.content


@pytest.mark.parametrize("rule", ["majority", "soft"])
def test_sparse_and_dense_parts_batched_together_get_their_own_answers(client, rule):
    """The batcher merges requests of both forms into one infer call: each part's answer
    equals the one it gets alone."""
    model = client.app.state.ncaknn.engine.current()
    rng = np.random.default_rng(5)
    X = thinned(rng.uniform(0, 16, size=(30, model.n_features)))
    query = Query(5, rule)
    parts = [(X[:10], query), (csr_of(X[10:20]), query), (X[20:], query)]
    merged = infer(model, parts)
    for (rows, q), answer in zip(parts, merged, strict=True):
        (alone,) = infer(model, [(rows, q)])
        np.testing.assert_array_equal(answer.indices, alone.indices)
        np.testing.assert_array_equal(answer.distances, alone.distances)
        np.testing.assert_array_equal(answer.predicted, alone.predicted)
    (as_dense,) = infer(model, [(X[10:20], query)])
    np.testing.assert_array_equal(merged[1].indices, as_dense.indices)


# A row whose float64 sum cancels (found by a hostile pass against the session's model):
# BLAS embeds it alone one float32 step from where it embeds it beside another row.
CANCELLING_ROW = [
    8.288018226623535,
    1529885.375,
    3.400812864303589,
    7.802827835083008,
    -5.710346698760986,
    -3208585.5,
    9.31806468963623,
    7.536799907684326,
    722951.875,
    5.554887771606445,
    -8.63155746459961,
    20.417892456054688,
    6.360015392303467,
    -7.76732873916626,
    13.633283615112305,
    -9.113144874572754,
    -2057456.75,
    -4.949761867523193,
    -3618970.75,
    -6.754124164581299,
    -4.742569923400879,
    -1149000.125,
    1.9359904527664185,
    -5916151.5,
    8.476877212524414,
    1.9879333972930908,
    1914508.0,
    11.198548316955566,
    7.615123748779297,
    -6.387674331665039,
    -12.645193099975586,
    1.4609036445617676,
    7.266770362854004,
    9.217916488647461,
    -2268672.75,
    -6.946831703186035,
    -937227.6875,
    -830184.6875,
    8.80366325378418,
    10.04974365234375,
    13.251859664916992,
    11.147391319274902,
    3.7427215576171875,
    11.188701629638672,
    9.114797592163086,
    17.29402732849121,
    3.5275824069976807,
    10.755744934082031,
    -5.536532878875732,
    -2433583.5,
    -1933596.125,
    25.05907440185547,
    13.712793350219727,
    9.069766998291016,
    7.008359432220459,
    5.334096431732178,
    3891596.25,
    3688295.75,
    6.508040428161621,
    -3.7589216232299805,
    -59495.1328125,
    -1695699.75,
    8.573005676269531,
    25.45052146911621,
]


def test_a_dense_part_embeds_as_in_its_dense_batch_whatever_sparse_parts_are_merged(client):
    """The dense parts of a merged batch are projected together whether sparse parts sit
    beside them or not (was: each part alone once a sparse part was there, so a dense
    request's answer depended on a sparse request it was merged with)."""
    model = client.app.state.ncaknn.engine.current()
    row = np.array([CANCELLING_ROW], dtype=np.float32)  # (1, 64)
    other = np.full((1, model.n_features), 8.0, dtype=np.float32)
    sparse_part = csr_of(thinned(np.full((3, model.n_features), 2.0), keep=0.3))
    dense_only = project_rows(model, [row, other])
    mixed = project_rows(model, [row, sparse_part, other])
    assert np.array_equal(mixed[0], dense_only[0])
    assert np.array_equal(mixed[4], dense_only[1])
    assert np.array_equal(mixed[1:4], project_sparse(sparse_part, model.projection, model.offset))


def test_sparse_rows_count_by_their_non_zeros_for_the_event_loop():
    """A projection runs on the event loop only when its work is small: sparse rows count by
    their non-zeros (a few full rows of D = 50,000 took over a second)."""
    few = SparseRows(np.array([0, 2, 3]), np.array([1, 7, 4]), np.ones(3, np.float32), 50_000)
    assert sparse.dense_rows_equivalent(few) == 2
    full = SparseRows(np.array([0, 50_000]), np.arange(50_000), np.ones(50_000, np.float32), 50_000)
    assert sparse.dense_rows_equivalent(full) == sparse.SPARSE_NONZERO_COST
    assert sparse.dense_rows_equivalent(np.zeros((5, 10), np.float32)) == 5


def test_sparse_rows_near_the_row_limit_are_not_refused_by_the_value_guard(client):
    """2,100 full sparse rows are 2 x 64 numbers a row, under the row limit (was: 413, "more
    values than 4096 instances of 64", for a body the dense form of which was accepted)."""
    full = {"indices": list(range(64)), "values": [0.5] * 64}
    answer = client.post("/v1/embed", json={"sparse_instances": [full] * 2100})
    assert answer.status_code == 200, answer.text[:200]


def test_a_rows_embedding_does_not_depend_on_the_order_of_its_indices():
    """The wire sorts each row's non-zeros by column, so the sum runs in one order whatever
    the client sent (was: [1e20, 1, -1e20] against a map of ones embedded to 0 in one order
    and to 1 in another)."""
    W = np.ones((1, 3), dtype=np.float32)
    b = np.zeros(1, dtype=np.float32)
    values = {0: 1e20, 1: 1.0, 2: -1e20}
    embeddings = set()
    for order in ([0, 1, 2], [1, 0, 2], [2, 1, 0], [0, 2, 1]):
        row = SparseInstance(indices=order, values=[values[j] for j in order])
        rows = to_sparse_rows([row], n_features=3, max_rows=4, abs_max=1e30)
        assert rows.indices.tolist() == [0, 1, 2]
        embeddings.add(float(project_sparse(rows, W, b)[0, 0]))
    assert len(embeddings) == 1
