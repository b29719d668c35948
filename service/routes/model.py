"""GET /v1/model and POST /v1/admin/reload."""

from __future__ import annotations

from fastapi import APIRouter, Depends
from starlette.concurrency import run_in_threadpool

from service.deps import Model, State, require_api_key
from service.errors import ReloadFailed
from service.routes.common import error_responses
from service.schemas import ModelInfo, ReloadResponse

router = APIRouter(prefix="/v1", tags=["model"], dependencies=[Depends(require_api_key)])


@router.get(
    "/model",
    response_model=ModelInfo,
    responses=error_responses(401, 503),
    summary="What is loaded",
)
async def model_info(state: State, model: Model) -> ModelInfo:
    manifest = model.artifact.manifest
    settings = state.settings
    return ModelInfo(
        model_version=model.version,
        path=str(model.artifact.path),
        n_features=model.n_features,
        n_components=model.n_components,
        n_references=model.n_references,
        classes=model.classes,
        default_k=model.artifact.default_k,
        decision_rule=model.artifact.decision_rule,
        index=model.index_params,
        metrics=manifest.get("metrics", {}),
        training={k: v for k, v in manifest.get("training", {}).items() if k != "config"},
        loaded_at=model.loaded_at,
        load_seconds=model.load_seconds,
        last_reload_error=state.engine.last_error,
        limits={
            "max_batch_rows": settings.max_batch_rows,
            "max_body_bytes": settings.max_body_bytes,
            "max_in_flight": settings.max_in_flight,
            "max_k": settings.max_k,
            "batching": settings.batching,
            "batch_max_rows": settings.batch_max_rows,
            "batch_max_wait_us": settings.batch_max_wait_us,
        },
    )


@router.post(
    "/admin/reload",
    response_model=ReloadResponse,
    responses=error_responses(401, 409),
    summary="Load the artifact at the model path again and swap it in atomically",
)
async def reload(state: State) -> ReloadResponse:
    loaded = state.engine.peek()
    before = loaded.version if loaded is not None else None
    try:
        model = await run_in_threadpool(state.engine.load)
    except Exception as exc:
        state.metrics.model_load_failures.inc()
        raise ReloadFailed(
            f"cannot load the artifact at {state.settings.model_path}: {exc}; "
            + ("the previous model keeps serving" if before else "no model is serving")
        ) from None
    state.metrics.set_model(model)
    return ReloadResponse(
        status="unchanged" if model.version == before else "reloaded", model_version=model.version
    )
