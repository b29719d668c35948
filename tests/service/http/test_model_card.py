"""The model card at GET / (service/http/card.py): what it shows, who may see it, that it
is rendered off the event loop and once per model version, and that it fetches nothing."""

from __future__ import annotations

import re
import threading
import time

import pytest
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry, Histogram

from service.app import create_app
from service.core.artifact import read_artifact, write_artifact
from service.http import card as card_module
from tests.service.conftest import model_arrays, settings_for

# a valid 1 x 1 PNG
PIXEL = bytes.fromhex(
    "89504e470d0a1a0a0000000d49484452000000010000000108060000001f15c489"
    "0000000d49444154789c6360f8cfc0000003010100c9fe92ef0000000049454e44ae426082"
)


@pytest.fixture
def card_model(model_artifact, tmp_path):
    """The session model rewritten with plots and baselines, as the training job writes them."""
    art = read_artifact(model_artifact[0])
    metrics = {
        **art.manifest["metrics"],
        "test_accuracy": {"5": 0.9123},
        "baselines": {"pca": {"test_accuracy": {"5": 0.8765}}},
    }
    out = tmp_path / "model"
    write_artifact(
        out,
        **model_arrays(art),
        extra_files={"objective.png": PIXEL, "embedding_test.png": PIXEL},
        metadata={
            "metrics": metrics,
            "data": {"name": "digits-like"},
            "training": {"objective": "nca", "n_iter": 42, "stop_reason": "converged"},
            "lineage": [{"operation": "add", "n_rows": 3}],
        },
    )
    return out


def test_the_card_shows_the_model_its_figures_and_links(card_model):
    with TestClient(create_app(settings_for(card_model, docs="public"))) as client:
        for _ in range(3):
            client.post("/v1/classify", json={"instances": [[0.0] * 64]})
        client.post("/v1/classify", json={"instances": "nope"})
        response = client.get("/")
        version = client.get("/v1/model").json()["model_version"]
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/html")
    page = response.text
    assert version in page and "digits-like" in page
    assert "0.9123" in page and "0.8765" in page and "k = 5" in page
    assert "&quot;operation&quot;: &quot;add&quot;" in page  # lineage, HTML-escaped
    assert "flat" in page.lower()  # the index and its search setting
    assert page.count("data:image/png;base64,") == 2
    assert 'href="/docs"' in page and 'href="/v1/model"' in page
    requests = re.search(r"<th>requests</th><td>(\d+)</td>", page)
    assert requests and int(requests.group(1)) >= 4
    assert "latency p50" in page and "latency p99" in page
    assert "<script" not in page and "<link" not in page
    assert not re.findall(r'src="(?!data:)', page)
    assert not re.findall(r"https?://", page)


def test_the_card_follows_the_docs_access_rule(card_model):
    key = "s3cret-key"
    protected = settings_for(card_model, docs="protected", api_key=key)
    with TestClient(create_app(protected)) as client:
        refused = client.get("/")
        assert refused.status_code == 401
        assert "html" not in refused.headers["content-type"]
        assert "0.9123" not in refused.text  # nothing of the model leaks
        assert client.get("/", headers={"Authorization": f"Bearer {key}"}).status_code == 200
    with TestClient(create_app(settings_for(card_model, docs="off"))) as client:
        assert client.get("/").status_code == 404


def test_the_model_part_is_rendered_once_per_version(card_model, monkeypatch):
    reads = []

    def counting(model):
        reads.append(model.version)
        return {}

    monkeypatch.setattr(card_module, "artifact_images", counting)
    with TestClient(create_app(settings_for(card_model, docs="public"))) as client:
        for _ in range(3):
            assert client.get("/").status_code == 200
    assert len(reads) == 1


def test_a_slow_card_does_not_hold_up_the_hot_routes(card_model, monkeypatch):
    """The card renders in a worker thread: while one takes 1 s, /healthz answers at once."""
    rendering = threading.Event()

    def slow(model):
        rendering.set()
        time.sleep(1.0)
        return {}

    monkeypatch.setattr(card_module, "artifact_images", slow)
    with TestClient(create_app(settings_for(card_model, docs="public"))) as client:
        thread = threading.Thread(target=client.get, args=("/",))
        thread.start()
        assert rendering.wait(10), "the card never started rendering"
        started = time.perf_counter()
        assert client.get("/healthz").status_code == 200
        waited = time.perf_counter() - started
        still_rendering = thread.is_alive()
        thread.join()
    assert still_rendering and waited < 0.5, waited


def test_latency_percentiles_come_from_the_histogram_buckets():
    registry = CollectorRegistry()
    latency = Histogram(
        "ncaknn_request_latency_seconds",
        "",
        ["route"],
        buckets=(0.001, 0.01, 0.1, 1.0),
        registry=registry,
    )
    assert card_module.latency_percentiles(registry) == {}
    for value in [0.0005] * 50 + [0.005] * 40 + [0.05] * 9:
        latency.labels("/v1/classify").observe(value)
    latency.labels("/v1/embed").observe(0.5)
    assert card_module.latency_percentiles(registry) == {0.5: 0.001, 0.9: 0.01, 0.99: 0.1}
