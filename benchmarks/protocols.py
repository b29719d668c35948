"""One engine, five wires: rows/s and requests/s of the same classification over /v1 JSON,
/v1 npy, Open Inference Protocol (V2) JSON, V2 binary tensors and gRPC, side by side.

Model: the HTTP benchmark's (``http_load.build_models``: D = 64, N = 60k references, d = 32,
exact Flat search). One server (``python -m service``, 1 worker, uvloop + httptools, gRPC
on) pinned to core 1; the load generator (this process, asyncio) pinned to core 0. Every
request asks for the same answer: label, class probabilities and nearest distance (V2
and gRPC name those outputs; /v1/classify gives them by default, with a null outlier flag:
this model has no outlier calibration).

Clients: HTTP through a minimal keep-alive HTTP/1.1 client on asyncio streams (the
request bytes are built once: the client costs a few microseconds a request), gRPC
through ``grpc.aio`` with the request serialised once (Python's gRPC client is the
costlier of the two: one-row gRPC figures are bounded by it, see the results' note).
Closed loop: ``--concurrency`` requests in flight for one-row requests, 4 for 1,024-row
ones; each (wire, size) cell runs ``--seconds``, cells interleaved, medians of
``--rounds``.

Usage: python benchmarks/protocols.py [--seconds 5] [--rounds 3]
Writes benchmarks/results/protocols.json.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness.models import build_models
from harness.report import machine, median, print_table, save_json
from harness.servers import free_port, start_service, stop

ROOT = Path(__file__).resolve().parents[1]
SERVER_CORE, LOAD_CORE = "1", 0
OUTPUTS = ["label", "probabilities", "nearest_distance"]  # the model has no calibration
WIRES = ("v1 json", "v1 npy", "v2 json", "v2 binary", "grpc")


def start_server(model: Path) -> tuple[subprocess.Popen, int, int]:
    """The service on SERVER_CORE with gRPC on, and room for every request in flight."""
    grpc_port = free_port()
    env = {"NCAKNN_GRPC_PORT": str(grpc_port), "NCAKNN_MAX_IN_FLIGHT": "4096"}
    proc, port = start_service(model, cores=SERVER_CORE, env=env)
    return proc, port, grpc_port


def npy_bytes(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()


def http_request(path: str, body: bytes, headers: dict[str, str]) -> bytes:
    head = f"POST {path} HTTP/1.1\r\nHost: bench\r\nContent-Length: {len(body)}\r\n"
    head += "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    return head.encode() + b"\r\n" + body


def requests_for(rows: np.ndarray) -> dict[str, bytes]:
    """The request bytes of each HTTP wire, and the gRPC request message, for ``rows``."""
    n, d = rows.shape
    v1 = json.dumps({"instances": rows.tolist()}).encode()
    v2_json = json.dumps(
        {
            "inputs": [
                {
                    "name": "input",
                    "shape": [n, d],
                    "datatype": "FP32",
                    "data": rows.ravel().tolist(),
                }
            ],
            "outputs": [{"name": o} for o in OUTPUTS],
        }
    ).encode()
    v2_head = json.dumps(
        {
            "inputs": [
                {
                    "name": "input",
                    "shape": [n, d],
                    "datatype": "FP32",
                    "parameters": {"binary_data_size": rows.nbytes},
                }
            ],
            "outputs": [{"name": o, "parameters": {"binary_data": True}} for o in OUTPUTS],
        }
    ).encode()
    infer = "/v2/models/nca-knn/infer"
    npy = {"Content-Type": "application/x-npy", "Accept": "application/x-npy"}
    from service.oip.protocol import message

    grpc_request = message("inference.ModelInferRequest")(model_name="nca-knn")
    grpc_request.inputs.add(name="input", datatype="FP32", shape=[n, d])
    grpc_request.raw_input_contents.append(rows.astype("<f4").tobytes())
    for name in OUTPUTS:
        grpc_request.outputs.add(name=name)
    return {
        "v1 json": http_request("/v1/classify", v1, {"Content-Type": "application/json"}),
        "v1 npy": http_request("/v1/classify", npy_bytes(rows), npy),
        "v2 json": http_request(infer, v2_json, {"Content-Type": "application/json"}),
        "v2 binary": http_request(
            infer,
            v2_head + rows.astype("<f4").tobytes(),
            {
                "Content-Type": "application/octet-stream",
                "Inference-Header-Content-Length": str(len(v2_head)),
            },
        ),
        "grpc": grpc_request.SerializeToString(),
    }


async def read_response(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    return status, await reader.readexactly(length)


async def http_loop(port: int, request: bytes, deadline: float, counts: list) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        while time.perf_counter() < deadline:
            writer.write(request)
            status, _ = await read_response(reader)
            if status != 200:
                raise RuntimeError(f"status {status}")
            counts[0] += 1
    finally:
        writer.close()


async def grpc_loop(call, request: bytes, deadline: float, counts: list) -> None:
    while time.perf_counter() < deadline:
        await call(request)
        counts[0] += 1


async def run_cell(wire, request, port, grpc_port, concurrency, seconds) -> float:
    """Requests per second of ``concurrency`` closed loops for ``seconds``."""
    counts = [0]
    if wire == "grpc":
        import grpc

        async with grpc.aio.insecure_channel(
            f"127.0.0.1:{grpc_port}", options=[("grpc.max_receive_message_length", -1)]
        ) as channel:
            call = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
            await call(request)  # warm up, and check it answers
            started = time.perf_counter()
            deadline = started + seconds
            await asyncio.gather(
                *(grpc_loop(call, request, deadline, counts) for _ in range(concurrency))
            )
    else:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(request)
        status, body = await read_response(reader)  # warm up, and check it answers
        writer.close()
        if status != 200:
            raise RuntimeError(f"{wire}: status {status}: {body[:300]!r}")
        started = time.perf_counter()
        deadline = started + seconds
        await asyncio.gather(
            *(http_loop(port, request, deadline, counts) for _ in range(concurrency))
        )
    return counts[0] / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=32)
    args = parser.parse_args()
    os.sched_setaffinity(0, {LOAD_CORE})
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    with tempfile.TemporaryDirectory() as tmp:
        model, _ = build_models(Path(tmp))
        X = np.random.default_rng(3).normal(size=(1024, 64)).astype(np.float32)
        sizes = {1: (X[:1], args.concurrency), 1024: (X, 4)}
        bodies = {n: requests_for(rows) for n, (rows, _) in sizes.items()}
        proc, port, grpc_port = start_server(model)
        runs: dict[tuple[str, int], list[float]] = {}
        try:
            for _ in range(args.rounds):
                for n, (_, concurrency) in sizes.items():
                    for wire in WIRES:
                        rate = asyncio.run(
                            run_cell(
                                wire, bodies[n][wire], port, grpc_port, concurrency, args.seconds
                            )
                        )
                        runs.setdefault((wire, n), []).append(rate)
        finally:
            stop(proc)
    results = []
    for n in sizes:
        npy_rate = median(runs[("v1 npy", n)])
        json_rate = median(runs[("v1 json", n)])
        for wire in WIRES:
            req = median(runs[(wire, n)])
            results.append(
                {
                    "wire": wire,
                    "rows_per_request": n,
                    "requests_per_second": round(req),
                    "rows_per_second": round(req * n),
                    "vs_v1_npy": round(req / npy_rate, 3),
                    "vs_v1_json": round(req / json_rate, 3),
                    "runs": runs[(wire, n)],
                }
            )
    print_table(
        results,
        [
            "wire",
            "rows_per_request",
            "requests_per_second",
            "rows_per_second",
            "vs_v1_npy",
            "vs_v1_json",
        ],
    )
    save_json(
        "protocols.json",
        {
            "machine": machine(),
            "settings": vars(args),
            "pinning": f"server on core {SERVER_CORE}, load generator on core {LOAD_CORE}",
            "results": results,
        },
    )


if __name__ == "__main__":
    main()
