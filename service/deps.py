"""Typed dependencies for the routes: the app's state, the current model, auth, the gate."""

from __future__ import annotations

import hmac
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request

from service.batcher import Batcher
from service.config import Settings
from service.engine import Engine, LoadedModel
from service.errors import Overloaded, PayloadTooLarge, Unauthorized
from service.metrics import Metrics


@dataclass
class AppState:
    settings: Settings
    engine: Engine
    metrics: Metrics
    batcher: Batcher | None = None
    in_flight: int = 0

    @contextmanager
    def admit(self):
        """The in-flight gate: fail fast with 429 rather than queue without bound."""
        if self.in_flight >= self.settings.max_in_flight:
            raise Overloaded(
                f"{self.in_flight} requests in flight, the limit is {self.settings.max_in_flight}; retry later"
            )
        self.in_flight += 1
        self.metrics.in_flight.inc()
        try:
            yield
        finally:
            self.in_flight -= 1
            self.metrics.in_flight.dec()


# Dependencies are `async def` on purpose: FastAPI runs plain `def` dependencies in its thread
# pool, one thread hop each per request (py-spy showed it dominating the classify path).


async def get_state(request: Request) -> AppState:
    return request.app.state.ncaknn


State = Annotated[AppState, Depends(get_state)]


async def current_model(state: State) -> LoadedModel:
    return state.engine.current()


Model = Annotated[LoadedModel, Depends(current_model)]


def check_api_key(request: Request, key) -> None:
    if key is None:
        return
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token:
        raise Unauthorized("missing API key: send 'Authorization: Bearer <key>'")
    if not hmac.compare_digest(token.strip().encode(), key.get_secret_value().encode()):
        raise Unauthorized("the API key is not valid")


async def require_api_key(request: Request, state: State) -> None:
    check_api_key(request, state.settings.api_key)


async def read_body(request: Request, state: State) -> bytes:
    """The request body, refused with 413 as soon as it passes the size limit."""
    limit = state.settings.max_body_bytes
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"request body of {declared} bytes; the limit is {limit}")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"request body over {limit} bytes; the limit is {limit}")
        chunks.append(chunk)
    return b"".join(chunks)


Body = Annotated[bytes, Depends(read_body)]
