"""Data: loading, validation, stratified splitting and standardisation.

Sources: a built-in scikit-learn set (digits, iris, wine, breast_cancer: shipped with the
package, no network), an ``.npz`` file (``X``, ``y``, optional ``X_test``, ``y_test``), an
``.npy`` feature file with a separate ``.npy`` label file (memory-mapped: rows are read when
taken), a CSV file with a label column, or a Parquet file (pyarrow) whose features are either
one numeric column each or one list column of equal-length numeric lists, beside the label
column. Labels may be integers or strings.

Cheap checks first: for ``.npz``, ``.npy`` and Parquet files the labels are read and checked
(numbers or strings, at least two classes, two rows of each) before any feature, and the
features' size is read from the file's header or metadata and held against a memory budget
(the job's ``--memory-budget-gib``: by default 80% of the memory available when it starts)
before their values are read. So a small compressed file whose arrays expand to gigabytes,
or a sparse file with an honest large header, is refused in one line for what is wrong with
it, without first being read. A CSV file is read whole, in two passes: the first counts
its rows, so that the features' size is held against the budget before any value is
parsed.
"""

from __future__ import annotations

import ast
import codecs
import csv
import hashlib
import re
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import scipy.sparse as sp
from sklearn import datasets

from training.data import sparse_file
from training.data.parquet import ParquetError, read_parquet, read_parquet_labels
from training.numerics import shard_bounds

BUILTIN_DATASETS = ("digits", "iris", "wine", "breast_cancer")


class DataError(ValueError):
    """The data cannot be used for training; the message says what and why."""


@dataclass
class Dataset:
    """Features and labels as loaded; labels in their original type (ints or strings)."""

    X: np.ndarray  # (n, D) float64
    y: np.ndarray  # (n,) labels
    X_test: np.ndarray | None = None  # (n_test, D)
    y_test: np.ndarray | None = None  # (n_test,)
    name: str = "data"
    feature_names: list[str] | None = None
    source: str | None = None  # the file it was read from (None: a built-in set, arrays)

    def named(self, what: str) -> str:
        """``what`` (X, labels, ...) as an error names it: with the file when there is one."""
        return f"{self.source}: {what}" if self.source else what


@dataclass
class Split:
    """A stratified train / validation / test split with labels encoded as class indices."""

    X_train: np.ndarray  # (n_train, D)
    y_train: np.ndarray  # (n_train,) int64 indices into classes
    X_val: np.ndarray  # (n_val, D), possibly empty
    y_val: np.ndarray
    X_test: np.ndarray  # (n_test, D), possibly empty
    y_test: np.ndarray
    classes: np.ndarray  # (C,) original labels, sorted
    # data-parallel (training.distributed.ranks): X_train, X_val (and their labels) are this rank's
    # rows [start, stop) of the splits, shard_bounds(n_train / n_val, rank, P); X_test is
    # held by rank 0 only. None in a single process: the arrays are the whole splits.
    n_train_total: int | None = None
    n_val_total: int | None = None

    @property
    def n_train(self) -> int:
        return self.X_train.shape[0] if self.n_train_total is None else self.n_train_total

    @property
    def n_val(self) -> int:
        return self.X_val.shape[0] if self.n_val_total is None else self.n_val_total


# --------------------------------------------------------------------------- loading


def load_dataset(
    spec: str,
    *,
    labels: str | None = None,
    label_column: str | None = None,
    memory_map: bool = False,
    memory_budget: int | None = None,
    for_training: bool = False,
    sparse: bool = False,
) -> Dataset:
    """Load a data set from a built-in name or a file path (see module docstring).

    memory_map: a ``.npy`` feature file is mapped, not read: rows are read when taken (a
    data-parallel rank reads only its shard). Other formats are read whole.
    memory_budget: bytes the features may take as float64 (None: no limit); checked from
    the file's header before the features are read.
    for_training: the labels are checked as training needs them (:func:`check_labels`)
    before any feature is read (rows added to a reference set need not make a training
    set).
    sparse: the caller takes a sparse X, so a ``scipy.sparse.save_npz`` file is read (as
    CSR, with ``labels``: ``training.data.sparse_file``); otherwise such a file is refused."""
    suffix = "" if spec in BUILTIN_DATASETS else Path(spec).suffix.lower()
    if spec not in BUILTIN_DATASETS and suffix not in (".npz", ".npy", ".csv", ".parquet"):
        raise DataError(
            f"--data {spec!r}: expected one of the built-in sets {list(BUILTIN_DATASETS)} "
            "or a path ending in .npz, .npy, .csv or .parquet"
        )
    if labels is not None and suffix not in (".npy", ".npz"):
        raise DataError(
            f"--labels applies to a .npy feature file or a sparse .npz, not to --data {spec!r} "
            "(a CSV or Parquet file holds its label column: --label-column)"
        )
    if label_column is not None and suffix not in (".csv", ".parquet"):
        raise DataError(
            f"--label-column applies to a CSV or Parquet file, not to --data {spec!r} (an "
            ".npz holds y; a .npy's labels are --labels)"
        )
    if spec in BUILTIN_DATASETS:
        return _load_builtin(spec)
    path = Path(spec)
    check_regular_file(path, "--data")
    label_check = check_labels if for_training else _no_check
    if suffix == ".npz":
        return _load_npz(path, memory_budget, label_check, labels, sparse)
    if suffix == ".npy":
        return _load_npy_pair(path, labels, memory_map, memory_budget, label_check)
    if suffix == ".parquet":
        return load_parquet(path, label_column, memory_budget, label_check)
    return _load_csv(path, label_column, memory_budget)


def _no_check(y, what: str = "") -> None:
    """No label check (for rows that need not make a training set)."""


def default_memory_budget(fraction: float = 0.8) -> int | None:
    """``fraction`` of the memory available now (MemAvailable in /proc/meminfo), in bytes;
    None where it cannot be read."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(int(line.split()[1]) * 1024 * fraction)
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_memory(shape: tuple, what: str, budget: int | None, itemsize: int = 8) -> None:
    """DataError when an array of ``shape`` would take more than ``budget`` bytes: its values
    as float64 (how the job holds its rows), or as ``itemsize`` bytes when that is more."""
    if budget is None:
        return
    size = max(8, itemsize) * int(np.prod([int(n) for n in shape], dtype=object))
    if size > budget:
        kind = "as float64" if itemsize <= 8 else f"at {itemsize} bytes each"
        raise DataError(
            f"{what}: {' x '.join(str(int(n)) for n in shape)} values take "
            f"{_size(size)} {kind}, over the memory budget of {_size(budget)} "
            "(--memory-budget-gib; by default 80% of the memory available when the job "
            "started); nothing was read"
        )


def _size(n_bytes: int) -> str:
    """1.5 MiB, 7,450.6 GiB."""
    if n_bytes >= 2**30:
        return f"{n_bytes / 2**30:,.1f} GiB"
    return f"{n_bytes / 2**20:,.1f} MiB"


def check_labels(y: np.ndarray, what: str = "labels") -> np.ndarray:
    """The labels (n,) checked as training needs them, before any feature is read (the
    checks and messages of :func:`plan_split`): integers or strings, at least 2 classes, 2
    rows per class on average and 2 of each. Returns them (integer floats as int64, bytes
    as str)."""
    y = np.asarray(y)
    if y.ndim != 1:
        raise DataError(f"{what}: expected a 1-D array, got shape {y.shape}")
    y = label_values(y, what)  # booleans refused there
    classes, counts = np.unique(y, return_counts=True)
    if len(classes) < 2:
        raise DataError(
            f"{what}: need at least 2 classes, found {len(classes)} ({classes.tolist()})"
        )
    if len(y) < 2 * len(classes):
        raise DataError(
            f"{what}: {len(y)} samples for {len(classes)} classes; need at least 2 per class "
            "on average"
        )
    if counts.min() < 2:
        rare = classes[counts < 2].tolist()
        raise DataError(f"{what}: classes {rare} have fewer than 2 samples; NCA needs 2 per class")
    return y


NPY_HEADER_MAX_BYTES = 100_000  # numpy itself reads headers of up to 10,000 bytes


def npy_header(stream) -> tuple[tuple, np.dtype]:
    """(shape, dtype) from an .npy stream's header (format versions 1.0, 2.0 and 3.0),
    its values left unread. ValueError for a stream that is not .npy."""
    version = np.lib.format.read_magic(stream)
    if version not in ((1, 0), (2, 0), (3, 0)):
        raise ValueError(f"unsupported .npy format version {version}")
    length_bytes = 2 if version == (1, 0) else 4
    length = int.from_bytes(stream.read(length_bytes), "little")
    if length > NPY_HEADER_MAX_BYTES:
        raise ValueError(
            f"its header is {length} bytes, over {NPY_HEADER_MAX_BYTES} (numpy writes headers "
            "far under it)"
        )
    text = stream.read(length).decode("utf-8" if version == (3, 0) else "latin1")
    header = ast.literal_eval(text)
    if not isinstance(header, dict) or not {"descr", "shape"} <= set(header):
        raise ValueError(f"not an .npy header: {text[:80]!r}")
    shape = header["shape"]
    if not isinstance(shape, tuple) or not all(
        isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape
    ):
        raise ValueError(f"its shape {str(shape)[:80]} is not a tuple of non-negative integers")
    try:
        dtype = np.lib.format.descr_to_dtype(header["descr"])
    except (TypeError, ValueError) as exc:
        raise ValueError(f"its dtype {str(header['descr'])[:80]!r} is not one ({exc})") from None
    return shape, dtype


def member_header(archive, key: str, path: Path) -> tuple[tuple, np.dtype]:
    """(shape, dtype) of an .npz's member ``key`` from its header, its values unread;
    DataError naming the member when the header is not a readable .npy one."""
    try:
        with archive.zip.open(_member_name(archive, key)) as member:
            return npy_header(member)
    except (ValueError, SyntaxError, MemoryError, RecursionError, UnicodeDecodeError) as exc:
        raise DataError(f"{path}: {key}: not a readable .npy header ({_line(exc)})") from None


def _member_name(archive, key: str) -> str:
    """The zip member of an .npz's array ``key``: np.savez adds .npy; others may not."""
    names = archive.zip.namelist()
    return f"{key}.npy" if f"{key}.npy" in names else key


def check_regular_file(path: Path, option: str) -> None:
    """DataError naming ``option`` unless ``path`` is a regular file: missing, a directory,
    or another kind (a FIFO, a device, a socket) each said as such."""
    if not path.exists():
        raise DataError(f"{option} {str(path)!r}: no such file")
    if path.is_dir():
        raise DataError(f"{option} {str(path)!r} is a directory; expected a data file")
    if not path.is_file():
        raise DataError(
            f"{option} {str(path)!r} is not a regular file (a FIFO, a device or a socket); "
            "expected a data file"
        )


def _load_builtin(name: str) -> Dataset:
    loader = getattr(datasets, f"load_{name}")
    bunch = loader()
    return Dataset(
        X=np.asarray(bunch.data, dtype=np.float64),
        y=np.asarray(bunch.target),
        name=name,
        feature_names=[str(f) for f in getattr(bunch, "feature_names", [])] or None,
    )


NPY_MAGIC = b"\x93NUMPY"  # the first bytes of every .npy file


def _with_path(exc: OSError, path: Path) -> OSError:
    """``exc`` naming ``path`` (a read error, EIO on a failing disk, names no file)."""
    return exc if exc.filename is not None else OSError(exc.errno, exc.strerror, str(path))


def _load_npy(path: Path, what: str, memory_map: bool = False) -> np.ndarray:
    try:
        with open(path, "rb") as fh:
            magic = fh.read(len(NPY_MAGIC))
    except OSError as exc:
        raise _with_path(exc, path) from exc
    if magic != NPY_MAGIC:  # numpy would try it as a pickle
        raise DataError(f"{path}: not a .npy file (it does not start with .npy's magic bytes)")
    try:
        return np.load(path, allow_pickle=False, mmap_mode="r" if memory_map else None)
    except ValueError as exc:
        if "max_header_size" in str(exc):  # numpy's refusal of a header over 10,000 bytes
            raise DataError(
                f"{path}: not a readable .npy file (its header is over numpy's limit of "
                "10,000 bytes; the files numpy writes have headers far under it)"
            ) from exc
        if "pickle" in str(exc) or "object" in str(exc).lower():
            raise DataError(f"{path}: cannot read {what} without pickle ({_line(exc)})") from exc
        raise DataError(f"{path}: not a readable .npy file ({_line(exc)})") from exc
    except (OSError, EOFError) as exc:
        raise DataError(f"{path}: not a readable .npy/.npz file ({_line(exc)})") from exc


def _line(exc: BaseException) -> str:
    """An exception's text on one line (numpy's may run over several)."""
    return " ".join(str(exc).split())


def _load_npz(
    path: Path,
    memory_budget: int | None = None,
    label_check=_no_check,
    labels: str | None = None,
    sparse: bool = False,
) -> Dataset:
    try:
        archive = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:
        raise DataError(f"{path}: not a readable .npz file ({_line(exc)})") from exc
    with archive:
        keys = set(archive.files)
        as_sparse = sparse_file.is_sparse_layout(keys) or labels is not None
        missing = {"X", "y"} - keys
        if missing and not as_sparse:
            raise DataError(f"{path}: missing arrays {sorted(missing)}; found {sorted(keys)}")
        try:
            if as_sparse:
                return _load_sparse_npz(archive, path, memory_budget, label_check, labels, sparse)
            for key in ("y", "y_test", "X", "X_test"):  # every header before any value
                if key not in keys:
                    continue
                shape, dtype = member_header(archive, key, path)
                if key.startswith("X") and dtype.kind not in "biuf":
                    raise DataError(f"{path}: {key}: features must be numeric, got dtype {dtype}")
                check_memory(shape, f"{path}: {key}", memory_budget, dtype.itemsize)
            y = archive["y"]
            label_check(y, what=f"{path}: labels")  # before any feature is read
            X = archive["X"]
            X_test = archive["X_test"] if "X_test" in keys else None
            y_test = archive["y_test"] if "y_test" in keys else None
        except DataError:  # the labels' or the budget's refusal, as it is
            raise
        except ValueError as exc:
            if "pickle" in str(exc):  # numpy's refusal of an object array
                raise DataError(f"{path}: arrays must load without pickle ({exc})") from exc
            # a member cut short or damaged ("EOF: reading array data ...")
            raise DataError(f"{path}: not a readable .npz file ({_line(exc)})") from exc
        except (OSError, EOFError, KeyError, SyntaxError, zipfile.BadZipFile, zlib.error) as exc:
            raise DataError(f"{path}: not a readable .npz file ({_line(exc)})") from exc  # damaged
    if (X_test is None) != (y_test is None):
        raise DataError(f"{path}: X_test and y_test must be given together")
    return Dataset(X=X, y=y, X_test=X_test, y_test=y_test, name=path.stem, source=str(path))


def _load_sparse_npz(
    archive, path: Path, memory_budget: int | None, label_check, labels: str | None, sparse: bool
) -> Dataset:
    """A ``scipy.sparse.save_npz`` file and its ``--labels`` (``training.data.sparse_file``);
    the labels read and checked before any feature."""
    if not sparse_file.is_sparse_layout(set(archive.files)):
        holds = "its y are the labels" if "y" in archive.files else "not a sparse matrix"
        raise DataError(
            f"--labels applies to a .npy feature file or a sparse .npz (scipy.sparse.save_npz), "
            f"not to --data {path}, which holds arrays {sorted(archive.files)} ({holds})"
        )
    if not sparse:
        raise DataError(
            f"--data {path} is a sparse matrix (scipy.sparse.save_npz): the training job "
            "(python -m training) reads it; this command takes dense rows (densify them with "
            "X.toarray(), or save them with np.savez(X=..., y=...))"
        )
    if labels is None:
        raise DataError(
            f"--data {path} is a sparse matrix (scipy.sparse.save_npz), which holds no labels: "
            "give them as --labels LABELS.npy"
        )
    y = _read_labels(labels, memory_budget, label_check)  # before any feature is read

    def header_of(archive, key: str):
        return member_header(archive, key, path)

    X = sparse_file.read_sparse_npz(archive, path, memory_budget, header_of, DataError, len(y))
    return Dataset(X=X, y=y, name=path.stem, source=str(path))


def _read_labels(labels: str, memory_budget: int | None, label_check) -> np.ndarray:
    """--labels LABELS.npy: (n,) read whole (its size held against the budget first) and
    checked by ``label_check``."""
    label_path = Path(labels)
    if label_path.suffix.lower() != ".npy":
        raise DataError(f"--labels {labels!r}: expected a .npy file of labels (n,)")
    check_regular_file(label_path, "--labels")
    labels_mapped = _load_npy(label_path, "labels", memory_map=True)  # header: no values
    check_memory(
        labels_mapped.shape, f"{label_path}: labels", memory_budget, labels_mapped.dtype.itemsize
    )
    y = np.array(labels_mapped)
    del labels_mapped
    label_check(y, what=f"{label_path}: labels")
    return y


def _load_npy_pair(
    path: Path,
    labels: str | None,
    memory_map: bool = False,
    memory_budget: int | None = None,
    label_check=_no_check,
) -> Dataset:
    if labels is None:
        raise DataError(f"--data {path}: a .npy feature file needs --labels LABELS.npy")
    y = _read_labels(labels, memory_budget, label_check)  # before any feature is read
    X = _load_npy(path, "features", memory_map=True)  # its header: the shape, no values
    check_memory(X.shape, f"{path}: features", memory_budget, X.dtype.itemsize)
    if not memory_map:
        X = np.array(X)
    return Dataset(X=X, y=y, name=path.stem, source=str(path))


def load_parquet(
    path: Path, label_column: str | None, memory_budget: int | None = None, label_check=_no_check
) -> Dataset:
    """The labels first (checked), then the features' size from the file's metadata against
    the budget, then the features."""
    try:
        y, n_rows, n_values = read_parquet_labels(path, label_column)
        label_check(y, what=f"{path}: labels")
        check_memory((n_rows, n_values // max(n_rows, 1)), f"{path}: features", memory_budget)
        X, y, names = read_parquet(path, label_column)
    except ParquetError as exc:
        raise DataError(str(exc)) from exc
    return Dataset(X=X, y=y, name=path.stem, feature_names=names, source=str(path))


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _csv_rows(path: Path):
    """The non-empty rows of a CSV file, streamed (each a list of str). utf-8-sig: a
    byte-order mark (a spreadsheet's "CSV UTF-8") is read as such, never as part of the
    first column's name. Decoding and parsing errors are DataErrors naming the file."""
    try:
        with open(path, newline="", encoding="utf-8-sig") as fh:
            for row in csv.reader(fh):
                if row:
                    yield row
    except UnicodeDecodeError as exc:
        raise DataError(
            f"{path}: not UTF-8 text (byte {_first_bad_utf8(path)}: {exc.reason}); save it as "
            "UTF-8 (a spreadsheet's 'CSV UTF-8')"
        ) from None
    except csv.Error as exc:
        raise DataError(f"{path}: not a readable CSV file ({exc})") from None
    except OSError as exc:
        raise _with_path(exc, path) from exc


def _first_bad_utf8(path: Path, chunk: int = 1 << 20) -> int:
    """The offset in the file of its first byte that is not UTF-8 (the decoder's error
    counts from the start of the chunk it was decoding)."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0  # bytes of the file handed to the decoder so far
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            pending = len(decoder.getstate()[0])  # a sequence split by the last block
            try:
                decoder.decode(block)
            except UnicodeDecodeError as exc:
                return offset - pending + exc.start
            offset += len(block)
    return offset


def _feature_error(path: Path, i: int, values: list[str], names: list[str]) -> DataError:
    """The refusal of data row ``i``'s first feature value that is not a plain decimal
    number (digits, a point, an exponent; inf and nan are read, and refused later)."""
    for value, name in zip(values, names, strict=True):
        try:
            if "_" in value or not value.isascii():
                raise ValueError
            float(value)
        except ValueError:
            return DataError(
                f"{path}: data row {i + 1}, column {name!r}: {value[:40]!r} is not a number "
                "(expected a decimal such as 1.5 or -2e3)"
            )
    return DataError(f"{path}: data row {i + 1} changed while it was read")


def _label_index(path: Path, header: list[str], label_column: str | None) -> int:
    """The label column's index in ``header`` (a headerless file's columns are named '0',
    '1', ...): a name in the header, else a position (0 the first, -1 the last), else
    'label' or the last column when none is given. DataError naming the columns."""
    if label_column is None:
        return header.index("label") if "label" in header else len(header) - 1
    if label_column in header:
        return header.index(label_column)
    if re.fullmatch(r"-?[0-9]+", label_column.strip(), re.ASCII):
        position = int(label_column)
        if -len(header) <= position < len(header):
            return position % len(header)
        raise DataError(
            f"{path}: --label-column {label_column}: no column at that position; the file has "
            f"{len(header)} columns (0 to {len(header) - 1}, or -1 for the last)"
        )
    raise DataError(f"{path}: no label column {label_column!r}; columns are {header}")


def _load_csv(path: Path, label_column: str | None, memory_budget: int | None = None) -> Dataset:
    """Features and labels of a CSV file, read in two passes: the first counts the rows and
    checks every row's width, so that the features (rows x columns as float64) are held
    against ``memory_budget`` before any value is parsed; the second parses each row into
    its place."""
    header, n_rows, widths = None, 0, set()
    for row in _csv_rows(path):
        if header is None:
            header = row
        else:
            widths.add(len(row))
        n_rows += 1
    if header is None:
        raise DataError(f"{path}: empty CSV file")
    has_header = not all(_is_number(cell) for cell in header)
    if not has_header:
        widths.add(len(header))
        header = [str(i) for i in range(len(header))]
    n_body = n_rows - 1 if has_header else n_rows
    if n_body == 0:
        raise DataError(f"{path}: a header and no rows")
    twice = sorted({name for name in header if header.count(name) > 1})
    if twice:
        raise DataError(
            f"{path}: header names {twice[:10]} appear more than once; give each column its own name"
        )
    li = _label_index(path, header, label_column)
    if widths - {len(header)}:
        raise DataError(f"{path}: every row must have {len(header)} fields, found {sorted(widths)}")
    check_memory((n_body, len(header) - 1), f"{path}: features", memory_budget)
    X = np.empty((n_body, len(header) - 1), dtype=np.float64)  # (n, D)
    raw = []  # (n,) the label column's text
    rows = _csv_rows(path)
    if has_header:
        next(rows)
    for i, row in enumerate(rows):
        if i >= n_body:
            raise DataError(f"{path}: changed while it was read")
        values = [v for j, v in enumerate(row) if j != li]
        try:
            if any("_" in v or not v.isascii() for v in values):  # float() takes 1_000, ١
                raise ValueError
            X[i] = [float(v) for v in values]
        except ValueError:
            names = [h for j, h in enumerate(header) if j != li]
            raise _feature_error(path, i, values, names) from None
        raw.append(row[li])
    if len(raw) != n_body:
        raise DataError(f"{path}: changed while it was read")
    y = _csv_labels(raw, path)
    names = [h for j, h in enumerate(header) if j != li]
    return Dataset(X=X, y=y, name=path.stem, feature_names=names, source=str(path))


INTEGER = re.compile(r"[+-]?[0-9]+")
INT64 = np.iinfo(np.int64)


def _csv_labels(raw: list[str], path: Path) -> np.ndarray:
    """(n,) the label column: int64 when every label is an integer, written as one ("7") or
    as an integer-valued decimal ("7.0", the same class as "7"), else the strings without
    the spaces around them (" cat" and "cat" are one class, as " 7" and "7" are). An empty
    label, or an integer beyond int64, is refused naming its data row."""
    for i, text in enumerate(raw):
        if not text.strip():
            raise DataError(f"{path}: the label of data row {i + 1} is empty")
    if all(INTEGER.fullmatch(text.strip()) for text in raw):
        values = [int(text) for text in raw]
    elif all(_is_number(text) and float(text).is_integer() for text in raw):
        values = [int(float(text)) for text in raw]
    else:
        return np.array([text.strip() for text in raw])
    for i, value in enumerate(values):
        if not INT64.min <= value <= INT64.max:
            raise DataError(
                f"{path}: the label {raw[i].strip()} of data row {i + 1} is beyond the 64-bit "
                f"integer range ({INT64.min}..{INT64.max})"
            )
    return np.array(values, dtype=np.int64)


# --------------------------------------------------------------------------- validation


FLOAT32_MAX = float(np.finfo(np.float32).max)


def check_finite(X: np.ndarray, what: str, error: type[Exception] = ValueError) -> None:
    """Raise ``error`` naming the first NaN or infinite value of X (n, D)."""
    if X.dtype.kind in "fc" and not np.all(np.isfinite(X)):
        row, column = np.argwhere(~np.isfinite(X))[0]
        raise error(f"{what}: contains NaN or Inf (first at row {row}, column {column})")


def check_float32_range(X: np.ndarray, what: str, error: type[Exception] = ValueError) -> None:
    """Raise ``error`` naming the first value of X (n, D) beyond float32's range (about
    3.4e38): the map, the references and the service compute in float32, where such a value
    is infinite."""
    if X.dtype.kind != "f" or X.dtype.itemsize <= 4 or X.size == 0:
        return  # integers up to int64 and float32 values fit
    with np.errstate(invalid="ignore"):
        beyond = np.abs(X) > FLOAT32_MAX
    if beyond.any():
        row, column = np.argwhere(beyond)[0]
        raise error(
            f"{what}: value {X[row, column]:.6g} at row {row}, column {column} is beyond "
            f"float32's range (|x| <= {FLOAT32_MAX:.4g}), which the map and the service "
            "compute in; rescale the data"
        )


def validate_xy(X, y, *, what: str = "X") -> tuple[np.ndarray, np.ndarray]:
    """Check features (n, D) numeric and finite and labels (n,) ints or strings."""
    X = np.asarray(X)
    y = np.asarray(y)
    _check_features_shape(X, what)
    if X.shape[1] == 0:
        raise DataError(f"{what}: has 0 features")
    if y.ndim != 1:
        raise DataError(f"labels for {what}: expected a 1-D array, got shape {y.shape}")
    if len(X) != len(y):
        raise DataError(f"{what} has {len(X)} rows but its labels have {len(y)}")
    check_finite(X, what, DataError)
    check_float32_range(X, what, DataError)
    return X.astype(np.float64), label_values(y, f"labels for {what}")


FLOAT_LABEL_MAX = 2.0**53  # float labels beyond it are not distinct integers


def label_values(y: np.ndarray, what: str) -> np.ndarray:
    """Labels (n,) as training takes them: integers (integer-valued floats as int64, within
    +-FLOAT_LABEL_MAX, where every integer is a float of its own) or strings (bytes as str);
    ``what`` names them in the error for any other kind (booleans too: True and False
    would become the classes 1 and 0 of an integer model)."""
    if y.dtype.kind == "b":
        raise DataError(f"{what}: must be integers or strings, got booleans")
    if y.dtype.kind == "f":
        with np.errstate(invalid="ignore"):
            whole = np.isfinite(y) & (y == np.round(y))
        if not np.all(whole):
            row = int(np.flatnonzero(~whole.ravel())[0])
            raise DataError(
                f"{what}: must be integers or strings, got non-integer floats (first at row "
                f"{row}: {float(y.ravel()[row])!r})"
            )
        beyond = np.abs(y) > FLOAT_LABEL_MAX
        if np.any(beyond):  # 1e30 and 2e30 would both become -2**63 as int64
            row = int(np.flatnonzero(beyond.ravel())[0])
            raise DataError(
                f"{what}: float labels must lie within +-2**53 (where each is a distinct "
                f"integer), got {float(y.ravel()[row])!r} at row {row}: write them as "
                "integers or strings"
            )
        return y.astype(np.int64)
    if y.dtype.kind not in "iuUS":
        raise DataError(f"{what}: must be integers or strings, got dtype {y.dtype}")
    return y.astype(str) if y.dtype.kind == "S" else y


def row_digests(X: np.ndarray) -> np.ndarray:
    """sha256 of each row's features (float64, C order): (n, 32) uint8; of a sparse row's
    canonical CSR form (``training.data.sparse_file.row_digests``)."""
    if sp.issparse(X):
        return sparse_file.row_digests(X)
    rows = np.ascontiguousarray(X, dtype=np.float64)
    out = np.empty((len(rows), 32), dtype=np.uint8)
    for i, row in enumerate(rows):
        out[i] = np.frombuffer(hashlib.sha256(row.tobytes()).digest(), dtype=np.uint8)
    return out


def fingerprint_from_row_digests(digests: np.ndarray, y: np.ndarray) -> str:
    """sha256 over the rows' digests in order and the labels' text."""
    digest = hashlib.sha256()
    digest.update(np.ascontiguousarray(digests, dtype=np.uint8).tobytes())
    digest.update("\x1f".join(map(str, y.tolist())).encode())
    return digest.hexdigest()


# --------------------------------------------------------------------------- splitting


def stratified_split(y: np.ndarray, fractions: tuple[float, ...], seed: int) -> list[np.ndarray]:
    """Split indices of ``y`` into len(fractions) + 1 parts, class by class.

    Part p > 0 gets round(fraction_p * n_c) members of each class c (at least one when the
    fraction is > 0 and the class has enough members to leave two in part 0); part 0 (train)
    gets the rest. Deterministic for a seed. Returns sorted index arrays.
    """
    rng = np.random.default_rng(seed)
    parts: list[list[np.ndarray]] = [[] for _ in range(len(fractions) + 1)]
    for cls in np.unique(y):
        members = rng.permutation(np.flatnonzero(y == cls))
        n_c = len(members)
        start = 0
        for p, frac in enumerate(fractions, start=1):
            take = round(frac * n_c)
            if frac > 0 and take == 0 and n_c - start >= 3:
                take = 1
            take = min(take, max(0, n_c - start - 2))  # keep >= 2 in train where possible
            parts[p].append(members[start : start + take])
            start += take
        parts[0].append(members[start:])
    return [np.sort(np.concatenate(p)) if p else np.empty(0, dtype=np.int64) for p in parts]


@dataclass
class SplitPlan:
    """Which rows go where, decided from the labels alone (every rank of a data-parallel job
    computes the same plan). Indices are into the data set's X; ``test_idx`` is None when the
    data set brings its own test set."""

    classes: np.ndarray  # (C,) original labels, sorted
    y_idx: np.ndarray  # (n,) class indices of X's rows
    train_idx: np.ndarray
    val_idx: np.ndarray
    test_idx: np.ndarray | None
    y_test: np.ndarray | None  # class indices of the data set's own test rows


def _check_features_shape(X, what: str) -> None:
    if X.dtype.kind not in "biuf":
        raise DataError(f"{what}: features must be numeric, got dtype {X.dtype}")
    if X.ndim != 2:
        raise DataError(
            f"{what}: expected a 2-D array (n_samples, n_features), got shape {X.shape}"
        )


def plan_split(data: Dataset, *, test_size: float, val_size: float, seed: int) -> SplitPlan:
    """Validate the labels and the fractions, encode the labels and split the rows' indices
    into train / validation / test. Reads X's shape only, never its values."""
    for name, value in (("test_size", test_size), ("val_size", val_size)):
        if not 0.0 <= value < 1.0:
            raise DataError(f"--{name.replace('_', '-')}={value} must lie in [0, 1)")
    if test_size + val_size >= 0.9:
        raise DataError(
            f"--test-size + --val-size = {test_size + val_size:.2f} leaves too little to train on "
            "(must be < 0.9)"
        )
    _check_features_shape(data.X, data.named("X"))
    # (n,) numbers or strings, 2 classes at least, 2 rows of each
    y = check_labels(data.y, data.named("labels"))
    if data.X.shape[0] != len(y):
        raise DataError(
            f"{data.named('X')} has {data.X.shape[0]} rows but its labels have {len(y)}"
        )
    classes, y_idx = np.unique(y, return_inverse=True)
    y_test = None  # class indices of the data set's own test rows
    if data.X_test is not None:
        _, y_test_raw = validate_xy(np.zeros((len(data.y_test), 1)), data.y_test, what="X_test")
        if len(data.X_test) != len(y_test_raw):
            raise DataError(
                f"X_test has {len(data.X_test)} rows but its labels have {len(y_test_raw)}"
            )
        if np.ndim(data.X_test) != 2 or data.X_test.shape[1] != data.X.shape[1]:
            raise DataError(
                f"X_test has shape {np.shape(data.X_test)}, X has {data.X.shape[1]} features"
            )
        unknown = np.setdiff1d(np.unique(y_test_raw), classes)
        if unknown.size:
            raise DataError(f"y_test has labels not seen in y: {unknown.tolist()}")
        y_test = np.searchsorted(classes, y_test_raw)
    fractions = (val_size,) if data.X_test is not None else (val_size, test_size)
    train_idx, val_idx, *test_idx = stratified_split(y_idx, fractions, seed)
    return SplitPlan(classes, y_idx, train_idx, val_idx, test_idx[0] if test_idx else None, y_test)


def make_split(
    data: Dataset,
    *,
    test_size: float,
    val_size: float,
    seed: int,
    rank: int = 0,
    world_size: int = 1,
) -> Split:
    """Validate, encode the labels and split into train / validation / test, by the plan
    every rank makes from the labels alone (:func:`plan_split`).

    In one process (``world_size`` 1) the splits are whole, and X is checked whole first; a
    sparse X (CSR, checked by its reader: ``training.data.sparse_file``) stays sparse in
    every split. Data-parallel, they are ``rank``'s rows [start, stop) of the training and
    validation splits (``shard_bounds``) and rank 0 alone takes the test split: only these
    rows are read from a memory-mapped ``.npy``, and only they are checked for NaN and Inf."""
    sharded = world_size > 1
    X = data.X
    if not sharded and not sp.issparse(X):
        X, _ = validate_xy(X, data.y, what=data.named("X"))
    plan = plan_split(data, test_size=test_size, val_size=val_size, seed=seed)
    n_train, n_val = len(plan.train_idx), len(plan.val_idx)
    if n_train < world_size:
        raise DataError(
            f"{n_train} training rows cannot be shared by {world_size} ranks "
            "(each needs at least one)"
        )

    def rows(index: np.ndarray, what: str) -> np.ndarray:
        """X[index], as float64 checked numeric and finite when X was not checked whole."""
        if not sharded:
            return X[index]
        taken = np.asarray(X[np.asarray(index, dtype=np.int64)])
        return validate_xy(taken, np.zeros(len(taken), dtype=np.int64), what=what)[0]

    train = plan.train_idx[slice(*shard_bounds(n_train, rank, world_size))]
    val = plan.val_idx[slice(*shard_bounds(n_val, rank, world_size))]
    mine = f"rank {rank}'s "
    X_train = rows(train, f"X ({mine}training rows)")
    X_val = rows(val, f"X ({mine}validation rows)")
    X_test, y_test = np.empty((0, X_train.shape[1])), np.empty(0, dtype=np.int64)
    if rank == 0 and plan.test_idx is None:  # the data set's own test rows
        X_test, _ = validate_xy(data.X_test, data.y_test, what=data.named("X_test"))
        y_test = plan.y_test
    elif rank == 0:
        X_test, y_test = rows(plan.test_idx, "X (test rows)"), plan.y_idx[plan.test_idx]
    return Split(
        X_train,
        plan.y_idx[train],
        X_val,
        plan.y_idx[val],
        X_test,
        y_test,
        plan.classes,
        n_train_total=n_train if sharded else None,
        n_val_total=n_val if sharded else None,
    )
