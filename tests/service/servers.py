"""A real ``python -m service`` for the tests that need one: start it in a subprocess on a free
port, wait for it, stop it, and talk to it over raw sockets (responses, closes, metrics).

Servers started here turn the gRPC and probe listeners off unless a test asks for them
(``NCAKNN_GRPC_PORT``, ``NCAKNN_PROBE_PORT``), so several can run at once."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: Path, port: int, *, preexec_fn=None, **env) -> subprocess.Popen:
    """``python -m service`` on ``port`` with ``env`` added to the environment, its stdout
    and stderr in a temporary file (``server_log`` reads it): a pipe nobody reads would block
    the server once full. ``preexec_fn`` runs in the child before it starts (limits)."""
    environment = {
        **os.environ,
        "NCAKNN_LOG_JSON": "true",
        "NCAKNN_DRAIN_DELAY_SECONDS": "0.5",
        "NCAKNN_GRPC_PORT": "0",
        "NCAKNN_PROBE_PORT": "0",
        **{k: str(v) for k, v in env.items()},
    }
    log = tempfile.NamedTemporaryFile(prefix="ncaknn-server-", suffix=".log", delete=False)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "service",
            "--model",
            str(model),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ],
        cwd=ROOT,
        env=environment,
        stdout=log,
        stderr=subprocess.STDOUT,
        preexec_fn=preexec_fn,
    )
    log.close()
    proc.log_path = Path(log.name)  # type: ignore[attr-defined]
    return proc


def server_log(proc: subprocess.Popen) -> str:
    """What the server started by ``start_server`` has written so far."""
    return proc.log_path.read_text(errors="replace")  # type: ignore[attr-defined]


def wait_for(condition, *, timeout: float, what: str, every: float = 0.05, raises: bool = True):
    """Call ``condition()`` until it returns a true value, and return that value. When
    ``timeout`` seconds pass first: an AssertionError naming ``what`` and the last value, or
    with ``raises=False`` the last value (the test's own assertion then says what was
    measured). Tests wait for the state they assert, never for a fixed time: a slower
    machine takes longer, not another path."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value or time.monotonic() >= deadline:
            break
        time.sleep(every)
    if not value and raises:
        raise AssertionError(f"{what}: not within {timeout} s (last: {value!r})")
    return value


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"server exited early: {server_log(proc)}")
        try:
            if httpx.get(f"{url}/readyz", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise AssertionError("server did not become ready")


@contextlib.contextmanager
def running_server(model: Path, **env):
    """``python -m service`` on ``model`` with settings ``env`` (NCAKNN_*), on a free port:
    (port, url, process) once it answers, stopped (SIGTERM, then SIGKILL) on leaving."""
    port = free_port()
    proc = start_server(model, port, **env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, proc)
        yield port, url, proc
    finally:
        stop_server(proc)


def stop_server(proc) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except Exception:
            proc.kill()
            proc.wait()


def in_flight(url: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=5).text.splitlines():
        if line.startswith("ncaknn_in_flight_requests "):
            return float(line.split()[1])
    return 0.0


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def read_response(sock: socket.socket, timeout: float = 10) -> tuple[int, bytes, bytes]:
    """(status, head, body) of one response read to the end of its Content-Length."""
    sock.settimeout(timeout)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError(f"closed before a full response: {data[:200]!r}")
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    while len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return int(head.split()[1]), head, body


def closed_by_server(sock: socket.socket, timeout: float = 5) -> bool:
    sock.settimeout(timeout)
    try:
        while sock.recv(65536):
            pass
        return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def error_type(body: bytes) -> str:
    payload = json.loads(body)
    assert set(payload) == {"error", "error_type"}, payload
    return payload["error_type"]


def refused_count(url: str, reason: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=5).text.splitlines():
        if line.startswith(f'ncaknn_connections_refused_total{{reason="{reason}"}}'):
            return float(line.split()[-1])
    raise AssertionError(f"no refusal counter for {reason}")
