"""What a servable artifact holds: the invariants the writer enforces before it writes and
the reader checks again after it reads, with the same functions, so that an artifact edited
or corrupted between the two (its checksums and version made consistent again) is refused
on load with the field named, never served.

* the dimensions (``n_features_in``, ``n_components``, ``n_references``, ``n_validation``)
  are integers (not booleans, not floats, not strings), at least 1 (``n_validation`` 0);
* ``classes`` is a non-empty list of distinct integers or strings whose string forms are
  distinct too (0 and "0" would be one key of an answer's probabilities);
* ``default_k`` is an integer in [1, n_references]; ``decision_rule`` one of
  ``DECISION_RULES``;
* the records a reader interprets have their types: ``outlier_calibration``
  (``parse_outlier_calibration``), ``index`` (a kind and integer parameters), and the
  descriptive ``metrics``, ``training``, ``data`` and ``reference_set`` (objects),
  ``lineage`` (a list of objects) and ``created_at`` (a string);
* every float array is finite, every standardisation scale > 0, every label index points
  into ``classes``, and the validation embeddings and labels come together.

numpy and the standard library only.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from service.core.artifact.format import (
    ARRAY_SPECS,
    DECISION_RULES,
    ArtifactError,
    parse_outlier_calibration,
)

# manifest field -> the minimum of that dimension
DIMENSIONS = {"n_features_in": 1, "n_components": 1, "n_references": 1, "n_validation": 0}
# descriptive records a reader shows (GET /v1/model, the model card) -> their JSON type
RECORD_TYPES: dict[str, type] = {
    "metrics": dict,
    "training": dict,
    "data": dict,
    "reference_set": dict,
    "lineage": list,
    "created_at": str,
    "index": dict,
}


def _shown(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 12]}... ({len(text)} chars)"


def check_dimension(name: str, value: Any) -> int:
    """The manifest's dimension ``name`` as an int of at least its minimum."""
    minimum = DIMENSIONS[name]
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ArtifactError(
            f"manifest {name}: expected an integer >= {minimum}, got {_shown(value)}"
        )
    return value


def check_classes(classes: Any) -> list:
    """``classes`` as a list of distinct integers or strings with distinct string forms."""
    if not isinstance(classes, list) or not classes:
        raise ArtifactError(f"manifest classes: expected a non-empty list, got {_shown(classes)}")
    for i, label in enumerate(classes):
        if isinstance(label, bool) or not isinstance(label, int | str):
            raise ArtifactError(
                f"manifest classes[{i}]: expected an integer or a string, got {_shown(label)} "
                f"({type(label).__name__})"
            )
    names = [str(c) for c in classes]
    if len(set(names)) != len(names):
        repeated = sorted({n for n in names if names.count(n) > 1})[:5]
        raise ArtifactError(
            f"manifest classes: expected distinct classes (compared as strings, the keys of "
            f"an answer's probabilities), got {repeated} more than once"
        )
    return classes


def check_default_k(default_k: Any, n_references: int) -> int:
    if isinstance(default_k, bool) or not isinstance(default_k, int | np.integer):
        raise ArtifactError(
            f"manifest default_k: expected an integer in [1, {n_references}], got "
            f"{_shown(default_k)}"
        )
    if not 1 <= int(default_k) <= n_references:
        raise ArtifactError(
            f"manifest default_k: expected an integer in [1, {n_references}] (the number of "
            f"references), got {_shown(default_k)}"
        )
    return int(default_k)


def check_decision_rule(rule: Any) -> str:
    if rule not in DECISION_RULES:
        raise ArtifactError(
            f"manifest decision_rule: expected one of {list(DECISION_RULES)}, got {_shown(rule)}"
        )
    return rule


def check_records(manifest: Mapping[str, Any]) -> None:
    """The records a reader interprets have their JSON types (absent is fine)."""
    for key, expected in RECORD_TYPES.items():
        value = manifest.get(key)
        if value is not None and not isinstance(value, expected):
            raise ArtifactError(
                f"manifest {key}: expected a JSON {expected.__name__.replace('dict', 'object')}"
                f", got {_shown(value)}"
            )
    lineage = manifest.get("lineage") or []
    if not all(isinstance(entry, dict) for entry in lineage):
        raise ArtifactError("manifest lineage: expected a list of objects")
    index = manifest.get("index")
    if index is not None:
        params = index.get("params", {})
        if not isinstance(index.get("kind"), str) or not isinstance(params, dict):
            raise ArtifactError(
                "manifest index: expected an object with a string kind and a params object"
            )
        for name, value in params.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ArtifactError(
                    f"manifest index.params.{name}: expected an integer >= 0, got {_shown(value)}"
                )
    try:
        parse_outlier_calibration(manifest.get("outlier_calibration"))
    except ArtifactError as exc:
        raise ArtifactError(f"manifest {exc}") from None


def check_manifest(manifest: Mapping[str, Any]) -> dict[str, int]:
    """Every field of a manifest the reader interprets; returns the dimensions
    ``{"d", "D", "N", "V"}``."""
    dims = {
        "D": check_dimension("n_features_in", manifest.get("n_features_in")),
        "d": check_dimension("n_components", manifest.get("n_components")),
        "N": check_dimension("n_references", manifest.get("n_references")),
        "V": check_dimension("n_validation", manifest.get("n_validation", 0)),
    }
    check_classes(manifest.get("classes"))
    check_default_k(manifest.get("default_k"), dims["N"])
    check_decision_rule(manifest.get("decision_rule"))
    check_records(manifest)
    return dims


def check_arrays(arrays: Mapping[str, np.ndarray], n_classes: int) -> None:
    """Finite float arrays, positive scales, label indices within the classes, validation
    embeddings and labels together. Messages name the file and the first bad row."""
    for name, array in arrays.items():
        if array.dtype.kind == "f" and array.size:
            finite = np.isfinite(array)
            if not finite.all():
                where = np.argwhere(~finite)[0]
                raise ArtifactError(
                    f"{ARRAY_SPECS[name][0]}: expected finite values, got "
                    f"{array[tuple(where)]!r} at index {tuple(int(i) for i in where)}"
                )
    scale = arrays.get("scale")
    if scale is not None and np.any(scale <= 0):
        raise ArtifactError("scale.npy: every standardisation scale must be > 0")
    for name in ("labels", "validation_labels"):
        labels = arrays.get(name)
        if labels is not None and labels.size and (labels.min() < 0 or labels.max() >= n_classes):
            raise ArtifactError(
                f"{ARRAY_SPECS[name][0]}: label indices must lie in [0, {n_classes}), got "
                f"range [{labels.min()}, {labels.max()}]"
            )
    if ("validation_embeddings" in arrays) != ("validation_labels" in arrays):
        raise ArtifactError("validation_embeddings and validation_labels go together")
