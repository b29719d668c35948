"""Input rows: not empty (400), within the row limit (413), D values each (422), every value
finite and within the model's input range ``[-abs_max, abs_max]`` (beyond it the embedding
would overflow float32) (422), as a C-contiguous float32 array (n, D)."""

from __future__ import annotations

import numpy as np

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
