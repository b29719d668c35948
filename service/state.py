"""The application's state, shared by every wire (HTTP /v1, /v2 REST, gRPC): settings, the
engine (the model, the in-flight gate, the batcher), metrics, tracing and the budgets of
request bodies and of answers in flight. No web framework here; ``service.wire.state_of`` finds it from a
request."""

from __future__ import annotations

from dataclasses import dataclass, field

from service.config import Settings
from service.engine.engine import Engine
from service.ops.answers import AnswerBudget
from service.ops.bodies import BodyBudget
from service.ops.metrics import Metrics
from service.ops.tracing import NoTracing, Tracing
from service.server.workers import ReloadGeneration, RepositoryActions


@dataclass
class AppState:
    settings: Settings
    engine: Engine
    metrics: Metrics
    generation: ReloadGeneration | None = None  # shared with the other workers, if any
    repository_actions: RepositoryActions | None = None  # ... with a model repository
    tracing: Tracing | NoTracing = field(default_factory=NoTracing)
    bodies: BodyBudget | None = None  # request bodies in flight (set from the settings)
    answers: AnswerBudget | None = None  # answers not yet taken (set from the settings)

    def __post_init__(self) -> None:
        if self.bodies is None:
            self.bodies = BodyBudget(self.settings.max_body_bytes_in_flight)
        if self.answers is None:
            self.answers = AnswerBudget(self.settings.max_answer_bytes_in_flight)
