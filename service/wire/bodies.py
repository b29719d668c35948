"""Request bodies and media types, shared by the HTTP wires (/v1 and the Open Inference
Protocol's REST): the media types, Accept negotiation, the body-size limit for a model and
reading a body while it streams in (413 as soon as it passes the limit), and the message for
JSON text that is not UTF-8."""

from __future__ import annotations

from starlette.requests import Request

from service.errors import NotAcceptable, PayloadTooLarge, UnsupportedMediaType
from service.wire.integers import parse_count

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


async def read_body(request: Request, limit: int, what: str) -> bytes:
    """The request body, refused with 413 as soon as it passes ``limit``."""
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
        chunks.append(chunk)
    return b"".join(chunks)
