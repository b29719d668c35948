"""The Open Inference Protocol (KServe V2) over REST, with the binary tensor data extension.

Routes: ``GET /v2`` (server metadata), ``/v2/health/live``, ``/v2/health/ready`` (open, for
probes), ``GET /v2/models/{name}[/versions/{version}]`` (model metadata) and ``/ready``,
``POST /v2/models/{name}[/versions/{version}]/infer``. Errors are the protocol's
``{"error": "<message>"}`` with the status of the one error table (``service.errors``).

Binary tensor data: with an ``Inference-Header-Content-Length: N`` header the first N bytes
of the body are the JSON request and the rest the binary data of the inputs whose
``parameters`` say ``binary_data_size``, in input order, exactly (no more, no less). An
output is answered in binary when its ``binary_data`` parameter is true, or, without one,
when the request's ``binary_data_output`` is; the answer then carries the header too.
"""

from __future__ import annotations

import functools
from typing import Any

import msgspec
import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from service import __version__
from service.errors import (
    InvalidInput,
    NotReady,
    PayloadTooLarge,
    ServiceError,
    UnsupportedMediaType,
    status_of,
)
from service.oip import tensors as oip
from service.wire import (
    JSON,
    THREAD_PARSE_BYTES,
    body_limit,
    check_key,
    describe_unicode_error,
    parse_count,
    read_body,
    state_of,
)

router = APIRouter(prefix="/v2", tags=["open inference protocol (KServe V2)"])
HEADER_LENGTH = "inference-header-content-length"
OCTET = "application/octet-stream"
INFER_ROUTE = "/v2/models/{model_name}/infer"


class V2Input(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    shape: list[int]
    datatype: str
    parameters: dict[str, Any] | None = None
    data: msgspec.Raw = msgspec.Raw(b"")  # empty: absent (binary data instead)


class V2Output(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    parameters: dict[str, Any] | None = None


class V2Request(msgspec.Struct, forbid_unknown_fields=True):
    inputs: list[V2Input]
    id: str | None = None
    parameters: dict[str, Any] | None = None
    outputs: list[V2Output] | None = None


decode_request = msgspec.json.Decoder(V2Request).decode
decode_flat = msgspec.json.Decoder(list[float]).decode
decode_nested = msgspec.json.Decoder(list[list[float]]).decode
encode = msgspec.json.Encoder().encode


def error_body(error: ServiceError) -> Response:
    return Response(encode({"error": error.message}), status_of(error), media_type=JSON)


def v2_errors(endpoint):
    """Answer the endpoint's ServiceErrors in the protocol's body, counted in the metrics."""

    @functools.wraps(endpoint)
    async def wrapped(request: Request, *args, **kwargs) -> Response:
        try:
            return await endpoint(request, *args, **kwargs)
        except ServiceError as exc:
            state_of(request).metrics.errors.labels(exc.error_type).inc()
            return error_body(exc)

    return wrapped


def served_model(request: Request, name: str, version: str | None):
    state = state_of(request)
    check_key(request.headers.getlist("authorization"), state.settings.api_key)
    return state, state.engine.model(name, version)


# ------------------------------------------------------------------ metadata and health


@router.get("", summary="Server metadata: name, version, extensions")
@v2_errors
async def server_metadata(request: Request) -> Response:
    check_key(request.headers.getlist("authorization"), state_of(request).settings.api_key)
    body = {"name": "nca-knn", "version": __version__, "extensions": oip.EXTENSIONS}
    return Response(encode(body), media_type=JSON)


@router.get("/health/live", summary="Liveness (no key): the server is up")
async def live() -> Response:
    return Response(encode({"live": True}), media_type=JSON)


@router.get("/health/ready", summary="Readiness (no key): a model is loaded, not draining")
@v2_errors
async def ready(request: Request) -> Response:
    if not state_of(request).engine.ready:
        raise NotReady("not ready: no model is loaded, or the server is draining")
    return Response(encode({"ready": True}), media_type=JSON)


@router.get("/models/{model_name}", summary="Model metadata: inputs and outputs")
@router.get("/models/{model_name}/versions/{model_version}", summary="Model metadata")
@v2_errors
async def model_metadata(request: Request, model_name: str, model_version: str | None = None):
    state, model = served_model(request, model_name, model_version)
    body = oip.model_metadata(model, state.engine.name_of(model))
    return Response(encode(body), media_type=JSON)


@router.get("/models/{model_name}/ready", summary="Model readiness (200 ready)")
@router.get("/models/{model_name}/versions/{model_version}/ready", summary="Model readiness")
@v2_errors
async def model_ready(request: Request, model_name: str, model_version: str | None = None):
    state, _ = served_model(request, model_name, model_version)
    if state.engine.draining:
        raise NotReady("not ready: the server is draining")
    return Response(encode({"name": model_name, "ready": True}), media_type=JSON)


# ------------------------------------------------------------------ inference


def is_v2(path: str) -> bool:
    return path == "/v2" or path.startswith("/v2/")


def route_template(path: str) -> str | None:
    """The metrics' route label of a /v2/models path (names and versions vary)."""
    parts = path.split("/")
    if len(parts) < 4 or parts[:3] != ["", "v2", "models"]:
        return None
    tail = parts[4:]
    if tail[:1] == ["versions"] and len(tail) >= 2:
        tail = ["versions", "{model_version}", *tail[2:]]
    return "/".join(["", "v2", "models", "{model_name}", *tail])


def infer_target(path: str) -> tuple[str, str | None] | None:
    """(model name, version or None) of an infer path, None for any other path."""
    parts = path.split("/")  # "", "v2", "models", name, [versions, v,] infer
    if len(parts) == 5 and parts[:3] == ["", "v2", "models"] and parts[4] == "infer":
        return parts[3], None
    if (
        len(parts) == 7
        and parts[:3] == ["", "v2", "models"]
        and parts[4] == "versions"
        and parts[6] == "infer"
    ):
        return parts[3], parts[5]
    return None


def _values(tensor: V2Input, raw: bytes | None) -> np.ndarray:
    """The tensor's elements (flat) from its JSON data or its binary data."""
    if raw is not None:
        return oip.raw_values(tensor.name, tensor.datatype, raw, "binary data")
    if not tensor.data:
        raise InvalidInput(
            f"input {tensor.name!r} has neither data nor a binary_data_size parameter"
        )
    try:
        return np.asarray(decode_flat(tensor.data), dtype=np.float64)
    except msgspec.ValidationError:
        pass
    except UnicodeDecodeError as exc:
        raise InvalidInput(describe_unicode_error(exc, f"input {tensor.name!r} data")) from None
    try:
        return np.asarray(decode_nested(tensor.data), dtype=np.float64).reshape(-1)
    except (msgspec.ValidationError, ValueError):
        raise InvalidInput(
            f"input {tensor.name!r}: data must be a flat or [n][D] nested list of numbers "
            "(row-major)"
        ) from None


def _binary_sizes(request: V2Request) -> list[int | None]:
    sizes = []
    for tensor in request.inputs:
        params = tensor.parameters or {}
        unknown = set(params) - {"binary_data_size"}
        if unknown:
            raise InvalidInput(
                f"input {tensor.name!r}: unknown parameters {sorted(unknown)}; inputs take "
                "binary_data_size"
            )
        size = params.get("binary_data_size")
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 0):
            raise InvalidInput(
                f"input {tensor.name!r}: binary_data_size must be an integer >= 0, got {size!r}"
            )
        if size is not None and tensor.data:
            raise InvalidInput(f"input {tensor.name!r} has both data and binary_data_size")
        sizes.append(size)
    return sizes


def parse_infer(body: bytes, header_length: str | None, model, max_rows: int) -> oip.InferCall:
    """A REST infer body (JSON, or JSON + binary tensors) -> a checked InferCall."""
    if header_length is None:
        head, binary = body, b""
    else:
        length = parse_count(header_length.strip(), "Inference-Header-Content-Length")
        if not 0 < length <= len(body):
            raise InvalidInput(
                f"Inference-Header-Content-Length is {length}; expected the byte length of "
                f"the JSON header, between 1 and the body's {len(body)} bytes"
            )
        head, binary = body[:length], body[length:]
    try:
        request = decode_request(head)
    except msgspec.DecodeError as exc:
        raise InvalidInput(f"the inference request is not valid: {exc}") from None
    except UnicodeDecodeError as exc:
        raise InvalidInput(describe_unicode_error(exc, "the inference request")) from None
    ours, protocol = oip.split_parameters(request.parameters)
    sizes = _binary_sizes(request)
    declared = sum(s for s in sizes if s is not None)
    if declared != len(binary):
        raise InvalidInput(
            f"binary data: the inputs declare {declared} bytes (binary_data_size), the body "
            f"carries {len(binary)} after the {len(head)}-byte JSON header"
        )
    if len(request.inputs) != 1:
        names = [t.name for t in request.inputs]
        raise InvalidInput(f"expected one input, {oip.INPUT_NAME!r}; got {names}")
    tensor, size = request.inputs[0], sizes[0]
    values = _values(tensor, binary if size is not None else None)
    rows = oip.input_rows(model, tensor.name, tensor.datatype, tensor.shape, values, max_rows)
    requested = None
    if request.outputs is not None:
        requested = []
        for output in request.outputs:
            params = output.parameters or {}
            unknown = set(params) - {"binary_data"}
            binary_flag = params.get("binary_data")
            if unknown or (binary_flag is not None and not isinstance(binary_flag, bool)):
                raise InvalidInput(
                    f"output {output.name!r}: parameters {params}; outputs take binary_data "
                    "(a boolean)"
                )
            requested.append(oip.RequestedOutput(output.name, binary_flag))
    return oip.InferCall(
        rows=rows,
        outputs=oip.requested_outputs(model, requested),
        id=request.id or "",
        parameters=protocol,
        **ours,
    )


def binary_flags(call: oip.InferCall) -> dict[str, bool]:
    """{output: answered in binary}: its binary_data parameter, else the request's
    binary_data_output."""
    default = bool(call.parameters.get("binary_data_output", False))
    return {o.name: default if o.binary is None else o.binary for o in call.outputs}


def encode_answer(call: oip.InferCall, model, name: str, tensors) -> tuple[bytes, int | None]:
    """(body, JSON header length or None): the protocol's response, binary outputs after
    the JSON header."""
    binary = binary_flags(call)
    outputs, chunks = [], []
    for tensor in tensors:
        item = {"name": tensor.name, "datatype": tensor.datatype, "shape": tensor.shape}
        if binary[tensor.name]:
            raw = tensor.raw()
            item["parameters"] = {"binary_data_size": len(raw)}
            chunks.append(raw)
        else:
            item["data"] = tensor.values()
        outputs.append(item)
    header = {"model_name": name, "model_version": model.version, "outputs": outputs}
    if call.id:
        header = {"id": call.id, **header}
    head = encode(header)
    if not chunks:
        return head, None
    return b"".join([head, *chunks]), len(head)


@router.post("/models/{model_name}/infer", summary="Inference (JSON or binary tensors)")
@router.post("/models/{model_name}/versions/{model_version}/infer", summary="Inference")
@v2_errors
async def infer(request: Request, model_name: str | None = None, model_version=None):
    target = infer_target(request.url.path)
    name, version = target if target is not None else (model_name, model_version)
    state, model = served_model(request, name, version)
    settings = state.settings
    media = (request.headers.get("content-type") or JSON).split(";")[0].strip().lower()
    if media not in (JSON, OCTET):
        raise UnsupportedMediaType(
            f"Content-Type {media!r} is not accepted here; use {JSON!r} (or {OCTET!r} with "
            "binary tensor data)"
        )
    if request.headers.get("content-encoding", "identity").lower() != "identity":
        raise UnsupportedMediaType(
            f"Content-Encoding {request.headers['content-encoding']!r} is not accepted; send "
            "the body uncompressed"
        )
    limit = body_limit(
        JSON,
        n_features=model.n_features,
        max_rows=settings.max_batch_rows,
        max_body_bytes=settings.max_body_bytes,
    )
    with state.bodies.hold() as hold:
        body = await read_body(
            request, limit, f"(max_body_bytes, or {settings.max_batch_rows} rows of JSON)", hold
        )
        header_length = request.headers.get(HEADER_LENGTH)
        if len(body) > THREAD_PARSE_BYTES:
            call = await run_in_threadpool(
                parse_infer, body, header_length, model, settings.max_batch_rows
            )
        else:
            call = parse_infer(body, header_length, model, settings.max_batch_rows)
    query = oip.query_of(model, settings.max_k, call)  # 422 before the answer's size
    json_values = _json_values(call, model, query.k)
    if json_values > settings.max_response_values:
        raise PayloadTooLarge(
            f"the JSON outputs would hold {json_values} numbers; the limit max_response_values "
            f"is {settings.max_response_values}: ask for binary outputs or send fewer rows"
        )
    tensors = await oip.run_call(state, model, call, query, INFER_ROUTE)
    content, head_length = encode_answer(call, model, state.engine.name_of(model), tensors)
    headers = {"x-model-version": model.version}
    if head_length is None:
        return Response(content, media_type=JSON, headers=headers)
    headers["Inference-Header-Content-Length"] = str(head_length)
    return Response(content, media_type=OCTET, headers=headers)


def _json_values(call: oip.InferCall, model, k: int) -> int:
    """Numbers the answer would carry as JSON (binary outputs cost no encoding)."""
    binary = binary_flags(call)
    return len(call.rows) * sum(
        oip.values_per_row(model, o.name, k) for o in call.outputs if not binary[o.name]
    )
