"""A real server: `python -m service` in a subprocess, graceful drain on SIGTERM, hot reload."""

from __future__ import annotations

import signal
import threading
import time

import httpx
import numpy as np
import pytest
from fastapi.testclient import TestClient

from service.app import create_app
from service.core.artifact import read_artifact
from tests.service.conftest import republish_scaled, settings_for
from tests.service.servers import (
    free_port,
    in_flight,
    server_log,
    start_server,
    wait_for,
    wait_ready,
)


def test_real_server_answers_and_drains_on_sigterm(model_artifact):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    # a 2 s batching window keeps requests in flight when SIGTERM arrives
    proc = start_server(model_artifact[0], port, NCAKNN_BATCH_MAX_WAIT_US=2_000_000)
    try:
        wait_ready(url, proc)
        body = {"instances": [[0.0] * 64]}
        assert httpx.post(f"{url}/v1/classify", json=body, timeout=10).status_code == 200
        results: list[int] = []

        def call():
            try:
                results.append(httpx.post(f"{url}/v1/classify", json=body, timeout=30).status_code)
            except httpx.HTTPError as exc:  # pragma: no cover - the failure we test against
                results.append(repr(exc))

        threads = [threading.Thread(target=call) for _ in range(12)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 10
        while in_flight(url) < 12:  # every request admitted and waiting for its search
            assert time.monotonic() < deadline, "requests did not all arrive"
            time.sleep(0.01)
        proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(30)
        assert results == [200] * 12
        # uvicorn drains, then re-raises the signal: a clean stop exits by SIGTERM (or 0)
        assert proc.wait(30) in (0, -signal.SIGTERM)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_real_server_refuses_to_start_without_a_model(tmp_path):
    proc = start_server(tmp_path / "missing", free_port())
    assert proc.wait(60) != 0
    assert "failed to load" in server_log(proc)


def test_reload_under_a_request_loop_loses_no_request(model_dir):
    app = create_app(settings_for(model_dir))
    failures, answered = [], []  # answered: the version of every request answered 200
    stop = threading.Event()
    rows = np.zeros((2, 64)).tolist()
    with TestClient(app) as c:

        def loop():
            while not stop.is_set():
                r = c.post("/v1/classify", json={"instances": rows, "k": 3})
                if r.status_code != 200:
                    failures.append(r.text)
                else:
                    answered.append(r.json()["model_version"])

        workers = [threading.Thread(target=loop) for _ in range(3)]
        for w in workers:
            w.start()
        seen = {read_artifact(model_dir).version}
        for step in range(1, 4):
            republish_scaled(model_dir, 1.0 + step / 10)
            r = c.post("/v1/admin/reload")
            assert r.status_code == 200 and r.json()["status"] == "reloaded"
            version = r.json()["model_version"]
            seen.add(version)
            wait_for(lambda v=version: v in answered, timeout=10, what=f"{version} answered")
        good = c.get("/v1/model").json()["model_version"]
        (model_dir / "projection.npy").write_bytes(b"corrupt")
        assert c.post("/v1/admin/reload").status_code == 409
        so_far = len(answered)  # the loops go on after the failed reload
        wait_for(lambda: len(answered) >= so_far + 6, timeout=10, what="requests answered")
        stop.set()
        for w in workers:
            w.join(30)
        assert c.get("/v1/model").json()["model_version"] == good
    assert failures == []
    assert 3 <= len(set(answered)) and set(answered) <= seen


def test_poller_picks_up_a_new_artifact(model_dir):
    app = create_app(settings_for(model_dir, reload_poll_seconds=0.05))
    with TestClient(app) as c:
        before = c.get("/v1/model").json()["model_version"]
        republish_scaled(model_dir, 3.0)
        deadline = time.monotonic() + 10
        while c.get("/v1/model").json()["model_version"] == before:
            assert time.monotonic() < deadline, "poller did not reload"
            time.sleep(0.05)


@pytest.mark.parametrize("workers", [2])
def test_real_server_with_several_workers(model_artifact, workers):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_server(model_artifact[0], port, NCAKNN_WORKERS=workers)
    try:
        wait_ready(url, proc)
        for _ in range(4):
            assert (
                httpx.post(
                    f"{url}/v1/classify", json={"instances": [[0.0] * 64]}, timeout=10
                ).status_code
                == 200
            )
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) in (0, -signal.SIGTERM)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
