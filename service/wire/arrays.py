"""Bodies to arrays: one strict msgspec decode of a JSON body (numbers must be JSON numbers,
unknown fields refused; a count of commas bounds the values before anything is decoded), or
a raw ``.npy`` body whose header is read and checked (dtype: integer or float of at most 8
bytes; 2-D; rows within the limit; D columns; exactly the declared size) before any data is
touched; and arrays back to ``.npy`` bytes."""

from __future__ import annotations

import ast
import io

import msgspec
import numpy as np

from service.errors import EmptyBatch, InvalidInput, PayloadTooLarge
from service.wire.bodies import NPY_HEADER_MAX, describe_unicode_error

NPY_MAGIC = b"\x93NUMPY"


def describe_decode_error(exc: msgspec.MsgspecError) -> str:
    text = str(exc)
    if isinstance(exc, msgspec.DecodeError) and not isinstance(exc, msgspec.ValidationError):
        return f"body is not valid JSON ({text})"
    return text.replace("`$.", "`").replace("`$`", "`body`")


def parse_json(body: bytes, schema: type[msgspec.Struct], *, n_features: int, max_rows: int):
    """One strict decode of a JSON body into ``schema``; the instances are not yet checked."""
    if body.count(b",") > max_rows * (n_features + 1) + 64:
        raise PayloadTooLarge(
            f"the body holds more values than {max_rows} instances of {n_features} "
            f"(max_batch_rows x D); send fewer rows per request"
        )
    try:
        return msgspec.json.decode(body, type=schema)
    except msgspec.MsgspecError as exc:
        raise InvalidInput(describe_decode_error(exc)) from None
    except UnicodeDecodeError as exc:
        raise InvalidInput(describe_unicode_error(exc)) from None


def parse_npy(body: bytes, *, n_features: int, max_rows: int) -> np.ndarray:
    """A 2-D numeric .npy body -> an array (n, D) of its dtype, header checked first."""
    if len(body) < 10 or body[:6] != NPY_MAGIC:
        raise InvalidInput("body is not an .npy array (it does not start with the .npy magic)")
    major = body[6]
    if major == 1:
        header_len, start = int.from_bytes(body[8:10], "little"), 10
    elif major in (2, 3):
        if len(body) < 12:
            raise InvalidInput("the .npy header is truncated")
        header_len, start = int.from_bytes(body[8:12], "little"), 12
    else:
        raise InvalidInput(f".npy format version {major} is not supported (1, 2 or 3)")
    if start + header_len > len(body) or header_len > NPY_HEADER_MAX:
        raise InvalidInput(f"the .npy header declares {header_len} bytes; the body is shorter")
    shape, fortran, dtype = _npy_header(body[start : start + header_len])
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
    data_start = start + header_len
    expected = n * width * dtype.itemsize
    actual = len(body) - data_start
    if actual != expected:
        raise InvalidInput(
            f"the .npy header declares {shape} {dtype} ({expected} bytes of data), the body "
            f"holds {actual} bytes after the header"
            + (" (truncated)" if actual < expected else " (extra bytes after the array)")
        )
    array = np.frombuffer(body, dtype=dtype, count=n * width, offset=data_start)
    return array.reshape(shape, order="F" if fortran else "C")


def _npy_header(text: bytes) -> tuple[tuple[int, ...], bool, np.dtype]:
    try:
        header = ast.literal_eval(text.decode("latin1"))
    except (ValueError, SyntaxError, MemoryError, RecursionError, UnicodeDecodeError):
        raise InvalidInput("the .npy header is not a readable dictionary") from None
    if not isinstance(header, dict) or set(header) != {"descr", "fortran_order", "shape"}:
        raise InvalidInput("the .npy header must hold exactly descr, fortran_order and shape")
    shape, fortran, descr = header["shape"], header["fortran_order"], header["descr"]
    if not (isinstance(shape, tuple) and all(type(s) is int and s >= 0 for s in shape)):
        raise InvalidInput(f"the .npy shape {shape!r} is not a tuple of sizes")
    if not isinstance(fortran, bool):
        raise InvalidInput("the .npy fortran_order must be True or False")
    try:
        dtype = np.dtype(descr) if isinstance(descr, str) else None
    except (TypeError, ValueError):
        dtype = None
    if dtype is None or dtype.kind not in "iuf" or dtype.itemsize > 8 or dtype.shape != ():
        raise InvalidInput(
            f"instances must be integers or floats of at most 8 bytes, the .npy dtype is {descr!r}"
        )
    return shape, fortran, dtype


def npy_bytes(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, np.ascontiguousarray(array), allow_pickle=False)
    return buffer.getvalue()
