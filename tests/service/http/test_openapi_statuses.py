"""Every status the OpenAPI document lists for a route is produced by a real request here."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re

import httpx
import numpy as np
import pytest
from fastapi.testclient import TestClient

from service.app import create_app
from tests.service.conftest import npy, settings_for

ROW = [[0.0] * 64]


def listed_statuses(app) -> list[tuple[str, str, int]]:
    spec = app.openapi()
    return sorted(
        (path, method, int(status))
        for path, ops in spec["paths"].items()
        for method, op in ops.items()
        for status in op["responses"]
        if status.isdigit()
    )


def v2_body(rows: list) -> dict:
    flat = [v for row in rows for v in row]
    return {
        "inputs": [{"name": "input", "datatype": "FP32", "shape": [len(rows), 64], "data": flat}]
    }


def body_for(path: str, rows=ROW) -> dict | None:
    if path.endswith("/infer"):
        return v2_body(rows)
    return {"instances": rows} if operation_of(path) else None


def operation_of(path: str) -> str | None:
    """classify, embed or neighbors for a /v1 inference route, named or not; else None."""
    operation = path.rsplit("/", 1)[1]
    named = path.startswith("/v1/models/{model_name}/")
    if operation in ("classify", "embed", "neighbors") and (named or path.count("/") == 2):
        return operation
    return None


def is_v2(path: str) -> bool:
    return path == "/v2" or path.startswith("/v2/")


def concrete(path: str, model_dir, name: str = "nca-knn") -> str:
    manifest = model_dir / "manifest.json"
    version = json.loads(manifest.read_text())["model_version"] if manifest.exists() else "none"
    return path.replace("{model_name}", name).replace("{model_version}", version)


def call(client, method, path, **kw):
    """The request, with the protocol's path parameters filled in: the served model's name
    and the loaded version (or an unknown name, to produce the 404)."""
    model_dir = client.app.state.ncaknn.settings.model_path
    path = concrete(path, model_dir, kw.pop("model_name", "nca-knn"))
    return client.request(method.upper(), path, **kw)


@pytest.fixture(scope="module")
def app_for(model_artifact, tmp_path_factory):
    """A running app per settings variant, shared by every recipe that only reads: the
    session's artifact (or, for ``absent=True``, a path with none), started once."""
    opened: dict[tuple, TestClient] = {}
    absent = tmp_path_factory.mktemp("absent") / "model"
    with contextlib.ExitStack() as stack:

        def client(absent_model: bool = False, **overrides) -> TestClient:
            key = (absent_model, *sorted(overrides.items()))
            if key not in opened:
                path = absent if absent_model else model_artifact[0]
                app = create_app(settings_for(path, **overrides))
                opened[key] = stack.enter_context(TestClient(app))
            return opened[key]

        yield client


def produce(status: int, method: str, path: str, model_dir, app_for) -> httpx.Response:
    """Make `path` answer `status` for real: on a shared app when the recipe only reads,
    on its own app and its own copy of the model when it damages the model (409) or needs
    the gate to itself (429)."""
    body = body_for(path)
    if status == 404:
        return call(app_for(), method, path, json=body, model_name="another-model")
    if status in (200,):
        return call(app_for(), method, path, json=body)
    if status == 400:
        return call(app_for(), method, path, json=body_for(path, []) or {"instances": []})
    if status == 401:
        client = app_for(api_key="k", metrics_require_api_key=True)
        return call(client, method, path, json=body)
    if status == 406:
        return call(app_for(), method, path, json=body, headers={"accept": "text/html"})
    if status == 409:
        with TestClient(create_app(settings_for(model_dir))) as c:
            (model_dir / "offset.npy").write_bytes(b"broken")
            return call(c, method, path)
    if status == 413:
        return call(app_for(max_batch_rows=1), method, path, json=body_for(path, ROW * 2))
    if status == 415:
        headers = {"content-type": "text/plain"}
        return call(app_for(), method, path, content=b"x", headers=headers)
    if status == 422:
        return call(app_for(), method, path, json={"instances": [[1.0]]})
    if status == 429:
        app = create_app(settings_for(model_dir, max_in_flight=1, batch_max_wait_us=20000))
        body = body_for(path, ROW * 200)  # large enough that embedding runs off the event loop
        path = concrete(path, model_dir)

        async def burst():
            transport = httpx.ASGITransport(app=app)
            async with app.router.lifespan_context(app):
                async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
                    rs = await asyncio.gather(
                        *(c.request(method.upper(), path, json=body) for _ in range(8))
                    )
            return next((r for r in rs if r.status_code == 429), rs[0])

        return asyncio.run(burst())
    if status == 503:
        client = app_for(absent_model=True, require_model_at_startup=False)
        return call(client, method, path, json=body)
    raise AssertionError(f"no recipe for status {status}")


# what each refusal's message must say (the cause, in the words of the recipe above)
STATUS_MESSAGE = {
    400: r"empty|no rows",
    401: r"API key",
    404: r"another-model",
    406: r"Accept",
    409: r"cannot load the artifact",
    413: r"limit is 1|max_batch_rows",
    415: r"Content-Type",
    422: r"features|shape|unknown field `instances`",
    429: r"the limit is 1",
    503: r"no model is loaded",
}


def check_answer(path: str, answer: dict, model_dir) -> None:
    """A 200 from an inference route answers the one row (all zeros) correctly: its
    embedding, or its nearest references and majority label, by brute force in numpy."""
    from service.core.artifact import read_artifact

    art = read_artifact(model_dir)
    z = np.asarray(art.offset, np.float64)  # the embedding of x = 0
    d2 = ((np.asarray(art.embeddings, np.float64) - z) ** 2).sum(axis=1)  # (N,)
    nearest = np.argsort(d2, kind="stable")[: art.default_k]
    if operation_of(path) == "embed":
        np.testing.assert_allclose(answer["embeddings"], [z], rtol=1e-5, atol=1e-6)
    elif operation_of(path) == "neighbors":
        assert [n["id"] for n in answer["neighbors"][0]] == art.ids[nearest].tolist()
    else:
        votes = np.bincount(art.labels[nearest], minlength=len(art.classes))
        (label,) = [p["label"] for p in answer["predictions"]]
        assert votes[art.classes.index(label)] == votes.max()


# The statuses the document lists do not depend on the model (only the limits inside the
# schemas do), so they are read once, from an app with none, to parametrise the test.
LISTED = [
    t
    for t in listed_statuses(
        create_app(settings_for("/nonexistent-model", require_model_at_startup=False))
    )
    if t[0] not in ("/docs", "/redoc", "/openapi.json")
]


def test_the_document_lists_every_error_status_the_service_has():
    assert {s for _, _, s in LISTED} >= {200, 400, 401, 406, 409, 413, 415, 422, 429, 503}


def test_a_loaded_model_does_not_change_the_listed_statuses(model_artifact):
    app = create_app(settings_for(model_artifact[0]))
    with TestClient(app):
        served = listed_statuses(app)
    assert [t for t in served if t[0] not in ("/docs", "/redoc", "/openapi.json")] == LISTED


@pytest.mark.parametrize(
    "path, method, status", LISTED, ids=[f"{m.upper()} {p} {s}" for p, m, s in LISTED]
)
def test_every_listed_status_is_produced(model_dir, app_for, path, method, status):
    response = produce(status, method, path, model_dir, app_for)
    assert response.status_code == status, (
        f"{method.upper()} {path}: {response.status_code} {response.text[:200]}"
    )
    if status >= 400:  # the one error body; the Open Inference Protocol's under /v2
        assert set(response.json()) == ({"error"} if is_v2(path) else {"error", "error_type"})
        message = response.json()["error"]
        assert re.search(STATUS_MESSAGE[status], message, re.IGNORECASE), (status, message)
    elif operation_of(path):
        check_answer(path, response.json(), app_for().app.state.ncaknn.settings.model_path)


@pytest.mark.parametrize("path", ["/v1/classify", "/v1/embed", "/v1/neighbors"])
def test_no_request_body_shape_yields_a_500(client, path):
    """A small fuzz over malformed bodies: always a 4xx with the error shape, never a 500."""
    rng = np.random.default_rng(0)
    bodies = [
        b"",
        b"null",
        b"[]",
        b"{}",
        b'{"instances": null}',
        b'{"instances": [null]}',
        b'{"instances": [[]]}',
        b'{"instances": [[1, 2], 3]}',
        b'{"instances": [[true, false]]}',
        b'{"instances": {"a": 1}}',
        b'{"instances": [[1e400]]}',
        b'{"instances": [' + b",".join([b"[" + b",".join([b"0"] * 64) + b"]"] * 3) + b'], "k": -1}',
        b'{"instances": [' + b",".join([b"0"] * 64) + b"]}",
        rng.bytes(100),
        '{"instances": [["\u00e9"]]}'.encode(),
    ]
    for raw in bodies:
        r = client.post(path, content=raw, headers={"content-type": "application/json"})
        assert 400 <= r.status_code < 500, (raw, r.status_code, r.text)
        assert set(r.json()) == {"error", "error_type"}
    for array in (np.zeros((2, 3, 4), np.float32), np.zeros((1, 64), np.complex64), np.array(5.0)):
        r = client.post(path, content=npy(array), headers={"content-type": "application/x-npy"})
        assert r.status_code == 422, (array.shape, r.text)


LISTED_GET = [t for t in LISTED if t[1] == "get"]


@pytest.mark.parametrize(
    "path, method, status", LISTED_GET, ids=[f"HEAD {p} {s}" for p, _, s in LISTED_GET]
)
def test_every_listed_get_status_is_produced_by_head_without_a_body(
    model_dir, app_for, path, method, status
):
    """HEAD is answered as GET (service.http.head): every status the document lists for a
    GET comes from the same recipe with HEAD, with the GET's headers and no body."""
    got = produce(status, "get", path, model_dir, app_for)
    head = produce(status, "head", path, model_dir, app_for)
    assert head.status_code == got.status_code == status, (path, head.status_code)
    assert head.content == b""
    assert head.headers["content-type"] == got.headers["content-type"]
    assert "content-length" in head.headers
