"""The /v1 inference routes: POST /v1/classify, /v1/embed and /v1/neighbors, from the raw
request to the encoded answer. Imports nothing from ``service.oip``.

Each handler is decode -> engine -> encode: ``service.http.decode`` checks and parses the
request and resolves its k, rule and outlier quantile (the order of its refusals is in its
docstring); one engine operation answers it (``Engine.classify``, ``neighbors`` or
``embed``: the in-flight gate (429), the search, the metrics and the outlier flags); and
``service.http.encode`` writes the answer as JSON or as a structured ``.npy`` array. The
OpenAPI document (``service.openapi``) describes the bodies, the query options, the limits
of the loaded model and every status.

Answers: a JSON answer costs a dictionary per row and a decimal rendering of every number;
for batch clients the same numbers go out as one structured array (``Accept:
application/x-npy``), one record per instance, readable with
``numpy.load(io.BytesIO(body), allow_pickle=False)``:

* ``/v1/classify``: ``label`` (the class, int64 when every class is an integer, else a
  unicode string), ``probabilities`` (C,) float64 in the order of ``GET /v1/model``'s
  ``classes``, ``nearest_distance`` float64 (squared, to the nearest reference) and
  ``outlier`` bool (beyond the calibrated threshold; absent when the model has no
  calibration, where JSON says null); with neighbours also ``neighbor_ids`` (k,) int64,
  ``neighbor_labels`` (k,) and ``neighbor_distances`` (k,) float64 (squared Euclidean,
  ascending).
* ``/v1/neighbors``: ``ids`` (k,), ``labels`` (k,) and ``distances`` (k,).

The numbers are the ones the JSON answer holds (float64 throughout), so both encodings of
one request decode to equal values.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from service.http.decode import (
    ClassifyBody,
    EmbedBody,
    NeighborsBody,
    check_answer_size,
    query_of,
    receive,
)
from service.http.encode import (
    classify_json,
    classify_npy,
    encoded_response,
    json_response,
    neighbors_json,
    neighbors_npy,
)
from service.http.schemas import ClassifyResponse, EmbedResponse, NeighborsResponse
from service.wire import JSON, NPY, npy_bytes

router = APIRouter(prefix="/v1", tags=["inference"])


def inference_route(operation: str, response_model, summary: str, query: list[str]):
    """Declare ``POST /v1/{operation}`` and its named form
    ``POST /v1/models/{model_name}/{operation}`` for one endpoint: their OpenAPI (the
    request body, the query options, the .npy answer: ``service.openapi``) and the 405 for
    other methods. What serves a POST is the direct lane (``DIRECT_LANE``)."""
    extra = {
        "x-ncaknn-body": f"{operation.capitalize()}Request",
        "x-ncaknn-query": query,
        "x-ncaknn-npy-out": operation,
    }

    def declare(endpoint):
        for path, text in (
            (f"/{operation}", summary),
            (f"/models/{{model_name}}/{operation}", f"{summary} (a named model)"),
        ):
            router.post(
                path, response_model=response_model, summary=text, openapi_extra=dict(extra)
            )(endpoint)
        return endpoint

    return declare


@inference_route(
    "classify",
    ClassifyResponse,
    "Classify instances by kNN in the learned space",
    ["k", "rule", "return_neighbors", "outlier_quantile"],
)
async def classify(request: Request) -> Response:
    req = await receive(
        request,
        ClassifyBody,
        query=("k", "rule", "return_neighbors", "outlier_quantile"),
        offered=(JSON, NPY),
    )
    query = query_of(req, decides=True)
    body = req.body
    with_neighbors = bool(body is not None and body.return_neighbors) or req.options.get(
        "return_neighbors", False
    )
    values_per_row = len(req.model.classes) + 2 + (3 * query.k if with_neighbors else 0)
    if req.response_type == JSON:
        check_answer_size(req, values_per_row)
    answer = await req.state.engine.classify(req.model, req.rows, query, req.route)
    model = req.model
    n_values = len(req.rows) * values_per_row
    if req.response_type == NPY:
        return await encoded_response(
            req, n_values, lambda: classify_npy(model, answer, with_neighbors), NPY
        )
    return await json_response(req, n_values, lambda: classify_json(model, answer, with_neighbors))


@inference_route(
    "embed",
    EmbedResponse,
    "Project instances into the learned d-dimensional space (batch embedding)",
    [],
)
async def embed_route(request: Request) -> Response:
    req = await receive(request, EmbedBody, query=(), offered=(JSON, NPY))
    if req.response_type == JSON:
        check_answer_size(req, req.model.n_components)
    z = await req.state.engine.embed(req.model, req.rows, req.route)
    model = req.model
    if req.response_type == NPY:
        return Response(npy_bytes(z), media_type=NPY, headers={"x-model-version": model.version})
    return await json_response(
        req, z.size, lambda: {"embeddings": z.tolist(), "model_version": model.version}
    )


@inference_route(
    "neighbors", NeighborsResponse, "The k nearest reference points of each instance", ["k"]
)
async def neighbors(request: Request) -> Response:
    req = await receive(request, NeighborsBody, query=("k",), offered=(JSON, NPY))
    query = query_of(req, decides=False)
    if req.response_type == JSON:
        check_answer_size(req, 3 * query.k)
    answer = await req.state.engine.neighbors(req.model, req.rows, query, req.route)
    model = req.model
    n_values = len(req.rows) * 3 * query.k
    if req.response_type == NPY:
        return await encoded_response(req, n_values, lambda: neighbors_npy(model, answer), NPY)
    return await json_response(req, n_values, lambda: neighbors_json(model, answer))


# The direct lane: a POST to these paths calls the endpoint with the raw Request, past
# FastAPI's routing and dependencies (``service.app.ServiceApp``); the decorators above give
# their OpenAPI description and the 405 for other methods. This table is what serves them,
# and a model's named routes (/v1/models/{name}/classify, ...: ``named_target``) too.
DIRECT_LANE = {
    "/v1/classify": classify,
    "/v1/embed": embed_route,
    "/v1/neighbors": neighbors,
}


def named_target(path: str) -> tuple[str, str] | None:
    """(model name, the unnamed route) of a named inference path
    ``/v1/models/{name}/classify|embed|neighbors``; None for any other path."""
    parts = path.split("/")  # "", "v1", "models", name, operation
    if len(parts) == 5 and parts[:3] == ["", "v1", "models"] and parts[3]:
        route = f"/v1/{parts[4]}"
        if route in DIRECT_LANE:
            return parts[3], route
    return None


def named_template(path: str) -> str | None:
    """The metrics' route label of a named inference path (names vary, labels do not)."""
    target = named_target(path)
    return None if target is None else target[1].replace("/v1/", "/v1/models/{model_name}/")
