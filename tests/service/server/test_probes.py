"""The probe listener (service.server.probes): what it answers from the workers' heartbeats, a
real server's probe port through start, drain and a stalled worker, and (slow) probes on
fresh connections answered within 1 s while wrk drives 990 and 1,300 connections."""

from __future__ import annotations

import errno
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest

from service.server.probes import PROBES_DIR, ProbeServer, probe_answer, worker_states
from tests.service.servers import (
    free_port,
    start_server,
    stop_server,
    wait_for,
    wait_ready,
)

PROBE_BOUND_SECONDS = 1.0  # a probe on a fresh connection is answered within this


def beat(runtime_dir: Path, pid: int, state: str, age: float = 0.0) -> None:
    path = runtime_dir / PROBES_DIR / str(pid)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(state)
    moment = time.time() - age
    os.utime(path, (moment, moment))


@pytest.fixture
def dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


@pytest.mark.parametrize(
    "workers, healthz, readyz",
    [
        ([], 503, 503),  # starting: nobody has reported
        ([("ready", 0.1)], 200, 200),
        ([("unready", 0.1)], 200, 503),  # no model yet
        ([("draining", 0.1)], 200, 503),  # SIGTERM came
        ([("ready", 0.1), ("ready", 30.0)], 503, 503),  # one worker's loop has stopped
        ([("ready", 0.1), ("unready", 0.1)], 200, 503),
        ([("garbage", 0.1)], 200, 503),  # an unknown state counts as unready
    ],
)
def test_probe_answers_follow_the_heartbeats(tmp_path, workers, healthz, readyz):
    # live processes: this one and its parent stand in for two workers
    for pid, (state, age) in zip((os.getpid(), os.getppid()), workers, strict=False):
        beat(tmp_path, pid, state, age)
    assert probe_answer("/healthz", tmp_path, stall_seconds=10)[0] == healthz
    assert probe_answer("/readyz", tmp_path, stall_seconds=10)[0] == readyz


def test_a_gone_workers_heartbeat_is_dropped(tmp_path, dead_pid):
    beat(tmp_path, os.getpid(), "ready")
    beat(tmp_path, dead_pid, "ready", age=60)
    assert set(worker_states(tmp_path)) == {os.getpid()}
    assert not (tmp_path / PROBES_DIR / str(dead_pid)).exists()
    assert probe_answer("/healthz", tmp_path, stall_seconds=10)[0] == 200


def raw_get(port: int, path: str, method: str = "GET") -> tuple[int, bytes, float]:
    started = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(f"{method} {path} HTTP/1.1\r\nhost: t\r\nconnection: close\r\n\r\n".encode())
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), body, time.perf_counter() - started


def test_the_probe_server_answers_only_its_two_routes_and_survives_bad_clients(tmp_path):
    beat(tmp_path, os.getpid(), "ready")
    server = ProbeServer("127.0.0.1", 0, tmp_path, stall_seconds=10).start()
    port = server.address[1]
    try:
        assert raw_get(port, "/healthz")[0] == 200
        assert raw_get(port, "/readyz?verbose=1")[0] == 200
        assert raw_get(port, "/readyz", "HEAD")[:2] == (200, b"")
        assert raw_get(port, "/v1/classify")[0] == 404
        assert raw_get(port, "/healthz", "POST")[0] == 404
        # clients that connect and send nothing, more than the listener holds: no probe waits
        silent = [socket.create_connection(("127.0.0.1", port)) for _ in range(100)]
        latencies = [raw_get(port, "/healthz")[2] for _ in range(5)]
        assert max(latencies) < 0.5, latencies
        for sock in silent:
            sock.close()
        with socket.create_connection(("127.0.0.1", port)) as flood:
            flood.sendall(b"GET /" + b"a" * 100_000)  # no end of headers: cut at 4 KiB
        assert raw_get(port, "/healthz")[0] == 200
    finally:
        server.close()


class FlakyListener:
    """A listening socket whose accept() fails once as if the process had run out of file
    descriptors."""

    def __init__(self, sock):
        self.sock, self.failed = sock, False

    def accept(self):
        if not self.failed:
            self.failed = True
            raise OSError(errno.EMFILE, "Too many open files")
        return self.sock.accept()

    def __getattr__(self, name):
        return getattr(self.sock, name)


def test_the_probe_server_outlives_running_out_of_file_descriptors(tmp_path):
    beat(tmp_path, os.getpid(), "ready")
    server = ProbeServer("127.0.0.1", 0, tmp_path, stall_seconds=10)
    server.sock = FlakyListener(server.sock)
    server.start()
    try:
        assert raw_get(server.address[1], "/healthz")[0] == 200
        assert server.sock.failed and server.thread.is_alive()
    finally:
        server.close()


def test_a_real_server_answers_probes_on_its_own_port_through_start_and_drain(
    model_artifact, tmp_path
):
    """No model yet: live and not ready. With a model: ready. After SIGTERM: not ready at
    once, still live, while the drain delay runs."""
    model = tmp_path / "model"
    port, probe_port = free_port(), free_port()
    proc = start_server(
        model,
        port,
        NCAKNN_PROBE_PORT=probe_port,
        NCAKNN_REQUIRE_MODEL_AT_STARTUP="false",
        NCAKNN_RELOAD_POLL_SECONDS=0.2,
        NCAKNN_DRAIN_DELAY_SECONDS=3,
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if raw_get(probe_port, "/healthz")[0] == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, "the probe port never answered"
            time.sleep(0.1)
        assert raw_get(probe_port, "/readyz")[0] == 503
        shutil.copytree(model_artifact[0], model)
        wait_ready(f"http://127.0.0.1:{port}", proc)
        wait_for(  # the worker's next heartbeat says it is ready
            lambda: raw_get(probe_port, "/readyz")[0] == 200, timeout=10, what="probe ready"
        )
        proc.send_signal(signal.SIGTERM)
        status, body, _ = wait_for(  # within the drain delay (3 s)
            lambda: (answer := raw_get(probe_port, "/readyz"))[0] == 503 and answer,
            timeout=2.5,
            what="not ready after SIGTERM",
        )
        assert status == 503 and b"draining" in body
        assert raw_get(probe_port, "/healthz")[0] == 200
    finally:
        stop_server(proc)


@pytest.mark.slow  # a long real-server or training scenario: make test-slow
def test_a_stalled_worker_fails_liveness_and_heals(model_artifact):
    """Two workers; one is stopped (SIGSTOP): /healthz on the probe port is 503 naming it
    within the stall bound, and 200 again once it runs (SIGCONT)."""
    port, probe_port = free_port(), free_port()
    stall = 1.5
    proc = start_server(
        model_artifact[0],
        port,
        NCAKNN_WORKERS=2,
        NCAKNN_PROBE_PORT=probe_port,
        NCAKNN_LIVENESS_STALL_SECONDS=stall,
    )
    try:
        wait_ready(f"http://127.0.0.1:{port}", proc)
        deadline = time.monotonic() + 20
        while True:
            status, body, _ = raw_get(probe_port, "/readyz")
            workers = httpx.Response(200, content=body).json()["workers"]
            if status == 200 and len(workers) == 2:
                break
            assert time.monotonic() < deadline, body
            time.sleep(0.2)
        stopped = int(sorted(workers)[0])
        os.kill(stopped, signal.SIGSTOP)
        try:
            status, body, _ = wait_for(
                lambda: (answer := raw_get(probe_port, "/healthz"))[0] == 503 and answer,
                timeout=stall + 2.0,
                what="the stalled worker named",
            )
            assert status == 503 and str(stopped).encode() in body
        finally:
            os.kill(stopped, signal.SIGCONT)
        wait_for(
            lambda: raw_get(probe_port, "/healthz")[0] == 200,
            timeout=10,
            what="healed after SIGCONT",
        )
    finally:
        stop_server(proc)


def probe_loop(port: int, path: str, stop: threading.Event, out: list) -> None:
    while not stop.is_set():
        started = time.perf_counter()
        try:
            status = raw_get(port, path)[0]
        except OSError as exc:
            status = type(exc).__name__
        out.append((status, time.perf_counter() - started))
        stop.wait(max(0.0, 0.5 - (time.perf_counter() - started)))


@pytest.mark.slow  # 2 x 30 s of wrk
@pytest.mark.skipif(shutil.which("wrk") is None, reason="wrk is not installed")
@pytest.mark.parametrize("connections", [990, 1300])
def test_probes_are_answered_within_a_second_under_a_flood(model_artifact, tmp_path, connections):
    """wrk drives /v1/classify with 990 and 1,300 connections (the cap is 1,000) for 30 s;
    /healthz and /readyz on the probe port, each on a fresh connection every 0.5 s, are all
    answered 200 within PROBE_BOUND_SECONDS. On the main port a fresh connection's /healthz
    is answered 200 below the cap (connections are accepted in batches); over the cap it
    gets the refusal (503 too_many_connections, or a reset when the flood keeps every
    lingering slot busy); both within ten times the bound (best effort: the flood shares
    the cores)."""
    port, probe_port = free_port(), free_port()
    proc = start_server(model_artifact[0], port, NCAKNN_PROBE_PORT=probe_port)
    script = tmp_path / "classify.lua"
    row = ",".join(["0.5"] * 64)
    script.write_text(
        'wrk.method = "POST"\nwrk.headers["Content-Type"] = "application/json"\n'
        f"wrk.body = '{{\"instances\": [[{row}]]}}'\n"
    )
    try:
        wait_ready(f"http://127.0.0.1:{port}", proc)
        wrk = subprocess.Popen(
            [
                "wrk",
                "-t2",
                f"-c{connections}",
                "-d30s",
                "-s",
                str(script),
                f"http://127.0.0.1:{port}/v1/classify",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        time.sleep(2)
        stop = threading.Event()
        results = {"probe /healthz": [], "probe /readyz": [], "main /healthz": []}
        threads = [
            threading.Thread(
                target=probe_loop, args=(probe_port, "/healthz", stop, results["probe /healthz"])
            ),
            threading.Thread(
                target=probe_loop, args=(probe_port, "/readyz", stop, results["probe /readyz"])
            ),
            threading.Thread(
                target=probe_loop, args=(port, "/healthz", stop, results["main /healthz"])
            ),
        ]
        for t in threads:
            t.start()
        output, _ = wrk.communicate(timeout=90)
        stop.set()
        for t in threads:
            t.join()
        statuses = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
    finally:
        stop_server(proc)
    print(f"wrk -c{connections}:\n{output}")
    for name, samples in results.items():
        worst = max(seconds for _, seconds in samples)
        codes = sorted({str(status) for status, _ in samples})
        print(f"{name}: {len(samples)} probes, worst {worst:.3f} s, statuses {codes}")
    print(
        "\n".join(
            line for line in statuses.splitlines() if line.startswith("ncaknn_requests_total")
        )
    )
    for name in ("probe /healthz", "probe /readyz"):
        samples = results[name]
        assert len(samples) >= 40
        assert {status for status, _ in samples} == {200}, samples
        assert max(seconds for _, seconds in samples) <= PROBE_BOUND_SECONDS
    # The main port shares its cores with the flood (wrk runs on the same 2 cores): its
    # answer is best effort, the probe port above is the bound. Below the cap every fresh
    # connection is answered (worst 0.5-0.7 s alone on this machine, 1.15 s in one
    # fresh-clone run); over it, a refusal took up to 1.75 s per 503. How many probes fit
    # in the 28 s depends on the machine's speed (one a second at worst 1.06 s on an AVX2
    # machine with a third of the usual GEMM rate: 34 probes there, 56 on a fast one), so
    # below the cap at least 10 must come back: on average one every 2.8 s
    main = results["main /healthz"]
    assert len(main) >= (10 if connections < 1000 else 1)
    assert max(seconds for _, seconds in main) <= 10 * PROBE_BOUND_SECONDS
    expected = {200} if connections < 1000 else {200, 503, "ConnectionResetError"}
    assert {status for status, _ in main} <= expected
    assert 'status="500"' not in statuses
