"""Request bodies to arrays: JSON or raw ``application/x-npy``, with every check named.

Numbers end up as a C-contiguous float32 (n, D) array. Refused: bodies over the size limit
(413), unknown content types (415), malformed JSON or npy, non-numeric or ragged rows, NaN or
Inf (also values that overflow float32), the wrong number of features (422), an empty batch
(400), more rows than the batch limit (413).
"""

from __future__ import annotations

import io

import numpy as np
from pydantic import BaseModel, ValidationError

from service.errors import EmptyBatch, InvalidInput, PayloadTooLarge, UnsupportedMediaType

JSON = "application/json"
NPY = "application/x-npy"


def media_type(content_type: str | None) -> str:
    return (content_type or JSON).split(";")[0].strip().lower()


def parse_json(body: bytes, model: type[BaseModel]) -> BaseModel:
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        raise InvalidInput(describe_validation_error(exc)) from None


def describe_validation_error(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors()[:3]:
        where = ".".join(str(p) for p in err.get("loc", ())) or "body"
        parts.append(f"{where}: {err.get('msg')}")
    more = len(exc.errors()) - 3
    return "; ".join(parts) + (f" (and {more} more)" if more > 0 else "")


def parse_npy(body: bytes) -> np.ndarray:
    try:
        array = np.load(io.BytesIO(body), allow_pickle=False)
    except (ValueError, OSError, EOFError) as exc:
        raise InvalidInput(f"body is not a readable .npy array without pickle ({exc})") from None
    if not isinstance(array, np.ndarray):
        raise InvalidInput("body must hold one .npy array")
    if array.dtype.kind not in "biuf":
        raise InvalidInput(f"instances must be numbers, the .npy array has dtype {array.dtype}")
    if array.ndim != 2:
        raise InvalidInput(
            f"instances must be a 2-D array (n, D), the .npy array has shape {array.shape}"
        )
    return array


def to_rows(instances, *, n_features: int, max_rows: int) -> np.ndarray:
    """Validate a list of rows (or an array) and return float32 (n, D)."""
    if isinstance(instances, np.ndarray):
        n = instances.shape[0]
    else:
        n = len(instances)
    if n == 0:
        raise EmptyBatch("instances is empty; send at least one row")
    if n > max_rows:
        raise PayloadTooLarge(f"{n} instances in one request; the limit is {max_rows}")
    if not isinstance(instances, np.ndarray):
        widths = {len(row) for row in instances}
        if len(widths) != 1:
            raise InvalidInput(
                f"instances are ragged: rows have {sorted(widths)} values; all need {n_features}"
            )
        with np.errstate(over="ignore"):
            instances = np.asarray(instances, dtype=np.float64)
    if instances.shape[1] != n_features:
        raise InvalidInput(
            f"each instance must have {n_features} features (the model's D), got {instances.shape[1]}"
        )
    with np.errstate(over="ignore", invalid="ignore"):
        rows = np.ascontiguousarray(instances, dtype=np.float32)
    if not np.isfinite(rows).all():
        r, c = np.argwhere(~np.isfinite(rows))[0]
        raise InvalidInput(
            f"instances[{r}][{c}] is NaN, Inf or beyond float32 range; all values must be finite"
        )
    return rows


def npy_bytes(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, np.ascontiguousarray(array), allow_pickle=False)
    return buffer.getvalue()


def check_media(content_type: str | None, allowed: tuple[str, ...]) -> str:
    kind = media_type(content_type)
    if kind not in allowed:
        raise UnsupportedMediaType(
            f"Content-Type {kind!r} is not accepted here; use one of {list(allowed)}"
        )
    return kind
