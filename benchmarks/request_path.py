"""Which files of ``service/`` one request passes through: a JSON ``POST /v1/classify`` (one
row, default k and rule) on an in-process app, every Python call recorded with
``sys.setprofile`` (and ``threading.setprofile`` for the search thread), after a warm-up
request. Prints the files in the order first entered, with the number of calls into each,
and the way the event loop's thread goes through the service's three floors: the
application (``service/app.py``), the wire (``service/http``, ``service/wire/``, the body
budget) and the engine (``service/engine``, the kNN core, the search, the metrics it
reports to). The way is the floors in the order the thread is in them (a call into another
floor or a return to one) and its returns to a floor it had left: decode -> engine ->
encode is app, wire, engine, wire, app (two returns); every extra trip from the wire into
the engine's parts (the gate, the metrics, the outlier flags) adds two. The batcher's task
runs on the same thread and can interleave with the request; its stretches are kept.

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


FLOORS = (  # (path prefix, floor), first match wins
    ("service/app.py", "app"),
    ("service/http/", "wire"),
    ("service/oip/", "wire"),
    ("service/wire.py", "wire"),  # the tree before service/wire/ was a package
    ("service/wire/", "wire"),
    ("service/ops/bodies.py", "wire"),
    ("service/engine/", "engine"),
    ("service/core/", "engine"),
    ("service/search/", "engine"),
    ("service/ops/", "engine"),
)


def floor_of(name: str) -> str:
    return next((floor for prefix, floor in FLOORS if name.startswith(prefix)), name)


class Way:
    """The floors the event loop's thread is in, in order, and its returns to floors left."""

    def __init__(self) -> None:
        self.files: list[str] = []
        self.left: set[str] = set()
        self.returns = 0
        self.stretches: list[str] = []  # the files, for --files

    def enter_file(self, name: str) -> None:
        if not self.stretches or self.stretches[-1] != name:
            self.stretches.append(name)
        self.enter(floor_of(name))

    def enter(self, name: str) -> None:
        if self.files and self.files[-1] == name:
            return
        if name in self.left:
            self.returns += 1
        if self.files:
            self.left.add(self.files[-1])
        self.files.append(name)


def request_path(model: Path, batching: bool, way: Way | None = None) -> list[tuple[str, int]]:
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
    main_thread = threading.get_ident()

    def service_file(frame) -> str | None:
        filename = frame.f_code.co_filename if frame is not None else ""
        return filename[len(str(ROOT)) + 1 :] if filename.startswith(service_root) else None

    def profile(frame, event, arg):
        if not recording.is_set() or event not in ("call", "return"):
            return
        name = service_file(frame)
        if event == "call" and name is not None:
            if name not in calls:
                order.append(name)
            calls[name] += 1
        if way is None or threading.get_ident() != main_thread:
            return
        now_in = name if event == "call" else service_file(frame.f_back)
        if now_in is not None:
            way.enter_file(now_in)

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
    parser.add_argument("--files", action="store_true", help="print the way file by file")
    args = parser.parse_args()
    way = Way()
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(args.model) if args.model else synthetic_model(Path(tmp))
        path = request_path(model, args.batching, way)
    print(f"POST /v1/classify (batching {'on' if args.batching else 'off'}): {len(path)} files")
    for name, count in path:
        print(f"  {count:4d} calls  {name}")
    print(f"the event loop's way: {' -> '.join(way.files)}")
    print(f"  {way.returns} returns to a floor it had left")
    if args.files:
        print("file by file:", *way.stretches, sep="\n  ")


if __name__ == "__main__":
    main()
