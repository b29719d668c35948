"""Service fixtures: one artifact per session, built with ``service.core.artifact`` alone (no
torch, no scikit-learn: the service's tests run with only the ``serve`` extra installed), and
apps and clients on it. The training job's own artifacts are tested against the service in
tests/integration."""

from __future__ import annotations

import asyncio
import json
import shutil
from dataclasses import dataclass

import httpx
import numpy as np
import pytest
from fastapi.testclient import TestClient

from service.app import create_app
from service.config import Settings
from service.core.artifact import write_artifact
from service.core.knn import decide, exact_knn, project

N_FEATURES, N_COMPONENTS, N_CLASSES = 64, 16, 10
PER_CLASS = {"train": 125, "val": 15, "test": 40}


@dataclass
class Split:
    """Inputs (n, 64) float64 in [0, 16] and class indices (n,), like scikit-learn's digits."""

    X_train: np.ndarray
    y_train: np.ndarray
    X_val: np.ndarray
    y_val: np.ndarray
    X_test: np.ndarray
    y_test: np.ndarray
    classes: np.ndarray


def digits_like_split(seed: int = 0) -> Split:
    """10 classes of 64 'pixels' in [0, 16] around random class templates, with noise wide
    enough that neighbouring classes overlap a little (kNN accuracy ~0.95, not 1)."""
    rng = np.random.default_rng(seed)
    templates = rng.uniform(0, 16, size=(N_CLASSES, N_FEATURES))
    parts = {}
    for name, n in PER_CLASS.items():
        y = np.repeat(np.arange(N_CLASSES), n)
        X = np.clip(templates[y] + rng.normal(0, 8.0, size=(len(y), N_FEATURES)), 0, 16)
        order = rng.permutation(len(y))
        parts[f"X_{name}"], parts[f"y_{name}"] = X[order], y[order]
    return Split(**parts, classes=np.arange(N_CLASSES))


def pca_map(X: np.ndarray, d: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(projection W (d, D) float32, offset b (d,) float32, mean, scale): standardise, then
    the top d principal axes A, so that z = x W^T + b = ((x - mean) / scale) A^T."""
    mean, scale = X.mean(axis=0), X.std(axis=0)
    _, _, vt = np.linalg.svd((X - mean) / scale, full_matrices=False)
    A = vt[:d]  # (d, D)
    W = (A / scale[None, :]).astype(np.float32)
    b = (-(mean / scale) @ A.T).astype(np.float32)
    return W, b, mean, scale


CALIBRATION_QUANTILES = (0.5, 0.9, 0.95, 0.99, 0.995, 0.999)


def outlier_calibration(z_train: np.ndarray, z_val: np.ndarray) -> dict:
    """The manifest's outlier_calibration as the training job writes it (training.evaluation.calibration;
    not imported: these tests need only the serve extra): quantiles of the validation points'
    squared distance to their nearest reference."""
    nearest = exact_knn(z_val, z_train, 1)[0][:, 0]
    return {
        "source": "validation split",
        "n": len(nearest),
        "quantiles": {str(q): float(np.quantile(nearest, q)) for q in CALIBRATION_QUANTILES},
    }


def build_model_artifact(out, split: Split, default_k: int = 5, calibrated: bool = True) -> dict:
    """Write an artifact for ``split`` (PCA map, training points as references, validation
    split, the outlier calibration unless ``calibrated`` is False) and return its report:
    test accuracy per k, by the service's own kNN."""
    W, b, mean, scale = pca_map(split.X_train, N_COMPONENTS)
    z_train, z_val, z_test = (project(x, W, b) for x in (split.X_train, split.X_val, split.X_test))
    accuracy = {}
    for k in (1, 3, 5, 7):
        distances, indices = exact_knn(z_test, z_train, k)
        predicted, _ = decide(split.y_train[indices], distances, N_CLASSES, "majority")
        accuracy[k] = float(np.mean(predicted == split.y_test))
    metrics = {"test_accuracy": accuracy, "default_k": default_k}
    write_artifact(
        out,
        projection=W,
        offset=b,
        embeddings=z_train,
        labels=split.y_train.astype(np.int32),
        classes=split.classes.tolist(),
        mean=mean,
        scale=scale,
        default_k=default_k,
        validation_embeddings=z_val,
        validation_labels=split.y_val.astype(np.int32),
        extra_files={"report.json": json.dumps({"metrics": metrics}).encode()},
        metadata={
            "metrics": metrics,
            "data": {"name": "digits-like (generated)"},
            "training": {"map": "PCA of the standardised training inputs (tests/service)"},
            "outlier_calibration": outlier_calibration(z_train, z_val) if calibrated else None,
        },
    )
    return {"metrics": metrics}


@pytest.fixture(scope="session")
def model_artifact(tmp_path_factory):
    """(artifact path, report dict, split) of the session's model."""
    out = tmp_path_factory.mktemp("models") / "digits-like"
    split = digits_like_split()
    report = build_model_artifact(out, split)
    return out, report, split


@pytest.fixture
def model_dir(model_artifact, tmp_path):
    """A private copy of the session artifact (tests may replace or damage it)."""
    target = tmp_path / "model"
    shutil.copytree(model_artifact[0], target)
    return target


def model_arrays(art) -> dict:
    """The pieces of an artifact that write_artifact needs, without validation or index."""
    return dict(
        projection=art.projection,
        offset=art.offset,
        embeddings=art.embeddings,
        labels=art.labels,
        classes=art.classes,
        mean=art.mean,
        scale=art.scale,
        default_k=art.default_k,
    )


def settings_for(path, **overrides) -> Settings:
    """Settings for a test app: gRPC off unless a test asks for a port."""
    return Settings(model_path=path, log_json=False, **{"grpc_port": 0, **overrides})


@pytest.fixture
def client(model_artifact):
    with TestClient(create_app(settings_for(model_artifact[0]))) as c:
        yield c


def module_client():
    """A ``client`` fixture shared by the tests of one module, for a module whose tests
    only send requests (no setting, model or engine state changed): ``client =
    module_client()`` at its top replaces the per-test app with one per module."""

    @pytest.fixture(scope="module", name="client")
    def shared_client(model_artifact):
        with TestClient(create_app(settings_for(model_artifact[0]))) as c:
            yield c

    return shared_client


def republish_scaled(path, factor: float) -> str:
    """Rewrite the artifact at ``path`` with its projection and references scaled by
    ``factor`` (a different, valid model); returns the new model version."""
    from service.core.artifact import read_artifact, write_artifact

    art = read_artifact(path)
    write_artifact(
        path,
        projection=np.asarray(art.projection) * factor,
        offset=art.offset,
        embeddings=np.asarray(art.embeddings) * factor,
        labels=art.labels,
        classes=art.classes,
        mean=art.mean,
        scale=art.scale,
        default_k=art.default_k,
    )
    return read_artifact(path).version


@pytest.fixture
def repository(model_artifact, tmp_path):
    """A model repository: digits (the session model), scaled (its map and references x 2),
    versioned (folders 1 and 2, 2 = x 3), broken (a truncated references file), and a
    hidden folder that is not a model."""
    root = tmp_path / "repository"
    root.mkdir()
    source = model_artifact[0]
    shutil.copytree(source, root / "digits")
    shutil.copytree(source, root / "scaled")
    republish_scaled(root / "scaled", 2.0)
    shutil.copytree(source, root / "versioned" / "1")
    shutil.copytree(source, root / "versioned" / "2")
    republish_scaled(root / "versioned" / "2", 3.0)
    shutil.copytree(source, root / "broken")
    data = (root / "broken" / "embeddings.npy").read_bytes()
    (root / "broken" / "embeddings.npy").write_bytes(data[: len(data) // 2])
    (root / ".hidden").mkdir()
    return root


def brute_force_knn(model, rows: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(squared distances (n, k), reference rows (n, k)) of rows (n, D) by plain numpy in
    float64: every reference's distance, sorted, ties by row. Independent of service.core.knn and
    FAISS, to check the inference path against."""
    z = np.asarray(rows, np.float64) @ np.asarray(model.projection, np.float64).T
    z += np.asarray(model.offset, np.float64)
    refs = np.asarray(model.embeddings, np.float64)  # (N, d)
    d2 = ((z[:, None, :] - refs[None, :, :]) ** 2).sum(axis=2)  # (n, N)
    order = np.argsort(d2, axis=1, kind="stable")[:, :k]
    return np.take_along_axis(d2, order, axis=1), order


def manifest(path) -> dict:
    return json.loads((path / "manifest.json").read_text())


def npy(array) -> bytes:
    import io

    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()


async def post_all(app, bodies: list[dict], path: str = "/v1/classify") -> list:
    """POST every JSON body to ``path`` of an in-process app at once (its lifespan
    running), as concurrent clients do; the responses in the bodies' order."""
    transport = httpx.ASGITransport(app=app)
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
            return await asyncio.gather(*(c.post(path, json=b) for b in bodies))
