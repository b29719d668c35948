"""The /v1 inference routes: POST /v1/classify, /v1/embed and /v1/neighbors, from the raw
request to the encoded answer. Imports nothing from ``service.oip``.

Each handler reads top to bottom: :func:`receive` (below) checks and parses the request,
:func:`query_of` resolves its k, rule and outlier quantile (``service.engine.infer.resolve``),
one engine operation answers it (``Engine.classify``, ``neighbors`` or ``embed``: the
in-flight gate, the search, the metrics and the outlier flags), and the answer is rendered as JSON or as a structured ``.npy`` array. The OpenAPI document
(``service.openapi``) describes the bodies, the query options, the limits of the loaded
model and every status.

Reading a request, each step refusing before the work the next one does:
API key (401) -> a loaded model (503) -> Accept (406) -> Content-Type (415) -> body size,
while it streams (413) -> one strict parse (400/413/422) -> query options (422) -> k (422)
-> answer size (413) -> the in-flight gate (429) -> search. Large bodies are parsed and
large answers encoded in a worker thread, so the event loop keeps answering health probes.

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

import re
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import msgspec
import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from service.core.vocabulary import RULES
from service.engine.infer import Answer, Query, resolve
from service.engine.model import LoadedModel, class_array
from service.errors import InvalidInput, PayloadTooLarge
from service.http.schemas import ClassifyResponse, EmbedResponse, NeighborsResponse
from service.ops import memory
from service.state import AppState
from service.wire import (
    JSON,
    NPY,
    THREAD_PARSE_BYTES,
    body_limit,
    check_key,
    check_media,
    negotiate,
    npy_bytes,
    parse_count,
    parse_json,
    parse_npy,
    read_body,
    state_of,
    to_rows,
)

THREAD_ENCODE_VALUES = 32 * 1024  # answers with more numbers are encoded in a worker thread
BOOL_VALUES = {"true": True, "false": False}
DECIMAL = re.compile(r"[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?")  # unsigned, finite, no "nan"

json_encoder = msgspec.json.Encoder()

router = APIRouter(prefix="/v1", tags=["inference"])

# The JSON request bodies: one strict decode (``service.wire.parse_json``) refuses numbers that
# are not JSON numbers, a k that is not an integer, a return_neighbors that is not a boolean,
# and unknown fields (422).
PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
Rule = Literal[RULES]  # type: ignore[valid-type]  (the values of DecisionRule)


class InstancesBody(msgspec.Struct, forbid_unknown_fields=True):
    instances: list[list[float]]


class EmbedBody(InstancesBody, forbid_unknown_fields=True):
    pass


class NeighborsBody(InstancesBody, forbid_unknown_fields=True):
    k: PositiveInt | None = None


class ClassifyBody(InstancesBody, forbid_unknown_fields=True):
    k: PositiveInt | None = None
    rule: Rule | None = None
    return_neighbors: bool = False
    outlier_quantile: float | None = None


# ---------------------------------------------------------------- routes


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
    answer = await req.state.engine.classify(req.model, req.rows, query, "/v1/classify")
    model = req.model
    n_values = len(req.rows) * values_per_row
    if req.response_type == NPY:
        return await encoded_response(
            req, n_values, lambda: classify_npy(model, answer, with_neighbors), NPY
        )
    return await json_response(req, n_values, lambda: classify_json(model, answer, with_neighbors))


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
    req = await receive(request, EmbedBody, query=(), offered=(JSON, NPY))
    if req.response_type == JSON:
        check_answer_size(req, req.model.n_components)
    z = await req.state.engine.embed(req.model, req.rows, "/v1/embed")
    model = req.model
    if req.response_type == NPY:
        return Response(npy_bytes(z), media_type=NPY, headers={"x-model-version": model.version})
    return await json_response(
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
    req = await receive(request, NeighborsBody, query=("k",), offered=(JSON, NPY))
    query = query_of(req, decides=False)
    if req.response_type == JSON:
        check_answer_size(req, 3 * query.k)
    answer = await req.state.engine.neighbors(req.model, req.rows, query, "/v1/neighbors")
    model = req.model
    n_values = len(req.rows) * 3 * query.k
    if req.response_type == NPY:
        return await encoded_response(req, n_values, lambda: neighbors_npy(model, answer), NPY)
    return await json_response(req, n_values, lambda: neighbors_json(model, answer))


# The direct lane: a POST to these paths calls the endpoint with the raw Request, past
# FastAPI's routing and dependencies (``service.app.ServiceApp``); the decorators above give
# their OpenAPI description and the 405 for other methods. This table is what serves them.
DIRECT_LANE = {
    "/v1/classify": classify,
    "/v1/embed": embed_route,
    "/v1/neighbors": neighbors,
}

# ----------------------------------------------------- reading a request


@dataclass
class InferenceRequest:
    """A request that passed every check up to the search."""

    state: AppState
    model: LoadedModel
    rows: np.ndarray  # (n, D) float32
    body: InstancesBody | None  # the decoded JSON body; None for npy
    options: dict[str, Any]  # strict query options
    response_type: str  # negotiated media type of the answer
    body_bytes: int


def query_options(request: Request, allowed: tuple[str, ...]) -> dict[str, Any]:
    """Strictly parsed query parameters: k (integer >= 1), rule, return_neighbors (true or
    false), outlier_quantile (a decimal number). Unknown or repeated parameters are refused."""
    options: dict[str, Any] = {}
    for name, value in request.query_params.multi_items():
        if name not in allowed:
            raise InvalidInput(
                f"unknown query parameter {name!r}; this route takes {list(allowed) or 'none'}"
            )
        if name in options:
            raise InvalidInput(f"query parameter {name!r} is given more than once")
        if name == "k":
            options[name] = parse_count(value, "query parameter k", minimum=1)
        elif name == "rule":
            if value not in RULES:
                raise InvalidInput(
                    f"query parameter rule must be one of {list(RULES)}, got {value!r}"
                )
            options[name] = value
        elif name == "outlier_quantile":
            if not DECIMAL.fullmatch(value):
                raise InvalidInput(
                    f"query parameter outlier_quantile must be a decimal number, got {value!r}"
                )
            options[name] = float(value)
        elif name == "return_neighbors":
            if value not in BOOL_VALUES:
                raise InvalidInput(
                    f"query parameter return_neighbors must be true or false, got {value!r}"
                )
            options[name] = BOOL_VALUES[value]
    return options


def _parse(body: bytes, kind: str, schema: type[InstancesBody], model: LoadedModel, max_rows: int):
    d = model.n_features
    if kind == NPY:
        parsed, instances = None, parse_npy(body, n_features=d, max_rows=max_rows)
    else:
        parsed = parse_json(body, schema, n_features=d, max_rows=max_rows)
        instances = parsed.instances
    rows = to_rows(instances, n_features=d, max_rows=max_rows, abs_max=model.input_abs_max)
    return parsed, rows


async def receive(
    request: Request,
    schema: type[InstancesBody],
    *,
    query: tuple[str, ...],
    offered: tuple[str, ...] = (JSON,),
) -> InferenceRequest:
    state = state_of(request)
    check_key(request.headers.getlist("authorization"), state.settings.api_key)
    model = state.engine.current()
    response_type = negotiate(request.headers.get("accept"), offered)
    kind = check_media(request.headers.get("content-type"), (JSON, NPY))
    settings = state.settings
    limit = body_limit(
        kind,
        n_features=model.n_features,
        max_rows=settings.max_batch_rows,
        max_body_bytes=settings.max_body_bytes,
    )
    with state.bodies.hold() as hold:
        body = await read_body(
            request,
            limit,
            f"for {kind} bodies (max_body_bytes, or {settings.max_batch_rows} rows of "
            f"{model.n_features} features)",
            hold,
        )
        options = query_options(request, query)
        if len(body) > THREAD_PARSE_BYTES:
            parsed, rows = await run_in_threadpool(
                _parse, body, kind, schema, model, settings.max_batch_rows
            )
        else:
            parsed, rows = _parse(body, kind, schema, model, settings.max_batch_rows)
    return InferenceRequest(state, model, rows, parsed, options, response_type, len(body))


def query_of(request: InferenceRequest, decides: bool) -> Query:
    """The request's k, rule and outlier quantile (the JSON body's, else the query string's,
    else the model's defaults), resolved by the inference path's one ``resolve``. A query
    string k over the limit is refused even when the body's k wins."""
    body, options = request.body, request.options
    max_k = request.state.settings.max_k
    query_k = options.get("k")
    if query_k is not None and query_k > max_k:
        raise InvalidInput(f"query parameter k={query_k} is over the limit max_k={max_k}")
    body_k = getattr(body, "k", None)
    body_q = getattr(body, "outlier_quantile", None)
    return resolve(
        request.model,
        max_k,
        k=body_k if body_k is not None else query_k,
        rule=getattr(body, "rule", None) or options.get("rule"),
        quantile=body_q if body_q is not None else options.get("outlier_quantile"),
        decides=decides,
    )


def check_answer_size(request: InferenceRequest, values_per_row: int) -> None:
    limit = request.state.settings.max_response_values
    total = len(request.rows) * values_per_row
    if total > limit:
        raise PayloadTooLarge(
            f"the answer would hold {total} numbers ({len(request.rows)} rows x "
            f"{values_per_row}); the limit max_response_values is {limit}: send fewer rows, "
            "a smaller k, or leave out the neighbours"
        )


async def json_response(request: InferenceRequest, n_values: int, build) -> Response:
    """Encode ``build()`` as JSON, in a worker thread when the answer is large; give memory
    back after large requests."""
    return await encoded_response(
        request, n_values, lambda: json_encoder.encode(build()), media_type=JSON
    )


async def encoded_response(
    request: InferenceRequest, n_values: int, encode, media_type: str
) -> Response:
    """The bytes ``encode()`` returns, computed in a worker thread when the answer holds
    more than THREAD_ENCODE_VALUES numbers; memory given back after large requests."""
    large = n_values > THREAD_ENCODE_VALUES
    content = await run_in_threadpool(encode) if large else encode()
    if large or request.body_bytes > memory.LARGE_REQUEST_BYTES:
        memory.trim_soon()
    return Response(
        content, media_type=media_type, headers={"x-model-version": request.model.version}
    )


# --------------------------------------------------------------- answers


def neighbor_lists(
    model: LoadedModel, distances: np.ndarray, indices: np.ndarray
) -> list[list[dict]]:
    """Each row's k neighbours as [{"id", "label", "distance"}] (JSON answers)."""
    ids = model.ids[indices].tolist()
    labels = model.labels[indices].tolist()
    dists = distances.tolist()
    classes = model.classes
    return [
        [
            {"id": i, "label": classes[c], "distance": d}
            for i, c, d in zip(id_row, label_row, dist_row, strict=True)
        ]
        for id_row, label_row, dist_row in zip(ids, labels, dists, strict=True)
    ]


def classify_json(model: LoadedModel, answer: Answer, with_neighbors: bool) -> dict:
    """The JSON answer of /v1/classify: a label, a {class: probability}, the nearest
    distance and the outlier flag per instance (null without a calibration), and the
    neighbours when asked."""
    flags = answer.outliers  # (n,) bool, or None
    names, classes = model.class_names, model.classes
    proba = answer.probabilities.tolist()
    nearest = answer.distances[:, 0].tolist()
    flags = [None] * len(nearest) if flags is None else flags.tolist()
    neighbors = neighbor_lists(model, answer.distances, answer.indices) if with_neighbors else None
    predictions = []
    for i, c in enumerate(answer.predicted.tolist()):
        item = {
            "label": classes[c],
            "probabilities": dict(zip(names, proba[i], strict=True)),
            "nearest_distance": nearest[i],
            "outlier": flags[i],
        }
        if neighbors is not None:
            item["neighbors"] = neighbors[i]
        predictions.append(item)
    return {"predictions": predictions, "model_version": model.version}


def neighbors_json(model: LoadedModel, answer: Answer) -> dict:
    """The JSON answer of /v1/neighbors."""
    return {
        "neighbors": neighbor_lists(model, answer.distances, answer.indices),
        "model_version": model.version,
    }


def _records(fields: list[tuple[str, np.ndarray]]) -> np.ndarray:
    """Columns (n, ...) -> one structured (n,) array with a field per column."""
    n = len(fields[0][1])
    dtype = np.dtype([(name, column.dtype, column.shape[1:]) for name, column in fields])
    out = np.empty(n, dtype=dtype)
    for name, column in fields:
        out[name] = column
    return out


def _neighbour_columns(
    model: LoadedModel, answer: Answer, prefix: str, plural: bool
) -> list[tuple[str, np.ndarray]]:
    classes = class_array(model.classes)
    s = "s" if plural else ""
    return [
        (f"{prefix}id{s}", model.ids[answer.indices]),  # (n, k) int64
        (f"{prefix}label{s}", classes[model.labels[answer.indices]]),  # (n, k)
        (f"{prefix}distance{s}", np.asarray(answer.distances, dtype=np.float64)),  # (n, k)
    ]


def classify_npy(model: LoadedModel, answer: Answer, with_neighbors: bool) -> bytes:
    flags = answer.outliers  # (n,) bool, or None
    fields = [
        ("label", class_array(model.classes)[answer.predicted]),  # (n,)
        ("probabilities", np.asarray(answer.probabilities, dtype=np.float64)),  # (n, C)
        ("nearest_distance", np.asarray(answer.distances[:, 0], dtype=np.float64)),  # (n,)
    ]
    if flags is not None:
        fields.append(("outlier", flags))  # (n,) bool
    if with_neighbors:
        fields += _neighbour_columns(model, answer, "neighbor_", plural=True)
    return npy_bytes(_records(fields))


def neighbors_npy(model: LoadedModel, answer: Answer) -> bytes:
    return npy_bytes(_records(_neighbour_columns(model, answer, "", plural=True)))
