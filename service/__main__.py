"""``python -m service`` / ``nca-serve``: run the service under uvicorn.

    python -m service --model models/digits --host 127.0.0.1 --port 8000

Options override the NCAKNN_* environment (they are passed to uvicorn's workers through it).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import sys
import tempfile
from pathlib import Path

from service.core.vocabulary import INDEX_KINDS
from service.ops.connections import check_open_files
from service.ops.workers import METRICS_DIR


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m service", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="artifact directory (NCAKNN_MODEL_PATH)")
    parser.add_argument("--host", help="interface to bind (NCAKNN_HOST)")
    parser.add_argument("--port", type=int, help="TCP port (NCAKNN_PORT)")
    parser.add_argument("--workers", type=int, help="worker processes (NCAKNN_WORKERS)")
    parser.add_argument("--index", choices=list(INDEX_KINDS), help="index type (NCAKNN_INDEX_TYPE)")
    args = parser.parse_args(argv)
    for option, variable in (
        ("model", "NCAKNN_MODEL_PATH"),
        ("host", "NCAKNN_HOST"),
        ("port", "NCAKNN_PORT"),
        ("workers", "NCAKNN_WORKERS"),
        ("index", "NCAKNN_INDEX_TYPE"),
    ):
        value = getattr(args, option)
        if value is not None:
            os.environ[variable] = str(value)

    from pydantic import ValidationError

    from service.config import Settings

    try:
        settings = Settings()
    except ValidationError as exc:
        print(f"error: invalid settings: {exc}", file=sys.stderr)
        return 2
    from service.ops.tracing import TracingUnavailable, check_available

    try:
        check_open_files(settings.max_connections, listeners=2 if settings.grpc_port else 1)
        check_available()
    except (ValueError, TracingUnavailable) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    has = importlib.util.find_spec
    runtime_dir = None
    if settings.workers > 1 and settings.runtime_dir is None:
        # shared by the workers: the reload generation and Prometheus's multiprocess files
        runtime_dir = Path(tempfile.mkdtemp(prefix="ncaknn-runtime-"))
        (runtime_dir / METRICS_DIR).mkdir()
        os.environ["NCAKNN_RUNTIME_DIR"] = str(runtime_dir)
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(runtime_dir / METRICS_DIR)
    try:
        _run(settings, has)
    finally:
        if runtime_dir is not None:
            shutil.rmtree(runtime_dir, ignore_errors=True)
    return 0


def _run(settings, has) -> None:
    import uvicorn

    uvicorn.run(
        "service.app:create_app_from_env",
        factory=True,
        host=settings.host,
        port=settings.port,
        workers=settings.workers,
        loop="uvloop" if has("uvloop") else "asyncio",
        http="service.ops.connections:GuardedHttpProtocol",  # header timeout and limits, a cap
        timeout_keep_alive=settings.keep_alive_timeout_seconds,
        timeout_graceful_shutdown=settings.graceful_shutdown_seconds,
        access_log=False,
        log_level=settings.log_level,
        lifespan="on",
    )


if __name__ == "__main__":
    sys.exit(main())
