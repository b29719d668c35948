"""The reference we compare the service with: the FastAPI + FAISS app a user would write in an
afternoon. It is deliberately not tuned: a pydantic body model, z = A x, one FAISS Flat k-NN
search per request, a majority vote, a dict answer that FastAPI encodes.

It reads the same artifact as the service (the loading code is not what is measured).
Two handler styles are served, because a user writes either: ``/v1/classify`` is an
``async def`` handler (runs on the event loop), ``/v1/classify-sync`` a plain ``def`` one
(FastAPI runs it in its thread pool). The benchmark compares the service with the faster.
``/noop`` parses the body with the same pydantic model and answers a constant: what any
FastAPI endpoint costs before it does any work.

    NCAKNN_MODEL_PATH=... python -m uvicorn benchmarks.naive_app:create --factory ...
"""

from __future__ import annotations

import os
from collections import Counter

import faiss
import numpy as np
from fastapi import FastAPI
from pydantic import BaseModel

from service.core.artifact import read_artifact


class ClassifyRequest(BaseModel):
    instances: list[list[float]]
    k: int = 5


def create() -> FastAPI:
    artifact = read_artifact(os.environ["NCAKNN_MODEL_PATH"])
    W = np.asarray(artifact.projection, dtype=np.float32)  # (d, D)
    b = np.asarray(artifact.offset, dtype=np.float32)  # (d,)
    labels = np.asarray(artifact.labels)
    classes = list(artifact.classes)
    faiss.omp_set_num_threads(1)
    index = faiss.IndexFlatL2(W.shape[0])
    index.add(np.ascontiguousarray(artifact.embeddings, dtype=np.float32))
    app = FastAPI()

    def predict(req: ClassifyRequest) -> dict:
        x = np.asarray(req.instances, dtype=np.float32)  # (n, D)
        z = x @ W.T + b  # (n, d)
        _, neighbours = index.search(z, req.k)
        predictions = []
        for row in neighbours:
            votes = Counter(labels[row].tolist())
            predictions.append({"label": classes[votes.most_common(1)[0][0]]})
        return {"predictions": predictions}

    @app.post("/v1/classify")
    async def classify(req: ClassifyRequest) -> dict:
        return predict(req)

    @app.post("/v1/classify-sync")
    def classify_sync(req: ClassifyRequest) -> dict:
        return predict(req)

    @app.post("/noop")
    async def noop(req: ClassifyRequest) -> dict:
        """Parse-only: the ceiling of a FastAPI + pydantic endpoint on these settings."""
        return {"ok": True}

    @app.get("/readyz")
    def ready() -> dict:
        return {"ready": True}

    return app
