"""Service fixtures: a digits artifact trained once per session, apps and clients on it."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from fastapi.testclient import TestClient

from service.app import create_app
from service.config import Settings
from training.config import TrainConfig
from training.data import load_dataset, make_split
from training.job import run

DIGITS_CONFIG = dict(data="digits", n_components=16, max_iter=40, quiet=True, plots=False, seed=0)


@pytest.fixture(scope="session")
def digits_artifact(tmp_path_factory):
    """(artifact path, report dict, split) for digits, trained by the real job."""
    out = tmp_path_factory.mktemp("models") / "digits"
    config = TrainConfig(out=str(out), **DIGITS_CONFIG)
    report = run(config, log=lambda message: None)
    split = make_split(
        load_dataset("digits"),
        test_size=config.test_size,
        val_size=config.val_size,
        seed=config.seed,
    )
    return out, report, split


@pytest.fixture
def model_dir(digits_artifact, tmp_path):
    """A private copy of the digits artifact (tests may replace or damage it)."""
    target = tmp_path / "model"
    shutil.copytree(digits_artifact[0], target)
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
    return Settings(model_path=path, log_json=False, **overrides)


@pytest.fixture
def client(digits_artifact):
    with TestClient(create_app(settings_for(digits_artifact[0]))) as c:
        yield c


def republish_scaled(path, factor: float) -> str:
    """Rewrite the artifact at ``path`` with its projection and references scaled by
    ``factor`` (a different, valid model); returns the new model version."""
    from service.artifact import read_artifact, write_artifact

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


def manifest(path) -> dict:
    return json.loads((path / "manifest.json").read_text())


def npy(array) -> bytes:
    import io

    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()
