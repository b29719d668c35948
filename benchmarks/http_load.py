"""HTTP throughput and latency on loopback with wrk: classify against a no-op endpoint.

Serves a model with D = 64 inputs and N = 60k references projected to d = 32 (synthetic data,
NCA map learned on 5k of it) from `benchmarks/http_app.py` (the service plus a no-op route
that parses the same body). For each server setting (workers; dynamic batching on or off),
wrk drives 20 s runs at concurrency 16 and 64 with one 64-dim instance per request against
POST /bench/noop and POST /v1/classify, side by side. Also measures batch embedding:
rows/s for 10k-row batches, JSON against npy.

Usage: python benchmarks/http_load.py [--seconds 20]   (needs `wrk`: apt-get install wrk)
Writes benchmarks/results/http_load.json.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, median, print_table, save_json, synthetic

ROOT = Path(__file__).resolve().parents[1]
LUA = """
wrk.method = "POST"
wrk.body = '{"instances": [[%s]]}'
wrk.headers["Content-Type"] = "application/json"
"""


def build_model(directory: Path) -> Path:
    from service.artifact import write_artifact
    from training import NCA

    X, y = synthetic(60000, n_features=64, seed=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        nca = NCA(n_components=32, max_iter=30, random_state=0).fit(X[:5000], y[:5000])
    return write_artifact(
        directory / "model",
        projection=nca.projection_,
        offset=nca.offset_,
        embeddings=nca.transform(X),
        labels=y.astype(np.int32),
        classes=list(range(10)),
        mean=nca.mean_,
        scale=nca.scale_,
        default_k=5,
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(model: Path, port: int, workers: int, batching: bool) -> subprocess.Popen:
    env = {
        **os.environ,
        "NCAKNN_MODEL_PATH": str(model),
        "NCAKNN_BATCHING": str(batching).lower(),
        "NCAKNN_LOG_LEVEL": "warning",
        "NCAKNN_MAX_BATCH_ROWS": "10000",
        "PYTHONPATH": str(ROOT),
    }
    cmd = [
        sys.executable,
        "-m",
        "uvicorn",
        "benchmarks.http_app:create",
        "--factory",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--workers",
        str(workers),
        "--loop",
        "uvloop",
        "--http",
        "httptools",
        "--no-access-log",
        "--log-level",
        "warning",
    ]
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    import httpx

    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"server did not start: {proc.stderr.read().decode()[-2000:]}")


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()


def parse_wrk(text: str) -> dict:
    def seconds(value: str, unit: str) -> float:
        return float(value) * {"us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0}[unit]

    out = {"requests_per_second": float(re.search(r"Requests/sec:\s+([\d.]+)", text).group(1))}
    for pct in ("50", "99"):
        m = re.search(rf"\s{pct}%\s+([\d.]+)(us|ms|s|m)\b", text)
        out[f"p{pct}_ms"] = seconds(*m.groups()) * 1e3 if m else None
    m = re.search(r"(\d+) requests in", text)
    out["requests"] = int(m.group(1)) if m else None
    errors = 0
    m = re.search(r"Non-2xx or 3xx responses: (\d+)", text)
    errors += int(m.group(1)) if m else 0
    m = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", text)
    errors += sum(map(int, m.groups())) if m else 0
    out["errors"] = errors
    return out


def wrk(url: str, script: Path, connections: int, seconds: int) -> dict:
    cmd = [
        "wrk",
        "-t",
        "1",
        "-c",
        str(connections),
        "-d",
        f"{seconds}s",
        "--latency",
        "-s",
        str(script),
        url,
    ]
    result = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return parse_wrk(result.stdout)


def embed_rates(port: int, rows: np.ndarray, repeats: int = 5) -> dict:
    import httpx

    url = f"http://127.0.0.1:{port}/v1/embed"
    buffer = io.BytesIO()
    np.save(buffer, rows.astype(np.float32))
    npy_body = buffer.getvalue()
    json_body = json.dumps({"instances": rows.tolist()}).encode()
    out = {}
    with httpx.Client(timeout=120) as client:
        for name, body, headers in (
            ("json", json_body, {"content-type": "application/json"}),
            ("npy", npy_body, {"content-type": "application/x-npy", "accept": "application/x-npy"}),
        ):
            times = []
            for _ in range(repeats):
                t = time.perf_counter()
                r = client.post(url, content=body, headers=headers)
                r.raise_for_status()
                if name == "json":
                    np.asarray(r.json()["embeddings"], np.float32)
                else:
                    np.load(io.BytesIO(r.content), allow_pickle=False)
                times.append(time.perf_counter() - t)
            out[f"{name}_rows_per_second"] = len(rows) / median(times)
            out[f"{name}_request_bytes"] = len(body)
    out["npy_over_json"] = out["npy_rows_per_second"] / out["json_rows_per_second"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=int, default=20)
    parser.add_argument("--workers", default="1,2")
    args = parser.parse_args()
    if shutil.which("wrk") is None:
        sys.exit("wrk not found: apt-get install wrk")
    work = Path(tempfile.mkdtemp(prefix="ncaknn-bench-"))
    model = build_model(work)
    rng = np.random.default_rng(0)
    row = ",".join(f"{v:.4f}" for v in rng.normal(size=64))
    script = work / "post.lua"
    script.write_text(LUA % row)
    rows = []
    embed = None
    for workers in map(int, args.workers.split(",")):
        for batching in (True, False):
            port = free_port()
            proc = start(model, port, workers, batching)
            try:
                if embed is None and workers == 1 and batching:
                    embed = embed_rates(port, rng.normal(size=(10000, 64)))
                    print(json.dumps(embed), flush=True)
                for connections in (16, 64):
                    for route in ("/bench/noop", "/v1/classify"):
                        if route == "/bench/noop" and not batching:
                            continue  # the no-op route does not search: batching does not apply
                        result = wrk(
                            f"http://127.0.0.1:{port}{route}", script, connections, args.seconds
                        )
                        rows.append(
                            {
                                "workers": workers,
                                "batching": batching,
                                "connections": connections,
                                "route": route,
                                **result,
                            }
                        )
                        print(json.dumps(rows[-1]), flush=True)
            finally:
                stop(proc)
    for r in rows:
        noop = next(
            (
                x
                for x in rows
                if x["route"] == "/bench/noop"
                and x["workers"] == r["workers"]
                and x["connections"] == r["connections"]
            ),
            None,
        )
        if noop and r["route"] == "/v1/classify":
            r["fraction_of_noop"] = r["requests_per_second"] / noop["requests_per_second"]
        if r["route"] == "/v1/classify" and r["batching"]:
            unbatched = next(
                (
                    x
                    for x in rows
                    if x["route"] == "/v1/classify"
                    and not x["batching"]
                    and x["workers"] == r["workers"]
                    and x["connections"] == r["connections"]
                ),
                None,
            )
            if unbatched:
                r["batched_over_unbatched"] = (
                    r["requests_per_second"] / unbatched["requests_per_second"]
                )
    print_table(
        rows,
        [
            "workers",
            "batching",
            "connections",
            "route",
            "requests_per_second",
            "p50_ms",
            "p99_ms",
            "errors",
            "fraction_of_noop",
            "batched_over_unbatched",
        ],
    )
    print(json.dumps(embed, indent=1))
    out = save_json(
        "http_load.json",
        {"machine": machine(), "seconds": args.seconds, "rows": rows, "embed": embed},
    )
    print(f"wrote {out}")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
