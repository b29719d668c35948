"""What the inference routes share: OpenAPI descriptions, parsing, search, response types."""

from __future__ import annotations

from typing import Any

import numpy as np
from starlette.concurrency import run_in_threadpool

from service.deps import AppState
from service.engine import LoadedModel
from service.errors import STATUS, InvalidInput
from service.payload import JSON, NPY, check_media, parse_json, parse_npy, to_rows
from service.schemas import ErrorBody

INLINE_ROWS = 64  # below this, projection runs on the event loop (a thread hop costs more)

_DESCRIPTIONS = {
    400: "empty batch",
    401: "missing or wrong API key",
    406: "the Accept header asks for a type this route cannot return",
    409: "the artifact could not be loaded; the previous model keeps serving",
    413: "too many instances or body too large",
    415: "unsupported Content-Type",
    422: "invalid input: wrong dimensionality, NaN/Inf, non-numeric, ragged rows, bad k or rule",
    429: "overloaded: too many requests in flight",
    503: "no model loaded yet, or shutting down",
}


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    return {s: {"model": ErrorBody, "description": _DESCRIPTIONS[s]} for s in statuses}


INFERENCE_ERRORS = error_responses(400, 401, 413, 415, 422, 429, 503)
assert set(_DESCRIPTIONS) <= set(STATUS.values())


def request_body(schema: type, *, npy: bool) -> dict:
    """OpenAPI requestBody: the JSON schema, and a raw float32 (n, D) .npy when allowed."""
    content: dict[str, Any] = {
        JSON: {"schema": {"$ref": f"#/components/schemas/{schema.__name__}"}}
    }
    if npy:
        content[NPY] = {
            "schema": {"type": "string", "format": "binary"},
            "description": "a 2-D float32 .npy array (n, D); options go in the query string",
        }
    return {"requestBody": {"required": True, "content": content}}


def parse_instances(
    body: bytes,
    content_type: str | None,
    schema: type,
    model: LoadedModel,
    state: AppState,
    npy: bool,
):
    """(validated request or None for npy, rows float32 (n, D))."""
    kind = check_media(content_type, (JSON, NPY) if npy else (JSON,))
    if kind == NPY:
        request, instances = None, parse_npy(body)
    else:
        request = parse_json(body, schema)
        instances = request.instances
    rows = to_rows(instances, n_features=model.n_features, max_rows=state.settings.max_batch_rows)
    return request, rows


def resolve_k(k: int | None, model: LoadedModel, state: AppState) -> int:
    k = model.artifact.default_k if k is None else k
    if k > state.settings.max_k:
        raise InvalidInput(f"k={k} is over the limit max_k={state.settings.max_k}")
    model.check_k(k)
    return k


async def search(state: AppState, model: LoadedModel, rows: np.ndarray, k: int):
    """(distances (n, k), row indices (n, k)): merged with other requests when batching."""
    if state.batcher is not None:
        return await state.batcher.search(model, rows, k)
    return await run_in_threadpool(lambda: model.search_embedded(model.embed(rows), k))


async def embed(model: LoadedModel, rows: np.ndarray) -> np.ndarray:
    if len(rows) <= INLINE_ROWS:
        return model.embed(rows)
    return await run_in_threadpool(model.embed, rows)


def neighbor_lists(
    model: LoadedModel, distances: np.ndarray, indices: np.ndarray
) -> list[list[dict]]:
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
