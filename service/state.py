"""The application's state, shared by every wire (HTTP /v1, /v2 REST, gRPC): settings, the
engine (the model, the in-flight gate, the batcher), metrics and tracing; and the API-key
check. No web framework here."""

from __future__ import annotations

import hmac
from dataclasses import dataclass, field

from service.config import Settings
from service.engine.infer import Engine
from service.errors import Unauthorized
from service.ops.metrics import Metrics
from service.ops.tracing import NoTracing, Tracing
from service.ops.workers import ReloadGeneration


@dataclass
class AppState:
    settings: Settings
    engine: Engine
    metrics: Metrics
    generation: ReloadGeneration | None = None  # shared with the other workers, if any
    tracing: Tracing | NoTracing = field(default_factory=NoTracing)


def state_of(request) -> AppState:
    """The state of the app serving ``request`` (a Starlette request of any wire)."""
    return request.app.state.ncaknn


def check_key(authorization: str | None, key) -> None:
    """401 unless the Authorization value carries ``key``; no check when ``key`` is None."""
    if key is not None:
        check_bearer(authorization or "", key)


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
