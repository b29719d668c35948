"""GET /v1/model, GET /v1/models[/{name}] and POST /v1/admin/reload."""

from __future__ import annotations

import os

from fastapi import APIRouter, Depends
from starlette.concurrency import run_in_threadpool

from service.errors import NotFound, ReloadFailed
from service.http.deps import State, require_admin_key, require_api_key
from service.http.schemas import ModelInfo, ReloadResponse, RepositoryEntry

router = APIRouter(prefix="/v1", tags=["model"])


@router.get(
    "/model",
    response_model=ModelInfo,
    summary="What is loaded",
    dependencies=[Depends(require_api_key)],
)
async def model_info(state: State) -> ModelInfo:
    return describe(state, state.engine.current(), state.engine.last_error)


@router.get(
    "/models",
    response_model=list[RepositoryEntry],
    summary="Every model this server holds: name, version, state and why it is not ready",
    dependencies=[Depends(require_api_key)],
)
async def models(state: State) -> list[RepositoryEntry]:
    entries = await run_in_threadpool(state.engine.repository_index)  # a look at the disk
    return [RepositoryEntry(**entry) for entry in entries]


@router.get(
    "/models/{model_name}",
    response_model=ModelInfo,
    summary="What is loaded under a model's name",
    dependencies=[Depends(require_api_key)],
)
async def named_model_info(state: State, model_name: str) -> ModelInfo:
    model = state.engine.model(model_name)
    return describe(state, model, state.engine.last_error_of(model_name))


def describe(state, model, last_error: str | None) -> ModelInfo:
    """A loaded model as GET /v1/model shows it."""
    manifest = model.artifact.manifest
    settings = state.settings
    return ModelInfo(
        model_version=model.version,
        path=str(model.artifact.path),
        artifact_directory=model.artifact.directory or str(model.artifact.path),
        artifact_fingerprint=model.artifact.fingerprint_id or "",
        worker_pid=os.getpid(),
        n_features=model.n_features,
        n_components=model.n_components,
        n_references=model.n_references,
        classes=model.classes,
        default_k=model.artifact.default_k,
        decision_rule=model.artifact.decision_rule,
        index=model.index_params,
        metrics=manifest.get("metrics", {}),
        training={k: v for k, v in manifest.get("training", {}).items() if k != "config"},
        lineage=manifest.get("lineage", []),
        reference_set=manifest.get("reference_set") or {"kind": "training_rows"},
        outliers=None
        if model.outlier_quantiles is None
        else {
            "calibration": manifest["outlier_calibration"],
            "quantile": model.default_outlier_quantile,
            "threshold": model.default_outlier_threshold,
        },
        loaded_at=model.loaded_at,
        load_seconds=model.load_seconds,
        last_reload_error=last_error,
        workers=settings.workers,
        limits={
            "max_batch_rows": settings.max_batch_rows,
            "max_body_bytes": settings.max_body_bytes,
            "max_in_flight": settings.max_in_flight,
            "max_k": min(settings.max_k, model.n_references),
            "max_response_values": settings.max_response_values,
            "input_abs_max": model.input_abs_max,
            "batching": settings.batching,
            "batch_max_rows": settings.batch_max_rows,
            "batch_max_wait_us": settings.batch_max_wait_us,
        },
    )


@router.post(
    "/admin/reload",
    response_model=ReloadResponse,
    summary="Load the artifact at the model path again and swap it in atomically",
    description="Loads in the worker that answers; with several workers the others follow "
    "within worker_sync_seconds (the answer says how many workers there are and that bound). "
    "409 when the artifact is refused (the old model keeps serving), when another load is "
    "running, or when the load takes longer than reload_timeout_seconds (it goes on in the "
    "background).",
    dependencies=[Depends(require_admin_key)],
)
async def reload(state: State) -> ReloadResponse:
    loaded = state.engine.peek()
    before = loaded.version if loaded is not None else None
    try:
        model = await state.engine.reload(state.settings.reload_timeout_seconds)
    except (ReloadFailed, NotFound):  # NotFound: a repository loads models by name
        raise
    except Exception as exc:
        raise ReloadFailed(
            f"cannot load the artifact at {state.settings.model_path}: {exc}; "
            + ("the previous model keeps serving" if before else "no model is serving")
        ) from None
    if state.generation is not None:
        state.generation.bump()
    return ReloadResponse(
        status="unchanged" if model.version == before else "reloaded",
        model_version=model.version,
        workers=state.settings.workers,
        other_workers_within_seconds=(
            state.settings.worker_sync_seconds if state.settings.workers > 1 else 0.0
        ),
    )


def route_template(path: str) -> str | None:
    """The metrics' route label of ``GET /v1/models/{name}`` (names vary, labels do not)."""
    parts = path.split("/")  # "", "v1", "models", name
    return (
        "/v1/models/{model_name}" if len(parts) == 4 and parts[:3] == ["", "v1", "models"] else None
    )
