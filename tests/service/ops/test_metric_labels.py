"""Metric labels come from fixed sets: thousands of distinct unknown paths (with and without
an API key, in one and two workers) leave the number of series and the size of /metrics
unchanged, and a scrape never holds up /healthz."""

from __future__ import annotations

import re
import statistics
import threading
import time

import httpx
import pytest
from fastapi.testclient import TestClient

from service.app import create_app
from tests.service.conftest import settings_for
from tests.service.servers import free_port, start_server, stop_server, wait_ready

KEY = "labels-key"
N_PATHS = 2000
PROBE_BOUND_SECONDS = 0.1


def unknown_paths(n: int, seed: str) -> list[str]:
    """Paths no route serves, in every shape a route template could be fooled by."""
    shapes = (
        "/v2/models/nca-knn/{}",
        "/v2/models/{}/infer/x",
        "/v2/models/x/versions/{}/ready/more",
        "/v1/{}",
        "/{}",
        "/v2/{}",
        "/v2/models/{}",  # a model name: one templated route, whatever the name
    )
    return [shapes[i % len(shapes)].format(f"{seed}{i}") for i in range(n)]


def series(text: str) -> set[str]:
    """The label sets of every sample line (value dropped)."""
    return {line.rsplit(" ", 1)[0] for line in text.splitlines() if line and line[0] != "#"}


def route_labels(text: str) -> set[str]:
    return set(re.findall(r'route="([^"]*)"', text))


@pytest.mark.slow  # a long real-server or training scenario: make test-slow
@pytest.mark.parametrize("api_key", [None, KEY], ids=["no key", "with key"])
def test_unknown_paths_add_no_series(model_artifact, api_key):
    settings = settings_for(model_artifact[0], api_key=api_key)
    with TestClient(create_app(settings), raise_server_exceptions=False) as client:
        for method in ("GET", "POST"):
            for path in unknown_paths(50, "warm"):
                client.request(method, path)
        client.get("/metrics")  # its own series exist before the one compared
        before = client.get("/metrics").text
        for i, path in enumerate(unknown_paths(N_PATHS, "x")):
            status = client.request("GET" if i % 2 else "POST", path).status_code
            assert status in (401, 404, 405, 422), (path, status)
        after = client.get("/metrics").text
        auth = {"authorization": f"Bearer {KEY}"} if api_key else {}
        documented = set(client.get("/openapi.json", headers=auth).json()["paths"])
    assert series(after) == series(before)
    assert abs(len(after) - len(before)) < 200  # counters grow by digits, not by lines
    known = documented | {"/openapi.json", "/docs", "/redoc", "unmatched"}
    assert route_labels(after) <= known, route_labels(after) - known


@pytest.mark.slow  # a long real-server or training scenario: make test-slow
@pytest.mark.parametrize("workers", [1, 2])
def test_a_real_server_keeps_its_metrics_bounded_and_probes_fast(model_artifact, workers):
    """A real server (1 or 2 workers, key set): N_PATHS unknown paths leave the series and
    the size of /metrics as they were, and /healthz answers within PROBE_BOUND_SECONDS
    (median of the probes sent while /metrics is scraped in a loop)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_server(model_artifact[0], port, NCAKNN_API_KEY=KEY, NCAKNN_WORKERS=workers)
    try:
        wait_ready(url, proc)
        with httpx.Client(timeout=10) as client:
            for path in unknown_paths(100, "warm"):
                client.get(f"{url}{path}")
            client.get(f"{url}/metrics")
            before = client.get(f"{url}/metrics").text
            for path in unknown_paths(N_PATHS, "x"):
                assert client.get(f"{url}{path}").status_code in (401, 404)
            after = client.get(f"{url}/metrics").text
            stop = threading.Event()

            def scrape():
                with httpx.Client(timeout=10) as scraper:
                    while not stop.is_set():
                        scraper.get(f"{url}/metrics")

            scrapers = [threading.Thread(target=scrape) for _ in range(2)]
            for t in scrapers:
                t.start()
            probes = []
            try:
                for _ in range(40):
                    started = time.perf_counter()
                    assert client.get(f"{url}/healthz").status_code == 200
                    probes.append(time.perf_counter() - started)
                    time.sleep(0.01)
            finally:
                stop.set()
                for t in scrapers:
                    t.join()
    finally:
        stop_server(proc)
    print(
        f"{workers} worker(s): /metrics {len(before)} -> {len(after)} bytes after {N_PATHS} "
        f"unknown paths; /healthz during scrapes: median {statistics.median(probes) * 1e3:.1f}"
        f" ms, max {max(probes) * 1e3:.1f} ms"
    )
    # the pid label and values change between scrapes; the label sets of routes do not
    assert route_labels(after) == route_labels(before)
    assert len(series(after)) <= len(series(before)) + 4 * workers  # a new status child or so
    assert len(after) < len(before) * 1.2
    assert statistics.median(probes) < PROBE_BOUND_SECONDS
