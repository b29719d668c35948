"""The reference set as data: adding rows without retraining, and what condensing buys.

1. add: a 60k-reference model (``http_load.build_models``: D = 64, d = 32), 10k new labelled
   rows added with ``training.references.versions.add_references`` (project, append, recalibrate,
   write a new version atomically); then a running server (``python -m service``, pinned to
   core 1) told to reload (``POST /v1/admin/reload``) until it answers from the new version.
   Seconds for each step, median of ``--repeats``.
2. condense: exact search (the service's Flat index, one thread) over a model's references
   before and after ``references condense``: queries per second and the speed-up, with the
   sizes. Needs two artifacts (``--condensed BEFORE AFTER``, e.g. a USPS model and its
   condensed version, made with ``python -m training references condense``).

Usage: python benchmarks/reference_set.py [--repeats 3] [--condensed BEFORE AFTER]
Writes benchmarks/results/reference_set.json.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness.data import synthetic
from harness.models import build_models
from harness.report import machine, median, print_table, save_json
from harness.servers import free_port, stop, wait_ready

ROOT = Path(__file__).resolve().parents[1]


def add_and_serve(directory: Path, repeats: int) -> dict:
    from training.references.versions import add_references

    model, _ = build_models(directory)
    X_new, y_new = synthetic(10_000, n_features=64, seed=9)
    port = free_port()
    env = {
        **os.environ,
        "NCAKNN_LOG_LEVEL": "warning",
        "NCAKNN_GRPC_PORT": "0",
        "NCAKNN_PROBE_PORT": "0",
        "NCAKNN_DRAIN_DELAY_SECONDS": "0",
    }
    link = directory / "current"
    link.symlink_to(model)
    cmd = ["taskset", "-c", "1", sys.executable, "-m", "service", "--model", str(link)]
    proc = subprocess.Popen([*cmd, "--port", str(port)], cwd=ROOT, env=env, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    add_s, reload_s, first_answer_s = [], [], []
    try:
        wait_ready(proc, port)
        row = {"instances": X_new[:1].tolist()}
        for i in range(repeats):
            out = directory / f"added-{i}"
            started = time.perf_counter()
            summary = add_references(model, X_new, y_new, out=out)
            add_s.append(time.perf_counter() - started)
            tmp_link = directory / "current.tmp"
            tmp_link.symlink_to(out)
            os.replace(tmp_link, link)  # publish: one atomic rename
            started = time.perf_counter()
            response = httpx.post(f"{url}/v1/admin/reload", timeout=120)
            assert response.status_code == 200, response.text
            reload_s.append(time.perf_counter() - started)
            answer = httpx.post(f"{url}/v1/classify", json=row, timeout=30).json()
            first_answer_s.append(time.perf_counter() - started)
            assert answer["model_version"] == response.json()["model_version"]
            # back to the 60k model for the next repeat
            tmp_link = directory / "current.tmp"
            tmp_link.symlink_to(model)
            os.replace(tmp_link, link)
            httpx.post(f"{url}/v1/admin/reload", timeout=120)
    finally:
        stop(proc)
    return {
        "references_before": summary["rows_before"],
        "rows_added": summary["rows_added"],
        "references_after": summary["rows_after"],
        "add_seconds": median(add_s),
        "reload_seconds": median(reload_s),
        "reload_to_first_answer_seconds": median(first_answer_s),
        "runs": {"add": add_s, "reload": reload_s, "first_answer": first_answer_s},
    }


def search_rate(path: Path, queries: np.ndarray, k: int, repeats: int) -> tuple[int, float]:
    """(references, queries per second) of exact Flat search through the engine."""
    from service.config import Settings
    from service.engine.infer import embed
    from service.engine.model import load_model
    from service.search.index import search

    model = load_model(path, Settings(model_path=path, index_type="flat", grpc_port=0))
    z = embed(model, queries)
    rates = []
    for _ in range(repeats):
        started = time.perf_counter()
        for start in range(0, len(z), 256):
            search(model, z[start : start + 256], k)
        rates.append(len(z) / (time.perf_counter() - started))
    return model.n_references, median(rates)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--condensed", nargs=2, type=Path, metavar=("BEFORE", "AFTER"))
    args = parser.parse_args()
    os.sched_setaffinity(0, {0})
    results: dict = {"machine": machine()}
    with tempfile.TemporaryDirectory() as tmp:
        results["add"] = add_and_serve(Path(tmp), args.repeats)
    add = results["add"]
    print_table(
        [add],
        [
            "references_before",
            "rows_added",
            "add_seconds",
            "reload_seconds",
            "reload_to_first_answer_seconds",
        ],
    )
    if args.condensed:
        from service.core.artifact import read_artifact

        before, after = args.condensed
        art = read_artifact(before)
        rng = np.random.default_rng(0)
        # queries: the training inputs back-projected are unknown; use rows drawn like the
        # inputs' scale (the search cost does not depend on where the queries lie)
        queries = (rng.normal(size=(4096, art.n_features_in)) * art.scale + art.mean).astype(
            np.float32
        )
        k = art.default_k
        n_before, rate_before = search_rate(before, queries, k, args.repeats)
        n_after, rate_after = search_rate(after, queries, k, args.repeats)
        results["condense_search"] = {
            "k": k,
            "references_before": n_before,
            "references_after": n_after,
            "queries_per_second_before": round(rate_before),
            "queries_per_second_after": round(rate_after),
            "speed_up": round(rate_after / rate_before, 2),
            "fewer_references": round(n_before / n_after, 2),
        }
        print_table([results["condense_search"]], list(results["condense_search"]))
    save_json("reference_set.json", results)


if __name__ == "__main__":
    main()
