"""Parquet input (training.data.parquet): both layouts read back exactly, string labels,
and every malformed file refused with a message naming what is wrong; the job trains from
one end to end."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from service.core.artifact import read_artifact
from training.cli import main
from training.data.datasets import DataError, load_dataset


def features(n=60, d=5, seed=0):
    rng = np.random.default_rng(seed)
    y = np.arange(n) % 3
    X = (rng.normal(size=(n, d)) + y[:, None]).astype(np.float32)
    return X, y


def write_wide(path, X, labels, label_name="label"):
    columns = {f"f{j}": X[:, j] for j in range(X.shape[1])}
    columns[label_name] = labels
    pq.write_table(pa.table(columns), path)


def test_wide_columns_read_back_exactly(tmp_path):
    X, y = features()
    write_wide(tmp_path / "d.parquet", X, y)
    data = load_dataset(str(tmp_path / "d.parquet"))
    assert data.X.dtype == np.float32 and np.array_equal(data.X, X)
    assert np.array_equal(data.y, y) and data.y.dtype == np.int64
    assert data.feature_names == [f"f{j}" for j in range(5)]


def test_a_float64_column_keeps_float64(tmp_path):
    X, y = features()
    columns = {"a": X[:, 0].astype(np.float64), "b": X[:, 1], "label": y}
    pq.write_table(pa.table(columns), tmp_path / "d.parquet")
    data = load_dataset(str(tmp_path / "d.parquet"))
    assert data.X.dtype == np.float64 and np.array_equal(data.X, X[:, :2].astype(np.float64))


@pytest.mark.parametrize("fixed", [False, True])
def test_one_list_column_of_embeddings(tmp_path, fixed):
    X, y = features(n=70, d=8)
    kind = pa.list_(pa.float32(), 8) if fixed else pa.list_(pa.float32())
    emb = pa.array(list(X), type=kind)
    # several row groups, so the list column comes back in several chunks
    pq.write_table(pa.table({"emb": emb, "cls": y}), tmp_path / "d.parquet", row_group_size=16)
    data = load_dataset(str(tmp_path / "d.parquet"), label_column="cls")
    assert np.array_equal(data.X, X) and np.array_equal(data.y, y)
    assert data.feature_names[:2] == ["emb[0]", "emb[1]"]


def test_string_and_dictionary_labels(tmp_path):
    X, y = features()
    names = np.array(["cat", "dog", "eel"])[y]
    write_wide(tmp_path / "s.parquet", X, names.tolist())
    assert load_dataset(str(tmp_path / "s.parquet")).y.tolist() == names.tolist()
    dictionary = pa.array(names.tolist()).dictionary_encode()
    write_wide(tmp_path / "d.parquet", X, dictionary)
    assert load_dataset(str(tmp_path / "d.parquet")).y.tolist() == names.tolist()


def malformed(tmp_path, case):
    X, y = features(n=6, d=3)
    path = tmp_path / "bad.parquet"
    if case == "not parquet":
        path.write_bytes(b"PAR1 this is not a parquet file")
    elif case == "null label":
        write_wide(path, X, pa.array([0, 1, None, 0, 1, 2]))
    elif case == "null feature":
        pq.write_table(pa.table({"a": pa.array([1.0, None, 2, 3, 4, 5]), "label": y}), path)
    elif case == "text feature":
        pq.write_table(pa.table({"a": ["x"] * 6, "label": y}), path)
    elif case == "float labels":
        write_wide(path, X, y.astype(np.float64) + 0.5)
    elif case == "ragged lists":
        rows = [list(r) for r in X]
        rows[4] = rows[4][:2]
        pq.write_table(pa.table({"emb": rows, "label": y}), path)
    elif case == "empty lists":
        empty = pa.array([[] for _ in range(6)], type=pa.list_(pa.float32()))
        pq.write_table(pa.table({"emb": empty, "label": y}), path)
    elif case == "null inside a list":
        rows = [list(map(float, r)) for r in X]
        rows[2][1] = None
        pq.write_table(pa.table({"emb": rows, "label": y}), path)
    elif case == "no such label column":
        write_wide(path, X, y)
    elif case == "label column only":
        pq.write_table(pa.table({"label": y}), path)
    return path


@pytest.mark.parametrize(
    "case, message",
    [
        ("not parquet", "not a readable Parquet file"),
        ("null label", "label column 'label' has 1 nulls"),
        ("null feature", "feature column 'a' has 1 nulls"),
        ("text feature", "feature column 'a' has type string; expected numbers"),
        ("float labels", "expected integers or strings"),
        ("ragged lists", "lists of different lengths .row 0 has 3, row 4 has 2"),
        ("empty lists", "holds empty lists"),
        ("null inside a list", "null values in its lists"),
        ("no such label column", "no label column 'species'"),
        ("label column only", "no feature columns"),
    ],
)
def test_malformed_files_are_refused_by_name(tmp_path, case, message):
    path = malformed(tmp_path, case)
    label = "species" if case == "no such label column" else None
    with pytest.raises(DataError, match=message):
        load_dataset(str(path), label_column=label)


def test_the_job_trains_from_parquet_with_string_labels(tmp_path, capsys):
    X, y = features(n=90, d=6)
    emb = pa.array(list(X), type=pa.list_(pa.float32(), 6))
    kinds = np.array(["red", "green", "blue"])[y].tolist()
    pq.write_table(pa.table({"embedding": emb, "colour": kinds}), tmp_path / "d.parquet")
    out = tmp_path / "m"
    args = ["--data", str(tmp_path / "d.parquet"), "--label-column", "colour"]
    code = main([*args, "--out", str(out), "--quiet", "--no-plots", "--max-iter", "5"])
    assert code == 0, capsys.readouterr().err
    art = read_artifact(out)
    assert art.classes == ["blue", "green", "red"] and art.n_features_in == 6


def test_a_bad_parquet_file_is_exit_2_naming_it(tmp_path, capsys):
    path = malformed(tmp_path, "ragged lists")
    code = main(["--data", str(path), "--out", str(tmp_path / "m"), "--quiet"])
    assert code == 2
    assert "different lengths" in capsys.readouterr().err
