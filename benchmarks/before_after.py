"""Behaviour and speed before and after a change of the code's shape, side by side in one run:
this checkout against another one (``--before``, e.g. a ``git worktree`` of an older commit).

Two measurements, rounds interleaved between the trees, medians reported:

* HTTP: ``python -m service`` from each tree on the same artifact (D = 64, N = 20k at
  d = 16, written by the *before* tree's writer so both can read it), one worker pinned to
  core 1, wrk pinned to core 0 (64 connections, one 64-value row per POST /v1/classify);
  both servers must give the same answer to the same request.
* Training: ``NCA(n_components=16, max_iter=40).fit`` on 5,000 x 64 synthetic points (the
  exact objective) in a fresh process per run, pinned to core 1; the fitted map must agree.

Usage: python benchmarks/before_after.py --before DIR [--seconds 5] [--rounds 3] [--name N]
Writes benchmarks/results/N.json (default before_after.json).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness.load import LUA, wrk
from harness.report import machine, median, print_table, save_json
from harness.servers import free_port, start_service

ROOT = Path(__file__).resolve().parents[1]
WRITE_MODEL = """
import numpy as np, sys
try:  # the tree before the restructure first: the editable install finds the newer package
    from service.artifact import write_artifact
except ImportError:
    from service.core.artifact import write_artifact
rng = np.random.default_rng(3)
X = rng.normal(size=(20000, 64)).astype(np.float32); y = rng.integers(0, 10, 20000)
W = (rng.normal(size=(16, 64)) / 8).astype(np.float32)
write_artifact(sys.argv[1], projection=W, offset=np.zeros(16, np.float32), embeddings=X @ W.T,
    labels=y.astype(np.int32), classes=list(range(10)), mean=np.zeros(64), scale=np.ones(64),
    default_k=5)
"""
FIT = """
import time, sys, numpy as np, warnings
warnings.simplefilter("ignore")
from training import NCA
rng = np.random.default_rng(0)
centres = rng.normal(0, 2, size=(10, 64))
y = rng.integers(0, 10, 5000); X = centres[y] + rng.normal(size=(5000, 64))
started = time.perf_counter()
model = NCA(n_components=16, max_iter=40, random_state=0).fit(X, y)
print(time.perf_counter() - started, float(np.abs(model.components_).sum()), model.n_iter_)
"""


def run_in(root: Path, code: str, *args: str, core: str = "1") -> str:
    env = {**os.environ, "PYTHONPATH": str(root)}
    cmd = ["taskset", "-c", core, sys.executable, "-c", code, *args]
    return subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, check=True).stdout


def start_server(root: Path, model: Path) -> tuple[subprocess.Popen, int]:
    """The tree at ``root`` serving ``model`` on core 1, its probe port on as shipped (a
    tree without one ignores the setting)."""
    return start_service(model, root=root, env={"NCAKNN_PROBE_PORT": str(free_port())})


def http_cells(trees: dict[str, Path], model: Path, seconds: int, rounds: int, tmp: Path):
    import httpx

    script = tmp / "post.lua"
    script.write_text(LUA % ", ".join(["0.5"] * 64))
    servers = {name: start_server(root, model) for name, root in trees.items()}
    try:
        body = {"instances": [[0.5] * 64], "return_neighbors": True}
        answers = {}
        for name, (_, port) in servers.items():
            answer = httpx.post(f"http://127.0.0.1:{port}/v1/classify", json=body).json()
            answer.pop("model_version")  # the version scheme itself changed
            answers[name] = answer
        same_answer = len({json.dumps(a, sort_keys=True) for a in answers.values()}) == 1
        runs = {name: [] for name in trees}
        for _ in range(rounds):
            for name, (_, port) in servers.items():
                runs[name].append(wrk(f"http://127.0.0.1:{port}/v1/classify", script, 64, seconds))
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(30)
    return runs, same_answer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", required=True, help="the other checkout")
    parser.add_argument("--seconds", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--name", default="before_after", help="results/NAME.json (one file per comparison)"
    )
    args = parser.parse_args()
    trees = {"before": Path(args.before).resolve(), "after": ROOT}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model = tmp / "model"
        run_in(trees["before"], WRITE_MODEL, str(model))
        http, same_answer = http_cells(trees, model, args.seconds, args.rounds, tmp)
    fits = {name: [] for name in trees}
    for _ in range(args.rounds):
        for name, root in trees.items():
            seconds, total, n_iter = run_in(root, FIT).split()
            fits[name].append((float(seconds), float(total), int(n_iter)))
    same_fit = len({(round(t, 6), n) for runs in fits.values() for _, t, n in runs}) == 1
    rows = []
    for name in trees:
        rows.append(
            {
                "tree": name,
                "classify_rps": median([r["requests_per_second"] for r in http[name]]),
                "classify_p99_ms": median([r["p99_ms"] for r in http[name]]),
                "errors": sum(r["errors"] for r in http[name]),
                "fit_s": median([s for s, _, _ in fits[name]]),
            }
        )
    print_table(rows, ["tree", "classify_rps", "classify_p99_ms", "errors", "fit_s"])
    print(f"same /v1/classify answer: {same_answer}; same fitted map: {same_fit}")
    facts = machine()
    save_json(
        f"{args.name}.json",
        {
            "machine": facts,
            "command": f"python benchmarks/before_after.py --before {args.before} "
            f"--seconds {args.seconds} --rounds {args.rounds} --name {args.name}",
            "rows": rows,
            "http_runs": http,
            "fit_runs": fits,
            "same_answer": same_answer,
            "same_fit": same_fit,
        },
    )


if __name__ == "__main__":
    main()
