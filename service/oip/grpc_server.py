"""The Open Inference Protocol over gRPC (``inference.GRPCInferenceService``) and gRPC health
checking (``grpc.health.v1.Health``), on the HTTP server's event loop and engine.

Started by the app's lifespan when ``grpc_port`` is not 0, stopped (with the drain's grace)
before the batcher. Every call goes through the same checks as REST: the API key (metadata
``authorization: Bearer <key>``, checked by :class:`KeyCheck` before the message is read),
the model name and version, the tensor checks of
``service.oip.tensors``, and ``oip.run_call`` (one engine operation).
Errors carry the gRPC status matching the HTTP status of the one error table
(:data:`GRPC_CODES`) and the same message.
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc
import numpy as np
from google.protobuf.message import DecodeError

from service import __version__
from service.errors import (
    InvalidInput,
    NotReady,
    RequestTimeout,
    ServiceError,
    Unauthorized,
    status_of,
)
from service.oip import tensors as oip
from service.oip.protocol import HEALTH_SERVICE, INFERENCE_SERVICE, message
from service.ops.tracing import REQUEST_ID_HEADER, current_span, trace_id_of
from service.state import AppState
from service.wire import check_key

log = logging.getLogger("service.grpc")

# HTTP status of the error table -> gRPC status (the gRPC project's HTTP mapping)
GRPC_CODES = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    404: grpc.StatusCode.NOT_FOUND,
    408: grpc.StatusCode.DEADLINE_EXCEEDED,
    406: grpc.StatusCode.INVALID_ARGUMENT,
    413: grpc.StatusCode.RESOURCE_EXHAUSTED,
    415: grpc.StatusCode.INVALID_ARGUMENT,
    422: grpc.StatusCode.INVALID_ARGUMENT,
    409: grpc.StatusCode.FAILED_PRECONDITION,  # a refused load (the index says why)
    429: grpc.StatusCode.UNAVAILABLE,
    500: grpc.StatusCode.INTERNAL,
    503: grpc.StatusCode.UNAVAILABLE,
}
# the typed contents field of each datatype (InferTensorContents)
CONTENTS_FIELD = {
    "BOOL": "bool_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
    "BYTES": "bytes_contents",
}
MESSAGES = {
    name: message(f"inference.{name}")
    for name in (
        "ServerLiveRequest",
        "ServerLiveResponse",
        "ServerReadyRequest",
        "ServerReadyResponse",
        "ModelReadyRequest",
        "ModelReadyResponse",
        "ServerMetadataRequest",
        "ServerMetadataResponse",
        "ModelMetadataRequest",
        "ModelMetadataResponse",
        "ModelInferRequest",
        "ModelInferResponse",
        "RepositoryIndexRequest",
        "RepositoryIndexResponse",
        "RepositoryModelLoadRequest",
        "RepositoryModelLoadResponse",
        "RepositoryModelUnloadRequest",
        "RepositoryModelUnloadResponse",
    )
}
HealthCheckRequest = message("grpc.health.v1.HealthCheckRequest")
HealthCheckResponse = message("grpc.health.v1.HealthCheckResponse")
SERVING, NOT_SERVING = 1, 2
SERVICE_UNKNOWN = 3
WATCH_POLL_SECONDS = 0.25
GRPC_IDLE_SECONDS = 60  # a connection with no call for this long is closed
GRPC_MAX_AGE_SECONDS = 300  # a connection is asked to go away (GOAWAY) after this long
MAX_STREAMS_PER_CONNECTION = 16  # concurrent calls on one HTTP/2 connection


def parameter(value) -> object:
    """An InferParameter's value."""
    choice = value.WhichOneof("parameter_choice")
    return None if choice is None else getattr(value, choice)


class InferenceService:
    """The six RPCs of the core protocol, over the app's state."""

    def __init__(self, state: AppState):
        self.state = state

    # -------------------------------------------------------------- plumbing

    async def run(self, name: str, handler, request, context):
        """Call ``handler``; a ServiceError becomes the matching gRPC status, counted in the
        metrics as the HTTP status it stands for."""
        started = time.perf_counter()
        status = 200
        tracing = self.state.tracing
        span = token = None
        if tracing.enabled:
            carrier = {k: v for k, v in (context.invocation_metadata() or ()) if isinstance(v, str)}
            span = tracing.start_request(f"grpc {INFERENCE_SERVICE}/{name}", carrier)
            token = current_span.set(span)
            await context.send_initial_metadata(((REQUEST_ID_HEADER, trace_id_of(span)),))
        incoming = request if isinstance(request, IncomingMessage) else None
        try:
            if incoming is not None:
                request = await incoming.read(context)
            if isinstance(request, Undecodable):
                raise InvalidInput(request.message)
            return await handler(request, context)
        except ServiceError as exc:
            status = status_of(exc)
            self.state.metrics.errors.labels(exc.error_type).inc()
            await context.abort(GRPC_CODES.get(status, grpc.StatusCode.INTERNAL), exc.message)
        except asyncio.CancelledError:
            status = 499  # the client cancelled the call or its deadline passed
            raise
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            status = 500
            log.error("unexpected error", extra={"rpc": name}, exc_info=exc)
            self.state.metrics.errors.labels("internal_error").inc()
            await context.abort(
                grpc.StatusCode.INTERNAL, f"internal error ({type(exc).__name__}); it was logged"
            )
        finally:
            if incoming is not None:
                incoming.release()
            if status == 200 and _deadline_passed(context):
                status = 499  # answered after the client's deadline: it never arrives
            route, seconds = f"grpc {INFERENCE_SERVICE}/{name}", time.perf_counter() - started
            count, latency = self.state.metrics.request_series[route, status]
            count.inc()
            latency.observe(seconds)
            if span is not None:
                current_span.reset(token)
                tracing.finish_request(span, route, status, seconds)

    def model(self, name: str, version: str):
        return self.state.engine.model(name, version)

    # -------------------------------------------------------------- RPCs

    async def server_live(self, request, context):
        return MESSAGES["ServerLiveResponse"](live=True)

    async def server_ready(self, request, context):
        return MESSAGES["ServerReadyResponse"](ready=self.state.engine.ready)

    async def model_ready(self, request, context):
        try:
            self.model(request.name, request.version)
        except NotReady:  # a repository's model that does not serve now
            return MESSAGES["ModelReadyResponse"](ready=False)
        return MESSAGES["ModelReadyResponse"](ready=not self.state.engine.draining)

    async def server_metadata(self, request, context):
        return MESSAGES["ServerMetadataResponse"](
            name="nca-knn", version=__version__, extensions=oip.EXTENSIONS
        )

    async def model_metadata(self, request, context):
        model = self.model(request.name, request.version)
        meta = oip.model_metadata(model, self.state.engine.name_of(model))
        return MESSAGES["ModelMetadataResponse"](**meta)

    async def model_infer(self, request, context):
        model = self.model(request.model_name, request.model_version)
        settings = self.state.settings
        call = infer_call(request, model, settings.max_batch_rows)
        query = oip.query_of(model, settings.max_k, call)
        tensors = await oip.run_call(
            self.state, model, call, query, f"grpc {INFERENCE_SERVICE}/ModelInfer"
        )
        response = MESSAGES["ModelInferResponse"](
            model_name=self.state.engine.name_of(model), model_version=model.version, id=request.id
        )
        for tensor in tensors:
            response.outputs.add(name=tensor.name, datatype=tensor.datatype, shape=tensor.shape)
            response.raw_output_contents.append(tensor.raw())
        return response

    async def repository_index(self, request, context):
        check_repository_name(request.repository_name)
        response = MESSAGES["RepositoryIndexResponse"]()
        loop = asyncio.get_running_loop()  # the index looks at the disk: off the event loop
        entries = await loop.run_in_executor(
            None, self.state.engine.repository_index, request.ready
        )
        for entry in entries:
            response.models.add(**entry)
        return response

    async def repository_model_load(self, request, context):
        check_repository_name(request.repository_name)
        parameters = {k: parameter(v) for k, v in request.parameters.items()}
        oip.check_request_parameters(request.model_name, parameters, set())
        timeout = self.state.settings.reload_timeout_seconds
        await self.state.engine.load_named(request.model_name, timeout)
        return MESSAGES["RepositoryModelLoadResponse"]()

    async def repository_model_unload(self, request, context):
        check_repository_name(request.repository_name)
        parameters = {k: parameter(v) for k, v in request.parameters.items()}
        oip.check_request_parameters(request.model_name, parameters, {"unload_dependents"})
        await self.state.engine.unload_named(request.model_name)
        return MESSAGES["RepositoryModelUnloadResponse"]()


def check_repository_name(name: str) -> None:
    """The server has one repository, which the calls leave unnamed."""
    if name:
        raise InvalidInput(
            f"repository_name {name[:100]!r}: this server has one repository; leave the name empty"
        )


def infer_call(request, model, max_rows: int) -> oip.InferCall:
    """A ModelInferRequest -> a checked InferCall (the same checks as REST's)."""
    ours, _ = oip.split_parameters({k: parameter(v) for k, v in request.parameters.items()})
    if len(request.inputs) != 1:
        names = [t.name for t in request.inputs]
        raise InvalidInput(f"expected one input, {oip.INPUT_NAME!r}; got {names}")
    tensor = request.inputs[0]
    if tensor.parameters:
        raise InvalidInput(
            f"input {tensor.name!r}: unknown parameters {sorted(tensor.parameters)}; inputs "
            "take none over gRPC"
        )
    if request.raw_input_contents:
        if len(request.raw_input_contents) != len(request.inputs):
            raise InvalidInput(
                f"raw_input_contents has {len(request.raw_input_contents)} entries for "
                f"{len(request.inputs)} inputs; expected one per input"
            )
        if tensor.HasField("contents"):
            raise InvalidInput(f"input {tensor.name!r} has both contents and raw contents")
        values = oip.raw_values(
            tensor.name, tensor.datatype, request.raw_input_contents[0], "raw contents"
        )
    else:
        field = CONTENTS_FIELD.get(tensor.datatype)
        if field is None or tensor.datatype in ("BYTES", "BOOL"):
            raise InvalidInput(
                f"input {tensor.name!r} has datatype {tensor.datatype!r}; expected FP32 (or "
                f"one of {list(oip.INPUT_DATATYPES)})"
            )
        values = np.asarray(getattr(tensor.contents, field), dtype=np.float64)
    rows = oip.input_rows(
        model, tensor.name, tensor.datatype, [int(s) for s in tensor.shape], values, max_rows
    )
    requested = []
    for output in request.outputs:
        if output.parameters:
            raise InvalidInput(
                f"output {output.name!r}: unknown parameters {sorted(output.parameters)}; "
                "outputs take none over gRPC"
            )
        requested.append(oip.RequestedOutput(output.name))
    return oip.InferCall(
        rows=rows,
        outputs=oip.requested_outputs(model, requested or None),
        id=request.id,
        **ours,
    )


class IncomingMessage:
    """A call's request message, not read yet: :meth:`InferenceService.run` reads it,
    within ``body_timeout_seconds``, after reserving the largest message the call may carry
    from the worker's budget of bodies in flight (``service.ops.bodies``). So the messages
    gRPC receives at once are bounded like HTTP bodies (429 -> UNAVAILABLE when the budget
    is spent), and a stalled message is cut off at the deadline (408 -> DEADLINE_EXCEEDED)."""

    def __init__(self, state: AppState, limit: int):
        self.state, self.limit, self.hold = state, limit, None

    async def read(self, context):
        self.hold = self.state.bodies.hold()
        self.hold.reserve(self.limit)
        timeout = self.state.settings.body_timeout_seconds
        try:
            message = await asyncio.wait_for(context.read(), timeout)
        except TimeoutError:
            raise RequestTimeout(
                f"the request message did not arrive within {timeout:g} s (body_timeout_seconds)"
            ) from None
        if message is grpc.aio.EOF:
            raise InvalidInput("the call carries no request message")
        return message

    def release(self) -> None:
        if self.hold is not None:
            self.hold.release()
            self.hold = None


def _deadline_passed(context) -> bool:
    remaining = context.time_remaining()
    return remaining is not None and remaining <= 0


class KeyCheck(grpc.aio.ServerInterceptor):
    """The API key (the admin key for the repository calls), checked on a call's metadata
    before its message is read: a call without
    a valid key gets UNAUTHENTICATED from a handler that never reads the request, so an
    unauthenticated client costs neither the message's memory nor its parsing. Health
    checking needs no key."""

    def __init__(self, state: AppState):
        self.state = state

    async def intercept_service(self, continuation, details):
        settings = self.state.settings
        key = settings.api_key
        if details.method.rsplit("/", 1)[-1] in REPOSITORY_RPCS:  # the admin key's calls
            key = settings.admin_api_key or settings.api_key
        if key is None or details.method.startswith(f"/{HEALTH_SERVICE}/"):
            return await continuation(details)
        values = [v for k, v in (details.invocation_metadata or ()) if k == "authorization"]
        try:
            check_key([v if isinstance(v, str) else "" for v in values], key)
        except Unauthorized as exc:
            return self.refusal(details.method, exc)
        return await continuation(details)

    def refusal(self, method: str, error: Unauthorized):
        """A handler that answers ``error`` without reading the request; the call is counted
        as the 401 it stands for."""
        metrics = self.state.metrics
        metrics.errors.labels(error.error_type).inc()
        name = method.rsplit("/", 1)[-1]
        route = f"grpc {INFERENCE_SERVICE}/{name if name in RPC_NAMES else 'unknown'}"

        async def refuse(requests, context):
            count, latency = metrics.request_series[route, status_of(error)]
            count.inc()
            latency.observe(0.0)
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, error.message)

        return grpc.stream_unary_rpc_method_handler(refuse)


class HealthService:
    """grpc.health.v1.Health: SERVING while a model is loaded and the server not draining;
    the overall server ("") and the inference service are known. A Watch stream gets the
    status at once and on every change; when the server starts draining it gets NOT_SERVING
    and the stream ends, so an open watcher never holds up shutdown."""

    KNOWN = ("", INFERENCE_SERVICE)

    def __init__(self, state: AppState):
        self.state = state

    def status(self) -> int:
        return SERVING if self.state.engine.ready else NOT_SERVING

    async def check(self, request, context):
        if isinstance(request, Undecodable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        if request.service not in self.KNOWN:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {request.service!r}")
        return HealthCheckResponse(status=self.status())

    async def watch(self, request, context):
        if isinstance(request, Undecodable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        if request.service not in self.KNOWN:
            yield HealthCheckResponse(status=SERVICE_UNKNOWN)
            return
        last = None
        while True:
            draining = self.state.engine.draining  # read once: the status sent agrees with it
            current = NOT_SERVING if draining else self.status()
            if current != last:
                yield HealthCheckResponse(status=current)
                last = current
            if draining:
                return  # NOT_SERVING was sent: end the stream so shutdown need not wait for it
            await asyncio.sleep(WATCH_POLL_SECONDS)


class Undecodable:
    """What a request that is not a valid message of its type decodes to: the handler
    answers INVALID_ARGUMENT (gRPC's own answer to a failing deserializer is INTERNAL)."""

    def __init__(self, type_name: str, error: Exception):
        self.message = f"the request is not a valid {type_name} message ({error})"


def _decoder(request_type):
    def decode(data: bytes):
        try:
            return request_type.FromString(data)
        except DecodeError as exc:
            return Undecodable(request_type.DESCRIPTOR.full_name, exc)

    return decode


def _unary(handler, request_type, response_type):
    return grpc.unary_unary_rpc_method_handler(
        handler,
        request_deserializer=_decoder(request_type),
        response_serializer=response_type.SerializeToString,
    )


REPOSITORY_RPCS = ("RepositoryIndex", "RepositoryModelLoad", "RepositoryModelUnload")
RPC_NAMES = (
    "ServerLive",
    "ServerReady",
    "ModelReady",
    "ServerMetadata",
    "ModelMetadata",
    "ModelInfer",
    *REPOSITORY_RPCS,
)


def handlers(state: AppState, limit: int) -> list:
    """The generic handlers of both services. Every RPC of the inference service reads its
    one request message itself (a stream-unary handler: the wire is the same for a unary
    client), so that the message is reserved for and given a deadline (IncomingMessage);
    ``limit`` is the largest message a call may carry (``message_limit``)."""
    service, health = InferenceService(state), HealthService(state)
    rpcs = {
        "ServerLive": service.server_live,
        "ServerReady": service.server_ready,
        "ModelReady": service.model_ready,
        "ServerMetadata": service.server_metadata,
        "ModelMetadata": service.model_metadata,
        "ModelInfer": service.model_infer,
        "RepositoryIndex": service.repository_index,
        "RepositoryModelLoad": service.repository_model_load,
        "RepositoryModelUnload": service.repository_model_unload,
    }

    def wrapped(name, method):
        async def call(requests, context):
            return await service.run(name, method, IncomingMessage(state, limit), context)

        return call

    table = {
        name: grpc.stream_unary_rpc_method_handler(
            wrapped(name, method),
            request_deserializer=_decoder(MESSAGES[f"{name}Request"]),
            response_serializer=MESSAGES[f"{name}Response"].SerializeToString,
        )
        for name, method in rpcs.items()
    }
    health_table = {
        "Check": _unary(health.check, HealthCheckRequest, HealthCheckResponse),
        "Watch": grpc.unary_stream_rpc_method_handler(
            health.watch,
            request_deserializer=_decoder(HealthCheckRequest),
            response_serializer=HealthCheckResponse.SerializeToString,
        ),
    }
    return [
        grpc.method_handlers_generic_handler(INFERENCE_SERVICE, table),
        grpc.method_handlers_generic_handler(HEALTH_SERVICE, health_table),
    ]


MESSAGE_FRAMING_BYTES = 64 * 1024  # a ModelInferRequest's fields besides the values


def message_limit(settings, model) -> int:
    """The largest request message: ``max_batch_rows`` rows of the model's D values at 8
    bytes (FP64 and INT64 raw contents; FP32 takes half) plus MESSAGE_FRAMING_BYTES, never
    more than ``max_body_bytes``; ``max_body_bytes`` while no model is loaded. gRPC core
    refuses a larger message from its length prefix, before buffering it."""
    if model is None:
        return settings.max_body_bytes
    needed = settings.max_batch_rows * model.n_features * 8 + MESSAGE_FRAMING_BYTES
    return min(settings.max_body_bytes, needed)


def server_options(settings, model=None) -> list[tuple[str, int]]:
    """gRPC core's channel arguments: the message size limit (``message_limit``), and the
    same connection limits as HTTP (service.server.connections): at most ``max_connections``
    open connections (beyond it a new one is refused, UNAVAILABLE), the HTTP/2 handshake
    within ``header_timeout_seconds`` (a connection that sends nothing is closed), metadata
    (headers) within ``max_header_bytes``, and an idle connection closed after
    GRPC_IDLE_SECONDS. The port is shared (SO_REUSEPORT) only between the workers of one
    server; with one worker no other process can bind it while it serves."""
    return [
        ("grpc.max_receive_message_length", message_limit(settings, model)),
        ("grpc.max_send_message_length", -1),
        # what a connection may have in flight before its messages are read: a few streams
        # with small flow-control windows (no bandwidth probing that would grow them)
        ("grpc.max_concurrent_streams", MAX_STREAMS_PER_CONNECTION),
        ("grpc.http2.bdp_probe", 0),
        ("grpc.http2.lookahead_bytes", 64 * 1024),
        # a connection lives at most this long, and its calls then get the body deadline to
        # finish: the backstop for a stream that stalls outside a call's own deadline
        ("grpc.max_connection_age_ms", GRPC_MAX_AGE_SECONDS * 1000),
        ("grpc.max_connection_age_grace_ms", int(settings.body_timeout_seconds * 1000)),
        ("grpc.so_reuseport", 1 if settings.workers > 1 else 0),
        ("grpc.max_allowed_incoming_connections", settings.max_connections),
        ("grpc.server_handshake_timeout_ms", int(settings.header_timeout_seconds * 1000)),
        ("grpc.max_metadata_size", settings.max_header_bytes),
        ("grpc.max_connection_idle_ms", GRPC_IDLE_SECONDS * 1000),
    ]


async def start(state: AppState) -> grpc.aio.Server:
    """Bind ``grpc_port`` on ``host`` and serve; the caller stops it (``stop``). The workers
    of one server share the port (SO_REUSEPORT). The message limit is sized by the model
    loaded now: a model loaded later with a larger D takes full batches over gRPC after a
    restart (until then a larger message is RESOURCE_EXHAUSTED, naming the limit)."""
    settings = state.settings
    model = state.engine.peek()
    server = grpc.aio.server(
        options=server_options(settings, model), interceptors=[KeyCheck(state)]
    )
    server.add_generic_rpc_handlers(handlers(state, message_limit(settings, model)))
    address = f"{settings.host}:{settings.grpc_port}"
    if server.add_insecure_port(address) == 0:
        raise OSError(f"cannot bind the gRPC port {address}")
    await server.start()
    log.info("grpc serving", extra={"address": address})
    return server


async def stop(server: grpc.aio.Server, grace_seconds: float) -> None:
    """Refuse new calls, let those in flight finish within ``grace_seconds``."""
    await server.stop(grace_seconds)
