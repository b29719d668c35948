"""Sparse request rows: n rows given by their non-zeros, embedded in O(nnz d).

A model fitted on sparse inputs (TF-IDF rows, say: D of 50,000 and a few hundred
non-zeros a row) maps a row x to z = x W^T + b. Sent densely, a row is D numbers; sent as
its column indices and values, the embedding reads only the map's columns it names::

    z_i = sum_{j in nz(i)} x_ij W[:, j] + b        (float64 accumulation, float32 result)

which is :func:`service.core.knn.project` of the dense row, summed in another order
(ascending columns here, BLAS's order there): the two are equal except where the float64
sum cancels, where the orders can round differently (by more than one float32 step when it
cancels beyond float64's precision). A row's embedding depends on its own non-zeros only,
so it does not depend on its batch or on the order its indices were sent in.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SparseRows:
    """n rows of n_features columns in CSR form, checked by the wire that built them
    (``service.wire.rows.to_sparse_rows``): indices within [0, n_features), ascending and
    no column twice in a row, values finite and within the model's input range."""

    indptr: np.ndarray  # (n + 1,) int64: row i's non-zeros are [indptr[i], indptr[i + 1])
    indices: np.ndarray  # (nnz,) int64 column of each non-zero
    values: np.ndarray  # (nnz,) float32 value of each non-zero
    n_features: int

    def __len__(self) -> int:
        return len(self.indptr) - 1

    def toarray(self) -> np.ndarray:
        """The dense rows (n, n_features) float32 (for tests and small models)."""
        dense = np.zeros((len(self), self.n_features), dtype=np.float32)
        rows = np.repeat(np.arange(len(self)), np.diff(self.indptr))
        dense[rows, self.indices] = self.values
        return dense


# A non-zero's share of the projection costs about this many values of a dense row's (a
# numpy gather and reduceat against a BLAS product: 64 full rows of D = 50,000 at d = 32
# took 1.17 s sparse and 0.03 s dense); it sizes what may run on the event loop.
SPARSE_NONZERO_COST = 40
# non-zeros embedded at once: at d = 32 a block's float32 gather and its two float64
# (d, 131,072) arrays hold about 80 MiB
CHUNK_NONZEROS = 1 << 17


def dense_rows_equivalent(rows) -> int:
    """The work of embedding ``rows`` counted in dense rows: len(rows) for dense rows, and
    for sparse ones at least that, or their non-zeros' cost (SPARSE_NONZERO_COST) in rows of
    n_features values. What decides whether a projection may run on the event loop."""
    if not isinstance(rows, SparseRows):
        return len(rows)
    cost = SPARSE_NONZERO_COST * len(rows.indices)
    return max(len(rows), -(-cost // rows.n_features))


def project_sparse(rows: SparseRows, projection: np.ndarray, offset: np.ndarray) -> np.ndarray:
    """rows (n, D) sparse, W (d, D) float32, b (d,) float32 -> z (n, d) float32 (module
    docstring): the columns of W the non-zeros name, weighted by their values and summed
    row by row in float64, plus b, rounded once. Rows are taken in blocks of about
    CHUNK_NONZEROS non-zeros (a row is never split), so the working memory is bounded
    whatever the request holds."""
    n, d = len(rows), projection.shape[0]
    z = np.zeros((n, d), dtype=np.float64)
    start = 0
    while start < n:
        # the block [start, stop): rows up to CHUNK_NONZEROS non-zeros past start's first
        limit = rows.indptr[start] + CHUNK_NONZEROS
        stop = max(start + 1, int(np.searchsorted(rows.indptr, limit, side="right")) - 1)
        stop = min(stop, n)
        _project_block(rows, start, stop, projection, z)
        start = stop
    z += np.asarray(offset, dtype=np.float32)
    return z.astype(np.float32)


def _project_block(rows: SparseRows, start: int, stop: int, projection, z: np.ndarray) -> None:
    """z[start:stop] = the sums of the rows' non-zeros times their columns of W, in float64
    (rows without a non-zero keep their 0)."""
    first, last = rows.indptr[start], rows.indptr[stop]
    if first == last:
        return
    columns = np.take(projection, rows.indices[first:last], axis=1).astype(np.float64)
    weighted = columns * rows.values[first:last].astype(np.float64)[None, :]  # (d, nnz)
    counts = np.diff(rows.indptr[start : stop + 1])
    filled = np.flatnonzero(counts > 0)  # the block's rows with a non-zero
    # reduceat sums [indptr[i], indptr[i + 1]) for each row that has one
    sums = np.add.reduceat(weighted, rows.indptr[start:stop][filled] - first, axis=1)
    z[start + filled] = sums.T  # (n_filled, d)
