"""The engine: a loaded model (projection + index + labels) and its atomic replacement.

No web imports: tests and benchmarks call it directly.

A :class:`LoadedModel` is immutable once built. :class:`Engine` holds the current one and
replaces it in one reference assignment after a new one has been fully loaded, indexed and
warmed up; a request that captured the old model finishes on it. A failed load leaves the
current model serving and is recorded in ``Engine.last_error``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import faiss
import numpy as np

from service.config import Settings
from service.core.artifact import (
    INDEX_FILE,
    Artifact,
    ArtifactError,
    parse_outlier_calibration,
    read_artifact,
)
from service.core.knn import FarPrior, outlier_threshold
from service.core.vocabulary import IVF_KINDS
from service.search.index import (
    IndexParams,
    build_index,
    configure,
    index_kind,
    reference_norm_limit,
    search,
)

FLOAT32_MAX = float(np.finfo(np.float32).max)
INT64 = np.iinfo(np.int64)


@dataclass(frozen=True)
class LoadedModel:
    artifact: Artifact
    index: faiss.Index
    projection: np.ndarray  # (d, D) float32
    offset: np.ndarray  # (d,) float32
    embeddings: np.ndarray  # (N, d) float32, contiguous
    labels: np.ndarray  # (N,) int64 class indices
    ids: np.ndarray  # (N,) int64 reference ids
    classes: list
    loaded_at: float
    load_seconds: float
    norm_limit: float  # queries with a larger norm are searched exactly (see service.search.index)
    input_abs_max: float  # inputs within [-input_abs_max, input_abs_max] embed finitely
    search_plan: IndexParams = field(default_factory=IndexParams)  # incl. the recheck stage
    # called with (far rows, under-filled rows) after a search that used the exact fallback
    on_fallback: Callable[[int, int], None] | None = None
    # the calibrated quantile function of held-out nearest distances {q: squared distance},
    # None when the model was trained without a validation split (service.core.knn.outlier_*)
    outlier_quantiles: dict[float, float] | None = None
    default_outlier_quantile: float = 0.99  # the setting outlier_quantile
    default_outlier_threshold: float | None = None  # its threshold (computed once, at load)
    far_prior: FarPrior | None = None  # the soft_prior rule's component (service.core.knn)
    version: str = ""  # the artifact's model version, read once at load
    default_k: int = 1  # the artifact's, read once at load
    decision_rule: str = "majority"
    name: str = ""  # its name in a model repository ("" when the service serves one model)
    # the shapes, set from the arrays: plain attributes, read on every request
    n_features: int = field(init=False)  # D
    n_components: int = field(init=False)  # d
    n_references: int = field(init=False)  # N
    class_names: list[str] = field(init=False)  # the keys of a classify answer's probabilities

    @property
    def index_type(self) -> str:
        return self.search_plan.kind

    @property
    def index_params(self) -> dict:
        """The search plan as GET /v1/model shows it."""
        return self.search_plan.describe()

    def __post_init__(self) -> None:
        object.__setattr__(self, "class_names", [str(c) for c in self.classes])
        object.__setattr__(self, "n_features", self.projection.shape[1])  # D
        object.__setattr__(self, "n_components", self.projection.shape[0])  # d
        object.__setattr__(self, "n_references", self.embeddings.shape[0])  # N


def class_array(classes: list) -> np.ndarray:
    """The classes as one numpy array: int64 when all are integers that fit, else their
    string forms (the keys of a JSON answer's probabilities)."""
    if all(isinstance(c, int) and INT64.min <= c <= INT64.max for c in classes):
        return np.asarray(classes, dtype=np.int64)
    return np.asarray([str(c) for c in classes], dtype=np.str_)


def input_abs_max(projection: np.ndarray, offset: np.ndarray) -> float:
    """The largest X such that every input with |x_i| <= X has a finite float32 embedding.

    |z_j| <= sum_i |W_ji| |x_i| + |b_j| <= X * ||W_j||_1 + |b_j|, kept below 0.999 of the
    float32 maximum (the float64 projection then rounds to a finite float32). Rounded down
    to three significant digits so that it can be stated.
    """
    row_l1 = np.abs(np.asarray(projection, dtype=np.float64)).sum(axis=1)  # (d,)
    room = 0.999 * FLOAT32_MAX - np.abs(np.asarray(offset, dtype=np.float64))  # (d,)
    with np.errstate(divide="ignore"):
        bounds = np.where(row_l1 > 0, room / row_l1, np.inf)
    limit = min(float(bounds.min(initial=np.inf)), 0.999 * FLOAT32_MAX)
    exponent = np.floor(np.log10(limit))
    return float(np.floor(limit / 10 ** (exponent - 2)) * 10 ** (exponent - 2))


def index_params(settings: Settings, artifact: Artifact, prebuilt: faiss.Index | None):
    """The index to serve: ``index_type`` auto means the artifact's prebuilt index, else
    flat. Search parameters left unset take the values the indexing command tuned for
    that kind (``manifest["index"]``), else FAISS-typical defaults. The tuned recheck stage
    belongs to the tuned first stage: setting nprobe / ef_search explicitly turns it off."""
    kind = settings.index_type
    if kind == "auto":
        kind = index_kind(prebuilt) if prebuilt is not None else "flat"
    record = artifact.manifest.get("index") or {}
    tuned = record.get("params", {}) if record.get("kind") == kind else {}
    overridden = settings.nprobe if kind in IVF_KINDS else settings.ef_search
    recheck = {} if overridden else tuned
    return IndexParams(
        kind=kind,
        ivf_nlist=settings.ivf_nlist,
        nprobe=settings.nprobe or int(tuned.get("nprobe", 16)),
        hnsw_m=settings.hnsw_m,
        ef_construction=settings.ef_construction,
        ef_search=settings.ef_search or int(tuned.get("ef_search", 64)),
        pq_m=settings.pq_m,
        search_threads=settings.search_threads,
        recheck_margin=int(recheck.get("recheck_margin", 0)),
        recheck_nprobe=int(recheck.get("recheck_nprobe", 0)),
        recheck_ef_search=int(recheck.get("recheck_ef_search", 0)),
    )


def _prebuilt_index(path, artifact: Artifact, embeddings: np.ndarray) -> faiss.Index | None:
    """The artifact's prebuilt index, checked against the references; None without one."""
    if artifact.index_bytes is None:
        return None
    try:
        prebuilt = faiss.deserialize_index(np.frombuffer(artifact.index_bytes, np.uint8))
    except RuntimeError as exc:
        raise ArtifactError(f"{path}/{INDEX_FILE}: not a readable FAISS index ({exc})") from exc
    if prebuilt.ntotal != len(embeddings) or prebuilt.d != embeddings.shape[1]:
        raise ArtifactError(
            f"{path}/{INDEX_FILE}: the index holds {prebuilt.ntotal} vectors of dimension "
            f"{prebuilt.d}, the references are {embeddings.shape}"
        )
    return prebuilt


def _calibration(path, artifact: Artifact, quantile: float):
    """(the outlier calibration's {q: squared distance}, the threshold at the setting's
    quantile), both None without a calibration; ArtifactError for a quantile outside it."""
    calibration = parse_outlier_calibration(artifact.manifest.get("outlier_calibration"))
    if calibration is None:
        return None, None
    quantiles = calibration["quantiles"]
    try:
        return quantiles, outlier_threshold(quantiles, quantile)
    except ValueError as exc:
        raise ArtifactError(f"{path}: the setting outlier_quantile: {exc}") from None


def load_model(
    path: str | Path, settings: Settings, on_fallback: Callable[[int, int], None] | None = None
) -> LoadedModel:
    """Read and check the artifact, build (or read) its index, and warm it up. The model's
    ``artifact.fingerprint`` names the bytes it was built from; an ArtifactError carries the
    ``fingerprint`` of what it refused (from the reader, or the artifact's when the build
    refused it)."""
    started = time.perf_counter()
    # Every file is read once into memory and verified there (service.core.artifact): a file
    # changed under a memory map would crash the process (SIGBUS) instead of failing a load.
    artifact = read_artifact(path)
    try:
        return build_model(artifact, settings, on_fallback, started)
    except ArtifactError as exc:
        exc.fingerprint = artifact.fingerprint
        raise


def build_model(
    artifact: Artifact,
    settings: Settings,
    on_fallback: Callable[[int, int], None] | None = None,
    started: float | None = None,
) -> LoadedModel:
    """The model of an artifact already read: its index built (or read) and warmed up.
    ``started`` (a ``time.perf_counter()``) is when the load began, for ``load_seconds``."""
    started = time.perf_counter() if started is None else started
    path = artifact.path
    if artifact.default_k > settings.max_k:
        raise ArtifactError(
            f"{path}: the manifest's default_k={artifact.default_k} is above this service's "
            f"max_k={settings.max_k} (NCAKNN_MAX_K): every request that leaves k out would "
            "be refused; raise NCAKNN_MAX_K or write the artifact with a smaller default_k"
        )
    embeddings = np.ascontiguousarray(artifact.embeddings, dtype=np.float32)  # (N, d)
    prebuilt = _prebuilt_index(path, artifact, embeddings)
    params = index_params(settings, artifact, prebuilt)
    if prebuilt is not None and index_kind(prebuilt) == params.kind:
        configure(prebuilt, params)
        index = prebuilt
    else:
        index = build_index(embeddings, params)
    labels = np.asarray(artifact.labels, dtype=np.int64)
    quantiles, default_threshold = _calibration(path, artifact, settings.outlier_quantile)
    model = LoadedModel(
        artifact=artifact,
        index=index,
        projection=np.ascontiguousarray(artifact.projection, dtype=np.float32),
        offset=np.ascontiguousarray(artifact.offset, dtype=np.float32),
        embeddings=embeddings,
        labels=labels,
        ids=np.asarray(artifact.ids, dtype=np.int64),
        classes=artifact.classes,
        loaded_at=time.time(),
        load_seconds=0.0,
        norm_limit=reference_norm_limit(embeddings),
        input_abs_max=input_abs_max(artifact.projection, artifact.offset),
        search_plan=params,
        on_fallback=on_fallback,
        outlier_quantiles=quantiles,
        default_outlier_quantile=settings.outlier_quantile,
        default_outlier_threshold=default_threshold,
        far_prior=FarPrior.of(embeddings, labels, len(artifact.classes)),
        version=artifact.version,
        default_k=artifact.default_k,
        decision_rule=artifact.decision_rule,
    )
    # warm-up: one query through the search (page in the arrays, start FAISS's threads)
    search(model, np.zeros((1, model.n_components), np.float32), 1)
    object.__setattr__(model, "load_seconds", time.perf_counter() - started)
    return model
