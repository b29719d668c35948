"""Request and response bodies (pydantic), with the examples shown at /docs."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

Label = int | str
EXAMPLE_ROW = [0.0, 0.5, 1.0, 0.25]


class InstancesRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    instances: list[list[float]] = Field(
        ..., description="rows of D numbers each", examples=[[EXAMPLE_ROW]]
    )


class ClassifyRequest(InstancesRequest):
    k: int | None = Field(None, ge=1, description="neighbours to consult (default: the model's)")
    rule: Literal["majority", "soft"] | None = Field(
        None, description="decision rule (default: the model's)"
    )
    return_neighbors: bool = Field(False, description="include the k neighbours in the answer")


class NeighborsRequest(InstancesRequest):
    k: int | None = Field(None, ge=1, description="neighbours to return (default: the model's k)")


class EmbedRequest(InstancesRequest):
    pass


class Neighbor(BaseModel):
    id: int
    label: Label
    distance: float = Field(description="squared Euclidean distance in the learned space")


class ClassPrediction(BaseModel):
    label: Label
    probabilities: dict[str, float]
    neighbors: list[Neighbor] | None = None


class ClassifyResponse(BaseModel):
    predictions: list[ClassPrediction]
    model_version: str


class EmbedResponse(BaseModel):
    embeddings: list[list[float]]
    model_version: str


class NeighborsResponse(BaseModel):
    neighbors: list[list[Neighbor]]
    model_version: str


class ErrorBody(BaseModel):
    error: str = Field(description="what was wrong and what was expected")
    error_type: str


class ModelInfo(BaseModel):
    model_version: str
    path: str
    n_features: int
    n_components: int
    n_references: int
    classes: list[Label]
    default_k: int
    decision_rule: str
    index: dict
    metrics: dict
    training: dict
    loaded_at: float
    load_seconds: float
    last_reload_error: str | None
    workers: int
    limits: dict


class ReloadResponse(BaseModel):
    status: Literal["reloaded", "unchanged"]
    model_version: str
    workers: int = Field(description="worker processes of this server")
    other_workers_within_seconds: float = Field(
        description="the other workers load the same artifact within this many seconds"
    )
