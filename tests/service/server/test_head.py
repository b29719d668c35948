"""HEAD against a real ``python -m service``: on every GET route the app has (enumerated from
the app, /v1, /v2, the docs, the card, the probes and /metrics), HEAD answers as GET without
a body: the same status and headers, Content-Length the GET body's. A refusal too (401
without the key), a path without a GET route keeps its 405, and the probe port answers
HEAD as GET."""

from __future__ import annotations

import socket

import pytest

from service.app import create_app
from service.core.artifact import read_artifact
from tests.service.conftest import settings_for
from tests.service.servers import free_port, running_server, wait_for

KEY = "head-key"
VARYING = {"date", "x-request-id"}  # headers whose value may differ between two answers


def raw(port: int, method: str, path: str, key: str | None = KEY) -> tuple[int, dict, bytes]:
    """(status, headers, every byte after the headers until the server closes)."""
    auth = f"authorization: Bearer {key}\r\n" if key else ""
    request = f"{method} {path} HTTP/1.1\r\nhost: t\r\n{auth}connection: close\r\n\r\n"
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(request.encode())
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return int(lines[0].split()[1]), headers, body


def get_paths(model) -> list[str]:
    """Every path a GET route of the app serves: the GET operations of its OpenAPI document
    and the GET routes it keeps out of the document (docs, card), path parameters filled in
    with the served model's name and version."""
    settings = settings_for(model, api_key=KEY)
    app = create_app(settings)
    templates = {path for path, operations in app.openapi()["paths"].items() if "get" in operations}
    templates |= {r.path for r in app.routes if "GET" in (getattr(r, "methods", None) or ())}
    version = read_artifact(model).version
    paths = sorted(
        t.replace("{model_name}", settings.v2_model_name).replace("{model_version}", version)
        for t in templates
    )
    assert {"/", "/healthz", "/readyz", "/metrics", "/openapi.json", "/v1/model"} <= set(paths)
    assert all("{" not in path for path in paths), paths
    return paths


def test_head_answers_as_get_without_a_body_on_every_get_route(model_artifact):
    model = model_artifact[0]
    paths = get_paths(model)
    probe_port = free_port()
    with running_server(model, NCAKNN_API_KEY=KEY, NCAKNN_PROBE_PORT=probe_port) as run:
        port = run[0]
        for path in paths:
            status, headers, body = raw(port, "GET", path)
            head_status, head_headers, head_body = raw(port, "HEAD", path)
            again = raw(port, "GET", path)[2]
            assert head_status == status == 200, (path, status, head_status)
            assert head_body == b"", (path, head_body[:100])
            assert set(head_headers) == set(headers), (path, headers, head_headers)
            for name in set(headers) - VARYING - {"content-length"}:
                assert head_headers[name] == headers[name], (path, name)
            assert int(head_headers["content-length"]) > 0, path
            if body == again:  # the answer did not change around the HEAD: its length is due
                assert int(head_headers["content-length"]) == len(body), path
        # a refusal: the same status and headers, no body
        status, headers, body = raw(port, "GET", "/v1/model", key=None)
        head_status, head_headers, head_body = raw(port, "HEAD", "/v1/model", key=None)
        assert (head_status, head_body) == (status, b"") and status == 401
        assert head_headers["content-length"] == headers["content-length"] == str(len(body))
        # no GET route: HEAD is not allowed, and GET routes allow HEAD
        status, headers, body = raw(port, "HEAD", "/v1/classify")
        assert (status, body) == (405, b"") and headers["allow"] == "POST"
        status, headers, body = raw(port, "POST", "/healthz")
        assert status == 405 and headers["allow"] == "GET, HEAD" and b"GET, HEAD" in body
        assert raw(port, "HEAD", "/no-such-path")[::2] == (404, b"")
        # the probe port, once the worker's heartbeat says ready
        wait_for(
            lambda: raw(probe_port, "GET", "/readyz")[0] == 200,
            timeout=30,
            what="the probe port ready",
        )
        for path in ("/healthz", "/readyz"):  # their bodies hold the heartbeats' ages
            status, headers, body = raw(probe_port, "GET", path)
            head_status, head_headers, head_body = raw(probe_port, "HEAD", path)
            assert (head_status, head_body) == (status, b"") and status == 200
            assert set(head_headers) == set(headers) and int(head_headers["content-length"]) > 0
            for name in set(headers) - {"content-length"}:
                assert head_headers[name] == headers[name], (path, name)
    print(f"HEAD answered as GET on {len(paths)} GET routes: {', '.join(paths)}")


@pytest.mark.parametrize("path", ["/healthz", "/openapi.json"])
def test_head_in_process_has_no_body(model_artifact, path):
    """The same through the ASGI app alone (no server to drop a body): nothing is sent."""
    from fastapi.testclient import TestClient

    with TestClient(create_app(settings_for(model_artifact[0]))) as client:
        got, head = client.get(path), client.head(path)
    assert head.status_code == got.status_code == 200
    assert head.content == b"" and head.headers["content-length"] == str(len(got.content))
