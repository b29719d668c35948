"""HEAD answered as GET without a body (RFC 9110, 9.3.2), on every path a GET route serves:
the same status and headers, ``Content-Length`` the GET answer's, no body bytes. FastAPI's
routes accept only the methods they declare, so a HEAD is dispatched to the GET route with
a copy of the request whose method is GET, and what it answers is sent without its body
(the server, which holds the original HEAD request, sends no body either). A path without a
GET route keeps its 405, whose ``Allow`` then lists HEAD wherever it lists GET
(``tests/service/server/test_head.py``)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from starlette.routing import BaseRoute, Match

Send = Callable[[dict[str, Any]], Awaitable[None]]


def as_get(routes: Iterable[BaseRoute], scope: dict[str, Any]) -> dict[str, Any] | None:
    """The HEAD request ``scope`` as a GET (a copy), when a GET route serves its path;
    else None (the HEAD goes its own way: 404, or 405 naming the allowed methods)."""
    get = {**scope, "method": "GET"}
    for route in routes:
        if route.matches(get)[0] == Match.FULL:
            return get
    return None


def without_body(send: Send) -> Send:
    """``send`` for a HEAD answer: the start (status, headers) as it is, every body message
    empty (whether more follows unchanged)."""

    async def send_head(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body" and message.get("body"):
            message = {**message, "body": b""}
        await send(message)

    return send_head


def allow_with_head(allow: str) -> str:
    """An ``Allow`` header's methods with HEAD wherever GET is (HEAD is answered as GET)."""
    methods = [m.strip() for m in allow.split(",") if m.strip()]
    if "GET" in methods and "HEAD" not in methods:
        methods.append("HEAD")
    return ", ".join(methods)
