"""``python -m service`` / ``nca-serve``: run the service under uvicorn.

    python -m service --model models/digits --host 127.0.0.1 --port 8000
    python -m service --model-repository models/ --port 8000   (every model by name)

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
from service.ops.logs import configure_logging, log_config
from service.server.connections import check_open_files
from service.server.probes import ProbeServer
from service.server.workers import METRICS_DIR

OPTIONS = (  # command-line option -> the NCAKNN_* variable it sets
    ("model", "NCAKNN_MODEL_PATH"),
    ("model_repository", "NCAKNN_MODEL_REPOSITORY"),
    ("host", "NCAKNN_HOST"),
    ("port", "NCAKNN_PORT"),
    ("workers", "NCAKNN_WORKERS"),
    ("index", "NCAKNN_INDEX_TYPE"),
)


def main(argv: list[str] | None = None) -> int:
    """Read the options and settings, check what the server needs, then serve: the runtime
    directory the workers share, the probe listener, and uvicorn."""
    apply_options(argv)
    from pydantic import ValidationError

    from service.config import Settings

    try:
        settings = Settings()
    except ValidationError as exc:
        print(f"error: invalid settings: {settings_errors(exc)}", file=sys.stderr)
        return 2
    from service.ops.tracing import TracingUnavailable, check_available

    try:
        check_open_files(settings.max_connections, listeners=2 if settings.grpc_port else 1)
        check_available()
    except (ValueError, TracingUnavailable) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    configure_logging(settings.log_level, settings.log_json)
    runtime_dir = make_runtime_dir(settings)
    probes = None
    try:
        if settings.probe_port:
            try:
                probes = ProbeServer(
                    settings.host,
                    settings.probe_port,
                    runtime_dir or settings.runtime_dir,
                    settings.liveness_stall_seconds,
                ).start()
            except OSError as exc:
                print(f"error: {exc}; set NCAKNN_PROBE_PORT to a free port, or 0", file=sys.stderr)
                return 2
        _run(settings, importlib.util.find_spec)
    finally:
        if probes is not None:
            probes.close()
        if runtime_dir is not None:
            shutil.rmtree(runtime_dir, ignore_errors=True)
    return 0


def apply_options(argv: list[str] | None) -> None:
    """The command line's options, written into the NCAKNN_* environment (uvicorn's workers
    read their settings from it)."""
    parser = argparse.ArgumentParser(prog="python -m service", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="artifact directory (NCAKNN_MODEL_PATH)")
    parser.add_argument(
        "--model-repository",
        help="serve every model under this directory by name, DIR/NAME/ or DIR/NAME/VERSION/ "
        "(NCAKNN_MODEL_REPOSITORY; in place of --model)",
    )
    parser.add_argument("--host", help="interface to bind (NCAKNN_HOST)")
    parser.add_argument("--port", type=int, help="TCP port (NCAKNN_PORT)")
    parser.add_argument("--workers", type=int, help="worker processes (NCAKNN_WORKERS)")
    parser.add_argument("--index", choices=list(INDEX_KINDS), help="index type (NCAKNN_INDEX_TYPE)")
    args = parser.parse_args(argv)
    for option, variable in OPTIONS:
        value = getattr(args, option)
        if value is not None:
            os.environ[variable] = str(value)


def make_runtime_dir(settings) -> Path | None:
    """The directory the workers share, made here unless the settings name one (returned,
    to be removed at exit): the probes' heartbeats and, with several workers, the reload
    generation and Prometheus's multiprocess files."""
    if settings.runtime_dir is not None:
        return None
    runtime_dir = Path(tempfile.mkdtemp(prefix="ncaknn-runtime-"))
    os.environ["NCAKNN_RUNTIME_DIR"] = str(runtime_dir)
    if settings.workers > 1:
        (runtime_dir / METRICS_DIR).mkdir()
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(runtime_dir / METRICS_DIR)
    return runtime_dir


def settings_errors(exc) -> str:
    """A pydantic ValidationError as 'field: message' lines, without the values given:
    a secret (an API key) must never reach a log."""
    return "; ".join(
        f"NCAKNN_{'.'.join(map(str, error['loc'])).upper()}: {error['msg']}"
        for error in exc.errors(include_url=False, include_input=False, include_context=False)
    )


def _run(settings, has) -> None:
    import uvicorn

    uvicorn.run(
        "service.app:create_app_from_env",
        factory=True,
        host=settings.host,
        port=settings.port,
        workers=settings.workers,
        loop="uvloop" if has("uvloop") else "asyncio",
        http="service.server.connections:GuardedHttpProtocol",  # every phase of a connection bounded
        timeout_keep_alive=settings.keep_alive_timeout_seconds,
        timeout_graceful_shutdown=settings.graceful_shutdown_seconds,
        access_log=False,
        log_config=log_config(settings.log_level, settings.log_json),
        log_level=settings.log_level,
        lifespan="on",
    )


if __name__ == "__main__":
    sys.exit(main())
