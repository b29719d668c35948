"""The Open Inference Protocol's model repository extension over REST, behind the admin
key: ``POST /v2/repository/index`` (every model, its version, state and reason),
``POST /v2/repository/models/{name}/load`` and ``.../unload`` (Triton's routes, as
tritonclient calls them). The engine does the work (``Engine.repository_index``,
``load_named``, ``unload_named``); errors are the protocol's ``{"error": ...}``.
"""

from __future__ import annotations

from typing import Any

import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from service.errors import InvalidInput
from service.oip.rest import encode, v2_errors
from service.oip.tensors import check_request_parameters
from service.wire import JSON, check_key, read_body, state_of

router = APIRouter(prefix="/v2/repository", tags=["open inference protocol: model repository"])
MAX_BODY_BYTES = 4096  # these bodies carry a flag or two


def route_template(path: str) -> str | None:
    """The metrics' route label of a load or unload path (names vary, labels do not)."""
    parts = path.split("/")  # "", "v2", "repository", "models", name, action
    if len(parts) == 6 and parts[:4] == ["", "v2", "repository", "models"]:
        return f"/v2/repository/models/{{model_name}}/{parts[5]}"
    return None


class IndexRequest(msgspec.Struct, forbid_unknown_fields=True):
    ready: bool = False


class RepositoryCallBody(msgspec.Struct, forbid_unknown_fields=True):
    parameters: dict[str, Any] | None = None


async def _body(request: Request, schema: type, what: str):
    """The admin key, then the JSON body (empty: the schema's defaults), strictly."""
    state = state_of(request)
    settings = state.settings
    check_key(request.headers.getlist("authorization"), settings.admin_api_key or settings.api_key)
    with state.bodies.hold() as hold:
        body = await read_body(request, MAX_BODY_BYTES, f"for {what}", hold)
    if not body.strip():
        return state, schema()
    try:
        return state, msgspec.json.decode(body, type=schema)
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:
        raise InvalidInput(f"the {what} body is not valid: {exc}") from None


@router.post("/index", summary="Every model of the repository: name, version, state, reason")
@v2_errors
async def repository_index(request: Request) -> Response:
    state, body = await _body(request, IndexRequest, "repository index")
    entries = await run_in_threadpool(state.engine.repository_index, body.ready)  # the disk
    return Response(encode(entries), media_type=JSON)


@router.post("/models/{model_name}/load", summary="Load (or reload) a model by name")
@v2_errors
async def load(request: Request, model_name: str) -> Response:
    state, body = await _body(request, RepositoryCallBody, "load")
    check_request_parameters(model_name, body.parameters, set())
    await state.engine.load_named(model_name, state.settings.reload_timeout_seconds)
    return Response(b"{}", media_type=JSON)


@router.post("/models/{model_name}/unload", summary="Unload a model by name")
@v2_errors
async def unload(request: Request, model_name: str) -> Response:
    state, body = await _body(request, RepositoryCallBody, "unload")
    check_request_parameters(model_name, body.parameters, {"unload_dependents"})
    await state.engine.unload_named(model_name)
    return Response(b"{}", media_type=JSON)
