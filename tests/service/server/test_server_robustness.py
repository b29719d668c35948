"""A real server under hostile conditions: artifacts replaced continuously while requests
run (1 and 2 workers), SIGTERM with requests in flight and in the socket buffers, memory
and probe latency under maximum-size requests."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest

from service.config import Settings
from service.core.artifact import read_artifact, rewrite_artifact
from service.engine.infer import Query, infer_one
from service.engine.model import load_model
from tests.service.conftest import republish_scaled
from tests.service.servers import (
    free_port,
    rss_mib,
    server_log,
    start_server,
    stop_server,
    wait_for,
    wait_ready,
)

D = 64
CONVERGENCE_BOUND_SECONDS = 5.0  # poll/sync interval (0.1-1 s) + a load of the digits model


def expected_answers(versions: dict[str, Path], x: np.ndarray) -> dict[str, list]:
    """version -> the labels and probabilities a whole artifact gives for x."""
    out = {}
    for version, path in versions.items():
        model = load_model(path, Settings(model_path=path))
        answer = infer_one(model, x, Query(5, "majority"))
        out[version] = [
            (model.classes[label], [float(p) for p in row])
            for label, row in zip(answer.predicted, answer.probabilities, strict=True)
        ]
    return out


def publish_copy(source: Path, target: Path) -> None:
    """Write the artifact at ``source`` again at ``target`` (an atomic directory exchange)."""
    art = read_artifact(source)
    rewrite_artifact(art, target, index_bytes=art.index_bytes, metadata={})


def answer_of(body: dict) -> list:
    return [(p["label"], list(p["probabilities"].values())) for p in body["predictions"]]


# both ways of replacing and both worker counts by default; the other two pairings are slow
@pytest.mark.slow  # a long real-server or training scenario: make test-slow
@pytest.mark.parametrize(
    "replace, workers",
    [
        ("symlink", 1),
        ("exchange", 2),
        pytest.param("symlink", 2, marks=pytest.mark.slow),
        pytest.param("exchange", 1, marks=pytest.mark.slow),
    ],
)
def test_artifacts_replaced_continuously_under_load(model_artifact, tmp_path, workers, replace):
    """Every answer equals one whole artifact's answer, no request fails, and every worker
    is on the final version within CONVERGENCE_BOUND_SECONDS."""
    _, _, split = model_artifact
    x = np.ascontiguousarray(split.X_test[:8], dtype=np.float32)
    v1, v2 = tmp_path / "v1", tmp_path / "v2"
    shutil.copytree(model_artifact[0], v1)
    shutil.copytree(model_artifact[0], v2)
    republish_scaled(v2, 1.7)
    publish_copy(v1, v1)  # both written by the same writer: the same manifest keys
    versions = {read_artifact(v1).version: v1, read_artifact(v2).version: v2}
    expected = expected_answers(versions, x)
    if replace == "symlink":
        served = tmp_path / "current"
        served.symlink_to(v1)
    else:
        served = tmp_path / "served"
        shutil.copytree(v1, served)

    def publish(i: int) -> None:
        source = (v1, v2)[i % 2]
        if replace == "symlink":
            tmp = tmp_path / f".link-{i}"
            tmp.symlink_to(source)
            os.replace(tmp, served)
        else:  # write_artifact exchanges the directory in one renameat2
            publish_copy(source, served)

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_server(
        served,
        port,
        NCAKNN_WORKERS=workers,
        NCAKNN_RELOAD_POLL_SECONDS=0.1,
        NCAKNN_WORKER_SYNC_SECONDS=0.2,
    )
    failures: list[str] = []
    sent = [0]
    seen: set[str] = set()
    stop = threading.Event()
    try:
        wait_ready(url, proc)

        def client_loop():
            with httpx.Client(timeout=30) as client:
                while not stop.is_set():
                    sent[0] += 1
                    try:
                        r = client.post(
                            f"{url}/v1/classify", json={"instances": x.tolist(), "k": 5}
                        )
                    except httpx.HTTPError as exc:
                        failures.append(repr(exc))
                        continue
                    if r.status_code != 200:
                        failures.append(f"{r.status_code} {r.text}")
                        continue
                    body = r.json()
                    version = body["model_version"]
                    seen.add(version)
                    if version not in expected or answer_of(body) != expected[version]:
                        failures.append(f"answer of {version} matches no whole artifact")

        threads = [threading.Thread(target=client_loop) for _ in range(3)]
        for t in threads:
            t.start()
        for i in range(1, 13):
            publish(i)
            time.sleep(0.25)
        final = read_artifact(served).version
        if workers > 1:  # and the reload route reaches every worker
            r = httpx.post(f"{url}/v1/admin/reload", timeout=30)
            assert r.status_code == 200 and r.json()["workers"] == workers
        deadline = time.monotonic() + CONVERGENCE_BOUND_SECONDS
        while True:  # many probes: every worker answers some of them
            answers = {
                httpx.get(f"{url}/readyz", timeout=5).json()["model_version"] for _ in range(20)
            }
            if answers == {final}:
                break
            assert time.monotonic() < deadline, f"workers still on {answers}, expected {final}"
            time.sleep(0.1)
        stop.set()
        for t in threads:
            t.join(30)
    finally:
        stop.set()
        exited = proc.poll()  # not None: the server stopped by itself during the test
        stop_server(proc)
        # shown by pytest when the test fails: how the server ended and its last log lines
        print(f"server exit code before the test stopped it: {exited}; its log ends with:")
        print(server_log(proc)[-6000:])
    print(f"reload race ({replace}, {workers} workers): {sent[0]} requests, {len(failures)} failed")
    assert failures == []
    assert sent[0] > 20 and len(seen) == 2


def _classify_total_and_pids(url: str) -> tuple[float, set[str]]:
    """From /metrics: classify requests answered 200, summed over workers, and the pids of
    the workers that report a loaded model."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    total = sum(
        float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith('ncaknn_requests_total{route="/v1/classify",status="200"}')
    )
    pids = {
        line.split('pid="')[1].split('"')[0]
        for line in text.splitlines()
        if line.startswith("ncaknn_model_info{")
    }
    return total, pids


@pytest.mark.slow  # a long real-server or training scenario: make test-slow
def test_two_workers_report_whole_metrics(model_artifact):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_server(model_artifact[0], port, NCAKNN_WORKERS=2)
    body = {"instances": [[0.0] * D]}
    try:
        wait_ready(url, proc)
        with httpx.Client(timeout=10, headers={"connection": "close"}) as client:
            # the first worker can be ready while the second still loads: wait (bounded) until
            # both report their model, so the count below is over two workers
            deadline = time.monotonic() + 60
            while len(_classify_total_and_pids(url)[1]) < 2 and time.monotonic() < deadline:
                assert client.post(f"{url}/v1/classify", json=body).status_code == 200
                time.sleep(0.05)
            before, pids = _classify_total_and_pids(url)
            for _ in range(40):  # new connections: spread over both workers
                assert client.post(f"{url}/v1/classify", json=body).status_code == 200
        after, _ = _classify_total_and_pids(url)
    finally:
        stop_server(proc)
    assert after - before == 40
    assert len(pids) == 2


def raw_request(port: int, body: bytes) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=60)
    head = (
        f"POST /v1/classify HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    sock.sendall(head + body)
    return sock


def read_status(sock: socket.socket) -> int:
    data = b""
    while b"\r\n" not in data:
        chunk = sock.recv(4096)
        if not chunk:
            return -1
        data += chunk
    sock.close()
    return int(data.split(b" ")[1])


def test_sigterm_readiness_first_then_nothing_lost(model_artifact):
    """SIGTERM while requests are being computed and others sit unread in socket buffers:
    /readyz is 503 at once, every request sent gets its 200, connections opened during the
    drain delay are served, and the process exits."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_server(
        model_artifact[0],
        port,
        NCAKNN_DRAIN_DELAY_SECONDS=1.5,
        NCAKNN_BATCH_MAX_WAIT_US=300_000,  # keeps requests in flight when SIGTERM arrives
    )
    try:
        wait_ready(url, proc)
        body = b'{"instances": [[' + b", ".join([b"0.5"] * D) + b"]]}"
        sockets = [raw_request(port, body) for _ in range(60)]  # in flight and unread
        proc.send_signal(signal.SIGTERM)
        ready = httpx.get(f"{url}/readyz", timeout=5)
        late = [raw_request(port, body) for _ in range(5)]  # during the drain delay
        statuses = [read_status(s) for s in sockets + late]
        code = proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    print(f"SIGTERM: {len(statuses)} requests, {sum(s != 200 for s in statuses)} lost")
    assert ready.status_code == 503 and ready.json()["error_type"] == "not_ready"
    assert ready.headers["connection"] == "close"
    assert statuses == [200] * 65
    assert code in (0, -signal.SIGTERM)


@pytest.mark.slow  # 12 s: a real server taking several 100 MB requests
def test_memory_comes_back_and_probes_stay_fast(model_artifact):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_server(model_artifact[0], port)
    rng = np.random.default_rng(0)
    rows = rng.uniform(0, 16, size=(4096, D)).round(6).tolist()  # the maximum row count
    # the bodies are encoded once, so the test's own JSON work (which holds this process's
    # GIL) does not slow its probes
    search_body = json.dumps({"instances": rows, "k": 64}).encode()
    embed_body = json.dumps({"instances": rows}).encode()
    headers = {"content-type": "application/json"}
    try:
        wait_ready(url, proc)
        with (
            httpx.Client(timeout=60) as client,
            httpx.Client(timeout=5) as prober,
            ThreadPoolExecutor(1) as pool,
        ):
            client.post(f"{url}/v1/neighbors", content=search_body, headers=headers)  # warm-up
            before = rss_mib(proc.pid)
            probe_latencies: list[float] = []
            request_seconds: list[float] = []
            for i in range(20):
                route = ("/v1/neighbors", "/v1/classify", "/v1/embed")[i % 3]
                body = search_body if route != "/v1/embed" else embed_body
                # the request runs in a pool thread: its failure is raised here by
                # result(), not lost inside the thread (which would leave the loop waiting)
                sent = time.perf_counter()
                pending = pool.submit(client.post, f"{url}{route}", content=body, headers=headers)
                time.sleep(0.02)
                while not pending.done():
                    started = time.perf_counter()
                    assert prober.get(f"{url}/healthz").status_code == 200
                    probe_latencies.append(time.perf_counter() - started)
                    time.sleep(0.01)
                response = pending.result(timeout=60)
                request_seconds.append(time.perf_counter() - sent)
                assert response.status_code == 200, response.text
            client.post(f"{url}/v1/classify", json={"instances": rows[:1]})
            # the trim runs at most once a second, after the last large request
            wait_for(lambda: rss_mib(proc.pid) - before < 64, timeout=10, what="", raises=False)
            after = rss_mib(proc.pid)
    finally:
        stop_server(proc)
    p90 = statistics.quantiles(probe_latencies, n=10)[-1] if len(probe_latencies) > 1 else 0
    print(
        f"memory: RSS {before:.0f} MiB -> {after:.0f} MiB after 20 maximum-size requests "
        f"(median {statistics.median(request_seconds) * 1e3:.0f} ms each); "
        f"{len(probe_latencies)} probes during them, median "
        f"{statistics.median(probe_latencies) * 1e3:.1f} ms, p90 {p90 * 1e3:.1f} ms, max "
        f"{max(probe_latencies) * 1e3:.1f} ms"
    )
    assert after - before < 64, (before, after)
    # the requests are parsed, searched and encoded off the event loop, so a typical probe
    # waits for a core, not for a request: its median is a small part of a request's time.
    # The bound is relative, so a slow or loaded machine scales both sides (an absolute
    # 100 ms bound failed in a CI run at 109 ms)
    assert statistics.median(probe_latencies) < statistics.median(request_seconds) / 4
