"""The answers of /v1/classify and /v1/neighbors: JSON bodies (as dicts and lists, encoded
by the route) and structured ``.npy`` arrays (``Accept: application/x-npy``).

A JSON answer costs a dictionary per row and a decimal rendering of every number; for
batch clients the same numbers go out as one structured array, one record per instance,
readable with ``numpy.load(io.BytesIO(body), allow_pickle=False)``:

* ``/v1/classify``: ``label`` (the class, int64 when every class is an integer, else a
  unicode string), ``probabilities`` (C,) float64 in the order of ``GET /v1/model``'s
  ``classes``, ``nearest_distance`` float64 (squared, to the nearest reference) and
  ``outlier`` bool (beyond the calibrated threshold; absent when the model has no
  calibration, where JSON says null); with neighbours also ``neighbor_ids`` (k,) int64, ``neighbor_labels`` (k,)
  and ``neighbor_distances`` (k,) float64 (squared Euclidean, ascending).
* ``/v1/neighbors``: ``ids`` (k,), ``labels`` (k,) and ``distances`` (k,).

The numbers are the ones the JSON answer holds (float64 throughout), so both encodings of
one request decode to equal values.
"""

from __future__ import annotations

import numpy as np

from service.engine.infer import Answer
from service.engine.model import LoadedModel, class_array
from service.wire import npy_bytes


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


def classify_json(
    model: LoadedModel, answer: Answer, with_neighbors: bool, flags: np.ndarray | None
) -> dict:
    """The JSON answer of /v1/classify: a label, a {class: probability}, the nearest
    distance and the outlier flag per instance (``flags`` (n,) bool, None without a
    calibration), and the neighbours when asked."""
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


def classify_npy(
    model: LoadedModel, answer: Answer, with_neighbors: bool, flags: np.ndarray | None
) -> bytes:
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
