"""Sparse feature files: a SciPy ``.npz`` as ``scipy.sparse.save_npz`` writes it (CSR, CSC
or COO), read as CSR without ever densifying it.

Such a file holds the matrix alone (members ``format``, ``shape``, ``data`` and
``indices``/``indptr`` or ``row``/``col``); its labels come from ``--labels y.npy``. The
reader takes the same care as the dense ones (``training.data.datasets``): every member's
header is read and its size held against the memory budget before any value is read, and
the matrix is then checked whole (indices within the shape, a non-decreasing ``indptr``,
numeric, finite values within float32's range), so that a hostile or damaged file is refused
in one line naming what is wrong rather than failing mid-fit.

A row's digest (the training set's fingerprint in the artifact) is the sha256 of its
canonical CSR form: the column indices (int64, ascending, no duplicates: duplicates are
summed as SciPy sums them) followed by the values (float64), with explicit zeros dropped.
Hashing the dense row instead would cost D x 8 bytes a row (400 KB at D = 50,000).
"""

from __future__ import annotations

import hashlib
import zipfile
import zlib
from pathlib import Path

import numpy as np
import scipy.sparse as sp

FORMATS = {  # format -> the members that hold its arrays
    "csr": ("data", "indices", "indptr"),
    "csc": ("data", "indices", "indptr"),
    "coo": ("data", "row", "col"),
}
INDEX_BYTES = 8  # an index once read (int64 at worst)


def is_sparse_layout(members: set[str]) -> bool:
    """True for the members of a ``scipy.sparse.save_npz`` file (and not of an ``.npz`` of
    dense ``X`` and ``y``, which is read as such whatever else it holds)."""
    return {"format", "shape", "data"} <= members and "X" not in members


def read_sparse_npz(
    archive, path: Path, budget: int | None, header_of, error, n_labels: int
) -> sp.csr_matrix:
    """The matrix of an open ``.npz`` ``archive`` in ``save_npz``'s layout, as CSR float64
    with sorted, summed indices; its rows must be the ``n_labels`` labels'.

    Every member's header is checked before any value is read (``header_of(archive, key)``
    gives its (shape, dtype)): ``format`` a string, ``shape`` two integers, the arrays 1-D
    of numbers (data, at most 8 bytes) or integers (indices), as many indices as values.

    The budget holds what the read and the conversion to CSR take at their peak: the stored
    arrays twice (as read, then as int64 / float64; three times for CSC and COO, which
    tocsr copies once more) and the CSR row pointers twice. The fit's own memory, which
    depends on d, is the job's check (``training.job.check_sparse_settings``).

    Then the structure is checked whole before scipy touches it (row pointers from 0,
    non-decreasing, ending at the number of values; indices within the shape). ``error`` is
    the exception raised, naming ``path``."""
    members = set(archive.files)
    fmt = _format_of(archive, path, header_of, error)
    missing = [key for key in FORMATS[fmt] if key not in members]
    if missing:
        raise error(
            f"{path}: a sparse {fmt} .npz needs the arrays {list(FORMATS[fmt])}; missing {missing}"
        )
    n_rows, n_features = _shape_of(archive, path, header_of, error)
    if n_rows != n_labels:
        raise error(f"{path}: X has {n_rows} rows but its labels have {n_labels}")
    lengths = {}
    for key in FORMATS[fmt]:
        shape, dtype = header_of(archive, key)
        if len(shape) != 1:
            raise error(f"{path}: {key} must be 1-D, got shape {tuple(shape)}")
        if key == "data" and (dtype.kind not in "biuf" or dtype.itemsize > 8):
            raise error(f"{path}: data must hold numbers of at most 8 bytes, got dtype {dtype}")
        if key != "data" and dtype.kind not in "iu":
            raise error(f"{path}: {key} must hold integers, got dtype {dtype}")
        lengths[key] = shape[0]
    nnz = lengths["data"]
    for key in ("indices", "row", "col"):
        if key in lengths and lengths[key] != nnz:
            raise error(f"{path}: {key} has {lengths[key]} entries, data has {nnz}: one each")
    copies = 2 if fmt == "csr" else 3
    n_bytes = sum(copies * n * 8 for n in lengths.values()) + 2 * (n_rows + 1) * INDEX_BYTES
    if budget is not None and n_bytes > budget:
        raise error(
            f"{path}: the sparse matrix ({n_rows} x {n_features}, {nnz} stored values) takes "
            f"{n_bytes / 2**30:.2f} GiB to read, over the memory budget of "
            f"{budget / 2**30:.2f} GiB (--memory-budget-gib)"
        )
    try:
        arrays = {key: archive[key] for key in FORMATS[fmt]}
    except MemoryError:
        raise error(f"{path}: the sparse matrix does not fit in memory ({n_bytes} bytes)") from None
    except (ValueError, OSError, EOFError, zlib.error, zipfile.BadZipFile) as exc:
        reason = " ".join(str(exc).split())
        raise error(f"{path}: a member is damaged ({reason})") from None
    try:
        X = _matrix(fmt, arrays, (n_rows, n_features))
    except MemoryError:
        raise error(f"{path}: the sparse matrix does not fit in memory ({n_bytes} bytes)") from None
    except (ValueError, IndexError, TypeError, OverflowError) as exc:
        reason = " ".join(str(exc).split())
        raise error(f"{path}: not a valid sparse {fmt} matrix ({reason})") from None
    check_values(X, str(path), error)
    return X


def _format_of(archive, path: Path, header_of, error) -> str:
    shape, dtype = header_of(archive, "format")
    value = None
    if shape == () and dtype.kind in "SU" and dtype.itemsize <= 64:
        value = archive["format"].item()
        if isinstance(value, bytes):
            value = value.decode("ascii", "replace")
    if value not in FORMATS:
        got = repr(value) if value is not None else f"an array of shape {shape}, dtype {dtype}"
        raise error(
            f"{path}: format must be one of {sorted(FORMATS)}, got {got} (convert with "
            "X.tocsr() before scipy.sparse.save_npz)"
        )
    return value


def _shape_of(archive, path: Path, header_of, error) -> tuple[int, int]:
    shape_shape, dtype = header_of(archive, "shape")
    if shape_shape != (2,) or dtype.kind not in "iu":
        raise error(
            f"{path}: shape must be two non-negative integers, got an array of shape "
            f"{shape_shape}, dtype {dtype}"
        )
    shape = archive["shape"]
    if (shape < 0).any():
        raise error(f"{path}: shape must be two non-negative integers, got {shape.tolist()!r}")
    n_rows, n_features = (int(v) for v in shape)
    if n_features == 0:
        raise error(f"{path}: the sparse matrix has 0 features")
    return n_rows, n_features


def _matrix(fmt: str, arrays: dict, shape: tuple[int, int]) -> sp.csr_matrix:
    """The CSR float64 matrix, its structure checked in full (ValueError when broken)."""
    data = arrays["data"].astype(np.float64)
    if fmt == "coo":
        row, col = arrays["row"].astype(np.int64), arrays["col"].astype(np.int64)
        for name, index, bound in (("row", row, shape[0]), ("col", col, shape[1])):
            if len(index) and (index.min() < 0 or index.max() >= bound):
                raise ValueError(f"{name} index out of range [0, {bound})")
        X = sp.coo_matrix((data, (row, col)), shape=shape).tocsr()
    else:
        indices, indptr = arrays["indices"].astype(np.int64), arrays["indptr"].astype(np.int64)
        major, minor = (shape[0], shape[1]) if fmt == "csr" else (shape[1], shape[0])
        if len(indptr) != major + 1:
            raise ValueError(f"indptr has {len(indptr)} entries, expected {major + 1}")
        if indptr[0] != 0 or (np.diff(indptr) < 0).any() or indptr[-1] != len(data):
            raise ValueError(
                f"indptr must rise from 0 to the number of stored values ({len(data)}) without "
                f"falling; it runs from {indptr[0]} to {indptr[-1]}"
            )
        if len(indices) and (indices.min() < 0 or indices.max() >= minor):
            raise ValueError(f"an index is out of range [0, {minor})")
        kind = sp.csr_matrix if fmt == "csr" else sp.csc_matrix
        X = kind((data, indices, indptr), shape=shape)
        X = X.tocsr()
    X.sum_duplicates()  # sorted indices, one value a column
    return X


def check_values(X: sp.csr_matrix, what: str, error) -> None:
    """``error`` naming the first row whose stored value is NaN, infinite or beyond
    float32's range (the map and the service compute in float32)."""
    bad = ~np.isfinite(X.data) | (np.abs(X.data) > np.finfo(np.float32).max)
    if bad.any():
        at = int(np.flatnonzero(bad)[0])
        row = int(np.searchsorted(X.indptr, at, side="right") - 1)
        value = X.data[at]
        kind = "NaN or Inf" if not np.isfinite(value) else f"{value:.6g}, beyond float32's range"
        raise error(f"{what}: row {row}, column {int(X.indices[at])} holds {kind}")


def row_digests(X: sp.csr_matrix) -> np.ndarray:
    """sha256 of each row's canonical CSR form (module docstring): (n, 32) uint8."""
    X = sp.csr_matrix(X, dtype=np.float64)
    X.sum_duplicates()
    X.eliminate_zeros()
    out = np.empty((X.shape[0], 32), dtype=np.uint8)
    for i in range(X.shape[0]):
        start, stop = X.indptr[i], X.indptr[i + 1]
        digest = hashlib.sha256(X.indices[start:stop].astype(np.int64).tobytes())
        digest.update(X.data[start:stop].tobytes())
        out[i] = np.frombuffer(digest.digest(), dtype=np.uint8)
    return out
