"""Who is calling: the app state of a request of any wire (``state_of``) and the API key
(``check_key``, ``check_bearer``: exactly one ``Authorization: Bearer <key>``, compared in
constant time)."""

from __future__ import annotations

import hmac
from typing import TYPE_CHECKING

from service.errors import Unauthorized

if TYPE_CHECKING:
    from service.state import AppState


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
