"""HTTP throughput and latency on loopback with wrk: our /v1/classify against a naive
FastAPI + FAISS app, side by side, and against parse-only routes.

Model: D = 64 inputs, N = 60k references projected to d = 32 (synthetic data, NCA map
learned on 5k of it), plus a 5k validation split; a second artifact carries the IVF index
``python -m service.search.tuning`` tunes on that split (label agreement >= 0.998).

Servers (1 uvicorn worker each, uvloop + httptools, pinned with ``taskset`` to core 1; wrk
pinned to core 0, 1 thread; one 64-dim instance per request):

* naive: ``benchmarks/naive_app.py`` (pydantic body, A x, FAISS Flat per request, majority
  vote); /v1/classify (``async def``) and /v1/classify-sync (``def``); /noop parses the body
  with the same pydantic model and answers a constant (a FastAPI endpoint's ceiling);
* ours (exact Flat): ``benchmarks/http_app.py`` = the service plus /bench/noop, which runs
  our whole request pipeline (key, media type, limits, strict parse) and answers a constant;
* ours (tuned IVF): the same service on the indexed artifact.

Each (server, route, concurrency) cell runs ``--seconds`` per round, rounds interleaved,
medians over ``--rounds``. Then large requests (1,024-row classify: JSON, npy body with a
JSON answer, npy in and out; rows/s, median of 5) and ``python -m service --workers 2``: pinned to core 1 (both workers share it)
and unpinned (both cores, shared with wrk).

Usage: python benchmarks/http_load.py [--seconds 10] [--rounds 3]   (needs `wrk`)
Writes benchmarks/results/http_load.json.
"""

from __future__ import annotations

import argparse
import io
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness.load import LUA, wrk
from harness.models import build_models
from harness.report import machine, median, print_table, save_json
from harness.servers import LOAD_CORE, SERVER_CORE, start_service, start_uvicorn, stop


def large_request_rates(port: int, rows: np.ndarray, repeats: int = 5) -> dict:
    """rows/s of 1,024-row /v1/classify requests: JSON in and out, npy in with a JSON
    answer, npy in and out (the answer a structured .npy array)."""
    import httpx

    url = f"http://127.0.0.1:{port}/v1/classify"
    buffer = io.BytesIO()
    np.save(buffer, rows.astype(np.float32))
    as_json = json.dumps({"instances": rows.tolist()}).encode()
    variants = {
        "json": (as_json, "application/json", "application/json"),
        "npy_body": (buffer.getvalue(), "application/x-npy", "application/json"),
        "npy": (buffer.getvalue(), "application/x-npy", "application/x-npy"),
    }
    out = {"rows_per_request": len(rows)}
    with httpx.Client(timeout=120) as client:
        for name, (body, media, accept) in variants.items():
            times = []
            for _ in range(repeats):
                t = time.perf_counter()
                r = client.post(
                    url, content=body, headers={"content-type": media, "accept": accept}
                )
                r.raise_for_status()
                if accept == "application/json":
                    answered = len(r.json()["predictions"])
                else:
                    answered = len(np.load(io.BytesIO(r.content), allow_pickle=False))
                times.append(time.perf_counter() - t)
                assert answered == len(rows)
            out[f"{name}_rows_per_second"] = len(rows) / median(times)
            out[f"{name}_request_bytes"] = len(body)
            out[f"{name}_answer_bytes"] = len(r.content)
    out["npy_over_json"] = out["npy_rows_per_second"] / out["json_rows_per_second"]
    return out


def cell_medians(runs: list[dict]) -> dict:
    keys = ("requests_per_second", "p50_ms", "p99_ms")
    out = {k: median([r[k] for r in runs]) for k in keys}
    out["errors"] = sum(r["errors"] for r in runs)
    out["p99_over_p50"] = out["p99_ms"] / out["p50_ms"]
    out["rounds"] = len(runs)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if shutil.which("wrk") is None or shutil.which("taskset") is None:
        sys.exit("wrk and taskset are needed: apt-get install wrk util-linux")
    work = Path(tempfile.mkdtemp(prefix="ncaknn-bench-"))
    plain, indexed = build_models(work)
    rng = np.random.default_rng(0)
    script = work / "post.lua"
    script.write_text(LUA % ",".join(f"{v:.4f}" for v in rng.normal(size=64)))

    servers = {
        "naive": start_uvicorn("benchmarks.naive_app:create", plain),
        "ours_flat": start_uvicorn("benchmarks.http_app:create", plain),
        "ours_ivf": start_uvicorn("benchmarks.http_app:create", indexed),
    }
    cells = [
        ("naive", "/v1/classify", "naive FastAPI+FAISS, async def"),
        ("naive", "/v1/classify-sync", "naive FastAPI+FAISS, def"),
        ("naive", "/noop", "FastAPI pydantic parse-only"),
        ("ours_flat", "/bench/noop", "our pipeline parse-only"),
        ("ours_flat", "/v1/classify", "ours, exact Flat"),
        ("ours_ivf", "/v1/classify", "ours, tuned IVF"),
    ]
    runs: dict[tuple, list[dict]] = {}
    large = {}
    try:
        for name in ("ours_flat", "ours_ivf"):
            large[name] = large_request_rates(servers[name][1], rng.normal(size=(1024, 64)))
            print(name, json.dumps(large[name]), flush=True)
        for round_ in range(args.rounds):
            for connections in (16, 64):
                for server, route, _ in cells:
                    url = f"http://127.0.0.1:{servers[server][1]}{route}"
                    result = wrk(url, script, connections, args.seconds)
                    runs.setdefault((server, route, connections), []).append(result)
                    print(round_, server, route, connections, json.dumps(result), flush=True)
    finally:
        for proc, _ in servers.values():
            stop(proc)

    rows = []
    for connections in (16, 64):
        for server, route, label in cells:
            rows.append(
                {
                    "connections": connections,
                    "server": label,
                    "route": route,
                    **cell_medians(runs[(server, route, connections)]),
                }
            )
    for connections in (16, 64):
        at = {r["server"]: r for r in rows if r["connections"] == connections}
        naive_best = max(
            at["naive FastAPI+FAISS, async def"]["requests_per_second"],
            at["naive FastAPI+FAISS, def"]["requests_per_second"],
        )
        for r in at.values():
            r["over_naive_best"] = r["requests_per_second"] / naive_best
            r["over_fastapi_noop"] = (
                r["requests_per_second"] / at["FastAPI pydantic parse-only"]["requests_per_second"]
            )
            r["over_our_noop"] = (
                r["requests_per_second"] / at["our pipeline parse-only"]["requests_per_second"]
            )

    workers = []
    for label, cores in (("2 workers, core 1", SERVER_CORE), ("2 workers, cores 0-1", None)):
        for count in (1, 2) if cores == SERVER_CORE else (2,):
            proc, port = start_service(plain, workers=count, cores=cores)
            try:
                for connections in (16, 64):
                    results = [
                        wrk(
                            f"http://127.0.0.1:{port}/v1/classify",
                            script,
                            connections,
                            args.seconds,
                        )
                        for _ in range(args.rounds)
                    ]
                    name = label if count == 2 else "1 worker, core 1"
                    workers.append(
                        {"setting": name, "connections": connections, **cell_medians(results)}
                    )
                    print(json.dumps(workers[-1]), flush=True)
            finally:
                stop(proc)

    columns = ["connections", "server", "requests_per_second", "p50_ms", "p99_ms", "p99_over_p50"]
    columns += ["errors", "over_naive_best", "over_fastapi_noop", "over_our_noop"]
    print_table(rows, columns)
    print_table(
        workers, ["setting", "connections", "requests_per_second", "p50_ms", "p99_ms", "errors"]
    )
    print(json.dumps(large, indent=1))
    out = save_json(
        "http_load.json",
        {
            "machine": machine(),
            "seconds": args.seconds,
            "rounds": args.rounds,
            "pinning": f"servers on core {SERVER_CORE}, wrk (1 thread) on core {LOAD_CORE}",
            "rows": rows,
            "workers": workers,
            "large_requests": large,
        },
    )
    print(f"wrote {out}")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
