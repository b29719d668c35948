"""Typed dependencies and the checks every route shares: the app's state, auth, the gate."""

from __future__ import annotations

import hmac
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request

from service.batcher import Batcher
from service.config import Settings
from service.engine import Engine
from service.errors import Overloaded, Unauthorized
from service.metrics import Metrics
from service.workers import ReloadGeneration


@dataclass
class AppState:
    settings: Settings
    engine: Engine
    metrics: Metrics
    batcher: Batcher | None = None
    generation: ReloadGeneration | None = None  # shared with the other workers, if any
    in_flight: int = 0

    @contextmanager
    def admit(self):
        """The in-flight gate: fail fast with 429 rather than queue without bound."""
        if self.in_flight >= self.settings.max_in_flight:
            raise Overloaded(
                f"{self.in_flight} requests in flight, the limit is "
                f"{self.settings.max_in_flight}; retry later"
            )
        self.in_flight += 1
        self.metrics.in_flight.inc()
        try:
            yield
        finally:
            self.in_flight -= 1
            self.metrics.in_flight.dec()


# Dependencies are `async def` on purpose: FastAPI runs plain `def` dependencies in its thread
# pool, one thread hop each per request.


async def get_state(request: Request) -> AppState:
    return request.app.state.ncaknn


State = Annotated[AppState, Depends(get_state)]


def check_api_key(request: Request, key) -> None:
    """401 unless ``Authorization: Bearer <key>`` carries ``key`` (no check when None).

    Keys are validated at startup (non-empty, no whitespace), the header's token is taken
    exactly after 'Bearer ' and compared in constant time.
    """
    if key is None:
        return
    check_bearer(request.headers.get("authorization", ""), key)


def check_bearer(header: str, key) -> None:
    """401 unless the Authorization value ``header`` is ``Bearer <key>`` (constant time)."""
    scheme, _, token = header.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        raise Unauthorized("missing API key: send 'Authorization: Bearer <key>'")
    if not hmac.compare_digest(token.encode(), key.get_secret_value().encode()):
        raise Unauthorized("the API key is not valid")


def check_admin_key(request: Request, settings: Settings) -> None:
    """Admin routes take the admin key when one is set, else the API key."""
    check_api_key(request, settings.admin_api_key or settings.api_key)


async def require_api_key(request: Request, state: State) -> None:
    check_api_key(request, state.settings.api_key)


async def require_admin_key(request: Request, state: State) -> None:
    check_admin_key(request, state.settings)
