"""POST /v1/classify, /v1/embed, /v1/neighbors."""

from __future__ import annotations

from typing import Literal

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import JSONResponse, Response

from service.deps import Body, Model, State, require_api_key
from service.errors import NotAcceptable
from service.payload import JSON, NPY, npy_bytes
from service.routes.common import (
    INFERENCE_ERRORS,
    embed,
    error_responses,
    neighbor_lists,
    parse_instances,
    request_body,
    resolve_k,
    search,
)
from service.schemas import (
    ClassifyRequest,
    ClassifyResponse,
    EmbedRequest,
    EmbedResponse,
    NeighborsRequest,
    NeighborsResponse,
)

router = APIRouter(prefix="/v1", tags=["inference"], dependencies=[Depends(require_api_key)])

K_QUERY = Query(None, ge=1, description="neighbours (npy bodies; JSON bodies may set it)")


async def search_request(request, state, model, body, schema, k, route):
    """Parse the instances, settle k (a JSON body's k wins over the query's), search.

    Returns (parsed JSON request or None for npy, k, distances (n, k), indices (n, k)).
    """
    parsed, rows = parse_instances(
        body, request.headers.get("content-type"), schema, model, state, npy=True
    )
    if parsed is not None and parsed.k is not None:
        k = parsed.k
    k = resolve_k(k, model, state)
    state.metrics.request_rows.labels(route).observe(len(rows))
    with state.admit():
        distances, indices = await search(state, model, rows, k)
    return parsed, k, distances, indices


@router.post(
    "/classify",
    response_model=ClassifyResponse,
    responses=INFERENCE_ERRORS,
    openapi_extra=request_body(ClassifyRequest, npy=True),
    summary="Classify instances by kNN in the learned space",
)
async def classify(
    request: Request,
    state: State,
    model: Model,
    body: Body,
    k: int | None = K_QUERY,
    rule: Literal["majority", "soft"] | None = Query(None, description="decision rule"),
    return_neighbors: bool = Query(False, description="include the k neighbours"),
) -> Response:
    parsed, k, distances, indices = await search_request(
        request, state, model, body, ClassifyRequest, k, "/v1/classify"
    )
    if parsed is not None:
        rule = parsed.rule or rule
        return_neighbors = parsed.return_neighbors or return_neighbors
    rule = rule or model.artifact.decision_rule
    prediction = model.decide(distances, indices, rule)
    names = [str(c) for c in model.classes]
    proba = prediction.probabilities.tolist()
    neighbors = neighbor_lists(model, distances, indices) if return_neighbors else None
    predictions = []
    for i, label in enumerate(prediction.labels):
        item = {"label": label, "probabilities": dict(zip(names, proba[i], strict=True))}
        if neighbors is not None:
            item["neighbors"] = neighbors[i]
        predictions.append(item)
    return JSONResponse({"predictions": predictions, "model_version": model.version})


@router.post(
    "/embed",
    response_model=EmbedResponse,
    responses={
        **INFERENCE_ERRORS,
        **error_responses(406),
        200: {"content": {NPY: {"schema": {"type": "string", "format": "binary"}}}},
    },
    openapi_extra=request_body(EmbedRequest, npy=True),
    summary="Project instances into the learned d-dimensional space (batch embedding)",
)
async def embed_route(request: Request, state: State, model: Model, body: Body) -> Response:
    accept = request.headers.get("accept", JSON)
    want_npy = NPY in accept
    if not want_npy and not any(t in accept for t in (JSON, "*/*", "application/*")):
        raise NotAcceptable(f"Accept {accept!r}: /v1/embed returns {JSON} or {NPY}")
    _, rows = parse_instances(
        body, request.headers.get("content-type"), EmbedRequest, model, state, npy=True
    )
    state.metrics.request_rows.labels("/v1/embed").observe(len(rows))
    with state.admit():
        z = await embed(model, rows)
    if want_npy:
        return Response(npy_bytes(z), media_type=NPY, headers={"x-model-version": model.version})
    return JSONResponse({"embeddings": z.tolist(), "model_version": model.version})


@router.post(
    "/neighbors",
    response_model=NeighborsResponse,
    responses=INFERENCE_ERRORS,
    openapi_extra=request_body(NeighborsRequest, npy=True),
    summary="The k nearest reference points of each instance",
)
async def neighbors(
    request: Request,
    state: State,
    model: Model,
    body: Body,
    k: int | None = K_QUERY,
) -> Response:
    _, k, distances, indices = await search_request(
        request, state, model, body, NeighborsRequest, k, "/v1/neighbors"
    )
    return JSONResponse(
        {"neighbors": neighbor_lists(model, distances, indices), "model_version": model.version}
    )
