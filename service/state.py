"""The application's state, shared by every wire (HTTP /v1, /v2 REST, gRPC): settings, the
engine holding the model, metrics, the batcher, the in-flight gate and the API-key check.
No web framework here."""

from __future__ import annotations

import asyncio
import hmac
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np

from service.config import Settings
from service.engine.batcher import Batcher
from service.engine.infer import Answer, Query, embed, infer_one
from service.engine.model import Engine
from service.errors import Overloaded, Unauthorized
from service.ops.metrics import Metrics
from service.ops.tracing import NoTracing, Tracing, record_inference
from service.ops.workers import ReloadGeneration

INLINE_EMBED_ROWS = 64  # below this, projection runs on the event loop


@dataclass
class AppState:
    settings: Settings
    engine: Engine
    metrics: Metrics
    batcher: Batcher | None = None
    generation: ReloadGeneration | None = None  # shared with the other workers, if any
    in_flight: int = 0
    tracing: Tracing | NoTracing = field(default_factory=NoTracing)

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

    async def infer(self, model, rows: np.ndarray, query: Query) -> Answer:
        """The inference path for one request: merged with others by the batcher when
        batching is on, else computed alone in a worker thread. With tracing on, the
        request's parse / queue / search / decide spans are recorded from its timings."""
        called = time.time_ns() if self.tracing.enabled else 0
        if self.batcher is not None:
            answer = await self.batcher.submit(model, rows, query)
        else:
            loop = asyncio.get_running_loop()
            answer = await loop.run_in_executor(None, infer_one, model, rows, query)
            if called and "search" in answer.timings:  # the hop to the worker thread
                answer.timings.setdefault("queue", (called, answer.timings["search"][0]))
        if self.tracing.enabled:
            record_inference(self.tracing, called, answer.timings)
        return answer

    async def embed(self, model, rows: np.ndarray) -> np.ndarray:
        """rows (n, D) -> embeddings (n, d): on the event loop up to INLINE_EMBED_ROWS rows
        (a thread hop costs more), else in a worker thread."""
        if len(rows) <= INLINE_EMBED_ROWS:
            return embed(model, rows)
        return await asyncio.get_running_loop().run_in_executor(None, embed, model, rows)


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
