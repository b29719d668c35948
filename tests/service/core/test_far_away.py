"""When the nearest neighbour is far away (Barber 14.3.1), served: the outlier threshold from
the calibration, the per-prediction nearest distance and outlier flag (JSON and npy), the
per-request and setting quantile, the metrics counter, and the soft_prior decision rule."""

from __future__ import annotations

import asyncio
import io
import json
import re

import numpy as np
import pytest
from fastapi.testclient import TestClient

from service.app import create_app
from service.core.artifact import ArtifactError, parse_outlier_calibration, read_artifact
from service.core.knn import (
    Background,
    FarPrior,
    decide,
    exact_knn,
    exact_knn_centered,
    outlier_flags,
    outlier_threshold,
    project,
)
from service.engine.infer import embed
from service.engine.model import load_model
from service.search.index import search
from tests.service.conftest import (
    build_model_artifact,
    digits_like_split,
    module_client,
    npy,
    post_all,
    settings_for,
)

client = module_client()  # these tests only send requests

ANSWER_NPY = {"content-type": "application/x-npy", "accept": "application/x-npy"}


def brute_nearest(z, refs):
    diff = z.astype(np.float64)[:, None, :] - refs.astype(np.float64)[None]
    return np.einsum("nmd,nmd->nm", diff, diff).min(axis=1)


@pytest.fixture(scope="module")
def uncalibrated(tmp_path_factory):
    out = tmp_path_factory.mktemp("models") / "uncalibrated"
    build_model_artifact(out, digits_like_split(), calibrated=False)
    return out


# ------------------------------------------------------------------ the math (service.core.knn)


def test_the_threshold_interpolates_the_calibrated_quantile_function():
    quantiles = {0.5: 1.0, 0.9: 3.0, 0.99: 10.0}
    assert outlier_threshold(quantiles, 0.9) == 3.0
    assert outlier_threshold(quantiles, 0.7) == pytest.approx(2.0)
    assert outlier_threshold(quantiles, 0.945) == pytest.approx(6.5)
    for outside in (0.49, 0.995, float("nan")):
        with pytest.raises(ValueError, match=r"\[0.5, 0.99\]"):
            outlier_threshold(quantiles, outside)


def test_the_calibration_is_checked_when_read():
    good = {"quantiles": {"0.5": 1.0, "0.99": 2.0}}
    assert list(parse_outlier_calibration(good)["quantiles"]) == [0.5, 0.99]
    assert parse_outlier_calibration(None) is None
    for bad, fragment in [
        ({"quantiles": {"0.5": 2.0, "0.99": 1.0}}, "must not decrease"),
        ({"quantiles": {"0.5": 1.0}}, "at least two"),
        ({"quantiles": {"high": 1.0, "0.9": 2.0}}, "not a number"),
        ({"quantiles": {"1.5": 1.0, "0.9": 2.0}}, "expected q in"),
        ({"quantiles": {"0.5": -1.0, "0.9": 2.0}}, "finite >= 0"),
        ({"quantiles": {"0.5": True, "0.9": 2.0}}, "expected q in"),
        ([1, 2], "expected an object"),
    ]:
        with pytest.raises(ArtifactError, match=fragment):
            parse_outlier_calibration(bad)


def test_far_prior_parameters_against_brute_force():
    rng = np.random.default_rng(0)
    refs = rng.normal(size=(300, 3)).astype(np.float32) * 4
    labels = rng.integers(0, 3, 300)
    prior = FarPrior.of(refs, labels, 4)
    assert np.allclose(prior.centre, refs.astype(np.float64).mean(0))
    spread = ((refs - refs.astype(np.float64).mean(0)) ** 2).sum(1).mean()
    assert prior.radius_sq == pytest.approx(spread) and prior.variance == pytest.approx(spread)
    assert prior.class_priors.tolist() == pytest.approx([*(np.bincount(labels) / 300), 0.0])
    assert FarPrior.of(refs * 1e-3, labels, 3).variance == 1.0  # never under 1


def toy():
    """Two separated classes of unequal size (priors 0.75 / 0.25) in 8 dimensions, at the
    scale NCA learns: nearest squared distances of several units (trained digits: median
    13, 0.99-quantile 34)."""
    rng = np.random.default_rng(1)
    a = rng.normal(size=(300, 8)) * 1.5
    b = rng.normal(size=(100, 8)) * 1.5
    a[:, 0] -= 12.0
    b[:, 0] += 12.0
    refs = np.concatenate([a, b]).astype(np.float32)
    labels = np.repeat([0, 1], [300, 100])
    return refs, labels


def calibrated_threshold(refs, quantile=0.99):
    held_out = toy_queries(200)
    return float(np.quantile(brute_nearest(held_out, refs), quantile))


def toy_queries(n, seed=5):
    rng = np.random.default_rng(seed)
    z = rng.normal(size=(n, 8)) * 1.5
    z[:, 0] += np.where(np.arange(n) % 4 == 0, 12.0, -12.0)
    return z.astype(np.float32)


def prior_rule(refs, labels, z, k, threshold):
    dist, idx = exact_knn_centered(z, refs, k)  # as the service searches far queries
    background = FarPrior.of(refs, labels, 2).background(z, threshold)
    return decide(labels[idx], dist, 2, "soft_prior", background), (dist, idx)


def test_soft_prior_without_the_component_is_the_soft_rule_bit_for_bit():
    rng = np.random.default_rng(2)
    labels = rng.integers(0, 4, (50, 7))
    dist = np.sort(rng.exponential(3.0, (50, 7)), axis=1)
    none = Background(np.full(4, 0.25), np.full(50, -np.inf))
    soft = decide(labels, dist, 4, "soft")
    prior = decide(labels, dist, 4, "soft_prior", none)
    assert np.array_equal(soft[0], prior[0]) and np.array_equal(soft[1], prior[1])
    with pytest.raises(ValueError, match="background"):
        decide(labels, dist, 4, "soft_prior")


def test_soft_prior_mixes_the_soft_rule_and_the_priors():
    """P = lambda soft + (1 - lambda) pi with lambda = S / (S + B)."""
    rng = np.random.default_rng(3)
    labels = rng.integers(0, 3, (40, 5))
    dist = np.sort(rng.exponential(2.0, (40, 5)), axis=1)
    priors = np.array([0.5, 0.3, 0.2])
    log_mass = rng.normal(-2.0, 2.0, 40)
    _, p = decide(labels, dist, 3, "soft_prior", Background(priors, log_mass))
    _, soft = decide(labels, dist, 3, "soft")
    s = np.exp(-dist).sum(axis=1)
    lam = s / (s + np.exp(log_mass))
    assert np.allclose(p, lam[:, None] * soft + (1 - lam)[:, None] * priors, atol=1e-12)


def test_near_the_data_the_prior_rule_is_the_soft_rule():
    refs, labels = toy()
    threshold = calibrated_threshold(refs)
    z = toy_queries(300, seed=6)  # in-distribution queries
    (_, p), (dist, idx) = prior_rule(refs, labels, z, 5, threshold)
    _, soft = decide(labels[idx], dist, 2, "soft")
    typical = dist[:, 0] <= np.median(dist[:, 0])
    assert np.abs(p - soft)[typical].max() < 1e-4


def test_far_away_the_probabilities_tend_monotonically_to_the_priors():
    refs, labels = toy()
    threshold = calibrated_threshold(refs)
    priors = np.array([0.75, 0.25])
    centre = refs.astype(np.float64).mean(0)
    rng = np.random.default_rng(7)
    for direction in [np.eye(8)[0], -np.eye(8)[0], np.eye(8)[3], *rng.normal(size=(4, 8))]:
        u = np.asarray(direction) / np.linalg.norm(direction)
        radius = np.abs((refs - centre) @ u).max()
        t = radius * np.geomspace(1.0, 1e6, 60)
        z = (centre + t[:, None] * u).astype(np.float32)
        (_, p), _ = prior_rule(refs, labels, z, 5, threshold)
        gap = np.abs(p - priors).sum(axis=1)  # total variation x 2
        assert np.all(np.diff(gap) <= 1e-12), direction
        assert gap[-1] < 1e-9 and np.isfinite(p).all()
        # the soft rule, meanwhile, is sure of the nearest class
        far_d, far_i = exact_knn(z[-1:], refs, 5)
        assert decide(labels[far_i], far_d, 2, "soft")[1].max() > 0.99


def test_the_prior_rule_does_not_overflow_however_far_the_query_is():
    refs, labels = toy()
    z = np.zeros((2, 8), np.float32)
    z[0, :2] = [3e18, -1e18]
    z[1, 5] = 1e30
    (pred, p), _ = prior_rule(refs, labels, z, 3, 1.0)
    assert np.allclose(p, [[0.75, 0.25], [0.75, 0.25]]) and pred.tolist() == [0, 0]


# ------------------------------------------------------------------ served


def test_each_prediction_carries_its_nearest_distance_and_flag(client, model_artifact):
    path, _, split = model_artifact
    art = read_artifact(path)
    far = split.X_test[:3] * 0 + 40.0  # every feature far beyond the data
    rows = np.concatenate([split.X_test[:30], far]).astype(np.float32)
    body = client.post("/v1/classify", json={"instances": rows.tolist()}).json()
    z = project(rows, art.projection, art.offset)
    nearest = brute_nearest(z, art.embeddings)
    threshold = art.manifest["outlier_calibration"]["quantiles"]["0.99"]
    got = [p["nearest_distance"] for p in body["predictions"]]
    assert got == pytest.approx(nearest.tolist(), rel=1e-9)
    assert [p["outlier"] for p in body["predictions"]] == (nearest > threshold).tolist()
    info = client.get("/v1/model").json()["outliers"]
    assert info["quantile"] == 0.99 and info["threshold"] == threshold
    assert all(p["outlier"] for p in body["predictions"][-3:])


def test_about_the_chosen_fraction_of_in_distribution_points_is_flagged(model_artifact):
    path, _, split = model_artifact
    for quantile in (0.9, 0.95):
        model = load_model(path, settings_for(path, outlier_quantile=quantile))
        z = embed(model, split.X_test)
        dist, _ = search(model, z, 1)
        rate = outlier_flags(dist, model.default_outlier_threshold).mean()
        assert abs(rate - (1 - quantile)) < 0.06, (quantile, rate)


def test_the_quantile_per_request_by_body_and_query_and_setting(model_artifact):
    path, _, split = model_artifact
    rows = split.X_test[:200].astype(np.float32)
    art = read_artifact(path)
    nearest = brute_nearest(project(rows, art.projection, art.offset), art.embeddings)
    quantiles = parse_outlier_calibration(art.manifest["outlier_calibration"])["quantiles"]

    def expected(q):
        return (nearest > outlier_threshold(quantiles, q)).tolist()

    with TestClient(create_app(settings_for(path, outlier_quantile=0.9))) as client:
        by_setting = client.post("/v1/classify", json={"instances": rows.tolist()}).json()
        assert [p["outlier"] for p in by_setting["predictions"]] == expected(0.9)
        body = {"instances": rows.tolist(), "outlier_quantile": 0.5}
        by_body = client.post("/v1/classify", json=body).json()
        assert [p["outlier"] for p in by_body["predictions"]] == expected(0.5)
        assert sum(expected(0.5)) > sum(expected(0.9))
        records = np.load(
            io.BytesIO(
                client.post(
                    "/v1/classify?outlier_quantile=0.75", content=npy(rows), headers=ANSWER_NPY
                ).content
            )
        )
        assert records["outlier"].tolist() == expected(0.75)
        assert records["nearest_distance"].tolist() == pytest.approx(nearest.tolist(), rel=1e-9)


@pytest.mark.parametrize(
    "body, query, fragment",
    [
        ({"outlier_quantile": 0.3}, "", r"outlier quantile must lie in \[0.5, 0.999\]"),
        ({"outlier_quantile": 1.0}, "", r"\[0.5, 0.999\]"),
        ({"outlier_quantile": "0.9"}, "", "outlier_quantile"),
        ({"outlier_quantile": True}, "", "outlier_quantile"),
        ({}, "?outlier_quantile=nan", "must be a decimal number"),
        ({}, "?outlier_quantile=-0.9", "must be a decimal number"),
        ({}, "?outlier_quantile=0.9&outlier_quantile=0.8", "more than once"),
        ({}, "?outlier_quantile=0.2", r"\[0.5, 0.999\]"),
        # the body's quantile wins, and the query's must still be one the model could use
        ({"outlier_quantile": 0.8}, "?outlier_quantile=10000000.0", r"\[0.5, 0.999\]"),
    ],
)
def test_bad_quantiles_are_refused_with_a_message(client, model_artifact, body, query, fragment):
    rows = model_artifact[2].X_test[:2].tolist()
    r = client.post("/v1/classify" + query, json={"instances": rows, **body})
    assert r.status_code == 422, r.text
    assert r.json()["error_type"] == "invalid_input"
    assert re.search(fragment, r.json()["error"]), r.json()["error"]


def test_a_model_without_calibration_flags_nothing_and_refuses_what_needs_it(uncalibrated):
    rows = digits_like_split().X_test[:4].tolist()
    with TestClient(create_app(settings_for(uncalibrated))) as client:
        body = client.post("/v1/classify", json={"instances": rows}).json()
        assert [p["outlier"] for p in body["predictions"]] == [None] * 4
        assert client.get("/v1/model").json()["outliers"] is None
        assert all(p["nearest_distance"] >= 0 for p in body["predictions"])
        records = np.load(
            io.BytesIO(
                client.post(
                    "/v1/classify", content=npy(np.asarray(rows, np.float32)), headers=ANSWER_NPY
                ).content
            )
        )
        assert "outlier" not in records.dtype.names and "nearest_distance" in records.dtype.names
        for extra, fragment in [
            ({"rule": "soft_prior"}, "needs the model's outlier calibration"),
            ({"outlier_quantile": 0.9}, "no outlier calibration"),
        ]:
            r = client.post("/v1/classify", json={"instances": rows, **extra})
            assert r.status_code == 422 and fragment in r.json()["error"], r.text


def test_a_malformed_calibration_fails_the_load_with_its_name(model_dir):
    manifest_path = model_dir / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["outlier_calibration"]["quantiles"]["0.999"] = -1.0
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match="outlier_calibration"):
        read_artifact(model_dir)


def test_the_outlier_counter_counts_flagged_predictions(model_artifact):
    path, _, split = model_artifact
    far = np.full((5, split.X_test.shape[1]), 40.0)
    rows = np.concatenate([split.X_test[:50], far]).tolist()
    with TestClient(create_app(settings_for(path))) as client:
        counted = []
        for _ in range(2):
            answer = client.post("/v1/classify", json={"instances": rows}).json()
            counted.append(sum(p["outlier"] for p in answer["predictions"]))
            client.post("/v1/neighbors", json={"instances": rows})  # flags nothing
        text = client.get("/metrics").text
    line = next(x for x in text.splitlines() if x.startswith("ncaknn_outliers_total"))
    assert counted[0] >= 5 and float(line.split()[-1]) == sum(counted)


def test_every_wire_counts_the_outliers_of_its_classifications(model_artifact):
    """The engine counts outliers once, whatever the wire: a /v2 call counts the rows it
    flags whether or not it asks for the outlier output, as /v1/classify does."""
    path, _, split = model_artifact
    far = np.full((5, split.X_test.shape[1]), 40.0)
    rows = np.concatenate([split.X_test[:50], far]).astype(np.float32)
    tensor = {"name": "input", "datatype": "FP32", "shape": list(rows.shape)}
    tensor["data"] = rows.ravel().tolist()
    with TestClient(create_app(settings_for(path))) as client:
        flagged = client.post("/v1/classify", json={"instances": rows.tolist()}).json()
        expected = sum(p["outlier"] for p in flagged["predictions"])
        for outputs in ([{"name": "outlier"}], [{"name": "label"}]):
            body = {"inputs": [tensor], "outputs": outputs}
            r = client.post("/v2/models/nca-knn/infer", json=body)
            assert r.status_code == 200, r.text
        text = client.get("/metrics").text
    line = next(x for x in text.splitlines() if x.startswith("ncaknn_outliers_total"))
    assert expected >= 5 and float(line.split()[-1]) == 3 * expected


def test_soft_prior_served_equals_the_offline_rule_bit_for_bit(client, model_artifact):
    path, _, split = model_artifact
    art = read_artifact(path)
    rows = np.concatenate([split.X_test[:40], split.X_test[:5] * 6.0]).astype(np.float32)
    for q in (0.99, 0.6):
        served = client.post(
            "/v1/classify",
            json={"instances": rows.tolist(), "rule": "soft_prior", "k": 7, "outlier_quantile": q},
        ).json()["predictions"]
        z = project(rows, art.projection, art.offset)
        dist, idx = exact_knn(z, art.embeddings, 7)
        quantiles = parse_outlier_calibration(art.manifest["outlier_calibration"])["quantiles"]
        background = FarPrior.of(art.embeddings, art.labels, 10).background(
            z, outlier_threshold(quantiles, q)
        )
        pred, proba = decide(np.asarray(art.labels)[idx], dist, 10, "soft_prior", background)
        classes = art.classes
        assert [p["label"] for p in served] == [classes[c] for c in pred]
        for item, row in zip(served, proba, strict=True):
            assert [item["probabilities"][str(c)] for c in classes] == row.tolist()


@pytest.mark.parametrize("on_loop", ["always", "never"])
def test_batched_requests_with_other_rules_and_quantiles_answer_as_alone(model_artifact, on_loop):
    """The batcher shares one search among requests with different rules and thresholds
    (one decision per rule and soft_prior threshold); each gets the answer it gets alone."""
    rows = model_artifact[2].X_test[:48] * 3.0
    asks = [
        {"rule": "soft_prior", "outlier_quantile": 0.6},
        {"rule": "soft_prior", "outlier_quantile": 0.99},
        {"rule": "soft_prior"},
        {"rule": "soft"},
        {"rule": "majority", "outlier_quantile": 0.5},
    ]
    bodies = [
        {"instances": rows[i : i + 1 + i % 3].tolist(), "k": 3 + 2 * (i % 2), **asks[i % 5]}
        for i in range(40)
    ]
    settings = settings_for(
        model_artifact[0], batch_max_wait_us=200_000, search_on_event_loop=on_loop
    )
    app = create_app(settings)
    batched = asyncio.run(post_all(app, bodies))
    merged = app.state.ncaknn.metrics.registry.get_sample_value("ncaknn_batch_rows_count")
    assert 0 < merged < len(bodies)
    with TestClient(create_app(settings_for(model_artifact[0], batching=False))) as c:
        single = [c.post("/v1/classify", json=b) for b in bodies]
    for a, b in zip(batched, single, strict=True):
        assert a.status_code == b.status_code == 200
        assert a.json() == b.json()
