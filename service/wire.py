"""Requests, read the same way on every wire (HTTP /v1, the Open Inference Protocol's REST
and gRPC): who may call, what may come in, and how it becomes rows.

* **The caller**: the app state of a request (``state_of``) and the API key
  (``check_key``, ``check_bearer``: exactly one ``Authorization: Bearer <key>``, compared in
  constant time).
* **Media types and bodies**: Accept negotiation (RFC 9110), the Content-Type check, the
  body-size limit for a model (what ``max_batch_rows`` rows of D values can take in that
  encoding, never more than ``max_body_bytes``), and reading a body while it streams in (413
  as soon as it passes the limit), its bytes reserved first in the worker's budget of bodies
  in flight (``service.ops.bodies``: 429 before a body that does not fit is read).
* **Integers off a wire**, strictly: Python's ``int(text)`` accepts ``"²"`` and other Unicode
  digits, underscores (``"1_000"``), signs and surrounding whitespace, and raises
  ``ValueError`` past 4,300 digits; ``parse_count`` accepts exactly ``[0-9]{1,MAX_DIGITS}``.
  JSON numbers are decoded by msgspec into Python ints of any size; ``check_int_range``
  bounds them before numpy or an index sees them.
* **Bodies to arrays**: one strict msgspec decode of a JSON body (numbers must be JSON
  numbers, unknown fields refused; a count of commas bounds the values before anything is
  decoded), or a raw ``.npy`` body whose header is read and checked (dtype: integer or float
  of at most 8 bytes; 2-D; rows within the limit; D columns; exactly the declared size)
  before any data is touched.
* **Input rows**: not empty (400), within the row limit (413), D values each (422), every
  value finite and within the model's input range ``[-abs_max, abs_max]`` (beyond it the
  embedding would overflow float32) (422), as a C-contiguous float32 array (n, D).

Every refusal is one of ``service.errors``' types and names what was wrong and what was
expected. No web framework is imported here (``tests/test_boundaries.py``). Tests: ``tests/service/http/test_bad_input_corpus.py``, ``test_wire_integers.py``,
``test_api.py``, ``test_v2_protocol.py``.
"""

from __future__ import annotations

import ast
import hmac
import io
import math
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np

from service.errors import (
    EmptyBatch,
    InvalidInput,
    NotAcceptable,
    PayloadTooLarge,
    Unauthorized,
    UnsupportedMediaType,
)

if TYPE_CHECKING:
    from service.ops.bodies import BodyHold
    from service.state import AppState

# ------------------------------------------------------------ the caller


def state_of(request) -> AppState:
    """The state of the app serving ``request`` (a Starlette request of any wire)."""
    return request.app.state.ncaknn


def check_key(authorizations: list[str], key) -> None:
    """401 unless the request's one Authorization value carries ``key``; no check when
    ``key`` is None. ``authorizations`` holds every Authorization value the request sent
    (HTTP headers or gRPC metadata): more than one is refused as ambiguous, whichever a
    proxy or a library would have picked."""
    if key is None:
        return
    if len(authorizations) > 1:
        raise Unauthorized(
            f"the request carries {len(authorizations)} Authorization values; credentials "
            "must be unambiguous: send exactly one 'Authorization: Bearer <key>'"
        )
    check_bearer(authorizations[0] if authorizations else "", key)


def check_bearer(header: str, key) -> None:
    """401 unless the Authorization value ``header`` is ``Bearer <key>`` (constant time).

    Keys are validated at startup (non-empty, no whitespace); the token is taken exactly
    after 'Bearer ' and compared in constant time."""
    scheme, _, token = header.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        raise Unauthorized("missing API key: send 'Authorization: Bearer <key>'")
    if not hmac.compare_digest(token.encode(), key.get_secret_value().encode()):
        raise Unauthorized("the API key is not valid")


# ------------------------------------------------ media types and bodies


JSON = "application/json"
NPY = "application/x-npy"
JSON_BYTES_PER_VALUE = 48  # generous: "-1.1754943508222875e-38," plus pretty-printing
JSON_BYTES_PER_ROW = 64
JSON_BYTES_EXTRA = 64 * 1024  # the other fields, whitespace
NPY_HEADER_MAX = 65536 + 16  # npy format 2.0 headers are at most 4 GiB in theory; numpy
# itself refuses headers over 10,000 bytes unless told otherwise (max_header_size)


def media_type(content_type: str | None) -> str:
    return (content_type or JSON).split(";")[0].strip().lower()


def check_media(content_type: str | None, allowed: tuple[str, ...]) -> str:
    kind = media_type(content_type)
    if kind not in allowed:
        raise UnsupportedMediaType(
            f"Content-Type {kind!r} is not accepted here; use one of {list(allowed)}"
        )
    return kind


def negotiate(accept: str | None, offered: tuple[str, ...]) -> str:
    """The offered media type the Accept header prefers (RFC 9110 section 12.5.1).

    Each offered type takes the quality of the most specific range that matches it
    (``type/subtype`` over ``type/*`` over ``*/*``); ``q=0`` excludes it. The highest
    quality wins, ties go to the earlier offered type. No Accept header: the first offered.
    Raises NotAcceptable when nothing offered is acceptable.
    """
    if accept is None or not accept.strip():
        return offered[0]
    ranges = []
    for part in accept.split(","):
        fields = [f.strip() for f in part.split(";")]
        media = fields[0].lower()
        if not media:
            continue
        quality = 1.0
        for param in fields[1:]:
            name, _, value = param.partition("=")
            if name.strip().lower() == "q":
                try:
                    quality = min(1.0, max(0.0, float(value)))
                except ValueError:
                    quality = 0.0
        ranges.append((media, quality))
    best, best_q = None, 0.0
    for kind in offered:
        main = kind.split("/")[0]
        specificity, quality = -1, 0.0
        for media, q in ranges:
            level = (
                2 if media == kind else 1 if media == f"{main}/*" else 0 if media == "*/*" else -1
            )
            if level > specificity:
                specificity, quality = level, q
        if specificity >= 0 and quality > best_q:
            best, best_q = kind, quality
    if best is None:
        raise NotAcceptable(f"Accept {accept!r}: this route returns one of {list(offered)}")
    return best


def body_limit(kind: str, *, n_features: int, max_rows: int, max_body_bytes: int) -> int:
    """The largest body accepted for a model with D = n_features: what max_rows rows can take
    in that encoding, and never more than max_body_bytes."""
    if kind == NPY:
        needed = NPY_HEADER_MAX + max_rows * n_features * 8
    else:
        needed = JSON_BYTES_EXTRA + max_rows * (
            n_features * JSON_BYTES_PER_VALUE + JSON_BYTES_PER_ROW
        )
    return min(max_body_bytes, needed)


def describe_unicode_error(exc: UnicodeDecodeError, what: str = "the JSON body") -> str:
    """The message for bytes that are not UTF-8 where JSON text (RFC 8259: UTF-8) is due."""
    bad = exc.object[exc.start : exc.start + 1].hex()
    return (
        f"{what} is not valid UTF-8: byte 0x{bad} at offset {exc.start} of a string "
        f"({exc.reason}); JSON text must be encoded as UTF-8"
    )


THREAD_PARSE_BYTES = 256 * 1024  # bodies larger than this are parsed in a worker thread


async def read_body(request, limit: int, what: str, hold: BodyHold) -> bytes:
    """The body of ``request`` (a Starlette request: ``headers`` and ``stream()``): refused
    with 413 before any of it is read when its Content-Length passes ``limit``, and as soon
    as what arrives passes it; every chunk reserved in ``hold`` as it arrives (429 when the
    worker's budget of bodies in flight is spent). Bytes are reserved as they arrive, not as
    declared: a client that declares a large body and sends nothing holds nothing."""
    declared = request.headers.get("content-length")
    if declared is not None and parse_count(declared.strip(), "Content-Length") > limit:
        raise PayloadTooLarge(
            f"request body of {declared.strip()} bytes; the limit is {limit} {what}"
        )
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"request body over {limit} bytes; the limit is {limit} {what}")
        hold.reserve(len(chunk))
        chunks.append(chunk)
    return b"".join(chunks)


# -------------------------------------------------------------- integers


MAX_DIGITS = 18  # every value up to 10**18 - 1 fits a signed 64-bit integer
ASCII_DIGITS = frozenset("0123456789")


def parse_count(text: str | bytes | None, what: str, *, minimum: int = 0) -> int:
    """``text`` as a non-negative decimal integer of 1 to MAX_DIGITS ASCII digits.

    ``what`` names the input in the message (``"query parameter k"``). InvalidInput when the
    text is empty, has any character other than 0-9 (signs, spaces, Unicode digits,
    underscores), more than MAX_DIGITS digits, or a value below ``minimum``.
    """
    if isinstance(text, bytes):
        text = text.decode("latin-1")
    if text is None or not text or len(text) > MAX_DIGITS or not ASCII_DIGITS.issuperset(text):
        shown = _shown(text)
        raise InvalidInput(
            f"{what} must be an integer >= {minimum} written with 1 to {MAX_DIGITS} ASCII "
            f"digits, got {shown}"
        )
    value = int(text)
    if value < minimum:
        raise InvalidInput(f"{what} must be an integer >= {minimum}, got {value}")
    return value


def check_int_range(value: Any, what: str, *, minimum: int, maximum: int | None = None) -> int:
    """A JSON integer (not a bool, not a float) within [minimum, maximum]; any size of int
    is compared exactly, so 10**30 is refused by its value, not by an overflow."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidInput(f"{what} must be an integer >= {minimum}, got {_shown(value)}")
    if value < minimum or (maximum is not None and value > maximum):
        bound = f"between {minimum} and {maximum}" if maximum is not None else f">= {minimum}"
        raise InvalidInput(f"{what} must be an integer {bound}, got {_shown(value)}")
    return value


def finite_number(value: Any, what: str) -> float:
    """A JSON number (int of any size or float, not a bool) as a finite float; InvalidInput
    for anything else, including ints too large for a float."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidInput(f"{what} must be a number, got {_shown(value)}")
    try:
        number = float(value)
    except OverflowError:
        raise InvalidInput(f"{what} must be a finite number, got {_shown(value)}") from None
    if not math.isfinite(number):
        raise InvalidInput(f"{what} must be a finite number, got {_shown(value)}")
    return number


def _shown(value: Any, limit: int = 40) -> str:
    """``repr(value)``, shortened for a message (a 5,000-digit number is not echoed)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        digits = int(value.bit_length() * math.log10(2)) + 1
        return f"{'-' if value < 0 else ''}an integer of about {digits} digits"
    text = repr(value)
    if len(text) > limit:
        return f"{text[: limit - 10]}... ({len(text)} characters)"
    return text


# ------------------------------------------------------ bodies to arrays


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


# ------------------------------------------------------------ input rows


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
    inside = np.abs(values) <= abs_max  # False for NaN and Inf: one pass checks all three
    if not inside.all():
        r, c = np.argwhere(~inside)[0]
        if values.dtype.kind == "f" and not np.isfinite(values[r, c]):
            raise InvalidInput(f"instances[{r}][{c}] is NaN or Inf; all values must be finite")
        raise InvalidInput(
            f"instances[{r}][{c}] = {float(values[r, c]):.6g} is outside this model's input "
            f"range [-{abs_max:.6g}, {abs_max:.6g}] (beyond it the embedding overflows float32)"
        )
    return np.ascontiguousarray(values, dtype=np.float32)
