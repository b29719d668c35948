"""A model repository of many small models: the memory each one costs the server, how long
a load takes, and the latency of the first request after a load against the requests
after it.

Models: ``--models`` artifacts of N references x D features mapped to d dimensions (random
Gaussian data and maps, 10 classes; written by this tree's writer). The server is
``python -m service --model-repository DIR`` pinned to core 1 (requests come from this
process on core 0, one at a time):

* memory per model: the server's RSS with the whole repository loaded, less its RSS with
  one model, over (models - 1); beside it the models' own bytes as the server counts them
  (``ncaknn_repository_model_memory_bytes``: arrays and FAISS index);
* for each model: unload, load (the call's seconds), then the first ``POST
  /v1/models/NAME/classify`` of one row and the median of the ``--after`` requests after it.

Usage: taskset -c 0 python benchmarks/model_repository.py [--models 20] [--n 5000] [--dim 256]
    [--d 32] [--after 20] [--name model_repository]
Writes benchmarks/results/NAME.json.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from harness.report import machine, median, print_table, save_json
from harness.servers import start_service

from service.core.artifact import write_artifact

ADMIN = {"Authorization": "Bearer admin"}


def write_models(root: Path, count: int, n: int, dim: int, d: int) -> None:
    rng = np.random.default_rng(0)
    for i in range(count):
        x = rng.normal(size=(n, dim)).astype(np.float32)  # (N, D)
        w = (rng.normal(size=(d, dim)) / np.sqrt(dim)).astype(np.float32)  # (d, D)
        write_artifact(
            root / f"model-{i:02d}",
            projection=w,
            offset=np.zeros(d, np.float32),
            embeddings=x @ w.T,
            labels=rng.integers(0, 10, n).astype(np.int32),
            classes=list(range(10)),
            mean=np.zeros(dim),
            scale=np.ones(dim),
            default_k=5,
        )


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def serve(root: Path):
    env = {"NCAKNN_MODEL_REPOSITORY": str(root), "NCAKNN_ADMIN_API_KEY": "admin"}
    return start_service(root, env=env)


def model_memory(url: str) -> dict[str, float]:
    """The server's own count of each model's bytes (its metrics)."""
    sizes = {}
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith("ncaknn_repository_model_memory_bytes{"):
            name = line.split('model="', 1)[1].split('"', 1)[0]
            sizes[name] = float(line.rsplit(" ", 1)[1])
    return sizes


def timed_post(client: httpx.Client, path: str, **kwargs) -> float:
    started = time.perf_counter()
    answer = client.post(path, **kwargs)
    seconds = time.perf_counter() - started
    answer.raise_for_status()
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", type=int, default=20)
    parser.add_argument("--n", type=int, default=5000, help="references per model")
    parser.add_argument("--dim", type=int, default=256, help="input features D")
    parser.add_argument("--d", type=int, default=32, help="dimensions of the map")
    parser.add_argument("--after", type=int, default=20, help="requests timed after the first")
    parser.add_argument("--name", default="model_repository")
    args = parser.parse_args()
    row = {"instances": [[0.1] * args.dim]}
    with tempfile.TemporaryDirectory() as tmp:
        one, many = Path(tmp) / "one", Path(tmp) / "many"
        write_models(many, args.models, args.n, args.dim, args.d)
        write_models(one, 1, args.n, args.dim, args.d)
        proc, port = serve(one)
        rss_one = rss_mib(proc.pid)
        proc.terminate()
        proc.wait()
        proc, port = serve(many)
        url = f"http://127.0.0.1:{port}"
        try:
            rss_all = rss_mib(proc.pid)
            counted = model_memory(url)
            per_model = []
            with httpx.Client(base_url=url, timeout=60) as client:
                for i in range(args.models):
                    name = f"model-{i:02d}"
                    timed_post(client, f"/v2/repository/models/{name}/unload", headers=ADMIN)
                    load = timed_post(client, f"/v2/repository/models/{name}/load", headers=ADMIN)
                    path = f"/v1/models/{name}/classify"
                    first = timed_post(client, path, json=row)
                    after = [timed_post(client, path, json=row) for _ in range(args.after)]
                    per_model.append(
                        {
                            "model": name,
                            "load_s": load,
                            "first_ms": 1e3 * first,
                            "after_ms": 1e3 * median(after),
                        }
                    )
        finally:
            proc.terminate()
            proc.wait()
    summary = {
        "models": args.models,
        "rss_one_mib": rss_one,
        "rss_all_mib": rss_all,
        "rss_per_model_mib": (rss_all - rss_one) / (args.models - 1),
        "counted_per_model_mib": median(list(counted.values())) / 2**20,
        "references_mib": args.n * args.d * 4 / 2**20,
        "load_s_median": median([m["load_s"] for m in per_model]),
        "first_request_ms_median": median([m["first_ms"] for m in per_model]),
        "later_requests_ms_median": median([m["after_ms"] for m in per_model]),
    }
    print_table([summary], list(summary))
    save_json(
        f"{args.name}.json",
        {
            "machine": machine(),
            "setup": vars(args) | {"server_core": "1", "client_core": "0 (run under taskset)"},
            "summary": summary,
            "per_model": per_model,
        },
    )


if __name__ == "__main__":
    main()
