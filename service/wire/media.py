"""Media types: the Content-Type check and Accept negotiation (RFC 9110) of the two
encodings every wire takes, JSON and ``.npy``."""

from __future__ import annotations

from service.errors import NotAcceptable, UnsupportedMediaType

JSON = "application/json"
NPY = "application/x-npy"


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
