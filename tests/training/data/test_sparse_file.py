"""Sparse feature files through the training job (issue 59, target 3): a ``scipy.sparse
.save_npz`` matrix with ``--labels`` is fitted as CSR and served, its rows fingerprinted in
their canonical form, its Euclidean baseline scored on the sparse rows; a corpus of malformed
sparse files, each refused in one line naming what is wrong, nothing written at ``--out``."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import numpy as np
import pytest
import scipy.sparse as sp
from fastapi.testclient import TestClient

from service.app import create_app
from service.config import Settings
from service.engine.infer import embed
from service.engine.model import load_model
from tests.training.conftest import refused_in_one_line
from training.config import TrainConfig
from training.data.datasets import load_dataset, make_split, row_digests
from training.data.sparse_file import row_digests as sparse_row_digests
from training.evaluation.evaluate import knn_accuracies, sparse_knn_accuracies
from training.model import sparse_input


def text_like(n: int = 240, n_features: int = 400, n_classes: int = 3, seed: int = 0):
    """Rows of unit length with 12 non-zeros: 4 from the class's own 40 columns, 8 anywhere."""
    rng = np.random.default_rng(seed)
    y = np.arange(n) % n_classes
    rows, cols, vals = [], [], []
    for i in range(n):
        own = rng.choice(40, 4, replace=False) + 40 * y[i]
        columns = np.unique(np.concatenate([own, rng.choice(n_features, 8, replace=False)]))
        values = rng.random(len(columns)) + 0.1
        rows += [i] * len(columns)
        cols += columns.tolist()
        vals += (values / np.linalg.norm(values)).tolist()
    return sp.csr_matrix((vals, (rows, cols)), shape=(n, n_features)), y


X_SPARSE, Y_SPARSE = text_like()


def sparse_pair(d: Path, X=X_SPARSE, y=Y_SPARSE) -> list[str]:
    sp.save_npz(d / "X.npz", X)
    np.save(d / "y.npy", y)
    return ["--data", d / "X.npz", "--labels", d / "y.npy"]


def raw_sparse(d: Path, y=Y_SPARSE, **arrays) -> list[str]:
    """A save_npz layout written member by member: the CSR of X_SPARSE with ``arrays``
    replacing its members."""
    members = {
        "format": np.array(b"csr"),
        "shape": np.array(X_SPARSE.shape),
        "data": X_SPARSE.data,
        "indices": X_SPARSE.indices,
        "indptr": X_SPARSE.indptr,
        **arrays,
    }
    np.savez(d / "X.npz", **{k: v for k, v in members.items() if v is not None})
    np.save(d / "y.npy", y)
    return ["--data", d / "X.npz", "--labels", d / "y.npy"]


def with_member_header(d: Path, key: str, header: str) -> list[str]:
    """The CSR of X_SPARSE with member ``key`` replaced by a hand-written .npy header
    (format 1.0, or 2.0 for a header over 65,535 bytes) over 64 zero bytes."""
    args = raw_sparse(d)
    version, width = ((1, 0), 2) if len(header) < 65_000 else ((2, 0), 4)
    text = header + " " * (-(8 + width + len(header) + 1) % 64) + "\n"
    member = b"\x93NUMPY" + bytes(version) + len(text).to_bytes(width, "little")
    member += text.encode("latin1")
    with zipfile.ZipFile(d / "X.npz") as archive:
        kept = {name: archive.read(name) for name in archive.namelist()}
    with zipfile.ZipFile(d / "X.npz", "w") as archive:
        for name, data in kept.items():
            archive.writestr(name, member + bytes(64) if name == f"{key}.npy" else data)
    return args


def truncated_member(d: Path, key: str) -> list[str]:
    """The CSR of X_SPARSE with member ``key`` cut short by 16 bytes (stored uncompressed)."""
    args = raw_sparse(d)
    with zipfile.ZipFile(d / "X.npz") as archive:
        kept = {name: archive.read(name) for name in archive.namelist()}
    with zipfile.ZipFile(d / "X.npz", "w") as archive:
        for name, data in kept.items():
            archive.writestr(name, data[:-16] if name == f"{key}.npy" else data)
    return args


def with_data_value(value: float, at: int = 7) -> np.ndarray:
    data = X_SPARSE.data.copy()
    data[at] = value
    return data


def row_of(at: int) -> int:
    """The row of X_SPARSE's ``at``-th stored value, counted by hand."""
    return next(i for i in range(X_SPARSE.shape[0]) if X_SPARSE.indptr[i + 1] > at)


SPARSE_CORPUS = [  # (name, lay out the files, words of the one-line refusal)
    (
        "a sparse matrix without --labels",
        lambda d: sparse_pair(d)[:2],
        "holds no labels: give them as --labels LABELS.npy",
    ),
    (
        "--labels beside an .npz of X and y",
        lambda d: (
            (np.savez(d / "X.npz", X=np.ones((6, 2)), y=np.arange(6) % 2), None)[1]
            or ["--data", d / "X.npz", "--labels", d / "X.npz"]
        ),
        "holds arrays ['X', 'y'] (its y are the labels)",
    ),
    (
        "a column index beyond the shape",
        lambda d: raw_sparse(
            d, indices=np.where(np.arange(X_SPARSE.nnz) == 5, 400, X_SPARSE.indices)
        ),
        "not a valid sparse csr matrix (an index is out of range [0, 400))",
    ),
    (
        "a negative column index",
        lambda d: raw_sparse(
            d, indices=np.where(np.arange(X_SPARSE.nnz) == 5, -1, X_SPARSE.indices)
        ),
        "not a valid sparse csr matrix (an index is out of range [0, 400))",
    ),
    (
        "indptr decreasing",
        lambda d: raw_sparse(d, indptr=np.r_[X_SPARSE.indptr[:3], 1, X_SPARSE.indptr[4:]]),
        "indptr must rise from 0 to the number of stored values",
    ),
    (
        "indptr of the wrong length",
        lambda d: raw_sparse(d, indptr=X_SPARSE.indptr[:-5]),
        "indptr has 236 entries, expected 241",
    ),
    (
        "data and indices of different lengths",
        lambda d: raw_sparse(d, data=X_SPARSE.data[:-3]),
        f"indices has {X_SPARSE.nnz} entries, data has {X_SPARSE.nnz - 3}: one each",
    ),
    (
        "a NaN value",
        lambda d: raw_sparse(d, data=with_data_value(np.nan)),
        f"row {row_of(7)}, column {X_SPARSE.indices[7]} holds NaN or Inf",
    ),
    (  # rows 0 to 4 hold 12 values each at most: the 100th value is in a later row
        "a NaN value in a later row",
        lambda d: raw_sparse(d, data=with_data_value(np.nan, at=100)),
        f"row {row_of(100)}, column {X_SPARSE.indices[100]} holds NaN or Inf",
    ),
    (
        "a value beyond float32",
        lambda d: raw_sparse(d, data=with_data_value(1e39)),
        "holds 1e+39, beyond float32's range",
    ),
    (
        "values as text",
        lambda d: raw_sparse(d, data=np.array(["a"] * X_SPARSE.nnz)),
        "must hold numbers",
    ),
    (
        "float indices",
        lambda d: raw_sparse(d, indices=X_SPARSE.indices.astype(float)),
        "indices must hold integers",
    ),
    (
        "a format scipy writes but we do not read",
        lambda d: raw_sparse(d, format=np.array(b"dia")),
        "format must be one of ['coo', 'csc', 'csr'], got 'dia'",
    ),
    (
        "a shape of three numbers",
        lambda d: raw_sparse(d, shape=np.array([240, 400, 1])),
        "shape must be two non-negative integers",
    ),
    (
        "a negative shape",
        lambda d: raw_sparse(d, shape=np.array([-240, 400])),
        "shape must be two non-negative integers",
    ),
    (
        "no features",
        lambda d: raw_sparse(d, shape=np.array([240, 0])),
        "the sparse matrix has 0 features",
    ),
    ("a csr file without indptr", lambda d: raw_sparse(d, indptr=None), "missing ['indptr']"),
    (  # was: scipy's CSR conversion allocating row pointers for 10^12 rows
        "a COO file claiming 10^12 rows",
        lambda d: raw_sparse(
            d,
            format=np.array(b"coo"),
            shape=np.array([10**12, 400]),
            row=np.arange(3),
            col=np.arange(3),
            data=np.ones(3),
            indices=None,
            indptr=None,
        ),
        "X has 1000000000000 rows but its labels have 240",
    ),
    (
        "labels of another length",
        lambda d: sparse_pair(d, y=Y_SPARSE[:-10]),
        "has 240 rows but its labels have 230",
    ),
    (  # the hostile pass's rows (were: tracebacks, a 201 MB line, or silently dropped values)
        "10^12 columns in a tiny file",
        lambda d: raw_sparse(d, shape=np.array([240, 10**12])),
        "at d = 32 the fit holds about 25 copies of the (32, 1000000000000) map",
    ),
    (
        "indptr ending at 0 with values stored",
        lambda d: raw_sparse(d, indptr=np.r_[0, 3, np.zeros(239, dtype=np.int64)]),
        "indptr must rise from 0 to the number of stored values",
    ),
    (
        "values past the last row pointer",
        lambda d: raw_sparse(d, indptr=np.r_[X_SPARSE.indptr[:-1], X_SPARSE.nnz - 3]),
        f"indptr must rise from 0 to the number of stored values ({X_SPARSE.nnz})",
    ),
    (
        "indptr not starting at 0",
        lambda d: raw_sparse(d, indptr=X_SPARSE.indptr + 1),
        "it runs from 1 to",
    ),
    (
        "a format of 2^20 bytes",
        lambda d: raw_sparse(d, format=np.zeros(2**20, np.uint8)),
        "format must be one of ['coo', 'csc', 'csr'], got an array of shape (1048576,)",
    ),
    (
        "format as a one-element array",
        lambda d: raw_sparse(d, format=np.array([b"csr"])),
        "got an array of shape (1,)",
    ),
    (
        "a shape of 2^20 numbers",
        lambda d: raw_sparse(d, shape=np.zeros(2**20, np.int64)),
        "shape must be two non-negative integers, got an array of shape (1048576,)",
    ),
    (
        "a header of 200,000 bytes",
        lambda d: with_member_header(
            d, "data", "{'descr': '<f8', 'fortran_order': False, 'shape': (3,), }" + " " * 200_000
        ),
        "over 100000",
    ),
    (
        "a truncated member",
        lambda d: truncated_member(d, "data"),
        "a member is damaged",
    ),
    (
        "a header claiming a negative length",
        lambda d: with_member_header(
            d, "indices", "{'descr': '<i8', 'fortran_order': False, 'shape': (-5,), }"
        ),
        "indices: not a readable .npy header (its shape (-5,) is not a tuple of non-negative",
    ),
    (
        "a header whose shape is text",
        lambda d: with_member_header(
            d, "data", "{'descr': '<f8', 'fortran_order': False, 'shape': ('a',), }"
        ),
        "data: not a readable .npy header",
    ),
    (
        "a header of an unknown dtype",
        lambda d: with_member_header(
            d, "data", "{'descr': 'zz9', 'fortran_order': False, 'shape': (3,), }"
        ),
        "its dtype 'zz9' is not one",
    ),
    (
        "data and indices claiming 10^11 values",
        lambda d: with_member_header(
            d, "data", "{'descr': '<f8', 'fortran_order': False, 'shape': (100000000000,), }"
        ),
        f"indices has {X_SPARSE.nnz} entries, data has 100000000000",
    ),
    (
        "long doubles",
        lambda d: raw_sparse(d, data=X_SPARSE.data.astype(np.longdouble)),
        "data must hold numbers of at most 8 bytes",
    ),
    (
        "a format and a shape alone, with --labels",
        lambda d: (
            (np.savez(d / "X.npz", format=np.array(b"csr"), shape=np.array([2, 2])), None)[1]
            or (np.save(d / "y.npy", Y_SPARSE), None)[1]
            or ["--data", d / "X.npz", "--labels", d / "y.npy"]
        ),
        "holds arrays ['format', 'shape'] (not a sparse matrix)",
    ),
    (
        "--standardize feature (refused before anything is said)",
        lambda d: [*sparse_pair(d), "--standardize", "feature"],
        "is a sparse matrix: standardize='feature' centres every feature",
    ),
    (
        "more stored values than the memory budget",
        lambda d: [*sparse_pair(d), "--memory-budget-gib", str(2**-18)],  # over the labels'
        "to read, over the memory budget of 0.00 GiB",
    ),
]


@pytest.mark.parametrize("name, lay_out, words", SPARSE_CORPUS, ids=[c[0] for c in SPARSE_CORPUS])
def test_the_job_refuses_a_malformed_sparse_file_in_one_line(
    python_m_training, tmp_path, name, lay_out, words
):
    line = refused_in_one_line(python_m_training, tmp_path, lay_out)
    assert words in line, (name, line)


def test_the_references_commands_refuse_a_sparse_file_in_one_line(
    python_m_training, digits_like_model, tmp_path
):
    args = sparse_pair(tmp_path)
    out = tmp_path / "v2"
    code, _, stderr = python_m_training(
        "references", "add", "--model", digits_like_model, *args, "--out", out
    )
    assert code == 2 and "Traceback" not in stderr, stderr
    assert "is a sparse matrix (scipy.sparse.save_npz): the training job" in stderr
    assert not out.exists()


def test_a_sparse_file_is_fitted_and_served_as_its_dense_rows_would_be(python_m_training, tmp_path):
    """The job on a sparse file writes an artifact whose map the service applies to the dense
    copies of the rows with the numbers the sparse projection gives; its references are the
    training rows projected; the Euclidean baseline is scored on the sparse rows."""
    out = tmp_path / "model"
    code, _, stderr = python_m_training(
        *sparse_pair(tmp_path), "--out", out, "--n-components", "4", "--quiet", "--max-iter", "20"
    )
    assert code == 0, stderr
    model = load_model(out, Settings(model_path=str(out)))
    assert model.n_features == X_SPARSE.shape[1]
    config = TrainConfig()
    split = make_split(
        load_dataset(str(tmp_path / "X.npz"), labels=str(tmp_path / "y.npy"), sparse=True),
        test_size=config.test_size,
        val_size=config.val_size,
        seed=config.seed,
    )
    assert sp.issparse(split.X_train)
    served = embed(model, split.X_test.toarray().astype(np.float32))  # (n_test, d)
    offline = sparse_input.project(split.X_test, model.projection, model.offset)
    np.testing.assert_allclose(served, offline, rtol=1e-5, atol=1e-6)
    references = sparse_input.project(split.X_train, model.projection, model.offset)
    np.testing.assert_allclose(model.embeddings, references, rtol=1e-5, atol=1e-6)
    rows = [  # the test rows by their non-zeros, as a client of a sparse model sends them
        {"indices": split.X_test[i].indices.tolist(), "values": split.X_test[i].data.tolist()}
        for i in range(split.X_test.shape[0])
    ]
    with TestClient(create_app(Settings(model_path=str(out), grpc_port=0))) as client:
        answer = client.post("/v1/embed", json={"sparse_instances": rows})
    assert answer.status_code == 200, answer.text
    np.testing.assert_allclose(answer.json()["embeddings"], offline, rtol=1e-6, atol=1e-6)
    report = json.loads((out / "report.json").read_text())
    baselines = report["metrics"]["baselines"]
    assert "densify" in baselines["skipped"]
    assert baselines["euclidean"]["test_rows"] == split.X_test.shape[0]
    assert report["data"]["n_features"] == X_SPARSE.shape[1]


def test_a_sparse_rows_digest_is_of_its_canonical_form():
    """Unsorted indices, duplicates (summed) and stored zeros give the canonical row's
    digest; another value gives another."""
    canonical = sp.csr_matrix(([1.0, 2.0], [1, 4], [0, 2]), shape=(1, 6))
    messy = sp.csr_matrix(([2.0, 0.0, 0.25, 0.75], [4, 2, 1, 1], [0, 4]), shape=(1, 6))
    other = sp.csr_matrix(([1.0, 2.5], [1, 4], [0, 2]), shape=(1, 6))
    assert np.array_equal(sparse_row_digests(messy), sparse_row_digests(canonical))
    assert not np.array_equal(sparse_row_digests(other), sparse_row_digests(canonical))
    assert np.array_equal(row_digests(canonical), sparse_row_digests(canonical))
    assert not np.array_equal(sparse_row_digests(messy), row_digests(messy.toarray()))


@pytest.mark.parametrize("rule", ["majority", "soft"])
def test_the_sparse_euclidean_baseline_equals_knn_on_the_dense_rows(rule):
    X, y = text_like(n=300, seed=1)
    dense = X.toarray()
    refs, queries = slice(0, 200), slice(200, 300)
    expected = knn_accuracies(dense[refs], y[refs], dense[queries], y[queries], 3, rule=rule)
    got = sparse_knn_accuracies(X[refs], y[refs], X[queries], y[queries], 3, rule=rule)
    assert got == expected
    assert got[1] > 0.5  # the class's own columns make neighbours


def test_a_sparse_file_is_refused_by_a_data_parallel_split(tmp_path):
    from training.distributed.ranks import ProcessGroup
    from training.job import split_data

    sparse_pair(tmp_path)
    data = load_dataset(str(tmp_path / "X.npz"), labels=str(tmp_path / "y.npy"), sparse=True)
    config = TrainConfig(data=str(tmp_path / "X.npz"))
    with pytest.raises(ValueError, match="a data-parallel run \\(torchrun\\) takes dense rows"):
        split_data(data, config, ProcessGroup(0, 2, "gloo"))


def test_an_npz_of_x_and_y_is_read_densely_whatever_else_it_holds(tmp_path):
    """X and y make an .npz the dense layout, as before sparse files were read (the hostile
    pass's file held both: it was read as sparse and asked for --labels)."""
    np.savez(
        tmp_path / "both.npz",
        X=np.ones((6, 2)),
        y=np.arange(6) % 2,
        format=np.array(b"csr"),
        shape=np.array([6, 2]),
        data=np.ones(3),
    )
    data = load_dataset(str(tmp_path / "both.npz"), sparse=True)
    assert not sp.issparse(data.X) and data.X.shape == (6, 2)
