"""Response bodies (pydantic), for the OpenAPI document and /v1/model.

Request bodies are the msgspec structs of ``service.http.decode`` (one strict decode); their
JSON schemas, with the live limits, are written by ``service.openapi``.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

Label = int | str


class Neighbor(BaseModel):
    id: int
    label: Label
    distance: float = Field(description="squared Euclidean distance in the learned space")


class ClassPrediction(BaseModel):
    label: Label
    probabilities: dict[str, float]
    nearest_distance: float = Field(
        description="squared Euclidean distance to the nearest reference, in the learned space"
    )
    outlier: bool | None = Field(
        description="the nearest reference is farther than the calibrated outlier threshold "
        "(outlier_quantile of held-out points' nearest distances); null when the model has "
        "no calibration"
    )
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


class ModelInfo(BaseModel):
    model_version: str
    path: str = Field(description="the model path this server is configured with")
    artifact_directory: str = Field(
        description="the directory the served model was read from, as the kernel named it "
        "when the load opened it (where the path's symlinks led then; a directory exchanged "
        "or renamed since may now have another name: artifact_fingerprint identifies it)"
    )
    artifact_fingerprint: str = Field(
        description="16 hex digits naming exactly what was read: the directory's identity, "
        "the manifest's sha256 and every listed file's size, time and inode. Every worker "
        "that serves what the model path names shows the same value"
    )
    worker_pid: int = Field(description="the process id of the worker that answered")
    n_features: int
    n_components: int
    n_references: int
    classes: list[Label]
    default_k: int
    decision_rule: str
    index: dict
    metrics: dict
    training: dict
    lineage: list[dict] = Field(
        default_factory=list,
        description="reference-set changes since training, oldest first (operation, parent "
        "version, row counts, time)",
    )
    reference_set: dict = Field(
        default_factory=lambda: {"kind": "training_rows"},
        description="what the references are: the projected training rows (kind "
        "'training_rows'), or learned prototypes (kind 'prototypes', with the method, the "
        "reduction and counts): a prototype is not a training example; its id names the "
        "training row of its class nearest it, and neighbour distances are to the prototype",
    )
    outliers: dict | None = Field(
        None,
        description="the outlier calibration (quantiles of held-out nearest squared "
        "distances), the configured outlier_quantile and its threshold; null without one",
    )
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


class RepositoryEntry(BaseModel):
    name: str = Field(description="the model's name (its folder in a repository)")
    version: str = Field(description="the version it serves; empty when it serves none")
    state: Literal["READY", "LOADING", "UNAVAILABLE"]
    reason: str = Field(description="why it is not READY (a load's error, or 'unloaded')")
