"""Reading a labelled data set from a Parquet file with pyarrow.

Two layouts, as users hold them:

* wide: one numeric column per feature, beside the label column;
* embedding: one list column (``list<float>`` or ``fixed_size_list<float, D>``) whose lists
  all have the same length D, beside the label column.

The features are written straight into one (n, D) float32 array (float64 when a column is
float64), column by column or from the list column's flat values, so that the set is held
once beside pyarrow's column buffers, not copied row by row. Labels may be integers or
strings; null features or labels are refused.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq


class ParquetError(ValueError):
    """The file cannot be read as a labelled data set; the message says why."""


def read_parquet(path: Path, label_column: str | None) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """(X (n, D), y (n,), feature names) from ``path``. The label column is ``label_column``,
    else 'label' when present, else the last column."""
    try:
        table = pq.read_table(path)
    except (OSError, pa.ArrowException) as exc:
        raise ParquetError(f"{path}: not a readable Parquet file ({one_line(exc)})") from exc
    names = table.column_names
    if label_column is None:
        label_column = "label" if "label" in names else names[-1]
    if label_column not in names:
        raise ParquetError(f"{path}: no label column {label_column!r}; columns are {names}")
    features = [name for name in names if name != label_column]
    if not features:
        raise ParquetError(f"{path}: no feature columns beside the label column {label_column!r}")
    y = _labels(path, table.column(label_column), label_column)
    columns = [table.column(name) for name in features]
    if len(columns) == 1 and _is_list(columns[0].type):
        X = _from_list_column(path, columns[0], features[0])
        return X, y, [f"{features[0]}[{j}]" for j in range(X.shape[1])]
    return _from_wide_columns(path, columns, features), y, features


def read_parquet_labels(path: Path, label_column: str | None) -> tuple[np.ndarray, int, int]:
    """(y (n,), n rows, the number of feature values) from the file's label column and its
    metadata alone: no feature value is read."""
    try:
        parquet = pq.ParquetFile(path)
        names = parquet.schema_arrow.names
        if label_column is None:
            label_column = "label" if "label" in names else names[-1]
        if label_column not in names:
            raise ParquetError(f"{path}: no label column {label_column!r}; columns are {names}")
        y = _labels(path, parquet.read(columns=[label_column]).column(0), label_column)
        meta = parquet.metadata
        # the label column's leaf columns: its fields' leaves come in schema order
        fields = list(parquet.schema_arrow)
        index = names.index(label_column)
        first = sum(_leaves(f.type) for f in fields[:index])
        labels = range(first, first + _leaves(fields[index].type))
        n_values = sum(
            meta.row_group(g).column(c).num_values
            for g in range(meta.num_row_groups)
            for c in range(meta.num_columns)
            if c not in labels
        )
    except (OSError, pa.ArrowException) as exc:
        raise ParquetError(f"{path}: not a readable Parquet file ({one_line(exc)})") from exc
    return y, meta.num_rows, n_values


def _leaves(kind: pa.DataType) -> int:
    """How many leaf (Parquet) columns a field of this Arrow type is stored as."""
    if pa.types.is_struct(kind):
        return sum(_leaves(kind.field(i).type) for i in range(kind.num_fields))
    if pa.types.is_map(kind):
        return _leaves(kind.key_type) + _leaves(kind.item_type)
    if _is_list(kind):
        return _leaves(kind.value_type)
    return 1


def one_line(error: Exception) -> str:
    """pyarrow's message on one line of printable text (a corrupt footer's message holds raw
    bytes and newlines)."""
    text = " ".join(str(error).split())
    return "".join(ch if ch.isprintable() else f"\\x{ord(ch):02x}" for ch in text)


def _is_list(kind: pa.DataType) -> bool:
    return (
        pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind)
    )


def _labels(path: Path, column: pa.ChunkedArray, name: str) -> np.ndarray:
    """(n,) int64 or str labels."""
    if column.null_count:
        raise ParquetError(f"{path}: label column {name!r} has {column.null_count} nulls")
    kind = column.type
    if pa.types.is_integer(kind):
        values = column.to_numpy()
        if values.dtype.kind == "u" and len(values) and values.max() > np.iinfo(np.int64).max:
            raise ParquetError(
                f"{path}: label column {name!r} holds {int(values.max())}, beyond int64's "
                f"range (<= {np.iinfo(np.int64).max}); store such labels as strings"
            )
        return values.astype(np.int64)
    if pa.types.is_string(kind) or pa.types.is_large_string(kind):
        return np.asarray(column.to_pylist(), dtype=str)
    if pa.types.is_dictionary(kind):
        return _labels(path, column.cast(kind.value_type), name)
    raise ParquetError(
        f"{path}: label column {name!r} has type {kind}; expected integers or strings"
    )


def _float_type(kinds: list[pa.DataType]) -> type:
    return np.float64 if any(pa.types.is_float64(kind) for kind in kinds) else np.float32


def _check_numeric(path: Path, kind: pa.DataType, name: str) -> None:
    if not (pa.types.is_integer(kind) or pa.types.is_floating(kind)):
        raise ParquetError(f"{path}: feature column {name!r} has type {kind}; expected numbers")


def _from_wide_columns(path: Path, columns: list[pa.ChunkedArray], names: list[str]) -> np.ndarray:
    """(n, D): column j of X from feature column j."""
    for column, name in zip(columns, names, strict=True):
        _check_numeric(path, column.type, name)
        if column.null_count:
            raise ParquetError(f"{path}: feature column {name!r} has {column.null_count} nulls")
    X = np.empty((len(columns[0]), len(columns)), _float_type([c.type for c in columns]))
    for j, column in enumerate(columns):
        X[:, j] = column.to_numpy()
    return X


def _from_list_column(path: Path, column: pa.ChunkedArray, name: str) -> np.ndarray:
    """(n, D) from a column whose rows are lists of D numbers."""
    if column.null_count:
        raise ParquetError(f"{path}: feature column {name!r} has {column.null_count} null rows")
    value_type = column.type.value_type
    _check_numeric(path, value_type, f"{name}[]")
    n = len(column)
    if n == 0:
        raise ParquetError(f"{path}: no rows")
    chunks = [chunk for chunk in column.chunks if len(chunk)]
    lengths = np.concatenate([c.value_lengths().to_numpy(zero_copy_only=False) for c in chunks])
    width = int(lengths[0])
    if (lengths != width).any():
        row = int(np.argmax(lengths != width))
        raise ParquetError(
            f"{path}: feature column {name!r} holds lists of different lengths "
            f"(row 0 has {width}, row {row} has {int(lengths[row])}); expected one length"
        )
    if width == 0:
        raise ParquetError(f"{path}: feature column {name!r} holds empty lists")
    X = np.empty((n, width), _float_type([value_type]))
    start = 0
    for chunk in chunks:
        values = chunk.flatten()
        if values.null_count:
            raise ParquetError(f"{path}: feature column {name!r} has null values in its lists")
        rows = len(chunk)
        X[start : start + rows] = values.to_numpy(zero_copy_only=False).reshape(rows, width)
        start += rows
    return X
