"""Request bodies: the size limit for a model (what ``max_batch_rows`` rows of D values can
take in that encoding, never more than ``max_body_bytes``), and reading a body while it
streams in (413 as soon as it passes the limit), its bytes reserved as they arrive in the
worker's budget of bodies in flight (``service.ops.bodies``: 429 before a body that does not
fit is read)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from service.errors import PayloadTooLarge
from service.wire.integers import parse_count
from service.wire.media import NPY

if TYPE_CHECKING:
    from service.ops.bodies import BodyHold


JSON_BYTES_PER_VALUE = 48  # generous: "-1.1754943508222875e-38," plus pretty-printing
JSON_BYTES_PER_ROW = 64
JSON_BYTES_EXTRA = 64 * 1024  # the other fields, whitespace
NPY_HEADER_MAX = 65536 + 16  # npy format 2.0 headers are at most 4 GiB in theory; numpy
# itself refuses headers over 10,000 bytes unless told otherwise (max_header_size)


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
