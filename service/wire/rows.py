"""Input rows: not empty (400), within the row limit (413), D values each (422), every value
finite and within the model's input range ``[-abs_max, abs_max]`` (beyond it the embedding
would overflow float32) (422), as a C-contiguous float32 array (n, D); or rows given by their
non-zeros (:func:`to_sparse_rows`), the same checks on their values, as ``SparseRows``."""

from __future__ import annotations

import numpy as np

from service.core.sparse import SparseRows
from service.errors import EmptyBatch, InvalidInput, PayloadTooLarge


def to_rows(instances, *, n_features: int, max_rows: int, abs_max: float) -> np.ndarray:
    """Validate a list of rows (or an (n, D) array) and return float32 (n, D)."""
    n = instances.shape[0] if isinstance(instances, np.ndarray) else len(instances)
    if n == 0:
        raise EmptyBatch("instances is empty; send at least one row")
    if n > max_rows:
        raise PayloadTooLarge(f"{n} instances in one request; the limit is {max_rows}")
    if not isinstance(instances, np.ndarray):
        widths = {len(row) for row in instances}
        if len(widths) != 1:
            raise InvalidInput(
                f"instances are ragged: rows have {sorted(widths)[:5]} values; all need "
                f"{n_features}"
            )
        instances = np.array(instances, dtype=np.float64)
    if instances.shape[1] != n_features:
        raise InvalidInput(
            f"each instance must have {n_features} features (the model's D), got "
            f"{instances.shape[1]}"
        )
    values = np.asarray(instances)
    # the bound in the values' own type, except where it cannot hold it (float16: it would
    # overflow to inf with a RuntimeWarning, or round): there in float64
    small = values.dtype.kind == "f" and values.dtype.itemsize < 4
    bound = np.float64(abs_max) if small else abs_max
    inside = np.abs(values) <= bound  # False for NaN and Inf: one pass checks all three
    if not inside.all():
        r, c = np.argwhere(~inside)[0]
        if values.dtype.kind == "f" and not np.isfinite(values[r, c]):
            raise InvalidInput(f"instances[{r}][{c}] is NaN or Inf; all values must be finite")
        raise InvalidInput(
            f"instances[{r}][{c}] = {float(values[r, c]):.6g} is outside this model's input "
            f"range [-{abs_max:.6g}, {abs_max:.6g}] (beyond it the embedding overflows float32)"
        )
    return np.ascontiguousarray(values, dtype=np.float32)


def to_sparse_rows(instances, *, n_features: int, max_rows: int, abs_max: float) -> SparseRows:
    """Validate rows given by their non-zeros (objects with ``indices`` and ``values``,
    decoded strictly: integers and numbers) and return them as :class:`SparseRows`: not
    empty (400), within the row limit (413), as many values as indices, every index in
    [0, D) and none twice in a row, every value finite and within the model's input range
    (422, naming the row and the position)."""
    n = len(instances)
    if n == 0:
        raise EmptyBatch("sparse_instances is empty; send at least one row")
    if n > max_rows:
        raise PayloadTooLarge(f"{n} sparse_instances in one request; the limit is {max_rows}")
    counts = np.empty(n, dtype=np.int64)
    for i, row in enumerate(instances):
        if len(row.indices) != len(row.values):
            raise InvalidInput(
                f"sparse_instances[{i}] has {len(row.indices)} indices and {len(row.values)} "
                "values; each index needs its value"
            )
        counts[i] = len(row.indices)
    indptr = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(counts, out=indptr[1:])
    flat_indices = [j for row in instances for j in row.indices]
    flat_values = [v for row in instances for v in row.values]
    try:
        indices = np.array(flat_indices, dtype=np.int64)
    except OverflowError:
        indices = None
    if indices is None or (len(indices) and (indices.min() < 0 or indices.max() >= n_features)):
        at = next(p for p, j in enumerate(flat_indices) if not 0 <= j < n_features)
        row, position = _located(indptr, at)
        raise InvalidInput(
            f"sparse_instances[{row}].indices[{position}] = {flat_indices[at]} is not a column "
            f"of this model: indices lie in [0, {n_features})"
        )
    values = np.array(flat_values, dtype=np.float64)
    inside = np.abs(values) <= abs_max  # False for NaN and Inf
    if not inside.all():
        at = int(np.flatnonzero(~inside)[0])
        row, position = _located(indptr, at)
        where = f"sparse_instances[{row}].values[{position}]"
        if not np.isfinite(values[at]):
            raise InvalidInput(f"{where} is NaN or Inf; all values must be finite")
        raise InvalidInput(
            f"{where} = {values[at]:.6g} is outside this model's input range [-{abs_max:.6g}, "
            f"{abs_max:.6g}] (beyond it the embedding overflows float32)"
        )
    order = _check_no_repeats(indices, indptr)
    # each row's non-zeros by ascending column: its sum then does not depend on the order
    # the client sent them in
    return SparseRows(indptr, indices[order], values[order].astype(np.float32), n_features)


def _located(indptr: np.ndarray, at: int) -> tuple[int, int]:
    """(row, position in the row) of the ``at``-th non-zero."""
    row = int(np.searchsorted(indptr, at, side="right") - 1)
    return row, at - int(indptr[row])


def _check_no_repeats(indices: np.ndarray, indptr: np.ndarray) -> np.ndarray:
    """The order (nnz,) that sorts the non-zeros by row, then column; InvalidInput naming
    the first row that gives a column twice (its two values would be summed silently
    otherwise)."""
    rows = np.repeat(np.arange(len(indptr) - 1), np.diff(indptr))
    order = np.lexsort((indices, rows))  # by row, then column
    same = (rows[order][1:] == rows[order][:-1]) & (indices[order][1:] == indices[order][:-1])
    if same.any():
        at = int(np.flatnonzero(same)[0])
        row, column = int(rows[order][at]), int(indices[order][at])
        raise InvalidInput(
            f"sparse_instances[{row}].indices gives column {column} twice; each column at "
            "most once a row"
        )
    return order
