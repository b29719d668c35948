"""POST /v1/classify, /v1/embed, /v1/neighbors.

Each handler takes the raw request: the pipeline (``service.http.request``) parses it
strictly and checks every limit; the OpenAPI document (``service.openapi``) describes the
bodies, the query options, the limits of the loaded model and every status.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from service.core.knn import outlier_flags
from service.http import request as pipeline
from service.http.payload import ClassifyBody, EmbedBody, NeighborsBody
from service.http.render import classify_json, classify_npy, neighbors_json, neighbors_npy
from service.http.schemas import ClassifyResponse, EmbedResponse, NeighborsResponse
from service.wire import JSON, NPY, npy_bytes

router = APIRouter(prefix="/v1", tags=["inference"])


@router.post(
    "/classify",
    response_model=ClassifyResponse,
    summary="Classify instances by kNN in the learned space",
    openapi_extra={
        "x-ncaknn-body": "ClassifyRequest",
        "x-ncaknn-query": ["k", "rule", "return_neighbors", "outlier_quantile"],
        "x-ncaknn-npy-out": "classify",
    },
)
async def classify(request: Request) -> Response:
    req = await pipeline.receive(
        request,
        ClassifyBody,
        query=("k", "rule", "return_neighbors", "outlier_quantile"),
        offered=(JSON, NPY),
    )
    query = pipeline.query_of(req, decides=True)
    body = req.body
    with_neighbors = bool(body is not None and body.return_neighbors) or req.options.get(
        "return_neighbors", False
    )
    values_per_row = len(req.model.classes) + 2 + (3 * query.k if with_neighbors else 0)
    if req.response_type == JSON:
        pipeline.check_answer_size(req, values_per_row)
    with req.state.engine.admit():
        req.state.metrics.request_rows.labels("/v1/classify").observe(len(req.rows))
        answer = await req.state.engine.infer(req.model, req.rows, query)
    flags = None
    if query.threshold is not None:
        flags = outlier_flags(answer.distances, query.threshold)  # (n,)
        req.state.metrics.outliers.inc(int(flags.sum()))
    model = req.model
    n_values = len(req.rows) * values_per_row
    if req.response_type == NPY:
        return await pipeline.encoded_response(
            req, n_values, lambda: classify_npy(model, answer, with_neighbors, flags), NPY
        )

    return await pipeline.json_response(
        req, n_values, lambda: classify_json(model, answer, with_neighbors, flags)
    )


@router.post(
    "/embed",
    response_model=EmbedResponse,
    summary="Project instances into the learned d-dimensional space (batch embedding)",
    openapi_extra={
        "x-ncaknn-body": "EmbedRequest",
        "x-ncaknn-query": [],
        "x-ncaknn-npy-out": "embed",
    },
)
async def embed_route(request: Request) -> Response:
    req = await pipeline.receive(request, EmbedBody, query=(), offered=(JSON, NPY))
    if req.response_type == JSON:
        pipeline.check_answer_size(req, req.model.n_components)
    with req.state.engine.admit():
        req.state.metrics.request_rows.labels("/v1/embed").observe(len(req.rows))
        z = await req.state.engine.embed(req.model, req.rows)
    model = req.model
    if req.response_type == NPY:
        return Response(npy_bytes(z), media_type=NPY, headers={"x-model-version": model.version})
    return await pipeline.json_response(
        req, z.size, lambda: {"embeddings": z.tolist(), "model_version": model.version}
    )


@router.post(
    "/neighbors",
    response_model=NeighborsResponse,
    summary="The k nearest reference points of each instance",
    openapi_extra={
        "x-ncaknn-body": "NeighborsRequest",
        "x-ncaknn-query": ["k"],
        "x-ncaknn-npy-out": "neighbors",
    },
)
async def neighbors(request: Request) -> Response:
    req = await pipeline.receive(request, NeighborsBody, query=("k",), offered=(JSON, NPY))
    query = pipeline.query_of(req, decides=False)
    if req.response_type == JSON:
        pipeline.check_answer_size(req, 3 * query.k)
    with req.state.engine.admit():
        req.state.metrics.request_rows.labels("/v1/neighbors").observe(len(req.rows))
        answer = await req.state.engine.infer(req.model, req.rows, query)
    model = req.model
    n_values = len(req.rows) * 3 * query.k
    if req.response_type == NPY:
        return await pipeline.encoded_response(
            req, n_values, lambda: neighbors_npy(model, answer), NPY
        )
    return await pipeline.json_response(req, n_values, lambda: neighbors_json(model, answer))


# The direct lane: a POST to these paths calls the endpoint with the raw Request, past
# FastAPI's routing and dependencies (``service.app.ServiceApp``); the decorators above give
# their OpenAPI description and the 405 for other methods. This table is what serves them.
DIRECT_LANE = {
    "/v1/classify": classify,
    "/v1/embed": embed_route,
    "/v1/neighbors": neighbors,
}
