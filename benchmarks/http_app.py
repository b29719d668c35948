"""Benchmark-only app: the real service plus POST /bench/noop, the ceiling of our own HTTP
path. The route is served by the same direct lane as /v1/classify and runs the same
``receive`` (key, media type, streamed body limit, strict parse to a float32 array,
query options), then answers a constant: classify minus the search, the decision and the
answer. It is not part of the public API.

    NCAKNN_MODEL_PATH=... python -m uvicorn benchmarks.http_app:create --factory ...
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from service.app import create_app_from_env
from service.http.decode import ClassifyBody, receive

OK = b'{"ok":true}'


async def noop(request: Request) -> Response:
    await receive(request, ClassifyBody, query=("k", "rule", "return_neighbors"))
    return Response(OK, media_type="application/json")


def create():
    app = create_app_from_env()
    app.direct_routes = {**app.direct_routes, "/bench/noop": noop}
    return app
