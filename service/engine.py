"""The engine: a loaded model (projection + index + labels) and its atomic replacement.

No web imports: tests and benchmarks call it directly.

A :class:`LoadedModel` is immutable once built. :class:`Engine` holds the current one and
replaces it in one reference assignment after a new one has been fully loaded, indexed and
warmed up; a request that captured the old model finishes on it. A failed load leaves the
current model serving and is recorded in ``Engine.last_error``.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import faiss
import numpy as np

from service.artifact import Artifact, read_artifact, read_manifest
from service.config import Settings
from service.errors import InvalidInput, NotReady
from service.index import IndexParams, build_index, configure, index_kind, search
from service.knn import RULES, decide, project

log = logging.getLogger("service.engine")


@dataclass(frozen=True)
class Prediction:
    """Answers for a batch of n queries."""

    labels: list  # (n,) original class labels
    probabilities: np.ndarray  # (n, C)
    distances: np.ndarray  # (n, k) squared distances
    indices: np.ndarray  # (n, k) reference row indices


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
    index_type: str
    loaded_at: float
    load_seconds: float
    search_threads: int = 0
    index_params: dict = field(default_factory=dict)

    @property
    def version(self) -> str:
        return self.artifact.version

    @property
    def n_features(self) -> int:
        return self.projection.shape[1]

    @property
    def n_components(self) -> int:
        return self.projection.shape[0]

    @property
    def n_references(self) -> int:
        return self.embeddings.shape[0]

    def check_k(self, k: int) -> None:
        if not 1 <= k <= self.n_references:
            raise InvalidInput(
                f"k={k} must lie in [1, {self.n_references}] (the number of reference points)"
            )

    def embed(self, x: np.ndarray) -> np.ndarray:
        """x (n, D) -> z (n, d) float32."""
        return project(x, self.projection, self.offset)

    def search_embedded(self, z: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """z (n, d) -> (squared distances (n, k), reference row indices (n, k))."""
        return search(self.index, self.embeddings, z, k, threads=self.search_threads)

    def decide(self, distances: np.ndarray, indices: np.ndarray, rule: str) -> Prediction:
        if rule not in RULES:
            raise InvalidInput(f"rule must be one of {list(RULES)}, got {rule!r}")
        predicted, proba = decide(self.labels[indices], distances, len(self.classes), rule)
        return Prediction(
            labels=[self.classes[i] for i in predicted],
            probabilities=proba,
            distances=distances,
            indices=indices,
        )

    def classify(self, x: np.ndarray, k: int, rule: str) -> Prediction:
        """The whole path for one batch, without the batcher: embed, search, decide."""
        dist, idx = self.search_embedded(self.embed(x), k)
        return self.decide(dist, idx, rule)


def load_model(path: str | Path, settings: Settings) -> LoadedModel:
    """Read and check the artifact, build (or read) its index, and warm it up."""
    started = time.perf_counter()
    # Read into memory, not memory-mapped: a file changed in place under a mapping would
    # crash the process (SIGBUS) instead of failing one reload.
    artifact = read_artifact(path, mmap=False)
    embeddings = np.ascontiguousarray(artifact.embeddings, dtype=np.float32)
    params = IndexParams(
        kind=settings.index_type,
        ivf_nlist=settings.ivf_nlist,
        nprobe=settings.nprobe,
        hnsw_m=settings.hnsw_m,
        ef_construction=settings.ef_construction,
        ef_search=settings.ef_search,
        pq_m=settings.pq_m,
        search_threads=settings.search_threads,
    )
    index = None
    if artifact.index_path is not None:
        prebuilt = faiss.read_index(str(artifact.index_path))
        if index_kind(prebuilt) == params.kind and prebuilt.ntotal == len(embeddings):
            configure(prebuilt, params)
            index = prebuilt
    if index is None:
        index = build_index(embeddings, params)
    model = LoadedModel(
        artifact=artifact,
        index=index,
        projection=np.ascontiguousarray(artifact.projection, dtype=np.float32),
        offset=np.ascontiguousarray(artifact.offset, dtype=np.float32),
        embeddings=embeddings,
        labels=np.asarray(artifact.labels, dtype=np.int64),
        ids=np.asarray(artifact.ids, dtype=np.int64),
        classes=artifact.classes,
        index_type=params.kind,
        loaded_at=time.time(),
        load_seconds=0.0,
        search_threads=settings.search_threads,
        index_params={
            k: v
            for k, v in vars(params).items()
            if k == "kind"
            or (params.kind in ("ivf", "ivfpq") and k in ("ivf_nlist", "nprobe"))
            or (params.kind == "hnsw" and k in ("hnsw_m", "ef_search", "ef_construction"))
            or (params.kind == "ivfpq" and k == "pq_m")
        },
    )
    # warm-up: one query through the whole path (page in the arrays, start FAISS)
    model.classify(
        np.zeros((1, model.n_features), np.float32), min(1, model.n_references), "majority"
    )
    object.__setattr__(model, "load_seconds", time.perf_counter() - started)
    return model


class Engine:
    """Holds the current model; loads a new one off to the side and swaps it in."""

    def __init__(self, settings: Settings):
        self.settings = settings
        self._model: LoadedModel | None = None
        self._load_lock = threading.Lock()
        self.last_error: str | None = None
        self.last_error_at: float | None = None
        self.loads = 0
        self.load_failures = 0
        self.draining = False
        self._failed_version: str | None = None

    @property
    def ready(self) -> bool:
        return self._model is not None and not self.draining

    def peek(self) -> LoadedModel | None:
        """The loaded model, or None."""
        return self._model

    def current(self) -> LoadedModel:
        model = self._model
        if model is None:
            raise NotReady(
                f"no model is loaded yet (model path {self.settings.model_path}); "
                + (f"last load failed: {self.last_error}" if self.last_error else "loading")
            )
        return model

    def load(self, path: str | Path | None = None) -> LoadedModel:
        """Load the artifact at ``path`` (default: the configured one) and swap it in.

        Raises the load error after recording it; the current model keeps serving.
        """
        path = Path(path or self.settings.model_path)
        with self._load_lock:
            try:
                model = load_model(path, self.settings)
            except Exception as exc:
                self._failed_version = _version_on_disk(path)
                self.load_failures += 1
                self.last_error = f"{type(exc).__name__}: {exc}"
                self.last_error_at = time.time()
                log.error("model load failed", extra={"path": str(path), "error": self.last_error})
                raise
            self._model = model  # one reference assignment: the swap
            self.loads += 1
            self.last_error = None
            log.info(
                "model loaded",
                extra={
                    "path": str(path),
                    "model_version": model.version,
                    "seconds": model.load_seconds,
                },
            )
            return model

    def changed_on_disk(self) -> bool:
        """True when the model path holds an artifact other than the loaded one and other
        than the last one that failed to load."""
        version = _version_on_disk(self.settings.model_path)
        if version is None or version == self._failed_version:
            return False
        model = self._model
        return model is None or version != model.version


def _version_on_disk(path: str | Path) -> str | None:
    try:
        return str(read_manifest(path).get("model_version"))
    except Exception:
        return None
