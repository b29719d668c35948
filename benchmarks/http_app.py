"""Benchmark-only app: the real service plus POST /bench/noop, which parses the same body as
/v1/classify and answers a constant. It measures the ceiling of the HTTP stack on the same
server settings; it is not part of the public API.

    NCAKNN_MODEL_PATH=... python -m uvicorn benchmarks.http_app:create --factory ...
"""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import JSONResponse

from service.app import create_app_from_env
from service.payload import ClassifyBody, parse_json


def create():
    app = create_app_from_env()

    @app.post("/bench/noop", include_in_schema=False)
    async def noop(request: Request) -> JSONResponse:
        model = request.app.state.ncaknn.engine.current()
        parse_json(await request.body(), ClassifyBody, n_features=model.n_features, max_rows=4096)
        return JSONResponse({"ok": True})

    return app
