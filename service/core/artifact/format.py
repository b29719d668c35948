"""The artifact format: file names, dtypes and symbolic shapes of the arrays, the manifest's
keys (required, owned by the writer, descriptive), the schema version, the ``Artifact`` a
reader gets, the outlier calibration's checks, and the model version: a hash of the array
files and of every manifest field that can change an answer. numpy and the standard library
only."""

from __future__ import annotations

import hashlib
import itertools
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from service.core.vocabulary import NEIGHBOUR_RULES

SCHEMA_VERSION = 1
FORMAT_NAME = "nca-knn-artifact"
MANIFEST_FILE = "manifest.json"
INDEX_FILE = "index.faiss"
DECISION_RULES = NEIGHBOUR_RULES  # a default rule needs nothing but the neighbours

# name -> (file name, dtype, symbolic shape). Symbols: d components, D features, N references.
ARRAY_SPECS: dict[str, tuple[str, np.dtype, tuple[str, ...]]] = {
    "projection": ("projection.npy", np.dtype(np.float32), ("d", "D")),
    "offset": ("offset.npy", np.dtype(np.float32), ("d",)),
    "embeddings": ("embeddings.npy", np.dtype(np.float32), ("N", "d")),
    "labels": ("labels.npy", np.dtype(np.int32), ("N",)),
    "mean": ("mean.npy", np.dtype(np.float64), ("D",)),
    "scale": ("scale.npy", np.dtype(np.float64), ("D",)),
    "ids": ("ids.npy", np.dtype(np.int64), ("N",)),
    "validation_embeddings": ("validation_embeddings.npy", np.dtype(np.float32), ("V", "d")),
    "validation_labels": ("validation_labels.npy", np.dtype(np.int32), ("V",)),
}
OPTIONAL_ARRAYS = frozenset({"ids", "validation_embeddings", "validation_labels"})
REQUIRED_MANIFEST_KEYS = (
    "format",
    "schema_version",
    "n_features_in",
    "n_components",
    "n_references",
    "classes",
    "default_k",
    "decision_rule",
    "files",
    "created_at",
    "package_version",
)
# written by write_artifact itself; metadata may not set them
OWNED_MANIFEST_KEYS = frozenset(REQUIRED_MANIFEST_KEYS) | {
    "model_version",
    "standardization",
    "extras",
    "n_validation",
}


# manifest fields that describe a model without changing any answer it gives; every other
# field is part of the model version (model_version_of)
DESCRIPTIVE_MANIFEST_KEYS = frozenset(
    {
        "model_version",
        "files",  # hashed by the sha256 of each file instead
        "created_at",
        "package_version",
        "extras",  # the report and plots
        "data",  # the training data's fingerprint and sizes
        "metrics",
        "training",
        "lineage",
        "reference_set",  # what the references are (training rows or learned prototypes)
    }
)


class ArtifactError(ValueError):
    """An artifact is missing, malformed, corrupted or inconsistent. ``fingerprint`` is the
    identity of what the reader saw (``read.artifact_fingerprint``'s form), when it got as
    far as the manifest; None otherwise."""

    fingerprint: tuple | None = None


@dataclass(frozen=True)
class Artifact:
    """A loaded, validated artifact. Arrays may be read-only memory maps."""

    path: Path
    manifest: dict[str, Any]
    projection: np.ndarray  # (d, D) float32
    offset: np.ndarray  # (d,) float32
    embeddings: np.ndarray  # (N, d) float32
    labels: np.ndarray  # (N,) int32, indices into classes
    mean: np.ndarray  # (D,) float64
    scale: np.ndarray  # (D,) float64
    ids: np.ndarray  # (N,) int64
    index_bytes: bytes | None = field(default=None, repr=False)  # verified index.faiss
    validation_embeddings: np.ndarray | None = None  # (V, d) float32, held out in training
    validation_labels: np.ndarray | None = None  # (V,) int32
    # what was read: the identity of the directory, manifest and files (read.py's
    # artifact_fingerprint) and the directory as the kernel named it when the read opened
    # it; None when not read
    fingerprint: tuple | None = field(default=None, repr=False)
    directory: str | None = None

    @property
    def fingerprint_id(self) -> str | None:
        """``fingerprint`` as 16 hex digits (what GET /v1/model shows); None without one."""
        if self.fingerprint is None:
            return None
        return hashlib.sha256(repr(self.fingerprint).encode()).hexdigest()[:16]

    @property
    def classes(self) -> list:
        return list(self.manifest["classes"])

    @property
    def n_features_in(self) -> int:
        return int(self.manifest["n_features_in"])

    @property
    def n_components(self) -> int:
        return int(self.manifest["n_components"])

    @property
    def default_k(self) -> int:
        return int(self.manifest["default_k"])

    @property
    def decision_rule(self) -> str:
        return str(self.manifest["decision_rule"])

    @property
    def version(self) -> str:
        """A short content hash naming everything that can change this model's answers
        (``model_version_of``): the arrays, the index and every field but the descriptive
        ones. Computed when the artifact is read."""
        return str(self.manifest["model_version"])


STANDARDIZATION_RECORD = {
    "method": "standard",
    "formula": "z = x @ projection.T + offset = ((x - mean) / scale) @ A.T",
    "mean_file": ARRAY_SPECS["mean"][0],
    "scale_file": ARRAY_SPECS["scale"][0],
}


def parse_outlier_calibration(record: Any) -> dict | None:
    """``outlier_calibration`` checked (the record ``training.evaluation.calibration.calibrate`` writes), with its
    quantiles as a sorted {float q: float distance}; ArtifactError naming what is wrong."""
    if record is None:
        return None
    where = "manifest outlier_calibration"
    if not isinstance(record, dict) or not isinstance(record.get("quantiles"), dict):
        raise ArtifactError(f"{where}: expected an object with a 'quantiles' object")
    quantiles: dict[float, float] = {}
    for key, value in record["quantiles"].items():
        try:
            q = float(key)
        except ValueError:
            raise ArtifactError(f"{where}: quantile {key!r} is not a number") from None
        if not 0.0 < q < 1.0 or isinstance(value, bool) or not isinstance(value, int | float):
            raise ArtifactError(
                f"{where}: quantile {key!r}: {value!r}; expected q in (0, 1) and a number"
            )
        if not np.isfinite(value) or value < 0:
            raise ArtifactError(f"{where}: quantile {key!r} is {value!r}, expected finite >= 0")
        quantiles[q] = float(value)
    qs = sorted(quantiles)
    if len(qs) < 2:
        raise ArtifactError(f"{where}: needs at least two quantiles, got {len(qs)}")
    values = [quantiles[q] for q in qs]
    if any(b < a for a, b in itertools.pairwise(values)):
        raise ArtifactError(f"{where}: the distances must not decrease with q, got {values}")
    return {**record, "quantiles": {q: quantiles[q] for q in qs}}


def model_version_of(manifest: Mapping[str, Any]) -> str:
    """The model version: a hash of everything in the artifact that can change an answer.

    That is the array files' sha256s in :data:`ARRAY_SPECS` order, then the prebuilt index's
    (an approximate index changes answers), then every manifest field except the
    :data:`DESCRIPTIVE_MANIFEST_KEYS` as canonical JSON (sorted keys, no whitespace): the
    classes, the default k and decision rule, the outlier calibration, the index's tuned
    search parameters, the shapes, and any field a later writer adds. Two artifacts with
    the same version answer every inference request identically; a field that only
    describes the model (training record, metrics, lineage, timestamps) leaves it unchanged.
    """
    files = manifest["files"]
    digest = hashlib.sha256()
    for name in (*ARRAY_SPECS, "index"):
        if name in files:
            digest.update(str(files[name]["sha256"]).encode())
    answering = {k: v for k, v in manifest.items() if k not in DESCRIPTIVE_MANIFEST_KEYS}
    digest.update(b"\0manifest\0")
    digest.update(json.dumps(answering, sort_keys=True, separators=(",", ":")).encode())
    return digest.hexdigest()[:16]


def legacy_model_version_of(files: Mapping[str, Mapping[str, Any]]) -> str:
    """The version nca-knn 0.1 artifacts were written with (the array and index files
    only); still accepted as the stored version of an older artifact, which is then served
    under its full :func:`model_version_of`."""
    digest = hashlib.sha256()
    for name in (*ARRAY_SPECS, "index"):
        if name in files:
            digest.update(str(files[name]["sha256"]).encode())
    return digest.hexdigest()[:16]
