"""Bodies to arrays: one strict msgspec decode of a JSON body (numbers must be JSON numbers,
unknown fields refused; a count of commas bounds the values before anything is decoded), or
a raw ``.npy`` body whose header is read (``service.core.npy``: no ``ast``, so any number of
threads may parse at once) and checked (dtype: integer or float of at most 8 bytes; 2-D;
rows within the limit; D columns; exactly the declared size) before any data is touched;
and arrays back to ``.npy`` bytes."""

from __future__ import annotations

import io

import msgspec
import numpy as np

from service.core.npy import NpyFormatError, array_of, read_header
from service.errors import EmptyBatch, InvalidInput, PayloadTooLarge
from service.wire.bodies import NPY_HEADER_MAX, describe_unicode_error


def describe_decode_error(exc: msgspec.MsgspecError) -> str:
    text = str(exc)
    if isinstance(exc, msgspec.DecodeError) and not isinstance(exc, msgspec.ValidationError):
        return f"body is not valid JSON ({text})"
    return text.replace("`$.", "`").replace("`$`", "`body`")


def parse_json(body: bytes, schema: type[msgspec.Struct], *, n_features: int, max_rows: int):
    """One strict decode of a JSON body into ``schema``; the instances are not yet checked."""
    # rows of D numbers (D + 1 commas a row), or of at most D (index, value) pairs each
    # (2D + 2) when the body names sparse_instances
    sparse = b'"sparse_instances"' in body
    per_row = 2 * n_features + 2 if sparse else n_features + 1
    if body.count(b",") > max_rows * per_row + 64:
        what = f"{n_features} (index, value) pairs" if sparse else f"{n_features} values"
        raise PayloadTooLarge(
            f"the body holds more values than {max_rows} instances of {what} "
            f"(max_batch_rows x D); send fewer rows per request"
        )
    try:
        return msgspec.json.decode(body, type=schema)
    except msgspec.MsgspecError as exc:
        raise InvalidInput(describe_decode_error(exc)) from None
    except UnicodeDecodeError as exc:
        raise InvalidInput(describe_unicode_error(exc)) from None


def parse_npy(body: bytes, *, n_features: int, max_rows: int) -> np.ndarray:
    """A 2-D numeric .npy body -> an array (n, D) of its dtype, header checked first (read by
    ``service.core.npy``, without ``ast``: safe from any number of threads at once)."""
    try:
        header = read_header(body, NPY_HEADER_MAX)
    except NpyFormatError as exc:
        raise InvalidInput(str(exc)) from None
    dtype = header.dtype
    if dtype.kind not in "iuf" or dtype.itemsize > 8:
        raise InvalidInput(
            f"instances must be integers or floats of at most 8 bytes, the .npy dtype is "
            f"{dtype.str!r}"
        )
    shape = header.shape
    if len(shape) != 2:
        raise InvalidInput(
            f"instances must be a 2-D array (n, D), the .npy array has shape {shape}"
        )
    n, width = shape
    if n == 0:
        raise EmptyBatch("instances is empty; send at least one row")
    if n > max_rows:
        raise PayloadTooLarge(f"{n} instances in one request; the limit is {max_rows}")
    if width != n_features:
        raise InvalidInput(
            f"each instance must have {n_features} features (the model's D), got {width}"
        )
    try:
        return array_of(body, header)
    except NpyFormatError as exc:
        raise InvalidInput(str(exc)) from None


def npy_bytes(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, np.ascontiguousarray(array), allow_pickle=False)
    return buffer.getvalue()
