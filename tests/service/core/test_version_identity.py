"""The model version names everything that can change an answer (service.core.artifact
.model_version_of): each answer-affecting manifest field changes it, and the answers with
it; descriptive fields change neither; a reload of a model that differs only in such a
field says "reloaded" and serves the new version."""

from __future__ import annotations

import json

import numpy as np
import pytest
from fastapi.testclient import TestClient

from service.app import create_app
from service.core.artifact import (
    DESCRIPTIVE_MANIFEST_KEYS,
    MANIFEST_FILE,
    legacy_model_version_of,
    read_artifact,
    write_artifact,
)
from tests.service.conftest import model_arrays, settings_for


def write_variant(source, target, **changes):
    """The artifact at ``source`` written again at ``target`` with ``changes`` to the
    pieces (classes, default_k, decision_rule) or, under ``metadata``, the manifest."""
    art = read_artifact(source)
    pieces = {
        **model_arrays(art),
        "ids": art.ids if "ids" in art.manifest["files"] else None,
        "validation_embeddings": art.validation_embeddings,
        "validation_labels": art.validation_labels,
    }
    metadata = {
        k: v
        for k, v in art.manifest.items()
        if k in ("metrics", "data", "training", "outlier_calibration", "lineage")
    }
    metadata.update(changes.pop("metadata", {}))
    pieces.update(changes)
    write_artifact(target, **pieces, metadata=metadata)
    return read_artifact(target)


def answers(path, rows: np.ndarray) -> tuple[str, list, list]:
    """(served version, /v1/classify predictions with neighbours, /v2 outputs)."""
    with TestClient(create_app(settings_for(path))) as client:
        v1 = client.post(
            "/v1/classify", json={"instances": rows.tolist(), "return_neighbors": True}
        )
        v2 = client.post(
            "/v2/models/nca-knn/infer",
            json={
                "inputs": [
                    {
                        "name": "input",
                        "datatype": "FP32",
                        "shape": list(rows.shape),
                        "data": rows.reshape(-1).tolist(),
                    }
                ]
            },
        )
        assert v1.status_code == 200 and v2.status_code == 200, (v1.text, v2.text)
        version = v1.headers["x-model-version"]
        assert v2.json()["model_version"] == version == v2.headers["x-model-version"]
        return version, v1.json()["predictions"], v2.json()["outputs"]


@pytest.fixture(scope="module")
def queries(model_artifact):
    _, _, split = model_artifact
    return np.ascontiguousarray(split.X_test[:12], dtype=np.float32)


def calibration_scaled(manifest: dict, factor: float) -> dict:
    record = dict(manifest["outlier_calibration"])
    record["quantiles"] = {q: v * factor for q, v in record["quantiles"].items()}
    return record


ANSWER_CHANGES = {
    "classes": lambda art: {"classes": [f"c{c}" for c in art.classes]},
    "default_k": lambda art: {"default_k": 1},
    "decision_rule": lambda art: {"decision_rule": "soft"},
    "outlier_calibration": lambda art: {
        "metadata": {"outlier_calibration": calibration_scaled(art.manifest, 1e-6)}
    },
}
DESCRIPTIVE_CHANGES = {
    "metrics": {"metrics": {"test_accuracy": {"1": 0.0}}},
    "training": {"training": {"note": "another run"}},
    "lineage": {"lineage": [{"operation": "add", "rows_added": 0}]},
    "data": {"data": {"name": "renamed"}},
}


@pytest.mark.parametrize("field", sorted(ANSWER_CHANGES))
def test_each_answer_affecting_field_changes_the_version_and_the_answers(
    model_artifact, tmp_path, queries, field
):
    base = read_artifact(model_artifact[0])
    variant = write_variant(model_artifact[0], tmp_path / field, **ANSWER_CHANGES[field](base))
    arrays_only = {"embeddings", "labels", "projection"}
    assert all(
        variant.manifest["files"][n]["sha256"] == base.manifest["files"][n]["sha256"]
        for n in arrays_only
    )  # the arrays are the same: only the field differs
    assert variant.version != base.version
    version, v1, v2 = answers(tmp_path / field, queries)
    base_version, base_v1, base_v2 = answers(model_artifact[0], queries)
    assert (version, base_version) == (variant.version, base.version)
    assert (v1, v2) != (base_v1, base_v2)


@pytest.mark.parametrize("field", sorted(DESCRIPTIVE_CHANGES))
def test_descriptive_fields_leave_the_version_and_the_answers(
    model_artifact, tmp_path, queries, field
):
    assert field in DESCRIPTIVE_MANIFEST_KEYS
    base = read_artifact(model_artifact[0])
    variant = write_variant(
        model_artifact[0], tmp_path / field, metadata=DESCRIPTIVE_CHANGES[field]
    )
    assert variant.manifest[field] != base.manifest.get(field)
    assert variant.version == base.version
    assert answers(tmp_path / field, queries) == answers(model_artifact[0], queries)


def test_an_unknown_manifest_field_is_part_of_the_version(model_artifact, tmp_path):
    """A field a later writer adds counts as answer-affecting until declared descriptive."""
    base = read_artifact(model_artifact[0])
    variant = write_variant(
        model_artifact[0], tmp_path / "v", metadata={"reference_kind": "prototypes"}
    )
    assert variant.version != base.version


def test_reload_of_a_model_that_differs_only_in_classes_says_reloaded(model_dir, queries):
    with TestClient(create_app(settings_for(model_dir))) as client:
        before = client.get("/v1/model").json()["model_version"]
        art = read_artifact(model_dir)
        write_variant(model_dir, model_dir, classes=[f"c{c}" for c in art.classes])
        reload = client.post("/v1/admin/reload").json()
        assert reload["status"] == "reloaded"
        after = client.get("/v1/model").json()["model_version"]
        r = client.post("/v1/classify", json={"instances": queries.tolist()})
        assert after == reload["model_version"] != before
        assert r.headers["x-model-version"] == after
        assert all(p["label"].startswith("c") for p in r.json()["predictions"])


def test_older_artifacts_load_and_are_served_under_their_full_identity(model_dir):
    """An artifact written by nca-knn 0.1 stores the array-only version: it loads, and its
    served version is the full identity; a version that matches neither is refused."""
    path = model_dir / MANIFEST_FILE
    manifest = json.loads(path.read_text())
    full = manifest["model_version"]
    manifest["model_version"] = legacy_model_version_of(manifest["files"])
    assert manifest["model_version"] != full
    path.write_text(json.dumps(manifest))
    assert read_artifact(model_dir).version == full
    manifest["model_version"] = "0123456789abcdef"
    path.write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match="model_version is '0123456789abcdef'"):
        read_artifact(model_dir)
