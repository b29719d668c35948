"""The FastAPI application: lifespan (load, warm up, batcher, model sync, drain), errors,
metrics, OpenAPI and docs.

``create_app(settings)`` builds an app; ``python -m service`` runs it under uvicorn.

Shutting down (SIGTERM, as Kubernetes sends it): /readyz answers 503 at once, every answer
carries ``Connection: close``, and the server keeps accepting and serving for
``drain_delay_seconds`` while load balancers stop sending; then uvicorn stops accepting,
finishes what was accepted (up to ``graceful_shutdown_seconds``) and the batcher drains its
queue. A request still unfinished when the grace period ends gets the one error body (503).
A second SIGTERM skips what is left of the delay.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal
import sys
import threading
import time
from collections.abc import Callable
from contextlib import asynccontextmanager

import msgspec
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse, Response
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from service import __version__
from service.config import Settings
from service.core.artifact import MANIFEST_FILE, artifact_fingerprint
from service.engine.batcher import Batcher
from service.engine.engine import Engine
from service.errors import (
    AnswerBudgetSpent,
    ClientClosed,
    InvalidInput,
    MethodNotAllowed,
    NotFound,
    NotReady,
    PayloadTooLarge,
    ServiceError,
    body_of,
    status_of,
)
from service.http import card as card_module
from service.http import head
from service.http.card import ModelCard
from service.http.decode import MODEL_NAME_KEY
from service.http.deps import check_api_key
from service.http.routes import health, inference, model
from service.oip import grpc_server
from service.oip import repository as repository_routes
from service.oip import rest as v2
from service.openapi import build_openapi
from service.ops import memory
from service.ops.answers import RESERVE_FROM_BYTES, AnswerHold, declared_size
from service.ops.metrics import Metrics
from service.ops.tracing import (
    REQUEST_ID_HEADER,
    NoTracing,
    Tracing,
    current_span,
    from_environment,
    trace_id_of,
)
from service.search.index import available_cores
from service.server import connections
from service.server.probes import Heartbeat
from service.server.workers import ReloadGeneration, RepositoryActions
from service.state import AppState
from service.wire import JSON as JSON_TYPE

log = logging.getLogger("service.app")
GIL_SWITCH_INTERVAL = 0.0002  # seconds
UNMATCHED_ROUTE = "unmatched"  # the route label of every path the app does not serve
INLINE_SEARCH_ROWS = 256  # merged searches this small may run on the event loop (see Batcher)
STARTUP_RETRY_SECONDS = 30.0  # a first load torn by a publish is tried again this long
STARTUP_RETRY_PAUSE = 0.1  # seconds between those tries
SHUTDOWN_BODY = msgspec.json.encode(
    {
        "error": "the server is shutting down and could not finish this request within its "
        "grace period; retry on another replica",
        "error_type": NotReady.error_type,
    }
)


KEPT_ON_REFUSAL = (b"connection", REQUEST_ID_HEADER.encode())  # headers of a refused answer


class ServiceMiddleware:
    """Pure ASGI middleware: requests by route and status, latency by route;
    ``Connection: close`` while draining; the error body for a request cancelled at the end
    of the shutdown grace period; the budget of answers in flight (``service.ops.answers``):
    an answer's start is held until its first body message gives its size, and an answer
    of RESERVE_FROM_BYTES or more is reserved (503 when it does not fit) and released by
    its connection once sent."""

    def __init__(self, app, state: AppState, routes: set[str]):
        self.app = app
        self.state = state
        self.routes = routes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500
        response_started = False
        tracing = self.state.tracing
        span = token = None
        if tracing.enabled:
            span = tracing.start_request(f"{scope['method']} {scope['path']}", _carrier(scope))
            token = current_span.set(span)

        held = None  # the answer's start, held until its first body message gives its size
        answer: AnswerHold | None = None  # its reservation in the budget of answers
        refused = False  # the answer was replaced by the answer budget's 503

        async def send_wrapped(message):
            nonlocal status, response_started, held, answer, refused
            if message["type"] == "http.response.start":
                status = message["status"]
                extra = []
                if self.state.engine.draining:
                    extra.append((b"connection", b"close"))
                if span is not None:
                    extra.append((REQUEST_ID_HEADER.encode(), trace_id_of(span).encode()))
                if extra:
                    message = {**message, "headers": [*message.get("headers", []), *extra]}
                held = message
                return
            if held is not None:
                start, held = held, None
                size = len(message.get("body", b""))
                if message.get("more_body", False):
                    size = declared_size(start)
                if size >= RESERVE_FROM_BYTES:  # a large answer: reserved, or refused
                    try:
                        answer = self.state.answers.reserve(size)
                    except (AnswerBudgetSpent, PayloadTooLarge) as exc:
                        status, refused, response_started = status_of(exc), True, True
                        await self.refuse_answer(exc, scope, start, send)
                        return
                response_started = True
                await send(start)
            elif refused:
                return  # the rest of an answer the budget refused
            await send(message)
            if answer is not None and not message.get("more_body", False):
                connections.hold_until_sent(send, answer)  # released once it left the process
                answer = None

        try:
            await self.app(scope, receive, send_wrapped)
            if held is not None:  # a start without a body message
                response_started = True
                await send(held)
        except asyncio.CancelledError:
            if response_started:
                raise
            status = 503
            await send(
                {
                    "type": "http.response.start",
                    "status": 503,
                    "headers": [
                        (b"content-type", b"application/json"),
                        (b"content-length", str(len(SHUTDOWN_BODY)).encode()),
                        (b"connection", b"close"),
                    ],
                }
            )
            await send({"type": "http.response.body", "body": SHUTDOWN_BODY})
        finally:
            if answer is not None:  # an answer cut short: released once nothing of it is held
                connections.hold_until_sent(send, answer)
            # a request the connection guard answered in the application's place (408 for a
            # body that did not arrive in time, 400 for malformed framing) counts as that
            status = scope.get(connections.ANSWERED_STATUS, status)
            route, seconds = self.route_label(scope.get("path", "")), time.perf_counter() - started
            count, latency = self.state.metrics.request_series[route, status]
            count.inc()
            latency.observe(seconds)
            if span is not None:
                current_span.reset(token)
                tracing.finish_request(span, f"{scope['method']} {route}", status, seconds)

    async def refuse_answer(self, error: ServiceError, scope, start, send) -> None:
        """Send the answer budget's refusal (the one error body; under /v2 the protocol's)
        in place of an answer that does not fit it, with the answer's ``Connection`` and
        request id headers: 503 with ``Retry-After: 1`` while other answers hold the budget,
        413 for an answer larger than the whole budget (no retry can send it)."""
        status = status_of(error)
        extra = {"retry-after": "1"} if status == 503 else None
        response = error_response(self.state, error, extra, path=scope["path"])
        memory.trim_soon()  # the refused answer's memory goes back
        kept = [h for h in start.get("headers", ()) if h[0] in KEPT_ON_REFUSAL]
        headers = [*response.raw_headers, *kept]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": response.body})

    def route_label(self, path: str) -> str:
        """The metrics' route label: a route of the app (a /v2 path as its template), else
        ``unmatched``. Labels come from this fixed set only, so no client can grow the
        metrics by sending new paths."""
        if path in self.routes:
            return path
        template = v2.route_template(path) or inference.named_template(path)
        template = template or repository_routes.route_template(path) or model.route_template(path)
        return template if template in self.routes else UNMATCHED_ROUTE


def _carrier(scope) -> dict[str, str]:
    """The request's traceparent and tracestate headers, for the trace propagator."""
    wanted = (b"traceparent", b"tracestate")
    return {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"] if k in wanted}


class ServiceApp(FastAPI):
    """FastAPI with a direct lane for the inference routes, and HEAD answered as GET without
    a body on every path a GET route serves (``service.http.head``).

    POST /v1/classify, /v1/embed and /v1/neighbors are declared as FastAPI routes (that gives
    their OpenAPI and the 405 for other methods) but a POST to them calls the route's
    endpoint directly, past FastAPI's middleware stack, routing and dependency resolution:
    those cost about 140 us a request on one core of this machine, where a raw ASGI app
    answers in about 30 us, and more than a batched search. The endpoints take the raw
    Request and do every check themselves (``service.http.routes.inference``); their errors go
    through the one error table (``error_response``). Everything else takes FastAPI's path.
    ``ServiceMiddleware`` (metrics, draining) wraps both lanes.
    """

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.direct_routes: dict[str, Callable] = {}  # path -> endpoint(Request) -> Response
        self.service_middleware: Callable | None = None  # set by create_app

    async def __call__(self, scope, receive, send) -> None:
        if self.service_middleware is None:
            await self.dispatch(scope, receive, send)
        else:
            await self.service_middleware(scope, receive, send)

    async def dispatch(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            endpoint = self.direct_routes.get(scope["path"])
            if endpoint is None and v2.infer_target(scope["path"]) is not None:
                endpoint = v2.infer
            named = inference.named_target(scope["path"]) if endpoint is None else None
            if named is not None:
                scope[MODEL_NAME_KEY], route = named
                endpoint = self.direct_routes[route]
            if endpoint is not None:
                scope["app"] = self
                await self.call_direct(endpoint, scope, receive, send)
                return
        if scope["type"] == "http" and scope["method"] == "HEAD":  # as GET, without a body
            get = head.as_get(self.router.routes, scope)
            if get is not None:
                await super().__call__(get, receive, head.without_body(send))
                return
        await super().__call__(scope, receive, send)

    async def call_direct(self, endpoint, scope, receive, send) -> None:
        state: AppState = self.state.ncaknn
        request = Request(scope, receive)
        try:
            response = await endpoint(request)
        except ServiceError as exc:
            response = error_response(state, exc, path=scope["path"])
        except ClientDisconnect:
            response = client_closed_response(state, scope)
        except Exception as exc:
            response = unexpected_error_response(state, exc, scope["path"])
        await response(scope, receive, send)


def error_response(
    state: AppState, error: ServiceError, headers: dict | None = None, path: str = ""
) -> Response:
    """The one error body, with the status from the error table; under /v2 the Open
    Inference Protocol's ``{"error": ...}``."""
    state.metrics.errors.labels(error.error_type).inc()
    status = status_of(error)
    if status == 401:
        headers = {**(headers or {}), "WWW-Authenticate": "Bearer"}
    body = {"error": error.message} if v2.is_v2(path) else body_of(error)
    return Response(msgspec.json.encode(body), status, headers=headers, media_type=JSON_TYPE)


def client_closed_response(state: AppState, scope) -> Response:
    """The client went away while its request was read: nothing reaches it, the request is
    counted as 499 (a client abort, not a server error) with one log line. When the
    connection guard cut the request off itself (``ANSWERED_STATUS`` 408 or 400), it
    counted it already."""
    if scope.get(connections.ANSWERED_STATUS, connections.CLIENT_CLOSED_STATUS) == (
        connections.CLIENT_CLOSED_STATUS
    ):
        state.metrics.errors.labels(ClientClosed.error_type).inc()
        log.info(
            "the client closed the connection before its request was read",
            extra={"path": scope.get("path", "")},
        )
    return Response(b"", 499, media_type=JSON_TYPE)


def unexpected_error_response(state: AppState, exc: Exception, path: str) -> Response:
    log.error("unexpected error", extra={"path": path}, exc_info=exc)
    state.metrics.errors.labels("internal_error").inc()
    body = {"error": f"internal error ({type(exc).__name__}); it was logged"}
    if not v2.is_v2(path):
        body["error_type"] = "internal_error"
    return Response(msgspec.json.encode(body), 500, media_type=JSON_TYPE)


async def _reload_in_background(state: AppState, reason: str) -> None:
    try:
        loaded = await run_in_threadpool(state.engine.load)
    except Exception:
        return  # recorded by the engine (last_error, metrics) and logged
    log.info("model synchronised", extra={"reason": reason, "model_version": loaded.version})


async def _keep_model_in_sync(state: AppState) -> None:
    """Reload when another worker did (its reload generation changed) or, with the poller
    on, when the artifact on disk changed (or a failed one healed)."""
    settings = state.settings
    poll = settings.reload_poll_seconds
    shared = state.generation is not None or state.repository_actions is not None
    interval = min(
        poll if poll > 0 else float("inf"),
        settings.worker_sync_seconds if shared else float("inf"),
    )
    last_poll = time.monotonic()
    while True:
        await asyncio.sleep(interval)
        try:
            if state.repository_actions is not None:
                await run_in_threadpool(state.engine.replay_repository)
            if state.generation is not None and state.generation.changed():
                await _reload_in_background(state, "another worker reloaded")
                continue
            if poll > 0 and time.monotonic() - last_poll >= poll - 1e-3:
                last_poll = time.monotonic()
                if state.engine.repository is not None:
                    for name in await run_in_threadpool(state.engine.reload_changed_models):
                        log.info("model synchronised", extra={"model": name})
                elif await run_in_threadpool(state.engine.changed_on_disk):
                    await _reload_in_background(state, "the artifact on disk changed")
        except Exception as exc:  # whatever the disk holds, the sync goes on
            log.error("model sync failed; retrying", exc_info=exc)


def _install_drain_on_sigterm(state: AppState, on_stop: Callable[[], None]) -> None:
    """Put our SIGTERM handler in front of uvicorn's: draining at once, uvicorn's shutdown
    after the drain delay, ``on_stop`` at the same moment (the gRPC server's stop, so that
    both wires finish within one grace period, not one after the other). Only in the main
    thread (uvicorn's, not a TestClient's)."""
    if threading.current_thread() is not threading.main_thread():
        return
    loop = asyncio.get_running_loop()
    uvicorn_handler = signal.getsignal(signal.SIGTERM)
    if not callable(uvicorn_handler):
        return
    pending: list[asyncio.TimerHandle] = []

    def stop_serving() -> None:
        for handle in pending:
            handle.cancel()
        pending.clear()
        on_stop()
        uvicorn_handler(signal.SIGTERM, None)

    def on_sigterm(signum, frame) -> None:
        if state.engine.draining:  # a second SIGTERM: stop waiting
            loop.call_soon_threadsafe(stop_serving)
            return
        state.engine.draining = True
        delay = state.settings.drain_delay_seconds
        log.info("SIGTERM: draining", extra={"drain_delay_seconds": delay})
        loop.call_soon_threadsafe(lambda: pending.append(loop.call_later(delay, stop_serving)))

    signal.signal(signal.SIGTERM, on_sigterm)


def create_app(
    settings: Settings | None = None, tracing: Tracing | NoTracing | None = None
) -> FastAPI:
    """The service: state (engine, metrics), lifespan, error table, routes, OpenAPI, and the
    direct lane for the inference routes. ``tracing`` defaults to what the OpenTelemetry
    environment variables ask for (``service.ops.tracing.from_environment``)."""
    settings = settings or Settings()
    metrics = Metrics()
    connections.set_observer(metrics.connection_refused, metrics.open_connections.set)
    request_tracing = from_environment() if tracing is None else tracing
    state = AppState(
        settings=settings,
        engine=Engine(settings, events=metrics, tracing=request_tracing),
        metrics=metrics,
        tracing=request_tracing,
    )
    app = ServiceApp(
        title="nca-knn",
        version=__version__,
        description=(
            "k-nearest-neighbour classification in a metric learned by NCA. Inputs are projected "
            "by the learned map and searched in a FAISS index over the projected training set."
        ),
        lifespan=_lifespan(state),
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )
    app.state.ncaknn = state
    _install_error_handlers(app, state)
    app.include_router(inference.router)
    app.include_router(model.router)
    app.include_router(health.router)
    app.include_router(v2.router)
    app.include_router(repository_routes.router)
    _install_openapi(app, state)
    every_route = {**_limits(state), "repository": True}  # the metrics' route labels
    routes = set(build_openapi(app, every_route, secured=False)["paths"])
    routes |= {"/openapi.json", "/docs", "/redoc", "/"}
    app.direct_routes = dict(inference.DIRECT_LANE)
    app.service_middleware = ServiceMiddleware(app.dispatch, state=state, routes=routes)
    return app


def _lifespan(state: AppState):
    """Start: load the model (fail fast unless told to wait), start the batcher and the model
    sync, arm the SIGTERM drain. Stop: drain, stop the sync, finish the batcher's queue."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        # The search thread needs the GIL for short stretches between FAISS/numpy calls; with
        # the default 5 ms switch interval it waits behind the event loop's request parsing
        # for most of a batch's life (measured: 25-row batches taking 34 ms instead of ~6 ms).
        sys.setswitchinterval(GIL_SWITCH_INTERVAL)
        runtime_dir = state.settings.runtime_dir
        if runtime_dir is not None and state.settings.workers > 1:
            if state.engine.repository is not None:
                state.repository_actions = RepositoryActions(runtime_dir)
                state.engine.shared_actions = state.repository_actions
            else:
                state.generation = ReloadGeneration(runtime_dir)
        heartbeat = None
        if runtime_dir is not None and state.settings.probe_port:
            beat = Heartbeat(runtime_dir, lambda: _probe_state(state))
            heartbeat = asyncio.get_running_loop().create_task(beat.run())
        await _load_at_startup(state)
        state.engine.batcher = _start_batcher(state)
        grpc = None
        if state.settings.grpc_port:
            grpc = await grpc_server.start(state)
        sync = None
        shared = state.generation is not None or state.repository_actions is not None
        if state.settings.reload_poll_seconds > 0 or shared:
            sync = asyncio.get_running_loop().create_task(_keep_model_in_sync(state))
        grpc_stopping: list[asyncio.Task] = []

        def stop_grpc() -> None:  # at most once; the lifespan's end awaits it
            if grpc is not None and not grpc_stopping:
                grace = state.settings.graceful_shutdown_seconds
                grpc_stopping.append(asyncio.ensure_future(grpc_server.stop(grpc, grace)))

        _install_drain_on_sigterm(state, stop_grpc)
        # Objects alive now (modules, route tables, the model's metadata) leave the garbage
        # collector's view: a full collection then scans only what requests allocate.
        # Measured at c64: p99 53 ms -> 20 ms (full collections walked ~10^6 objects).
        gc.collect()
        gc.freeze()
        log.info(
            "serving",
            extra={"model_path": str(state.settings.model_path), "ready": state.engine.ready},
        )
        try:
            yield
        finally:
            state.engine.draining = True
            if grpc is not None:
                stop_grpc()
                await grpc_stopping[0]
            if sync is not None:
                sync.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await sync
            if state.engine.batcher is not None:
                await state.engine.batcher.stop()
            state.tracing.shutdown()  # exports the spans still buffered, for a bounded time
            if heartbeat is not None:
                heartbeat.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await heartbeat
            gc.unfreeze()
            log.info("stopped")

    return lifespan


def _probe_state(state: AppState) -> str:
    """What this worker's heartbeat tells the probe listener (service.server.probes)."""
    if state.engine.draining:
        return "draining"
    return "ready" if state.engine.ready else "unready"


async def _load_at_startup(state: AppState) -> None:
    """Load the model; a failure stops the start (fail fast) unless
    require_model_at_startup is off, in which case the service starts unready
    (:func:`_first_load` says which failures are tried again first)."""
    settings = state.settings
    if state.engine.repository is not None:
        await _load_repository_at_startup(state)
        return
    try:
        await _first_load(state)
    except Exception as exc:
        if settings.require_model_at_startup:
            raise RuntimeError(
                f"cannot serve: the model at {settings.model_path} failed to load ({exc}). "
                "Train one with `python -m training --out <path>` or set "
                "NCAKNN_REQUIRE_MODEL_AT_STARTUP=false to start unready and wait for it."
            ) from exc
        log.warning("starting without a model", extra={"error": str(exc)})


async def _load_repository_at_startup(state: AppState) -> None:
    """Load every model of the repository, each on its own (a broken one is UNAVAILABLE
    with its reason, the others serve). With require_model_at_startup, a repository where
    no model loads stops the start."""
    repository = state.engine.repository
    if not repository.root.is_dir():
        problem = (
            f"the model repository {repository.root} is not a directory"
            if repository.root.exists()
            else f"the model repository {repository.root} does not exist"
        )
        if state.settings.require_model_at_startup:
            raise RuntimeError(f"cannot serve: {problem} (NCAKNN_MODEL_REPOSITORY)")
        log.warning("starting without a model", extra={"error": problem})
        return
    await run_in_threadpool(state.engine.load_repository)
    if repository.any_ready() or not state.settings.require_model_at_startup:
        if not repository.any_ready():
            log.warning("starting without a model", extra={"repository": str(repository.root)})
        return
    reasons = "; ".join(f"{e.name}: {e.reason}" for e in repository.index()[:5])
    if not reasons:
        reasons = "it holds no model folder"
        if (repository.root / MANIFEST_FILE).exists():
            reasons += ": it is an artifact itself, which --model serves"
    raise RuntimeError(
        f"cannot serve: no model of the repository {repository.root} loaded ({reasons}). "
        "Set NCAKNN_REQUIRE_MODEL_AT_STARTUP=false to start unready and load models later."
    )


async def _first_load(state: AppState) -> None:
    """The engine's first load. One that failed while the model path changed (its
    fingerprint after the load differs from the one before: repointed, replaced, its
    manifest written or removed; a read torn by a publish, as when a worker starts during a
    rollout) is tried again after STARTUP_RETRY_PAUSE, for up to STARTUP_RETRY_SECONDS; a
    load that fails on an unchanged path (a broken artifact, or none) raises its error."""
    path = state.settings.model_path
    deadline = time.monotonic() + STARTUP_RETRY_SECONDS
    while True:
        before = await run_in_threadpool(artifact_fingerprint, path)
        try:
            await run_in_threadpool(state.engine.load)
            return
        except Exception as exc:
            after = await run_in_threadpool(artifact_fingerprint, path)
            if after == before or time.monotonic() >= deadline:
                raise
            log.info(
                "the artifact changed while it was read at startup; reading it again",
                extra={"error": str(exc)},
            )
            await asyncio.sleep(STARTUP_RETRY_PAUSE)


def _start_batcher(state: AppState) -> Batcher | None:
    """The dynamic batcher (None when batching is off); small merged searches run on the
    event loop when search_on_event_loop says so (auto: with one core)."""
    settings = state.settings
    if not settings.batching:
        return None
    on_loop = settings.search_on_event_loop
    inline = on_loop == "always" or (on_loop == "auto" and available_cores() == 1)
    batcher = Batcher(
        max_rows=settings.batch_max_rows,
        max_wait_us=settings.batch_max_wait_us,
        inline_rows=INLINE_SEARCH_ROWS if inline else 0,
        on_batch=state.engine.events.batch_searched,
    )
    batcher.start()
    return batcher


def _install_error_handlers(app: FastAPI, state: AppState) -> None:
    def respond(request: Request, error: ServiceError, headers: dict | None = None) -> Response:
        return error_response(state, error, headers, path=request.url.path)

    @app.exception_handler(ServiceError)
    async def on_service_error(request: Request, exc: ServiceError) -> JSONResponse:
        return respond(request, exc)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        parts = [
            f"{'.'.join(map(str, e.get('loc', ())))}: {e.get('msg')}" for e in exc.errors()[:3]
        ]
        return respond(request, InvalidInput("; ".join(parts) or "invalid request"))

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            return respond(request, NotFound(f"no route {request.method} {request.url.path}"))
        if exc.status_code == 405:
            allowed = head.allow_with_head((exc.headers or {}).get("Allow", ""))
            return respond(
                request,
                MethodNotAllowed(
                    f"{request.method} is not allowed on {request.url.path}; allowed: {allowed}"
                ),
                headers={**(exc.headers or {}), "Allow": allowed},
            )
        error = ServiceError(str(exc.detail))
        error.error_type = "http_error"
        state.metrics.errors.labels(error.error_type).inc()
        return JSONResponse(body_of(error), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(ClientDisconnect)
    async def on_client_disconnect(request: Request, exc: ClientDisconnect) -> Response:
        return client_closed_response(state, request.scope)

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, exc: Exception) -> Response:
        return unexpected_error_response(state, exc, request.url.path)


def _limits(state: AppState) -> dict:
    """The limits the OpenAPI document states: the settings', and the loaded model's."""
    settings = state.settings
    limits = {
        "max_batch_rows": settings.max_batch_rows,
        "max_k": settings.max_k,
        "n_features": None,
        "input_abs_max": None,
        "v2_model_name": settings.v2_model_name,
        "model_names": [entry["name"] for entry in state.engine.repository_index(True)],
        "repository": state.engine.repository is not None,
        "version": None,
    }
    loaded = state.engine.peek()
    if loaded is not None:
        limits.update(
            version=loaded.version,
            max_k=min(settings.max_k, loaded.n_references),
            n_features=loaded.n_features,
            input_abs_max=loaded.input_abs_max,
        )
    return limits


def _install_openapi(app: FastAPI, state: AppState) -> None:
    """/openapi.json, /docs and /redoc per the ``docs`` setting, with the live limits."""
    settings = state.settings
    cache: dict[str, dict] = {}

    def openapi() -> dict:
        limits = _limits(state)
        key = repr(sorted(limits.items()))
        if key not in cache:
            cache.clear()
            cache[key] = build_openapi(app, limits, secured=settings.api_key is not None)
        return cache[key]

    app.openapi = openapi  # type: ignore[method-assign]
    if settings.docs == "off":
        return

    def guard(request: Request) -> None:
        if settings.docs == "protected":
            check_api_key(request, settings.api_key)

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi_json(request: Request) -> JSONResponse:
        guard(request)
        return JSONResponse(app.openapi())

    @app.get("/docs", include_in_schema=False)
    async def docs(request: Request) -> HTMLResponse:
        guard(request)
        return get_swagger_ui_html(openapi_url="/openapi.json", title="nca-knn")

    @app.get("/redoc", include_in_schema=False)
    async def redoc(request: Request) -> HTMLResponse:
        guard(request)
        return get_redoc_html(openapi_url="/openapi.json", title="nca-knn")

    card = ModelCard()

    @app.get("/", include_in_schema=False)
    async def model_card(request: Request) -> HTMLResponse:
        """The model card (service.http.card), rendered in a worker thread."""
        guard(request)
        if state.engine.repository is not None:
            entries = await run_in_threadpool(state.engine.repository_index)
            page = await run_in_threadpool(
                card_module.render_repository, entries, state.metrics.registry
            )
            return HTMLResponse(page)
        model = state.engine.current()
        page = await run_in_threadpool(
            card.render, model, state.metrics.registry, state.engine.last_error
        )
        return HTMLResponse(page)


def create_app_from_env() -> FastAPI:
    """Factory for uvicorn workers: settings come from NCAKNN_* variables."""
    from service.ops.logs import configure_logging

    settings = Settings()
    configure_logging(settings.log_level, settings.log_json)
    return create_app(settings)


__all__ = ["create_app", "create_app_from_env"]
