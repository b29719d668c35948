"""Writing a /v1 inference answer: JSON, or one structured ``.npy`` array (``Accept:
application/x-npy``) holding the same float64 numbers, one record per instance (the fields
are listed in ``service.http.routes.inference``). Answers with more than
THREAD_ENCODE_VALUES numbers are encoded in a worker thread, so the event loop keeps
answering health probes; memory is given back after large requests.
"""

from __future__ import annotations

import msgspec
import numpy as np
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from service.engine.infer import Answer
from service.engine.model import LoadedModel, class_array
from service.http.decode import InferenceRequest
from service.ops import memory
from service.wire import JSON, npy_bytes

THREAD_ENCODE_VALUES = 32 * 1024  # answers with more numbers are encoded in a worker thread

json_encoder = msgspec.json.Encoder()


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
