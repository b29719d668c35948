"""What a real server writes to its log: one JSON object per line, whoever writes it (uvicorn,
OpenTelemetry, the service), repeats rate-limited, no secret ever; and a stop that an
unreachable trace collector cannot hold up."""

from __future__ import annotations

import json
import logging
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from service.ops.logs import REPEAT_BURST, RepeatFilter
from tests.service.servers import (
    ROOT,
    connect,
    free_port,
    server_log,
    start_server,
    wait_for,
    wait_ready,
)

pytest.importorskip("opentelemetry.sdk.trace")


class BlackHole:
    """A trace collector that accepts connections and never answers."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.held: list[socket.socket] = []
        threading.Thread(target=self.run, daemon=True).start()

    def run(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.held.append(conn)

    def close(self) -> None:
        self.sock.close()
        for conn in self.held:
            conn.close()


@pytest.mark.slow  # a long real-server or training scenario: make test-slow
def test_every_line_is_json_and_a_dead_collector_cannot_hold_the_stop(model_artifact):
    """With tracing on and its collector accepting but never answering: 50 requests with a
    600-character traceparent and 3 aborted uploads, then SIGTERM. Every line the process
    wrote is a JSON object; OpenTelemetry's warning about the traceparent appears at most
    REPEAT_BURST + 1 times; the process exits within the graceful period (2 s) + the
    tracing bound (2 s) + 3 s."""
    collector = BlackHole()
    port = free_port()
    proc = start_server(
        model_artifact[0],
        port,
        NCAKNN_DRAIN_DELAY_SECONDS=0,
        NCAKNN_GRACEFUL_SHUTDOWN_SECONDS=2,
        OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{collector.port}",
        OTEL_TRACES_SAMPLER="always_on",
        OTEL_BSP_SCHEDULE_DELAY=100,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, proc)
        body = {"instances": [[0.5] * 64]}
        long_parent = "00-" + "a" * 600
        for _ in range(50):
            r = httpx.post(f"{url}/v1/classify", json=body, headers={"traceparent": long_parent})
            assert r.status_code == 200
        for _ in range(3):
            with connect(port) as sock:
                sock.sendall(
                    b"POST /v1/classify HTTP/1.1\r\nhost: t\r\ncontent-type: application/json"
                    b'\r\ncontent-length: 1000\r\n\r\n{"inst'
                )
        wait_for(  # the batch processor is exporting (and waits on the collector)
            lambda: collector.held, timeout=10, what="the exporter connected to the collector"
        )
        started = time.perf_counter()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(30)
        took = time.perf_counter() - started
    finally:
        if proc.poll() is None:
            proc.kill()
        collector.close()
    lines = server_log(proc).splitlines()
    records = [json.loads(line) for line in lines]  # fails on any line that is not JSON
    loggers = {r["logger"] for r in records}
    traceparent_warnings = [r for r in records if "traceparent" in r["message"].lower()]
    print(f"stop took {took:.2f} s; {len(lines)} lines from {sorted(loggers)}")
    assert code in (0, -signal.SIGTERM)
    assert took <= 2 + 2 + 3
    assert all(
        isinstance(r, dict) and {"time", "level", "logger", "message"} <= set(r) for r in records
    )
    assert {"uvicorn.error", "service.app"} <= loggers
    assert len(traceparent_warnings) <= REPEAT_BURST + 1
    aborts = [r for r in records if "closed the connection" in r["message"]]
    assert len(aborts) == 3
    traced = [r for r in records if r["logger"] == "service.requests" and r.get("status") == 200]
    assert len([r for r in traced if r["route"] == "POST /v1/classify"]) == 50  # never limited
    assert any("spans not exported" in r["message"] for r in records)  # the bound was needed


def test_the_repeat_filter_lets_a_burst_through_then_counts_what_it_dropped(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr("service.ops.logs.time.monotonic", lambda: clock[0])
    repeats = RepeatFilter()

    def record(message: str) -> logging.LogRecord:
        return logging.LogRecord("lib", logging.WARNING, "", 0, message, (), None)

    passed = [repeats.filter(record("the same")) for _ in range(20)]
    assert passed == [True] * REPEAT_BURST + [False] * (20 - REPEAT_BURST)
    assert repeats.filter(record("another")) is True
    clock[0] = 11.0
    later = record("the same")
    assert repeats.filter(later) is True and later.repeated == 20 - REPEAT_BURST


def test_an_invalid_api_key_is_refused_without_being_echoed():
    secret = "s3cr3t with a space"
    result = subprocess.run(
        [sys.executable, "-m", "service", "--port", "0"],
        cwd=ROOT,
        env={"PATH": "/usr/bin:/bin", "NCAKNN_API_KEY": secret, "NCAKNN_PROBE_PORT": "0"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "NCAKNN_API_KEY" in result.stderr and "whitespace" in result.stderr
    assert "s3cr3t" not in result.stderr + result.stdout
