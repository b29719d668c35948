"""Which files of ``service/`` one request passes through: a JSON ``POST /v1/classify`` (one
row, default k and rule) on an in-process app, every Python call recorded with
``sys.setprofile`` (and ``threading.setprofile`` for the search thread), after a warm-up
request. Prints the files in the order first entered, with the number of calls into each.

Usage: python benchmarks/request_path.py [--batching | --no-batching] [--model DIR]
(without --model, a small synthetic artifact is written to a temporary directory).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
from collections import Counter
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def synthetic_model(directory: Path) -> Path:
    try:
        from service.core.artifact import write_artifact
    except ImportError:  # the tree before the restructure
        from service.artifact import write_artifact

    rng = np.random.default_rng(0)
    X = rng.normal(size=(2000, 64)).astype(np.float32)
    y = rng.integers(0, 10, 2000)
    W = rng.normal(size=(16, 64)).astype(np.float32) / 8
    return write_artifact(
        directory / "model",
        projection=W,
        offset=np.zeros(16, np.float32),
        embeddings=X @ W.T,
        labels=y.astype(np.int32),
        classes=list(range(10)),
        mean=np.zeros(64),
        scale=np.ones(64),
        default_k=5,
    )


def request_path(model: Path, batching: bool) -> list[tuple[str, int]]:
    import asyncio

    import httpx

    from service.app import create_app
    from service.config import Settings

    settings = Settings(model_path=model, grpc_port=0, batching=batching, log_json=False)
    body = {"instances": [[0.5] * 64]}
    calls: Counter[str] = Counter()
    order: list[str] = []
    recording = threading.Event()
    service_root = str(ROOT / "service") + "/"

    def profile(frame, event, arg):
        if event != "call" or not recording.is_set():
            return
        filename = frame.f_code.co_filename
        if filename.startswith(service_root):
            name = filename[len(str(ROOT)) + 1 :]
            if name not in calls:
                order.append(name)
            calls[name] += 1

    async def run() -> None:
        app = create_app(settings)
        transport = httpx.ASGITransport(app=app)
        async with app.router.lifespan_context(app):
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
                assert (await client.post("/v1/classify", json=body)).status_code == 200
                recording.set()
                response = await client.post("/v1/classify", json=body)
                recording.clear()
                assert response.status_code == 200, response.text

    threading.setprofile(profile)  # the search thread, started by the batcher
    sys.setprofile(profile)
    try:
        asyncio.run(run())
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    return [(name, calls[name]) for name in order]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batching", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--model")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(args.model) if args.model else synthetic_model(Path(tmp))
        path = request_path(model, args.batching)
    print(f"POST /v1/classify (batching {'on' if args.batching else 'off'}): {len(path)} files")
    for name, count in path:
        print(f"  {count:4d} calls  {name}")


if __name__ == "__main__":
    main()
