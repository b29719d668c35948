"""GET /healthz (liveness), /readyz (readiness), /metrics (Prometheus).

The probes need no key and say nothing about the model's path or errors: those are in
GET /v1/model, behind the API key.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from service.errors import NotReady
from service.http.deps import State, check_api_key

router = APIRouter(tags=["health"])


@router.get("/healthz", summary="Liveness: the process is up")
async def healthz() -> dict:
    return {"status": "ok"}


@router.get(
    "/readyz",
    summary="Readiness: a model is loaded and warmed up (in a repository: at least one), not "
    "draining",
)
async def readyz(state: State) -> JSONResponse:
    if state.engine.draining:
        raise NotReady("shutting down: draining requests in flight")
    repository = state.engine.repository
    if repository is not None:  # ready while at least one of its models serves
        serving = [entry.name for entry in repository.index(ready_only=True)]
        if not serving:
            raise NotReady("no model of the repository is loaded")
        return JSONResponse({"status": "ready", "models": len(serving)})
    model = state.engine.peek()
    if model is None:
        raise NotReady("no model is loaded yet")
    return JSONResponse({"status": "ready", "model_version": model.version})


@router.get(
    "/metrics",
    summary="Prometheus metrics (text exposition format)",
    response_class=Response,
)
async def metrics(request: Request, state: State) -> Response:
    if state.settings.metrics_require_api_key:
        check_api_key(request, state.settings.api_key)
    # rendered in a worker thread: a scrape never holds the event loop (and the probes)
    content, media_type = await run_in_threadpool(state.metrics.exposition)
    return Response(content, media_type=media_type)
