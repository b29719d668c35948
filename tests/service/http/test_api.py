"""The HTTP API with `with TestClient(app)`: every route, every listed error status."""

from __future__ import annotations

import asyncio
import io
import os
import shutil

import numpy as np
import pytest
from fastapi.testclient import TestClient

from service.app import create_app
from service.core.artifact import ArtifactError
from tests.service.conftest import brute_force_knn, npy, post_all, settings_for
from tests.service.servers import ROOT

NPY = {"content-type": "application/x-npy"}


@pytest.fixture(scope="module")
def rows(model_artifact):
    return model_artifact[2].X_test[:20]


# ------------------------------------------------------------------ happy paths


def test_classify_json(client, rows, model_artifact):
    r = client.post("/v1/classify", json={"instances": rows[:3].tolist()})
    assert r.status_code == 200
    body = r.json()
    assert body["model_version"] and len(body["predictions"]) == 3
    p = body["predictions"][0]
    assert set(p) == {"label", "probabilities", "nearest_distance", "outlier"}
    assert p["nearest_distance"] >= 0 and isinstance(p["outlier"], bool)
    assert sum(p["probabilities"].values()) == pytest.approx(1.0)
    # the answers, by brute force: the default k = 5 nearest references and their vote
    model = client.app.state.ncaknn.engine.current()
    distances, nearest = brute_force_knn(model, rows[:3], 5)
    for prediction, d, idx in zip(body["predictions"], distances, nearest, strict=True):
        votes = np.bincount(model.labels[idx], minlength=10)
        assert votes[prediction["label"]] == votes.max()
        assert [prediction["probabilities"][str(c)] for c in range(10)] == pytest.approx(votes / 5)
        assert prediction["nearest_distance"] == pytest.approx(d[0], rel=1e-5)


def test_classify_with_neighbors_k_and_rule(client, rows):
    r = client.post(
        "/v1/classify",
        json={"instances": rows[:2].tolist(), "k": 5, "rule": "soft", "return_neighbors": True},
    )
    assert r.status_code == 200
    neighbors = r.json()["predictions"][0]["neighbors"]
    assert len(neighbors) == 5 and set(neighbors[0]) == {"id", "label", "distance"}
    model = client.app.state.ncaknn.engine.current()
    expected_d, expected_idx = brute_force_knn(model, rows[:1], 5)
    assert [n["id"] for n in neighbors] == model.ids[expected_idx[0]].tolist()
    assert [n["distance"] for n in neighbors] == pytest.approx(expected_d[0].tolist(), rel=1e-5)
    weights = np.exp(-(expected_d[0] - expected_d[0].min()))  # the soft rule over the 5
    soft = np.bincount(model.labels[expected_idx[0]], weights=weights, minlength=10)
    probabilities = r.json()["predictions"][0]["probabilities"]
    assert [probabilities[str(c)] for c in range(10)] == pytest.approx(soft / soft.sum())


def test_embed_json_and_npy_give_identical_numbers(client, rows):
    as_json = np.array(
        client.post("/v1/embed", json={"instances": rows.tolist()}).json()["embeddings"], np.float32
    )
    r = client.post(
        "/v1/embed",
        content=npy(rows.astype(np.float32)),
        headers={**NPY, "accept": "application/x-npy"},
    )
    assert r.status_code == 200 and r.headers["content-type"] == "application/x-npy"
    as_npy = np.load(io.BytesIO(r.content), allow_pickle=False)
    assert as_npy.dtype == np.float32 and as_npy.shape == (20, 16)
    np.testing.assert_array_equal(as_json, as_npy)


def test_classify_json_and_npy_give_identical_answers(client, rows):
    a = client.post(
        "/v1/classify", json={"instances": rows.tolist(), "k": 3, "return_neighbors": True}
    ).json()
    b = client.post(
        "/v1/classify?k=3&return_neighbors=true", content=npy(rows.astype(np.float32)), headers=NPY
    ).json()
    assert a == b


def test_neighbors(client, rows):
    r = client.post("/v1/neighbors", json={"instances": rows[:4].tolist(), "k": 7})
    assert r.status_code == 200
    lists = r.json()["neighbors"]
    assert len(lists) == 4 and all(len(x) == 7 for x in lists)
    model = client.app.state.ncaknn.engine.current()
    expected_d, expected_idx = brute_force_knn(model, rows[:4], 7)
    assert [[n["id"] for n in x] for x in lists] == model.ids[expected_idx].tolist()
    assert [[n["label"] for n in x] for x in lists] == model.labels[expected_idx].tolist()
    distances = [[n["distance"] for n in x] for x in lists]
    np.testing.assert_allclose(distances, expected_d, rtol=1e-5)


def test_model_health_ready_metrics(client):
    info = client.get("/v1/model").json()
    assert (
        info["n_features"] == 64
        and info["n_components"] == 16
        and info["classes"] == list(range(10))
    )
    assert info["index"]["kind"] == "flat" and info["limits"]["max_batch_rows"] > 0
    assert "test_accuracy" in info["metrics"]
    assert client.get("/healthz").json() == {"status": "ok"}
    assert client.get("/readyz").json()["status"] == "ready"
    client.post("/v1/classify", json={"instances": [[0.0] * 64]})
    text = client.get("/metrics").text
    for name in (
        'ncaknn_requests_total{route="/v1/classify",status="200"}',
        "ncaknn_request_latency_seconds_bucket",
        "ncaknn_batch_rows_bucket",
        "ncaknn_queue_wait_seconds_bucket",
        "ncaknn_model_info{",
        "ncaknn_model_loaded_timestamp_seconds",
    ):
        assert name in text


def test_openapi_lists_routes_with_examples(client):
    spec = client.get("/openapi.json").json()
    for path in (
        "/v1/classify",
        "/v1/embed",
        "/v1/neighbors",
        "/v1/model",
        "/healthz",
        "/readyz",
        "/metrics",
        "/v1/admin/reload",
    ):
        assert path in spec["paths"]
    body = spec["paths"]["/v1/classify"]["post"]["requestBody"]["content"]
    assert set(body) == {"application/json", "application/x-npy"}
    assert client.get("/docs").status_code == 200


# ------------------------------------------------------------------ errors


def assert_error(response, status, error_type, fragment=""):
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error", "error_type"} and body["error_type"] == error_type
    assert fragment in body["error"]


@pytest.mark.parametrize(
    "payload, fragment",
    [
        ({"instances": [[1.0, 2.0]]}, "must have 64 features"),
        ({"instances": [[0.0] * 64, [0.0] * 63]}, "ragged"),
        ({"instances": [["x"] * 64]}, "Expected `float`, got `str`"),
        ({"instances": [[1e39] * 64]}, "outside this model's input range"),
        ({"instances": [[0.0] * 64], "k": 0}, "k"),
        ({"instances": [[0.0] * 64], "k": 100000}, "k=100000"),
        ({"instances": [[0.0] * 64], "rule": "vote"}, "rule"),
        ({"rows": [[0.0] * 64]}, "unknown field `rows`"),
        ({"instances": "not a list"}, "instances"),
    ],
)
def test_invalid_json_input_is_422(client, payload, fragment):
    assert_error(client.post("/v1/classify", json=payload), 422, "invalid_input", fragment)


def test_nan_and_inf_are_422(client):
    for literal in ("NaN", "Infinity", "-Infinity"):
        body = '{"instances": [[' + ",".join(["0"] * 63 + [literal]) + "]]}"
        r = client.post("/v1/classify", content=body, headers={"content-type": "application/json"})
        assert r.status_code == 422 and r.json()["error_type"] == "invalid_input"
    bad = np.zeros((2, 64), np.float32)
    bad[1, 5] = np.nan
    assert_error(
        client.post("/v1/embed", content=npy(bad), headers=NPY),
        422,
        "invalid_input",
        "instances[1][5]",
    )


def test_malformed_bodies_are_422(client):
    assert_error(
        client.post(
            "/v1/classify", content=b"{not json", headers={"content-type": "application/json"}
        ),
        422,
        "invalid_input",
    )
    assert_error(
        client.post("/v1/classify", content=b"\x93NUMPY garbage", headers=NPY),
        422,
        "invalid_input",
        ".npy",
    )
    assert_error(
        client.post("/v1/classify", content=npy(np.zeros(64, np.float32)), headers=NPY),
        422,
        "invalid_input",
        "2-D",
    )
    assert_error(
        client.post("/v1/classify", content=npy(np.array([["a"] * 64])), headers=NPY),
        422,
        "invalid_input",
        "dtype",
    )
    pickled = io.BytesIO()
    np.save(pickled, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    assert_error(
        client.post("/v1/classify", content=pickled.getvalue(), headers=NPY),
        422,
        "invalid_input",
        "dtype is '|O'",
    )


def test_empty_batch_is_400(client):
    assert_error(client.post("/v1/classify", json={"instances": []}), 400, "empty_batch")
    assert_error(
        client.post("/v1/embed", content=npy(np.zeros((0, 64), np.float32)), headers=NPY),
        400,
        "empty_batch",
    )


def test_too_many_rows_and_too_large_body_are_413(model_artifact):
    app = create_app(settings_for(model_artifact[0], max_batch_rows=4, max_body_bytes=4096))
    with TestClient(app) as c:
        assert_error(
            c.post("/v1/classify", json={"instances": [[0.0] * 64] * 5}),
            413,
            "payload_too_large",
            "limit is 4",
        )
        assert_error(
            c.post("/v1/embed", content=npy(np.zeros((40, 64), np.float32)), headers=NPY),
            413,
            "payload_too_large",
            "4096",
        )


def test_wrong_content_type_is_415_and_wrong_accept_is_406(client):
    assert_error(
        client.post("/v1/classify", content=b"a,b", headers={"content-type": "text/csv"}),
        415,
        "unsupported_media_type",
    )
    r = client.post("/v1/embed", json={"instances": [[0.0] * 64]}, headers={"accept": "text/html"})
    assert_error(r, 406, "not_acceptable")


def test_unknown_route_404_and_wrong_method_405(client):
    assert_error(client.get("/v3/classify"), 404, "not_found")
    # under /v2 the Open Inference Protocol's body: {"error": ...}
    assert client.get("/v2/classify").json() == {"error": "no route GET /v2/classify"}
    assert_error(client.get("/v1/classify"), 405, "method_not_allowed")


def test_api_key(model_artifact):
    app = create_app(
        settings_for(model_artifact[0], api_key="s3cret", metrics_require_api_key=True)
    )
    body = {"instances": [[0.0] * 64]}
    with TestClient(app) as c:
        r = c.post("/v1/classify", json=body)
        assert_error(r, 401, "unauthorized", "missing API key")
        assert r.headers["www-authenticate"] == "Bearer"
        assert_error(
            c.post("/v1/classify", json=body, headers={"authorization": "Bearer nope"}),
            401,
            "unauthorized",
            "not valid",
        )
        assert_error(c.get("/v1/model"), 401, "unauthorized")
        assert_error(c.post("/v1/admin/reload"), 401, "unauthorized")
        assert_error(c.get("/metrics"), 401, "unauthorized")
        auth = {"authorization": "Bearer s3cret"}
        assert c.post("/v1/classify", json=body, headers=auth).status_code == 200
        assert c.get("/metrics", headers=auth).status_code == 200
        assert c.get("/healthz").status_code == 200 and c.get("/readyz").status_code == 200


def test_not_ready_is_503_until_a_model_arrives(tmp_path, model_artifact):
    import shutil

    path = tmp_path / "later"
    app = create_app(settings_for(path, require_model_at_startup=False))
    with TestClient(app) as c:
        assert_error(c.get("/readyz"), 503, "not_ready")
        assert_error(c.post("/v1/classify", json={"instances": [[0.0] * 64]}), 503, "not_ready")
        assert c.get("/healthz").status_code == 200
        assert_error(c.post("/v1/admin/reload"), 409, "reload_failed", "no model is serving")
        shutil.copytree(model_artifact[0], path)
        assert c.post("/v1/admin/reload").json()["status"] == "reloaded"
        assert c.get("/readyz").status_code == 200


def test_startup_fails_fast_without_a_model(tmp_path):
    app = create_app(settings_for(tmp_path / "missing"))
    with pytest.raises(RuntimeError, match=r"cannot serve: the model at .*missing failed to load"):
        with TestClient(app):
            pass


def test_a_first_load_torn_by_a_publish_is_read_again(model_artifact, tmp_path):
    """A worker that starts while its artifact is replaced (a rollout) reads it again, not
    dies: the first load fails as a torn read does, and the path now names another
    artifact. Was: startup failed, and uvicorn stopped every worker with it (CI, stop 66)."""
    v1, v2 = tmp_path / "v1", tmp_path / "v2"
    shutil.copytree(model_artifact[0], v1)
    shutil.copytree(model_artifact[0], v2)
    served = tmp_path / "served"
    served.symlink_to(v1)
    app = create_app(settings_for(served))
    engine = app.state.ncaknn.engine
    load, calls = engine.load, []

    def torn_load(path=None):
        calls.append(path)
        if len(calls) == 1:  # the publish lands during the first read
            link = tmp_path / ".link"
            link.symlink_to(v2)
            os.replace(link, served)
            raise ArtifactError(f"{served}/labels.npy: missing (listed in the manifest)")
        return load(path)

    engine.load = torn_load
    with TestClient(app) as c:  # (the same for a manifest written or removed meanwhile)
        assert c.get("/readyz").status_code == 200
        assert c.get("/v1/model").json()["artifact_directory"] == str(v2)
    assert len(calls) == 2


def test_a_first_load_that_fails_on_an_unchanged_artifact_fails_fast(model_dir):
    (model_dir / "labels.npy").write_bytes(b"garbage")
    app = create_app(settings_for(model_dir))
    engine = app.state.ncaknn.engine
    load, calls = engine.load, []
    engine.load = lambda path=None: (calls.append(path), load(path))[1]
    with pytest.raises(RuntimeError, match="checksum mismatch"):
        with TestClient(app):
            pass
    assert len(calls) == 1  # not tried again: nothing changed


def test_reload_of_a_corrupt_artifact_is_409_and_the_old_model_serves(model_dir):
    with TestClient(create_app(settings_for(model_dir))) as c:
        version = c.get("/v1/model").json()["model_version"]
        (model_dir / "labels.npy").write_bytes(b"garbage")
        r = c.post("/v1/admin/reload")
        assert_error(r, 409, "reload_failed", "checksum mismatch")
        assert "previous model keeps serving" in r.json()["error"]
        assert (
            c.post("/v1/classify", json={"instances": [[0.0] * 64]}).json()["model_version"]
            == version
        )
        info = c.get("/v1/model").json()
        assert "checksum mismatch" in info["last_reload_error"]
        assert "ncaknn_model_load_failures_total 1.0" in c.get("/metrics").text


# ------------------------------------------------------------------ concurrency


def test_overload_is_429(model_artifact):
    app = create_app(settings_for(model_artifact[0], max_in_flight=1, batch_max_wait_us=200_000))
    bodies = [{"instances": [[0.0] * 64]}] * 8
    responses = asyncio.run(post_all(app, bodies))
    statuses = sorted(r.status_code for r in responses)
    assert 200 in statuses and 429 in statuses
    rejected = next(r for r in responses if r.status_code == 429)
    assert_error(rejected, 429, "overloaded", "limit is 1")


@pytest.mark.parametrize("on_loop", ["always", "never"])
def test_batched_answers_equal_single_request_answers(model_artifact, on_loop):
    """Merged requests (mixed k, mixed rules: one decision per rule in a merged search),
    searched on the event loop or in the search thread, answer exactly as alone."""
    X = model_artifact[2].X_test[:64]
    rules = ["majority", "soft", None, "soft"]
    bodies = [
        {
            "instances": X[i : i + 1 + i % 3].tolist(),
            "k": 1 + 2 * (i % 3),
            "return_neighbors": True,
            **({"rule": rules[i % 4]} if rules[i % 4] else {}),
        }
        for i in range(48)
    ]
    app = create_app(
        settings_for(model_artifact[0], batch_max_wait_us=200_000, search_on_event_loop=on_loop)
    )
    batched = asyncio.run(post_all(app, bodies))
    registry = app.state.ncaknn.metrics.registry
    merged_searches = registry.get_sample_value("ncaknn_batch_rows_count")
    assert 0 < merged_searches < len(bodies)  # requests were merged
    with TestClient(create_app(settings_for(model_artifact[0], batching=False))) as c:
        single = [c.post("/v1/classify", json=b) for b in bodies]
    assert all(r.status_code == 200 for r in batched)
    assert [r.json() for r in batched] == [r.json() for r in single]


def test_every_setting_is_documented_in_the_settings_page():

    from service.config import Settings, settings_table

    readme = (ROOT / "docs" / "settings.md").read_text()
    for name in Settings.model_fields:
        assert f"`NCAKNN_{name.upper()}`" in readme, name
    assert settings_table() in readme, "regenerate with: python -m service.config --markdown"
