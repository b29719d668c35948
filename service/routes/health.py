"""GET /healthz (liveness), /readyz (readiness), /metrics (Prometheus)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from service.deps import State, check_api_key
from service.errors import NotReady
from service.routes.common import error_responses

router = APIRouter(tags=["health"])


@router.get("/healthz", summary="Liveness: the process is up")
async def healthz() -> dict:
    return {"status": "ok"}


@router.get(
    "/readyz", responses=error_responses(503), summary="Readiness: a model is loaded and warmed up"
)
async def readyz(state: State) -> JSONResponse:
    if state.engine.draining:
        raise NotReady("shutting down: draining requests in flight")
    model = state.engine.current()
    return JSONResponse({"status": "ready", "model_version": model.version})


@router.get("/metrics", responses=error_responses(401), summary="Prometheus metrics")
async def metrics(request: Request, state: State) -> Response:
    if state.settings.metrics_require_api_key:
        check_api_key(request, state.settings.api_key)
    return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)
