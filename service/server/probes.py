"""The probe listener: ``GET /healthz`` and ``/readyz`` on a port of their own
(``probe_port``), answered by a thread of their own, so that Kubernetes' probes are answered
within milliseconds however loaded the main port is.

Why a port of its own: under a flood of connections uvicorn's event loop (uvloop) accepts one
new connection per turn of the loop, and a turn takes 60-200 ms while hundreds of
connections are busy; a probe opening a fresh connection on the main port can wait seconds
in the kernel's accept queue, and the kubelet would restart a healthy pod. This listener
has its own accept queue and its own thread; the event loop is not on its path.

What it answers is what the workers report: each worker's event loop writes a **heartbeat**
(:class:`Heartbeat`) every ``HEARTBEAT_SECONDS`` into ``<runtime_dir>/probes/<pid>``, holding
``ready``, ``unready`` (no model yet) or ``draining`` (SIGTERM came). The listener, in the
process ``python -m service`` started (the only process with one worker, the supervisor with
several), reads them:

* ``/healthz`` 200 while every worker's heartbeat is younger than ``liveness_stall_seconds``
  (a worker whose loop has stopped turning is hung); 503 otherwise, and before the first
  heartbeat (the app is starting).
* ``/readyz`` 200 while the workers are live and every one is ``ready``; 503 otherwise.

The listener reads at most ``MAX_REQUEST_BYTES`` of a request within ``READ_TIMEOUT_SECONDS``
and answers with ``Connection: close``. One thread multiplexes every connection, so a client
that opens connections and sends nothing delays no probe, and at most ``MAX_CONNECTIONS``
are held (beyond, the oldest is dropped). It is meant for the kubelet, on a port the Service
does not expose.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import selectors
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

from service.core.processes import process_alive

log = logging.getLogger("service.server.probes")

PROBES_DIR = "probes"
HEARTBEAT_SECONDS = 0.5
READ_TIMEOUT_SECONDS = 1.0
MAX_REQUEST_BYTES = 4096
MAX_CONNECTIONS = 64  # open probe connections; beyond, the oldest is dropped
STATES = ("ready", "unready", "draining")


class Heartbeat:
    """A worker's heartbeat: its state, rewritten every HEARTBEAT_SECONDS by its event loop
    (the file's modification time is the beat)."""

    def __init__(self, runtime_dir: Path, state: Callable[[], str]):
        self.directory = Path(runtime_dir) / PROBES_DIR
        self.directory.mkdir(parents=True, exist_ok=True)
        self.path = self.directory / str(os.getpid())
        self.state = state  # () -> one of STATES

    def beat(self) -> None:
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        tmp.write_text(self.state())
        os.replace(tmp, self.path)

    async def run(self) -> None:
        """Beat until cancelled, then remove the heartbeat."""
        try:
            while True:
                self.beat()
                await asyncio.sleep(HEARTBEAT_SECONDS)
        finally:
            self.path.unlink(missing_ok=True)


def worker_states(runtime_dir: Path, now: float | None = None) -> dict[int, tuple[str, float]]:
    """{pid: (state, seconds since its last beat)} of the workers whose process exists (the
    heartbeat of a worker that is gone is removed)."""
    now = time.time() if now is None else now
    states = {}
    directory = Path(runtime_dir) / PROBES_DIR
    for path in directory.glob("[0-9]*"):
        pid = int(path.name)
        if not process_alive(pid):
            path.unlink(missing_ok=True)
            continue
        try:
            state, beat = path.read_text().strip(), path.stat().st_mtime
        except FileNotFoundError:
            continue
        states[pid] = (state if state in STATES else "unready", now - beat)
    return states


def probe_answer(path: str, runtime_dir: Path, stall_seconds: float) -> tuple[int, dict]:
    """(status, body) of a probe: /healthz or /readyz (see the module docstring)."""
    states = worker_states(runtime_dir)
    stalled = sorted(pid for pid, (_, age) in states.items() if age > stall_seconds)
    live = bool(states) and not stalled
    workers = {
        str(pid): {"state": s, "last_beat_seconds": round(a, 3)} for pid, (s, a) in states.items()
    }
    if path == "/healthz":
        if live:
            return 200, {"status": "ok", "workers": workers}
        why = "starting: no worker has reported yet" if not states else f"workers {stalled} stalled"
        return 503, {"status": "unhealthy", "error": why, "workers": workers}
    ready = live and all(state == "ready" for state, _ in states.values())
    if ready:
        return 200, {"status": "ready", "workers": workers}
    return 503, {"status": "not ready", "workers": workers}


class ProbeServer:
    """The listener: bound at construction (a port in use fails the start), served by a
    daemon thread from :meth:`start`. One thread multiplexes every connection (a selector):
    a client that connects and sends nothing delays no probe; each connection gets
    READ_TIMEOUT_SECONDS for its request, and beyond MAX_CONNECTIONS open ones the oldest
    is dropped, so an attacker cannot hold the listener whatever it opens."""

    def __init__(self, host: str, port: int, runtime_dir: Path, stall_seconds: float):
        self.runtime_dir = Path(runtime_dir)
        self.stall_seconds = stall_seconds
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.sock.bind((host, port))
        except OSError as exc:
            self.sock.close()
            raise OSError(f"cannot bind the probe port {host}:{port} ({exc.strerror})") from None
        self.sock.listen(64)
        self.sock.setblocking(False)
        self.address = self.sock.getsockname()[:2]
        self.closed = threading.Event()
        self.selector = selectors.DefaultSelector()
        self.pending: dict[socket.socket, tuple[float, bytearray]] = {}  # conn -> (since, read)
        self.thread = threading.Thread(target=self.serve, name="probes", daemon=True)

    def start(self) -> ProbeServer:
        self.selector.register(self.sock, selectors.EVENT_READ)
        self.thread.start()
        log.info("probes serving", extra={"address": f"{self.address[0]}:{self.address[1]}"})
        return self

    def serve(self) -> None:
        """Accept, read and answer until closed; an error on one connection (or running out
        of file descriptors for a moment) never ends the thread."""
        while not self.closed.is_set():
            try:
                events = self.selector.select(timeout=0.25)
            except (OSError, ValueError):
                if self.closed.is_set():
                    return
                time.sleep(0.05)
                continue
            for key, _ in events:
                if key.fileobj is self.sock:
                    self.accept_pending()
                else:
                    self.read(key.fileobj)
            self.expire()

    def accept_pending(self) -> None:
        for _ in range(MAX_CONNECTIONS):
            try:
                conn, _ = self.sock.accept()
            except BlockingIOError:
                return
            except OSError:  # out of file descriptors, or aborted: try again next turn
                time.sleep(0.01)
                return
            conn.setblocking(False)
            if len(self.pending) >= MAX_CONNECTIONS:
                oldest = min(self.pending, key=lambda c: self.pending[c][0])
                self.drop(oldest)
            self.pending[conn] = (time.monotonic(), bytearray())
            self.selector.register(conn, selectors.EVENT_READ)

    def read(self, conn: socket.socket) -> None:
        request = self.pending[conn][1]
        try:
            chunk = conn.recv(MAX_REQUEST_BYTES)
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        if not chunk:
            self.drop(conn)
            return
        request += chunk
        if b"\r\n\r\n" in request or len(request) >= MAX_REQUEST_BYTES:
            try:
                conn.setblocking(True)
                conn.settimeout(READ_TIMEOUT_SECONDS)
                conn.sendall(self.answer(bytes(request)))
            except OSError:
                pass  # the client went away
            self.drop(conn)

    def expire(self) -> None:
        """Close connections whose request has not arrived within READ_TIMEOUT_SECONDS."""
        now = time.monotonic()
        for conn in [
            c for c, (since, _) in self.pending.items() if now - since > READ_TIMEOUT_SECONDS
        ]:
            self.drop(conn)

    def drop(self, conn: socket.socket) -> None:
        self.pending.pop(conn, None)
        try:
            self.selector.unregister(conn)
        except (KeyError, ValueError):
            pass
        conn.close()

    def answer(self, request: bytes) -> bytes:
        """The HTTP answer to one request: /healthz or /readyz, else 404."""
        method, _, rest = request.partition(b" ")
        path = rest.partition(b" ")[0].split(b"?")[0].decode("latin-1")
        if method not in (b"GET", b"HEAD") or path not in ("/healthz", "/readyz"):
            status, body = 404, {"error": "the probe port serves GET /healthz and /readyz"}
        else:
            status, body = probe_answer(path, self.runtime_dir, self.stall_seconds)
        payload = json.dumps(body).encode()
        reason = {200: "OK", 404: "Not Found", 503: "Service Unavailable"}[status]
        head = (
            f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(payload)}\r\nconnection: close\r\n\r\n"
        ).encode()
        return head if method == b"HEAD" else head + payload

    def close(self) -> None:
        self.closed.set()
        self.thread.join(timeout=2)
        for conn in list(self.pending):
            self.drop(conn)
        self.selector.close()
        self.sock.close()
