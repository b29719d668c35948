"""What the connection limits cost on the hot path: the service under uvicorn's plain
httptools protocol against the same service under ``service.server.connections.GuardedHttpProtocol``
(header timeout, header size and count, connection cap), side by side.

Model: D = 64, N = 20k references at d = 16 (synthetic, a PCA map; no training). Both servers
are one uvicorn worker (uvloop), pinned with ``taskset`` to core 1; wrk is pinned to core 0
(1 thread, keep-alive connections). Cells: GET /healthz and POST /v1/classify (one 64-dim
instance) at 64 connections, ``--seconds`` per round, rounds interleaved between the two
servers, medians over ``--rounds``. A guarded server is run with the shipped defaults
(max_connections 1000, header timeout 10 s, 32 KiB / 100 headers).

Usage: python benchmarks/connection_guard.py [--seconds 5] [--rounds 3]   (needs `wrk`)
Writes benchmarks/results/connection_guard.json.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, median, print_table, save_json, synthetic
from http_load import LUA, start_uvicorn, stop, wrk

GUARDED = "service.server.connections:GuardedHttpProtocol"
GET_LUA = 'wrk.method = "GET"\n'


def build_model(directory: Path) -> Path:
    from service.core.artifact import write_artifact

    X, y = synthetic(20000, n_features=64, seed=3)
    mean, scale = X.mean(axis=0), X.std(axis=0)
    _, _, vt = np.linalg.svd((X - mean) / scale, full_matrices=False)
    W = (vt[:16] / scale[None, :]).astype(np.float32)
    b = (-(mean / scale) @ vt[:16].T).astype(np.float32)
    return write_artifact(
        directory / "model",
        projection=W,
        offset=b,
        embeddings=(X @ W.T + b).astype(np.float32),
        labels=y.astype(np.int32),
        classes=list(range(10)),
        mean=mean,
        scale=scale,
        default_k=5,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model = build_model(tmp)
        row = ", ".join(["0.5"] * 64)
        scripts = {"/v1/classify": tmp / "post.lua", "/healthz": tmp / "get.lua"}
        scripts["/v1/classify"].write_text(LUA % row)
        scripts["/healthz"].write_text(GET_LUA)
        servers = {
            "plain httptools": start_uvicorn("service.app:create_app_from_env", model),
            "guarded": start_uvicorn("service.app:create_app_from_env", model, http=GUARDED),
        }
        runs: dict[tuple[str, str], list[dict]] = {}
        try:
            for _ in range(args.rounds):
                for route, script in scripts.items():
                    for name, (_, port) in servers.items():
                        url = f"http://127.0.0.1:{port}{route}"
                        runs.setdefault((name, route), []).append(
                            wrk(url, script, 64, args.seconds)
                        )
        finally:
            for proc, _ in servers.values():
                stop(proc)
    cells = []
    for route in scripts:
        plain = [r["requests_per_second"] for r in runs[("plain httptools", route)]]
        guarded = [r["requests_per_second"] for r in runs[("guarded", route)]]
        cells.append(
            {
                "route": route,
                "connections": 64,
                "plain_rps": plain,
                "guarded_rps": guarded,
                "guarded_over_plain": median(guarded) / median(plain),
                "plain_p99_ms": median([r["p99_ms"] for r in runs[("plain httptools", route)]]),
                "guarded_p99_ms": median([r["p99_ms"] for r in runs[("guarded", route)]]),
                "errors": sum(r["errors"] for key in runs if key[1] == route for r in runs[key]),
            }
        )
    columns = ["route", "plain_rps", "guarded_rps", "guarded_over_plain"]
    columns += ["plain_p99_ms", "guarded_p99_ms", "errors"]
    print_table(
        [
            {**c, "plain_rps": median(c["plain_rps"]), "guarded_rps": median(c["guarded_rps"])}
            for c in cells
        ],
        columns,
    )
    save_json(
        "connection_guard.json",
        {
            "machine": machine(),
            "command": "python benchmarks/connection_guard.py "
            f"--seconds {args.seconds} --rounds {args.rounds}",
            "cells": cells,
        },
    )


if __name__ == "__main__":
    main()
