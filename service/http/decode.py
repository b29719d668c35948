"""Reading a /v1 inference request, each step refusing before the work the next one does:
API key (401) -> a loaded model, by name on a named route (404, 503) -> Accept (406) -> Content-Type (415) -> body size,
while it streams (413) -> one strict parse (400/413/422) -> query options (422) -> k (422)
-> answer size (413). Large bodies are parsed in a worker thread, so the event loop keeps
answering health probes.

:func:`receive` checks and parses a request into an :class:`InferenceRequest` (its rows
(n, D) float32, or SparseRows for sparse_instances, its body and query options, the
negotiated answer type), and
:func:`query_of` resolves its k, rule and outlier quantile through the engine's one
``resolve``. The JSON bodies are decoded strictly (``service.wire.arrays.parse_json``):
numbers that are not JSON numbers, a k that is not an integer, a return_neighbors that is
not a boolean, and unknown fields are refused (422).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import msgspec
import numpy as np
from fastapi import Request
from starlette.concurrency import run_in_threadpool

from service.core.sparse import SparseRows
from service.core.vocabulary import RULES
from service.engine.infer import Query, resolve, threshold_at
from service.engine.model import LoadedModel
from service.errors import InvalidInput, PayloadTooLarge
from service.state import AppState
from service.wire import (
    JSON,
    NPY,
    THREAD_PARSE_BYTES,
    body_limit,
    check_key,
    check_media,
    negotiate,
    parse_count,
    parse_json,
    parse_npy,
    read_body,
    state_of,
    to_rows,
    to_sparse_rows,
)

MODEL_NAME_KEY = "ncaknn.model_name"  # the scope key of a named route's model name
BOOL_VALUES = {"true": True, "false": False}
DECIMAL = re.compile(r"[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?")  # unsigned, finite, no "nan"

# The JSON request bodies (the strict decode refuses what the module docstring says).
PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
Rule = Literal[RULES]  # type: ignore[valid-type]  (the values of DecisionRule)


class SparseInstance(msgspec.Struct, forbid_unknown_fields=True):
    """One row by its non-zeros: column indices and their values (any order)."""

    indices: list[int]
    values: list[float]


class InstancesBody(msgspec.Struct, forbid_unknown_fields=True):
    """Rows of D numbers (``instances``), or rows by their non-zeros (``sparse_instances``):
    exactly one of the two."""

    instances: list[list[float]] | msgspec.UnsetType = msgspec.UNSET
    sparse_instances: list[SparseInstance] | msgspec.UnsetType = msgspec.UNSET


class EmbedBody(InstancesBody, forbid_unknown_fields=True):
    pass


class NeighborsBody(InstancesBody, forbid_unknown_fields=True):
    k: PositiveInt | None = None


class ClassifyBody(InstancesBody, forbid_unknown_fields=True):
    k: PositiveInt | None = None
    rule: Rule | None = None
    return_neighbors: bool = False
    outlier_quantile: float | None = None


@dataclass
class InferenceRequest:
    """A request that passed every check up to the search."""

    state: AppState
    model: LoadedModel
    rows: np.ndarray | SparseRows  # (n, D) float32, or n sparse rows of D columns
    body: InstancesBody | None  # the decoded JSON body; None for npy
    options: dict[str, Any]  # strict query options
    response_type: str  # negotiated media type of the answer
    body_bytes: int
    route: str  # the metrics' route label: /v1/classify, or /v1/models/{model_name}/classify


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
        dense, sparse = parsed.instances, parsed.sparse_instances
        if (dense is msgspec.UNSET) == (sparse is msgspec.UNSET):
            given = "neither" if dense is msgspec.UNSET else "both"
            raise InvalidInput(
                f"the body gives {given} of `instances` and `sparse_instances`; send exactly "
                f"one: `instances` as rows of {d} numbers, or `sparse_instances` as rows "
                'of {"indices": [...], "values": [...]}'
            )
        if sparse is not msgspec.UNSET:
            rows = to_sparse_rows(
                sparse,
                n_features=d,
                max_rows=max_rows,
                abs_max=model.input_abs_max,
            )
            return parsed, rows
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
    path = request.scope["path"]
    name = request.scope.get(MODEL_NAME_KEY)  # set by the direct lane for a named route
    model = state.engine.current() if name is None else state.engine.model(name)
    route = path if name is None else "/v1/models/{model_name}/" + path.rsplit("/", 1)[1]
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
    return InferenceRequest(state, model, rows, parsed, options, response_type, len(body), route)


def query_of(request: InferenceRequest, decides: bool) -> Query:
    """The request's k, rule and outlier quantile (the JSON body's, else the query string's,
    else the model's defaults), resolved by the inference path's one ``resolve``. A query
    string k over the limit, or outlier_quantile outside the calibrated range, is refused
    even when the body's value wins: every option a request sends must be one it could use."""
    body, options = request.body, request.options
    max_k = request.state.settings.max_k
    query_k = options.get("k")
    if query_k is not None and query_k > max_k:
        raise InvalidInput(f"query parameter k={query_k} is over the limit max_k={max_k}")
    query_q = options.get("outlier_quantile")
    if query_q is not None:
        threshold_at(request.model, query_q)  # InvalidInput outside the calibrated range
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
