"""Servers for the serving benchmarks: ``python -m service`` or a uvicorn app in a
subprocess, pinned with ``taskset`` to SERVER_CORE (the load generator takes LOAD_CORE),
waited for until ``/readyz`` answers 200, stopped with SIGTERM (then SIGKILL)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
SERVER_CORE, LOAD_CORE = "1", "0"
QUIET = {"NCAKNN_LOG_LEVEL": "warning", "NCAKNN_DRAIN_DELAY_SECONDS": "0"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(proc: subprocess.Popen, port: int, path: str = "/readyz", timeout: float = 180):
    """Poll ``path`` until it answers 200; RuntimeError with the server's stderr when it
    exits or ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(f"http://127.0.0.1:{port}{path}", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"server did not start: {proc.stderr.read().decode()[-2000:]}")


def start_service(
    model: Path,
    *,
    root: Path = ROOT,
    cores: str | None = SERVER_CORE,
    workers: int = 1,
    env: dict[str, str] | None = None,
) -> tuple[subprocess.Popen, int]:
    """``python -m service`` of the tree at ``root`` on ``model``, pinned to ``cores`` (None:
    unpinned), with settings from ``env`` (NCAKNN_*) over quiet logs, no drain delay and no
    probe or gRPC port;
    (the process, its port) once ready (and, with several workers, 2 s later: every worker
    up)."""
    port = free_port()
    cmd = [sys.executable, "-m", "service", "--model", str(model), "--port", str(port)]
    cmd += ["--workers", str(workers)]
    if cores is not None:
        cmd = ["taskset", "-c", cores, *cmd]
    off = {"NCAKNN_PROBE_PORT": "0", "NCAKNN_GRPC_PORT": "0"}  # several servers at once
    full_env = {**os.environ, **QUIET, **off, **(env or {}), "PYTHONPATH": str(root)}
    proc = subprocess.Popen(
        cmd, cwd=root, env=full_env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    wait_ready(proc, port)
    if workers > 1:
        time.sleep(2)
    return proc, port


def start_uvicorn(
    app: str, model: Path, cores: str | None = SERVER_CORE, http: str = "httptools"
) -> tuple:
    port = free_port()
    env = {
        **os.environ,
        **QUIET,
        "NCAKNN_MODEL_PATH": str(model),
        "NCAKNN_MAX_BATCH_ROWS": "4096",
        "NCAKNN_GRPC_PORT": "0",  # several servers at once: the gRPC port is not shared
        "PYTHONPATH": str(ROOT),
    }
    cmd = [
        sys.executable,
        "-m",
        "uvicorn",
        app,
        "--factory",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--workers",
        "1",
        "--loop",
        "uvloop",
        "--http",
        http,
        "--no-access-log",
        "--log-level",
        "warning",
    ]
    if cores is not None:
        cmd = ["taskset", "-c", cores, *cmd]
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    wait_ready(proc, port)
    return proc, port


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
