"""The defect classes found by hostile testing, each pinned by a test that would catch it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest
from fastapi.testclient import TestClient
from pydantic import ValidationError

import service.engine.infer as infer_module
from service.app import create_app
from service.config import Settings
from service.core.artifact import ArtifactError, read_artifact, write_artifact
from service.core.artifact import read as artifact_reader
from service.core.knn import decide
from service.engine.engine import Engine
from tests.service.conftest import republish_scaled, settings_for

D = 64


def brute(model_path, z, k):
    art = read_artifact(model_path)
    d2 = ((z[:, None, :].astype(np.float64) - art.embeddings[None].astype(np.float64)) ** 2).sum(-1)
    return np.argsort(d2, axis=1, kind="stable")[:, :k]


# ------------------------------------------------------------ 1. valid input never 500s


@pytest.mark.parametrize("rule", ["majority", "soft"])
def test_values_at_the_input_bound_are_answered_on_every_route(client, rule):
    limit = client.get("/v1/model").json()["limits"]["input_abs_max"]
    rows = [[limit] * D, [-limit] * D, [1e25] + [0.0] * (D - 1), [0.0] * D]
    r = client.post(
        "/v1/classify", json={"instances": rows, "rule": rule, "return_neighbors": True}
    )
    assert r.status_code == 200, r.text
    for prediction in r.json()["predictions"]:
        assert abs(sum(prediction["probabilities"].values()) - 1) < 1e-9
        assert all(np.isfinite(n["distance"]) for n in prediction["neighbors"])
    r = client.post("/v1/neighbors", json={"instances": rows, "k": 5})
    assert r.status_code == 200, r.text
    r = client.post("/v1/embed", json={"instances": rows})
    assert r.status_code == 200 and np.isfinite(np.array(r.json()["embeddings"])).all()
    r = client.post(
        "/v1/embed",
        content=_npy(np.array(rows, np.float32)),
        headers={"content-type": "application/x-npy", "accept": "application/x-npy"},
    )
    assert r.status_code == 200


def test_far_queries_get_the_exact_neighbours(client, model_artifact):
    model_path = model_artifact[0]
    art = read_artifact(model_path)
    x = np.zeros((3, D), np.float32)
    x[0, 10], x[1, 20], x[2, 30] = 1e25, -1e20, 1e6
    r = client.post("/v1/neighbors", json={"instances": x.tolist(), "k": 4})
    assert r.status_code == 200
    got = [[n["id"] for n in row] for row in r.json()["neighbors"]]
    z = client.post("/v1/embed", json={"instances": x.tolist()}).json()["embeddings"]
    z = np.array(z, np.float64)
    centre = art.embeddings.astype(np.float64).mean(0)
    rc = art.embeddings.astype(np.float64) - centre
    s = (rc * rc).sum(1)[None] - 2 * (z - centre) @ rc.T  # the well-conditioned order
    expected = np.argsort(s, axis=1, kind="stable")[:, :4]
    assert got == art.ids[expected].tolist()
    metrics = client.get("/metrics").text
    assert 'ncaknn_search_fallback_rows_total{reason="far"}' in metrics


def test_ivf_with_too_few_probes_never_adds_phantom_votes(model_artifact):
    """nprobe=1 over many lists: FAISS pads with -1; the answers must equal exact search."""
    path, _, split = model_artifact
    x = split.X_test[:200].tolist()
    with TestClient(create_app(settings_for(path))) as exact:
        want = exact.post("/v1/classify", json={"instances": x, "k": 15}).json()["predictions"]
        want_n = exact.post("/v1/neighbors", json={"instances": x, "k": 15}).json()["neighbors"]
    settings = settings_for(path, index_type="ivf", ivf_nlist=200, nprobe=1)
    with TestClient(create_app(settings)) as ivf:
        got = ivf.post("/v1/classify", json={"instances": x, "k": 15})
        got_n = ivf.post("/v1/neighbors", json={"instances": x, "k": 15})
        metrics = ivf.get("/metrics").text
    assert got.status_code == 200 and got_n.status_code == 200
    assert 'reason="underfilled"' in metrics
    n_ref = read_artifact(path).embeddings.shape[0]
    for row in got_n.json()["neighbors"]:
        assert len(row) == 15 and all(0 <= n["id"] < n_ref for n in row)
    # rows the IVF served itself may differ (approximate); under-filled rows are exact, and
    # no answer counts a phantom neighbour: vote fractions are multiples of 1/15
    for p in got.json()["predictions"]:
        votes = np.array(list(p["probabilities"].values())) * 15
        np.testing.assert_allclose(votes, np.round(votes), atol=1e-9)
    agree = np.mean(
        [a["label"] == b["label"] for a, b in zip(got.json()["predictions"], want, strict=True)]
    )
    assert agree > 0.9 and len(want_n) == 200


def test_decide_rejects_nothing_finite():
    """The soft rule with huge but finite distances stays a distribution."""
    labels = np.array([[0, 1, 1]])
    for scale in (1.0, 1e30, 1e300):
        _, proba = decide(labels, np.array([[1.0, 2.0, 3.0]]) * scale, 2, "soft")
        assert np.isfinite(proba).all() and abs(proba.sum() - 1) < 1e-12


# ------------------------------------------------------------ 9. OpenAPI, 405, 500


def test_openapi_defines_every_referenced_schema_and_states_the_limits(client):
    spec = client.get("/openapi.json").json()
    text = json.dumps(spec)
    for ref in {part.split('"')[0] for part in text.split("#/components/schemas/")[1:]}:
        assert ref in spec["components"]["schemas"], ref
    instances = spec["components"]["schemas"]["ClassifyRequest"]["properties"]["instances"]
    assert instances["maxItems"] == 4096 and instances["items"]["minItems"] == D
    limit = client.get("/v1/model").json()["limits"]["input_abs_max"]
    assert instances["items"]["items"]["maximum"] == limit
    metrics = spec["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    assert set(metrics) == {"text/plain"}


def test_405_has_an_allow_header_and_the_error_body(client):
    r = client.get("/v1/classify")
    assert r.status_code == 405 and r.headers["allow"] == "POST"
    assert r.json()["error_type"] == "method_not_allowed"


def test_an_internal_error_has_the_error_body(model_artifact, monkeypatch):
    with TestClient(
        create_app(settings_for(model_artifact[0])), raise_server_exceptions=False
    ) as c:
        assert c.app.state.ncaknn.engine.peek() is not None

        def broken(*args, **kwargs):
            raise RuntimeError("boom")

        monkeypatch.setattr(infer_module, "search", broken)
        r = c.post("/v1/classify", json={"instances": [[0.0] * D]})
    assert r.status_code == 500
    assert r.json() == {
        "error": "internal error (RuntimeError); it was logged",
        "error_type": "internal_error",
    }


# ------------------------------------------------------------ 11. auth


@pytest.mark.parametrize("key", ["", "   ", "a b", "tab\tkey"])
def test_unusable_api_keys_are_refused_at_startup(tmp_path, key):
    with pytest.raises(ValidationError, match="api_key"):
        Settings(model_path=tmp_path, api_key=key)


def test_api_key_surrounding_whitespace_is_stripped(tmp_path):
    assert (
        Settings(model_path=tmp_path, api_key="  secret\n").api_key.get_secret_value() == "secret"
    )


def test_auth_scope_docs_admin_key_and_quiet_probes(model_dir):
    settings = settings_for(model_dir, api_key="inference", admin_api_key="admin")
    with TestClient(create_app(settings)) as c:
        user = {"authorization": "Bearer inference"}
        admin = {"authorization": "Bearer admin"}
        for path in ("/openapi.json", "/docs", "/redoc", "/v1/model"):
            assert c.get(path).status_code == 401, path
            assert c.get(path, headers=user).status_code == 200, path
        assert (
            c.post(
                "/v1/classify",
                json={"instances": [[0.0] * D]},
                headers={"authorization": "Bearer  "},
            ).status_code
            == 401
        )
        assert c.post("/v1/admin/reload", headers=user).status_code == 401
        assert c.post("/v1/admin/reload", headers=admin).status_code == 200
        assert set(c.get("/readyz").json()) == {"status", "model_version"}
    with TestClient(create_app(settings_for(model_dir, api_key="k", docs="public"))) as c:
        assert c.get("/openapi.json").status_code == 200
    with TestClient(create_app(settings_for(model_dir, docs="off"))) as c:
        assert c.get("/openapi.json").status_code == 404 and c.get("/docs").status_code == 404


def test_readyz_does_not_reveal_the_path_or_the_error(tmp_path):
    missing = tmp_path / "secret-location"
    settings = settings_for(missing, require_model_at_startup=False, api_key="k")
    with TestClient(create_app(settings)) as c:
        r = c.get("/readyz")
        assert r.status_code == 503 and "secret-location" not in r.text
        detailed = c.get("/v1/model", headers={"authorization": "Bearer k"})
        assert detailed.status_code == 503 and "secret-location" in detailed.text


# ------------------------------------------------------------ 4. what was verified is served


def test_a_manifest_from_another_artifact_is_refused(model_dir, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(model_dir, other)
    republish_scaled(other, 2.0)
    # the files of one artifact with the manifest of another: checksums fail or the version
    # does not match the files
    shutil.copy(other / "manifest.json", model_dir / "manifest.json")
    with pytest.raises(ArtifactError):
        read_artifact(model_dir)


def test_the_reader_keeps_the_directory_it_opened(model_dir, tmp_path, monkeypatch):
    """Exchange the directory (symlink repointed) in the middle of a read: every file still
    comes from the directory the read started on."""
    v1 = tmp_path / "v1"
    v2 = tmp_path / "v2"
    shutil.copytree(model_dir, v1)
    shutil.copytree(model_dir, v2)
    version2 = republish_scaled(v2, 3.0)
    link = tmp_path / "current"
    link.symlink_to(v1)
    version1 = read_artifact(v1).version
    calls = {"n": 0}
    original = artifact_reader._PinnedDirectory.read

    def read_and_flip(self, name, what, max_bytes=None):
        calls["n"] += 1
        if calls["n"] == 3:  # after the manifest and two arrays
            tmp = tmp_path / "flip"
            tmp.symlink_to(v2)
            os.replace(tmp, link)
        return original(self, name, what, max_bytes)

    monkeypatch.setattr(artifact_reader._PinnedDirectory, "read", read_and_flip)
    art = read_artifact(link)
    assert art.version == version1 != version2
    np.testing.assert_array_equal(art.embeddings, read_artifact(v1).embeddings)


# ------------------------------------------------------------ 5. failed versions are retried


def test_the_poller_retries_a_version_once_it_heals(model_dir):
    now = [0.0]
    engine = Engine(settings_for(model_dir), clock=lambda: now[0], retry_failed_seconds=60)
    engine.load()
    new_version = republish_scaled(model_dir, 2.0)
    good = (model_dir / "embeddings.npy").read_bytes()
    (model_dir / "embeddings.npy").write_bytes(good[: len(good) // 2])  # caught half-copied
    assert engine.changed_on_disk()
    with pytest.raises(ArtifactError):
        engine.load()
    assert not engine.changed_on_disk()  # the same broken bytes are not retried at once
    now[0] = 61.0
    assert engine.changed_on_disk()  # ... but after retry_failed_seconds
    now[0] = 0.0
    engine.single._failed_at = 0.0
    (model_dir / "embeddings.npy").write_bytes(good)  # healed
    assert engine.changed_on_disk()
    assert engine.load().version == new_version


def test_the_server_poller_picks_up_a_healed_artifact(model_dir, tmp_path):
    from service.core.artifact.write import _exchange_paths

    with TestClient(create_app(settings_for(model_dir, reload_poll_seconds=0.05))) as c:
        before = c.get("/readyz").json()["model_version"]
        # the new version is written and broken aside, then swapped in at once: the poller
        # never sees it whole before it sees it broken
        side = tmp_path / "side"
        shutil.copytree(model_dir, side)
        new_version = republish_scaled(side, 2.0)
        good = (side / "labels.npy").read_bytes()
        (side / "labels.npy").write_bytes(b"broken")
        assert _exchange_paths(side, model_dir)
        deadline = time.monotonic() + 10
        while "ncaknn_model_load_failures_total 1.0" not in c.get("/metrics").text:
            assert time.monotonic() < deadline, "the poller never tried the broken artifact"
            time.sleep(0.05)
        assert c.get("/readyz").json()["model_version"] == before  # the broken one refused
        (model_dir / "labels.npy").write_bytes(good)
        deadline = time.monotonic() + 10
        while c.get("/readyz").json()["model_version"] != new_version:
            assert time.monotonic() < deadline, "the healed version was never loaded"
            time.sleep(0.05)


# ------------------------------------------------------------ 12. staging directories


def test_staging_left_by_a_killed_writer_is_removed_by_the_next_write(tmp_path, rng):
    target = tmp_path / "m"
    code = (
        "import os, numpy as np\n"
        "from service.core.artifact import write as a\n"
        "real = a._move_into_place\n"
        "def die(*args): os._exit(9)\n"
        "a._move_into_place = die\n"
        "r = np.random.default_rng(0)\n"
        f"a.write_artifact({str(target)!r}, projection=r.normal(size=(2, 3)), offset=np.zeros(2),"
        " embeddings=r.normal(size=(5, 2)), labels=np.array([0, 1, 0, 1, 0]), classes=[0, 1],"
        " mean=np.zeros(3), scale=np.ones(3), default_k=1)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=os.getcwd(), check=False)
    assert proc.returncode == 9
    leftovers = list(tmp_path.glob(".m.tmp-*"))
    assert len(leftovers) == 1 and not target.exists()
    old = tmp_path / ".m.tmp-otherhost-1-abcdef012345"  # another host's, two days old
    old.mkdir()
    os.utime(old, (time.time() - 2 * 86400,) * 2)
    fresh = tmp_path / ".m.tmp-otherhost-2-abcdef012345"  # another host's, maybe still writing
    fresh.mkdir()
    write_artifact(
        target,
        projection=rng.normal(size=(2, 3)),
        offset=np.zeros(2),
        embeddings=rng.normal(size=(5, 2)),
        labels=np.array([0, 1, 0, 1, 0]),
        classes=[0, 1],
        mean=np.zeros(3),
        scale=np.ones(3),
        default_k=1,
    )
    assert not leftovers[0].exists() and not old.exists() and fresh.exists()
    assert read_artifact(target).n_components == 2


def _npy(array) -> bytes:
    import io

    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()
