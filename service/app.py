"""The FastAPI application: lifespan (load, warm up, batcher, poller, drain), errors, metrics.

``create_app(settings)`` builds an app; ``python -m service`` runs it under uvicorn.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from service import __version__
from service.batcher import Batcher
from service.config import Settings
from service.deps import AppState
from service.engine import Engine
from service.errors import (
    InvalidInput,
    MethodNotAllowed,
    NotFound,
    ServiceError,
    body_of,
    status_of,
)
from service.metrics import Metrics
from service.routes import health, inference, model

log = logging.getLogger("service.app")
GIL_SWITCH_INTERVAL = 0.0002  # seconds


class MetricsMiddleware:
    """Pure ASGI middleware: requests by route and status, latency by route."""

    def __init__(self, app, metrics: Metrics, routes: set[str]):
        self.app = app
        self.metrics = metrics
        self.routes = routes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500

        async def send_with_status(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_with_status)
        finally:
            path = scope.get("path", "")
            route = path if path in self.routes else "unmatched"
            self.metrics.requests.labels(route, str(status)).inc()
            self.metrics.latency.labels(route).observe(time.perf_counter() - started)


async def _poll_for_new_models(state: AppState) -> None:
    interval = state.settings.reload_poll_seconds
    while True:
        await asyncio.sleep(interval)
        if not await run_in_threadpool(state.engine.changed_on_disk):
            continue
        try:
            loaded = await run_in_threadpool(state.engine.load)
        except Exception:
            state.metrics.model_load_failures.inc()
            continue
        state.metrics.set_model(loaded)


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings()
    state = AppState(settings=settings, engine=Engine(settings), metrics=Metrics())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        # The search thread needs the GIL for short stretches between FAISS/numpy calls; with
        # the default 5 ms switch interval it waits behind the event loop's request parsing
        # for most of a batch's life (measured: 25-row batches taking 34 ms instead of ~6 ms).
        sys.setswitchinterval(GIL_SWITCH_INTERVAL)
        try:
            loaded = await run_in_threadpool(state.engine.load)
            state.metrics.set_model(loaded)
        except Exception as exc:
            state.metrics.model_load_failures.inc()
            if settings.require_model_at_startup:
                raise RuntimeError(
                    f"cannot serve: the model at {settings.model_path} failed to load ({exc}). "
                    "Train one with `python -m training --out <path>` or set "
                    "NCAKNN_REQUIRE_MODEL_AT_STARTUP=false to start unready and wait for it."
                ) from exc
            log.warning("starting without a model", extra={"error": str(exc)})
        if settings.batching:
            state.batcher = Batcher(
                max_rows=settings.batch_max_rows,
                max_wait_us=settings.batch_max_wait_us,
                on_batch=lambda rows, waited: (
                    state.metrics.batch_rows.observe(rows),
                    state.metrics.queue_wait.observe(waited),
                ),
            )
            state.batcher.start()
        poller = None
        if settings.reload_poll_seconds > 0:
            poller = asyncio.get_running_loop().create_task(_poll_for_new_models(state))
        log.info(
            "serving", extra={"model_path": str(settings.model_path), "ready": state.engine.ready}
        )
        try:
            yield
        finally:
            state.engine.draining = True
            if poller is not None:
                poller.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await poller
            if state.batcher is not None:
                await state.batcher.stop()
            log.info("stopped")

    app = FastAPI(
        title="nca-knn",
        version=__version__,
        description=(
            "k-nearest-neighbour classification in a metric learned by NCA. Inputs are projected "
            "by the learned map and searched in a FAISS index over the projected training set."
        ),
        lifespan=lifespan,
    )
    app.state.ncaknn = state

    @app.exception_handler(ServiceError)
    async def on_service_error(request: Request, exc: ServiceError) -> JSONResponse:
        state.metrics.errors.labels(exc.error_type).inc()
        headers = {"WWW-Authenticate": "Bearer"} if status_of(exc) == 401 else None
        return JSONResponse(body_of(exc), status_code=status_of(exc), headers=headers)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        parts = [
            f"{'.'.join(map(str, e.get('loc', ())))}: {e.get('msg')}" for e in exc.errors()[:3]
        ]
        return await on_service_error(request, InvalidInput("; ".join(parts) or "invalid request"))

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            error: ServiceError = NotFound(f"no route {request.method} {request.url.path}")
        elif exc.status_code == 405:
            error = MethodNotAllowed(f"{request.method} is not allowed on {request.url.path}")
        else:
            error = ServiceError(str(exc.detail))
            state.metrics.errors.labels(error.error_type).inc()
            return JSONResponse(body_of(error), status_code=exc.status_code)
        return await on_service_error(request, error)

    app.include_router(inference.router)
    app.include_router(model.router)
    app.include_router(health.router)
    routes = set(app.openapi()["paths"])
    app.add_middleware(MetricsMiddleware, metrics=state.metrics, routes=routes)
    return app


def create_app_from_env() -> FastAPI:
    """Factory for uvicorn workers: settings come from NCAKNN_* variables."""
    from service.logs import configure_logging

    settings = Settings()
    configure_logging(settings.log_level, settings.log_json)
    return create_app(settings)


__all__ = ["create_app", "create_app_from_env"]
