"""The application's state, shared by every wire (HTTP /v1, /v2 REST, gRPC): settings, the
engine (the model, the in-flight gate, the batcher), metrics and tracing. No web framework
here; ``service.wire.state_of`` finds it from a request."""

from __future__ import annotations

from dataclasses import dataclass, field

from service.config import Settings
from service.engine.infer import Engine
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
