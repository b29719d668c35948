"""A model repository (``--model-repository DIR``): every model under DIR served by name,
each loading, swapping and failing on its own, under one memory budget; the repository
extension (index, load, unload) behind the admin key; per-model metrics."""

from __future__ import annotations

import shutil
import threading

import numpy as np
import pytest
from fastapi.testclient import TestClient

from service.app import create_app
from service.config import Settings
from service.core.artifact import read_artifact
from service.engine.repository import MIB, model_bytes
from service.errors import ReloadFailed
from tests.service.conftest import republish_scaled

ADMIN = {"Authorization": "Bearer admin-key"}


def repository_settings(root, **overrides) -> Settings:
    return Settings(
        model_repository=root,
        log_json=False,
        grpc_port=0,
        admin_api_key="admin-key",
        **overrides,
    )


def rows(split, n=4) -> list[list[float]]:
    return split.X_test[:n].tolist()


@pytest.fixture
def slow_loads(monkeypatch):
    """slow_loads(seconds) -> (the paths loaded, an Event set as a load starts, an Event
    set as it ends): from the call on, every model load takes ``seconds`` longer."""
    import time

    from service.engine import slot

    real_load = slot.load_model

    def slow(seconds: float):
        loads, started, done = [], threading.Event(), threading.Event()

        def load(*args, **kwargs):
            loads.append(args[0])
            started.set()
            time.sleep(seconds)
            try:
                return real_load(*args, **kwargs)
            finally:
                done.set()

        monkeypatch.setattr(slot, "load_model", load)
        return loads, started, done

    return slow


def post_in_thread(client, path: str) -> threading.Thread:
    """POST ``path`` with the admin key in a thread of its own (started)."""
    thread = threading.Thread(target=client.post, args=(path,), kwargs={"headers": ADMIN})
    thread.start()
    return thread


def scaled_by(plain: np.ndarray, factor: float, source) -> np.ndarray:
    """What republish_scaled's map gives: (factor W) x + b = factor (z - b) + b."""
    offset = np.asarray(read_artifact(source).offset, dtype=np.float64)
    return factor * (plain - offset) + offset


def index_of(client) -> dict[str, dict]:
    answer = client.post("/v2/repository/index", headers=ADMIN)
    assert answer.status_code == 200, answer.text
    return {entry["name"]: entry for entry in answer.json()}


def test_every_model_serves_by_name_and_a_broken_one_alone_is_unavailable(
    repository, model_artifact
):
    split = model_artifact[2]
    with TestClient(create_app(repository_settings(repository))) as client:
        index = index_of(client)
        assert sorted(index) == ["broken", "digits", "scaled", "versioned"]
        assert {n: e["state"] for n, e in index.items()} == {
            "broken": "UNAVAILABLE",
            "digits": "READY",
            "scaled": "READY",
            "versioned": "READY",
        }
        assert "embeddings.npy" in index["broken"]["reason"]
        assert client.get("/readyz").json() == {"status": "ready", "models": 3}

        body = {"instances": rows(split)}
        plain = np.array(client.post("/v1/models/digits/embed", json=body).json()["embeddings"])
        scaled = np.array(client.post("/v1/models/scaled/embed", json=body).json()["embeddings"])
        newest = np.array(client.post("/v1/models/versioned/embed", json=body).json()["embeddings"])
        source = model_artifact[0]
        np.testing.assert_allclose(scaled, scaled_by(plain, 2, source), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(newest, scaled_by(plain, 3, source), rtol=1e-5, atol=1e-5)

        labels = client.post("/v1/models/digits/classify", json=body)
        assert labels.status_code == 200
        assert [r["label"] for r in labels.json()["predictions"]] == [
            r["label"]
            for r in client.post("/v1/models/scaled/classify", json=body).json()["predictions"]
        ]
        assert client.post("/v1/models/digits/neighbors", json=body).status_code == 200

        broken = client.post("/v1/models/broken/classify", json=body)
        assert broken.status_code == 503
        assert "broken" in broken.json()["error"] and "embeddings.npy" in broken.json()["error"]
        unknown = client.post("/v1/models/nope/classify", json=body)
        assert unknown.status_code == 404 and "'digits'" in unknown.json()["error"]
        unnamed = client.post("/v1/classify", json=body)
        assert unnamed.status_code == 404 and "repository" in unnamed.json()["error"]


def test_the_v2_protocol_names_each_model_and_its_version(repository, model_artifact):
    split = model_artifact[2]
    x = split.X_test[:2].astype(np.float32)
    request = {
        "inputs": [
            {
                "name": "input",
                "shape": list(x.shape),
                "datatype": "FP32",
                "data": x.ravel().tolist(),
            }
        ],
        "outputs": [{"name": "embedding"}],
    }
    with TestClient(create_app(repository_settings(repository))) as client:
        answer = client.post("/v2/models/scaled/infer", json=request)
        assert answer.status_code == 200, answer.text
        assert answer.json()["model_name"] == "scaled"
        metadata = client.get("/v2/models/versioned").json()
        assert metadata["name"] == "versioned"
        version = read_artifact(repository / "versioned" / "2").version
        assert metadata["versions"] == [version]
        assert client.get("/v2/models/versioned/versions/2/ready").status_code == 200
        assert client.get(f"/v2/models/versioned/versions/{version}/ready").status_code == 200
        assert client.get("/v2/models/versioned/versions/1/ready").status_code == 404
        assert client.get("/v2/models/broken/ready").status_code == 503
        assert client.get("/v2/models/nope").status_code == 404
        assert "model_repository" in client.get("/v2").json()["extensions"]


def test_unload_and_load_through_the_repository_extension(repository, model_artifact):
    split = model_artifact[2]
    body = {"instances": rows(split)}
    with TestClient(create_app(repository_settings(repository))) as client:
        assert client.post("/v2/repository/index").status_code == 401  # the admin key
        assert client.post("/v2/repository/models/scaled/unload", json={}).status_code == 401
        client.post("/v1/models/scaled/embed", json=body)
        metrics = client.get("/metrics").text
        assert 'ncaknn_repository_model_requests_total{model="scaled"} 1.0' in metrics
        assert 'ncaknn_repository_model_memory_bytes{model="scaled"}' in metrics
        client.get("/v1/models/scaled")
        client.post("/v2/repository/index", headers=ADMIN)
        metrics = client.get("/metrics").text
        for route in ("/v1/models/{model_name}", "/v1/models/{model_name}/embed"):
            assert f'route="{route}",status="200"' in metrics, route
        assert 'route="/v2/repository/index",status="200"' in metrics

        assert client.post("/v2/repository/models/scaled/unload", headers=ADMIN).status_code == 200
        assert index_of(client)["scaled"] == {
            "name": "scaled",
            "version": "",
            "state": "UNAVAILABLE",
            "reason": "unloaded",
        }
        gone = client.post("/v1/models/scaled/embed", json=body)
        assert (
            gone.status_code == 503 and "/v2/repository/models/scaled/load" in gone.json()["error"]
        )
        assert 'model="scaled"' not in client.get("/metrics").text  # its series went
        assert client.post("/v1/models/digits/embed", json=body).status_code == 200

        again = client.post("/v2/repository/models/scaled/unload", headers=ADMIN)
        assert again.status_code == 404

        loaded = client.post("/v2/repository/models/scaled/load", headers=ADMIN, json={})
        assert loaded.status_code == 200, loaded.text
        assert index_of(client)["scaled"]["state"] == "READY"
        assert client.post("/v1/models/scaled/embed", json=body).status_code == 200

        # a broken model, mended on disk, loads on request
        shutil.rmtree(repository / "broken")
        shutil.copytree(repository / "digits", repository / "broken")
        mended = client.post("/v2/repository/models/broken/load", headers=ADMIN)
        assert mended.status_code == 200, mended.text
        assert client.post("/v1/models/broken/embed", json=body).status_code == 200


@pytest.mark.parametrize(
    "path, body, status, says",
    [
        ("/v2/repository/models/nope/load", b"", 404, "no model folder 'nope'"),
        ("/v2/repository/models/.hidden/load", b"", 404, "not a model name"),
        ("/v2/repository/models/digits/load", b'{"parameters": {"config": "{}"}}', 422, "config"),
        ("/v2/repository/models/digits/load", b"{", 422, "not valid"),
        ("/v2/repository/models/digits/load", b'{"bogus": 1}', 422, "bogus"),
        (
            "/v2/repository/models/digits/unload",
            b'{"parameters": {"unload_dependents": 1}}',
            422,
            "boolean",
        ),
        ("/v2/repository/index", b'{"ready": "yes"}', 422, "ready"),
        ("/v2/repository/index", b"x" * 5000, 413, "limit"),
    ],
)
def test_repository_calls_refuse_what_they_cannot_do(repository, path, body, status, says):
    with TestClient(create_app(repository_settings(repository))) as client:
        answer = client.post(path, content=body, headers=ADMIN)
        assert answer.status_code == status, answer.text
        assert says in answer.json()["error"]
        assert index_of(client)["digits"]["state"] == "READY"


def test_the_memory_budget_refuses_a_load_and_the_others_keep_serving(repository, model_artifact):
    split = model_artifact[2]
    for name in ("broken", "versioned"):
        shutil.rmtree(repository / name)
    with TestClient(create_app(repository_settings(repository))) as client:
        client.post("/v2/repository/models/scaled/unload", headers=ADMIN)
        engine = client.app.state.ncaknn.engine
        one = engine.repository.sizes["digits"]
    budget_mib = 1.5 * one / MIB  # room for one model, not two
    assert 2 * one > budget_mib * MIB > one
    settings = repository_settings(repository, repository_memory_mib=budget_mib)
    with TestClient(create_app(settings)) as client:
        index = index_of(client)
        assert index["digits"]["state"] == "READY"
        assert index["scaled"]["state"] == "UNAVAILABLE"
        assert "memory budget" in index["scaled"]["reason"]
        refused = client.post("/v2/repository/models/scaled/load", headers=ADMIN)
        assert refused.status_code == 409
        assert "repository_memory_mib" in refused.json()["error"]
        body = {"instances": rows(split)}
        assert client.post("/v1/models/digits/embed", json=body).status_code == 200
        # unloading one makes room for the other
        client.post("/v2/repository/models/digits/unload", headers=ADMIN)
        assert client.post("/v2/repository/models/scaled/load", headers=ADMIN).status_code == 200
        assert client.post("/v1/models/scaled/embed", json=body).status_code == 200


def test_model_bytes_counts_the_arrays_and_the_index(model_artifact):
    from service.engine.model import load_model

    model = load_model(model_artifact[0], Settings(log_json=False))
    references = model.embeddings.nbytes
    size = model_bytes(model)
    # the references twice at least (the array and the flat index's copy), plus the map
    assert size >= 2 * references + model.projection.nbytes
    assert size < 4 * references + 4 * model.artifact.mean.nbytes * model.n_components


def test_a_reload_of_one_model_never_mixes_two_versions_in_an_answer(repository, model_artifact):
    """Embeddings race loads that swap the scaled model between x2, x10 and x4: every
    answer is wholly one version's (one factor for all its rows), and one version always
    answers with the same factor."""
    split = model_artifact[2]
    x = split.X_test[:64].tolist()
    with TestClient(create_app(repository_settings(repository))) as client:
        plain = np.array(
            client.post("/v1/models/digits/embed", json={"instances": x}).json()["embeddings"]
        )
        stop = threading.Event()
        seen: list[tuple[str, np.ndarray]] = []

        statuses: list[int] = []

        def ask() -> None:  # asserts in the main thread: a thread's would only warn
            while not stop.is_set():
                answer = client.post("/v1/models/scaled/embed", json={"instances": x})
                statuses.append(answer.status_code)
                if answer.status_code == 200:
                    body = answer.json()
                    seen.append((body["model_version"], np.array(body["embeddings"])))

        threads = [threading.Thread(target=ask) for _ in range(2)]
        for thread in threads:
            thread.start()
        try:
            for factor in (5.0, 0.4, 2.5):  # the scaled model becomes x10, x4, x10
                republish_scaled(repository / "scaled", factor)
                loaded = client.post("/v2/repository/models/scaled/load", headers=ADMIN)
                assert loaded.status_code == 200, loaded.text
        finally:
            stop.set()
            for thread in threads:
                thread.join()
        assert set(statuses) == {200}
        factor_of: dict[str, float] = {}
        for version, embedding in seen:
            factors = [
                f
                for f in (2.0, 10.0, 4.0)
                if np.allclose(embedding, scaled_by(plain, f, model_artifact[0]), 1e-4, 1e-4)
            ]
            assert len(factors) == 1, "an answer mixed versions"
            assert factor_of.setdefault(version, factors[0]) == factors[0]
        assert len(set(factor_of.values())) >= 2, "the race never saw a swap"


def test_the_poller_serves_a_new_version_folder(repository, model_artifact):
    import time

    split = model_artifact[2]
    settings = repository_settings(repository, reload_poll_seconds=0.05)
    body = {"instances": rows(split)}
    with TestClient(create_app(settings)) as client:
        plain = np.array(client.post("/v1/models/digits/embed", json=body).json()["embeddings"])
        shutil.copytree(repository / "versioned" / "1", repository / "versioned" / "tmp")
        republish_scaled(repository / "versioned" / "tmp", 7.0)
        (repository / "versioned" / "tmp").rename(repository / "versioned" / "10")
        deadline = time.monotonic() + 10
        while True:
            z = np.array(client.post("/v1/models/versioned/embed", json=body).json()["embeddings"])
            if np.allclose(z, scaled_by(plain, 7, model_artifact[0]), rtol=1e-4, atol=1e-4):
                break
            assert time.monotonic() < deadline, "the poller never served version 10"
            time.sleep(0.05)
        assert client.get("/v2/models/versioned/versions/10/ready").status_code == 200


def test_a_repository_where_nothing_loads_stops_the_start(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(RuntimeError, match="no model of the repository"):
        with TestClient(create_app(repository_settings(tmp_path))):
            pass
    settings = repository_settings(tmp_path, require_model_at_startup=False)
    with TestClient(create_app(settings)) as client:
        assert client.get("/readyz").status_code == 503
        assert index_of(client)["empty"]["state"] == "UNAVAILABLE"


def test_one_model_mode_answers_the_repository_calls(client):
    index = client.post("/v2/repository/index").json()
    assert [entry["state"] for entry in index] == ["READY"]
    assert index[0]["name"] == "nca-knn"
    refused = client.post("/v2/repository/models/nca-knn/load")
    assert refused.status_code == 404 and "--model-repository" in refused.json()["error"]
    assert client.get("/v1/models").json() == index
    assert client.get("/v1/models/nca-knn").json()["model_version"] == index[0]["version"]


def test_the_repository_document_lists_its_routes_and_statuses(repository):
    with TestClient(create_app(repository_settings(repository))) as client:
        spec = client.app.openapi()
    paths = spec["paths"]
    load = paths["/v2/repository/models/{model_name}/load"]["post"]
    assert {"200", "401", "404", "409", "413", "422"} <= set(load["responses"])
    assert "404" in paths["/v1/classify"]["post"]["responses"]  # name the model
    (name,) = [
        p for p in paths["/v1/models/{model_name}/embed"]["post"]["parameters"] if p["in"] == "path"
    ]
    assert name["schema"]["enum"] == ["digits", "scaled", "versioned"]  # the ready ones
    index = paths["/v2/repository/index"]["post"]["responses"]["200"]
    assert index["content"]["application/json"]["schema"]["type"] == "array"


@pytest.mark.parametrize("refused_at", ["on disk", "loaded"])
def test_a_refused_load_is_not_tried_again_at_every_poll(repository, refused_at):
    """A model over the budget is refused once; the poller's next looks leave it until its
    files change or retry_failed_seconds pass (it once reloaded it at every poll)."""
    from service.engine.events import EngineEvents
    from service.engine.repository import Repository, artifact_bytes

    on_disk = artifact_bytes(repository / "digits")
    budget = on_disk / 2 if refused_at == "on disk" else on_disk * 1.01  # built > on disk
    now = [0.0]
    settings = repository_settings(repository, repository_memory_mib=budget / MIB)
    store = Repository(repository, settings, EngineEvents(), clock=lambda: now[0])
    with pytest.raises(ReloadFailed, match=refused_at):
        store.load("digits")
    (entry,) = [e for e in store.index() if e.name == "digits"]
    assert "memory budget" in entry.reason
    assert store.changed_on_disk() == []
    now[0] = 61.0
    assert store.changed_on_disk() == ["digits"]


# ---------------------------------------------------------------- the hostile pass's cases


def test_unreadable_entries_are_not_models_and_stop_nothing(repository, model_artifact):
    """A symlink loop in the root and in a model's folder, and folders named with non-ASCII
    digits: the start, the index, unknown names and the poller all go on (each was a 500,
    a failed start, or a poller stopped for every model)."""
    (repository / "loop").symlink_to(repository / "loop")
    (repository / "versioned" / "5").symlink_to(repository / "versioned" / "5")
    (repository / "versioned" / "\u00b2").mkdir()  # superscript two: isdigit(), not int()
    (repository / "versioned" / "\uff13").mkdir()  # full-width three
    split = model_artifact[2]
    settings = repository_settings(repository, reload_poll_seconds=0.05)
    body = {"instances": rows(split)}
    with TestClient(create_app(settings)) as client:
        index = index_of(client)
        assert "loop" not in index and index["versioned"]["state"] == "READY"
        assert client.post("/v1/models/nope/classify", json=body).status_code == 404
        assert client.get("/v1/models").status_code == 200 and client.get("/").status_code == 200
        assert client.post("/v2/repository/models/versioned/load", headers=ADMIN).status_code == 200
        plain = np.array(client.post("/v1/models/digits/embed", json=body).json()["embeddings"])
        republish_scaled(repository / "scaled", 3.0)  # the poller still serves the others
        expected = scaled_by(plain, 6.0, model_artifact[0])
        import time

        deadline = time.monotonic() + 10
        while not np.allclose(
            client.post("/v1/models/scaled/embed", json=body).json()["embeddings"],
            expected,
            rtol=1e-4,
            atol=1e-4,
        ):
            assert time.monotonic() < deadline, "the poller stopped"
            time.sleep(0.05)


def test_loads_of_one_name_do_not_pile_up(repository, slow_loads):
    """Eight loads of one slow model at once: one runs, the others are refused at once
    (each had run a full load in the background, filling the worker threads)."""
    settings = repository_settings(repository, reload_timeout_seconds=5)
    with TestClient(create_app(settings)) as client:
        loads, _, _ = slow_loads(2.0)
        answers = []

        def load() -> None:
            answers.append(client.post("/v2/repository/models/scaled/load", headers=ADMIN))

        threads = [threading.Thread(target=load) for _ in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        statuses = sorted(a.status_code for a in answers)
        assert statuses == [200] + [409] * 7, statuses
        refused = [a.json()["error"] for a in answers if a.status_code == 409]
        assert all("already running or waiting" in message for message in refused)
        assert len(loads) == 1


def test_an_unload_waits_for_another_models_load_at_most_the_reload_timeout(repository, slow_loads):
    settings = repository_settings(repository, reload_timeout_seconds=0.5)
    with TestClient(create_app(settings)) as client:
        _, started, done = slow_loads(3.0)
        slow = post_in_thread(client, "/v2/repository/models/scaled/load")
        assert started.wait(30)
        assert index_of(client)["scaled"]["state"] == "READY"  # the old version serves
        waited = client.post("/v2/repository/models/digits/unload", headers=ADMIN)
        assert waited.status_code == 409 and "another model's load" in waited.json()["error"]
        assert not done.is_set()  # refused while the slow load still ran, not after it
        slow.join()
        assert done.wait(30)


def test_unknown_names_are_answered_without_listing_the_repository(repository, monkeypatch):
    from service.engine.repository import Repository

    with TestClient(create_app(repository_settings(repository))) as client:

        def no_listing(self):
            raise AssertionError("listed the repository for a request")

        monkeypatch.setattr(Repository, "names_on_disk", no_listing)
        body = {"instances": [[0.0] * 64]}
        unknown = client.post("/v1/models/zz/classify", json=body)
        assert unknown.status_code == 404 and "'digits'" in unknown.json()["error"]
        assert client.post("/v1/models/broken/classify", json=body).status_code == 503
        assert client.get("/readyz").status_code == 200


def test_a_failed_reload_of_a_serving_model_is_shown(repository):
    with TestClient(create_app(repository_settings(repository))) as client:
        data = (repository / "digits" / "labels.npy").read_bytes()
        (repository / "digits" / "labels.npy").write_bytes(data[:10])
        refused = client.post("/v2/repository/models/digits/load", headers=ADMIN)
        assert refused.status_code == 409
        entry = index_of(client)["digits"]
        assert entry["state"] == "READY" and "labels.npy" in entry["reason"]
        info = client.get("/v1/models/digits").json()
        assert "labels.npy" in info["last_reload_error"]


def test_a_half_written_newest_version_is_passed_over(repository, model_artifact):
    (repository / "versioned" / "3").mkdir()  # being written: no manifest yet
    with TestClient(create_app(repository_settings(repository))) as client:
        assert client.get("/v2/models/versioned/versions/2/ready").status_code == 200


@pytest.mark.parametrize("kind", ["missing", "file", "artifact"])
def test_a_repository_path_that_is_no_repository_is_named_at_start(tmp_path, model_artifact, kind):
    root = {"missing": tmp_path / "nope", "file": tmp_path / "f", "artifact": tmp_path / "a"}[kind]
    if kind == "file":
        root.write_text("x")
    if kind == "artifact":
        shutil.copytree(model_artifact[0], root)
    says = {"missing": "does not exist", "file": "not a directory", "artifact": "--model"}[kind]
    with pytest.raises(RuntimeError, match=says):
        with TestClient(create_app(repository_settings(root))):
            pass


def test_a_request_that_outlives_its_models_unload_brings_no_series_back(repository):
    with TestClient(create_app(repository_settings(repository))) as client:
        engine = client.app.state.ncaknn.engine
        captured = engine.model("scaled")
        assert client.post("/v2/repository/models/scaled/unload", headers=ADMIN).status_code == 200
        with engine.admit("/v1/models/{model_name}/embed", 4, captured):
            pass
        assert 'model="scaled"' not in client.get("/metrics").text


def test_the_load_calls_document_any_folder_name(repository):
    with TestClient(create_app(repository_settings(repository))) as client:
        spec = client.app.openapi()
    load = spec["paths"]["/v2/repository/models/{model_name}/load"]["post"]
    (name,) = [p for p in load["parameters"] if p["name"] == "model_name"]
    assert "enum" not in name["schema"] and name["schema"]["pattern"].startswith("^")


def test_a_budget_below_one_byte_is_still_a_budget(repository):
    """1e-7 MiB is 0.1 byte: it once rounded to 0, which means no budget at all."""
    settings = repository_settings(repository, repository_memory_mib=1e-7)
    with pytest.raises(RuntimeError, match="memory budget"):
        with TestClient(create_app(settings)):
            pass


def test_a_load_queued_behind_a_slow_one_shows_loading_and_says_why_it_gave_up(
    repository, slow_loads
):
    import time

    settings = repository_settings(repository, reload_timeout_seconds=0.5)
    with TestClient(create_app(settings)) as client:
        client.post("/v2/repository/models/digits/unload", headers=ADMIN)
        _, started, done = slow_loads(3.0)
        slow = post_in_thread(client, "/v2/repository/models/scaled/load")
        assert started.wait(30)
        queued = client.post("/v2/repository/models/digits/load", headers=ADMIN)
        assert queued.status_code == 409
        assert "another model's load or unload" in queued.json()["error"]  # never started
        assert not done.is_set()
        assert index_of(client)["scaled"]["state"] == "READY"  # its old version serves on
        slow.join()
        assert done.wait(30)  # the slow load goes on past its request's timeout, then ends
        _, started, done = slow_loads(1.0)
        first = post_in_thread(client, "/v2/repository/models/digits/load")
        assert started.wait(30)
        assert index_of(client)["digits"]["state"] == "LOADING"
        first.join()
        assert done.wait(30)
        deadline = time.monotonic() + 30
        while index_of(client)["digits"]["state"] != "READY":  # the swap follows the read
            assert time.monotonic() < deadline
            time.sleep(0.05)


def test_a_serving_model_reloads_within_a_budget_that_holds_one_copy(repository):
    """The model's own previous size is not counted against its reload."""
    for name in ("broken", "versioned", "scaled"):
        shutil.rmtree(repository / name)
    with TestClient(create_app(repository_settings(repository))) as client:
        one = client.app.state.ncaknn.engine.repository.sizes["digits"]
    settings = repository_settings(repository, repository_memory_mib=1.5 * one / MIB)
    with TestClient(create_app(settings)) as client:
        again = client.post("/v2/repository/models/digits/load", headers=ADMIN)
        assert again.status_code == 200, again.text


def test_replay_applies_unloads_first_and_retries_what_failed(repository):
    """Another worker's record: unload digits, load scaled. Under a budget of about one
    model, the unload must come first; a load that fails (the scaled folder broken) is not
    marked applied and is tried again once its retry time has passed."""
    from service.engine.events import EngineEvents
    from service.engine.repository import Repository

    for name in ("broken", "versioned"):
        shutil.rmtree(repository / name)
    probe = Repository(repository, repository_settings(repository), EngineEvents())
    probe.load("digits")
    one = probe.sizes["digits"]
    now = [0.0]
    settings = repository_settings(repository, repository_memory_mib=1.5 * one / MIB)
    store = Repository(repository, settings, EngineEvents(), clock=lambda: now[0])
    store.load("digits")
    data = (repository / "scaled" / "labels.npy").read_bytes()
    (repository / "scaled" / "labels.npy").write_bytes(data[:10])
    wanted = {"scaled": ("load", "t2"), "digits": ("unload", "t1")}
    applied: dict[str, str] = {}
    store.replay(wanted, applied)
    assert applied == {"digits": "t1"} and "digits" not in store.slots
    (repository / "scaled" / "labels.npy").write_bytes(data)  # mended
    store.replay(wanted, applied)
    assert "scaled" not in applied  # not before its retry time
    now[0] = 61.0
    store.replay(wanted, applied)
    assert applied == {"digits": "t1", "scaled": "t2"}
    assert store.index(ready_only=True)[0].name == "scaled"
