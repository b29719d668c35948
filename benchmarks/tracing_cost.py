"""What request tracing costs: the service before tracing existed, with tracing off (the
default) and with tracing on, side by side.

Model: D = 64, N = 20k references at d = 16 (``connection_guard.build_model``). Three
servers, each one uvicorn worker (uvloop) pinned with ``taskset`` to core 1, wrk pinned to
core 0 (1 thread, 64 keep-alive connections), POST /v1/classify with one 64-dim instance:

* before: the tree at ``--before`` (a commit from before tracing; checked out into a
  temporary git worktree);
* off: this tree, no OTEL_* settings;
* on: this tree with OTEL_EXPORTER_OTLP_ENDPOINT pointing at a local OTLP/HTTP sink (this
  process answers every export with 200), the SDK's default batch processor: every request
  makes a server span and four children, which the server serialises and exports, and a
  log line;
* on, 1% sampled: the same with OTEL_TRACES_SAMPLER=parentbased_traceidratio and
  OTEL_TRACES_SAMPLER_ARG=0.01 (a caller's sampled traceparent is still followed).

Rounds are interleaved between the servers; medians over ``--rounds``.

Usage: python benchmarks/tracing_cost.py [--before 150fa87] [--seconds 5] [--rounds 3]
Writes benchmarks/results/tracing_cost.json. Needs wrk, and the tracing extra.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, median, print_table, save_json
from connection_guard import build_model
from http_load import LUA, SERVER_CORE, free_port, stop, wait_ready, wrk

ROOT = Path(__file__).resolve().parent.parent


class Sink(BaseHTTPRequestHandler):
    """An OTLP/HTTP receiver that keeps nothing: 200 and an empty export response."""

    exports = 0
    received_bytes = 0

    def do_POST(self):  # http.server's name for the POST handler
        length = int(self.headers.get("Content-Length", 0))
        Sink.received_bytes += len(self.rfile.read(length))
        Sink.exports += 1
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


def start(tree: Path, model: Path, **env) -> tuple[subprocess.Popen, int]:
    port = free_port()
    environment = {
        **{k: v for k, v in os.environ.items() if not k.startswith("OTEL_")},
        "NCAKNN_MODEL_PATH": str(model),
        "NCAKNN_LOG_LEVEL": "warning",
        "NCAKNN_DRAIN_DELAY_SECONDS": "0",
        "PYTHONPATH": str(tree),
        **env,
    }
    cmd = ["taskset", "-c", SERVER_CORE, sys.executable, "-m", "uvicorn"]
    cmd += ["service.app:create_app_from_env", "--factory", "--host", "127.0.0.1"]
    cmd += ["--port", str(port), "--workers", "1", "--loop", "uvloop", "--no-access-log"]
    cmd += ["--log-level", "warning"]
    proc = subprocess.Popen(cmd, cwd=tree, env=environment, stderr=subprocess.PIPE)
    wait_ready(proc, port)
    return proc, port


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", default="150fa87")
    parser.add_argument("--seconds", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    sink = ThreadingHTTPServer(("127.0.0.1", 0), Sink)
    threading.Thread(target=sink.serve_forever, daemon=True).start()
    endpoint = f"http://127.0.0.1:{sink.server_address[1]}"
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        before = tmp / "before"
        subprocess.run(
            ["git", "worktree", "add", "--detach", str(before), args.before],
            cwd=ROOT,
            check=True,
            capture_output=True,
        )
        model = build_model(tmp)
        script = tmp / "post.lua"
        script.write_text(LUA % ", ".join(["0.5"] * 64))
        servers = {}
        try:
            servers["before"] = start(before, model)
            servers["off"] = start(ROOT, model)
            servers["on"] = start(ROOT, model, OTEL_EXPORTER_OTLP_ENDPOINT=endpoint)
            servers["on, 1% sampled"] = start(
                ROOT,
                model,
                OTEL_EXPORTER_OTLP_ENDPOINT=endpoint,
                OTEL_TRACES_SAMPLER="parentbased_traceidratio",
                OTEL_TRACES_SAMPLER_ARG="0.01",
            )
            runs: dict[str, list[dict]] = {name: [] for name in servers}
            for _ in range(args.rounds):
                for name, (_, port) in servers.items():
                    url = f"http://127.0.0.1:{port}/v1/classify"
                    runs[name].append(wrk(url, script, 64, args.seconds))
        finally:
            for proc, _ in servers.values():
                stop(proc)
            subprocess.run(
                ["git", "worktree", "remove", "--force", str(before)], cwd=ROOT, check=False
            )
    sink.shutdown()
    base = median([r["requests_per_second"] for r in runs["before"]])
    rows = []
    for name, results in runs.items():
        rps = median([r["requests_per_second"] for r in results])
        rows.append(
            {
                "server": name,
                "requests_per_second": rps,
                "over_before": rps / base,
                "p50_ms": median([r["p50_ms"] for r in results]),
                "p99_ms": median([r["p99_ms"] for r in results]),
                "errors": sum(r["errors"] for r in results),
                "all_rps": [round(r["requests_per_second"]) for r in results],
            }
        )
    print_table(
        rows, ["server", "requests_per_second", "over_before", "p50_ms", "p99_ms", "errors"]
    )
    save_json(
        "tracing_cost.json",
        {
            "machine": machine(),
            "command": f"python benchmarks/tracing_cost.py --before {args.before} "
            f"--seconds {args.seconds} --rounds {args.rounds}",
            "otlp_exports_received": Sink.exports,
            "otlp_bytes_received": Sink.received_bytes,
            "rows": rows,
        },
    )


if __name__ == "__main__":
    main()
