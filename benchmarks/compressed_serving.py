"""What a learned reference set buys when served: /v1/classify on the compressed model
against the naive FastAPI + FAISS app serving the full set, side by side in one run.

Models (each with its validation split; test rows never seen by the map or the prototypes):

* D = 64: ``harness.data.synthetic`` (10 classes), the NCA map (d = 32) fitted on 5k rows as in
  ``http_load.py``; 60,000 references, 5,000 validation and 10,000 test rows;
* D = 784: ``harness.data.usps_784`` (60,000 references of real digits, 1,000 validation rows,
  USPS's 2,007 test images), the estimator's defaults at d = 32 (fitted once; pass
  ``--model784 DIR`` to reuse an artifact this script wrote before).

Each full model is compressed by ``python -m training references condense --method
prototypes`` (learned with the map fixed) to 2% and 5% of the references; test accuracy at
each model's served k is measured offline with the function the service runs.

Servers (1 uvicorn worker each, uvloop + httptools, pinned with ``taskset`` to core 1; wrk
pinned to core 0, 1 thread; one instance per request): the naive app
(``benchmarks/naive_app.py``, ``def`` handler, full set), ours on the full set, ours on 2%
and on 5%. Each (server, connections) cell runs ``--seconds`` per round, rounds
interleaved, medians over ``--rounds``; resident memory (VmRSS) of each server after load.

Then FAISS Flat search alone (d = 32, one thread): queries per second against N = 60k and
1M synthetic references and 2% and 5% of them, one query per call and 256 per call.

Usage: python benchmarks/compressed_serving.py [--seconds 10] [--rounds 3] [--dims 64,784]
       (needs `wrk`)
Writes benchmarks/results/compressed_serving.json and compressed_serving.png.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness.data import synthetic, usps_784
from harness.load import LUA, wrk
from harness.report import RESULTS, machine, median, print_table, save_json
from harness.servers import start_uvicorn, stop

FRACTIONS = {"2%": 50.0, "5%": 20.0}


def write_model(out: Path, nca, X, y, X_val, y_val, default_k: int) -> Path:
    from service.core.artifact import write_artifact
    from training.evaluation.calibration import calibrate

    z, z_val = nca.transform(X), nca.transform(X_val)
    return write_artifact(
        out,
        projection=nca.projection_,
        offset=nca.offset_,
        embeddings=z,
        labels=y.astype(np.int32),
        classes=sorted(set(y.tolist())),
        mean=nca.mean_,
        scale=nca.scale_,
        default_k=default_k,
        validation_embeddings=z_val,
        validation_labels=y_val.astype(np.int32),
        metadata={"outlier_calibration": calibrate(z, z_val)},
    )


def build(work: Path, dim: int, model784: str | None) -> tuple[Path, np.ndarray, np.ndarray]:
    """(the full model, test rows, test labels)."""
    from training import NCA
    from training.evaluation.evaluate import K_VALUES, choose_k, knn_accuracies

    if dim == 64:
        X, y = synthetic(75000, n_features=64, seed=2)
        fit_rows, refs, val, test = (
            X[:5000],
            slice(0, 60000),
            slice(60000, 65000),
            slice(65000, None),
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            nca = NCA(n_components=32, max_iter=30, random_state=0).fit(fit_rows, y[:5000])
        X_ref, y_ref, X_val, y_val, X_test, y_test = (
            X[refs],
            y[refs],
            X[val],
            y[val],
            X[test],
            y[test],
        )
    else:
        X_ref, y_ref, X_val, y_val, X_test, y_test = usps_784(60000, 1000, 2007)
        if model784:
            return Path(model784), X_test, y_test
        started = time.perf_counter()
        nca = NCA(n_components=32, random_state=0).fit(X_ref, y_ref)
        print(f"D=784: NCA fit {time.perf_counter() - started:.0f} s", flush=True)
    val = knn_accuracies(nca.transform(X_ref), y_ref, nca.transform(X_val), y_val, 10, K_VALUES)
    k = choose_k(val, fallback=3)
    return write_model(work / f"full-{dim}", nca, X_ref, y_ref, X_val, y_val, k), X_test, y_test


def test_accuracy(model: Path, X_test, y_test) -> tuple[int, float]:
    from service.core.artifact import read_artifact
    from service.core.knn import project
    from training.evaluation.evaluate import knn_predictions

    a = read_artifact(model)
    z = project(X_test, a.projection, a.offset)
    k = a.default_k
    predicted = knn_predictions(
        a.embeddings, np.asarray(a.labels), z, len(a.classes), (k,), a.decision_rule
    )[k]
    return k, float(np.mean(predicted == y_test))


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def serve_and_load(models: dict, dim: int, work: Path, seconds: int, rounds: int) -> list[dict]:
    rng = np.random.default_rng(0)
    script = work / f"post-{dim}.lua"
    script.write_text(LUA % ",".join(f"{v:.4f}" for v in rng.random(dim)))
    servers = {
        "naive FastAPI+FAISS (full set)": start_uvicorn(
            "benchmarks.naive_app:create", models["full"]["path"]
        )
    }
    for name, entry in models.items():
        servers[f"ours, {name}"] = start_uvicorn("benchmarks.http_app:create", entry["path"])
    routes = {
        name: "/v1/classify-sync" if name.startswith("naive") else "/v1/classify"
        for name in servers
    }
    runs: dict[tuple, list[float]] = {}
    try:
        for round_ in range(rounds):
            for connections in (16, 64):
                for name, (_, port) in servers.items():
                    result = wrk(
                        f"http://127.0.0.1:{port}{routes[name]}", script, connections, seconds
                    )
                    runs.setdefault((name, connections), []).append(result["requests_per_second"])
                    print(round_, dim, name, connections, result, flush=True)
        memory = {name: rss_mib(proc.pid) for name, (proc, _) in servers.items()}
    finally:
        for proc, _ in servers.values():
            stop(proc)
    rows = []
    for connections in (16, 64):
        naive = median(runs[("naive FastAPI+FAISS (full set)", connections)])
        for name in servers:
            rps = median(runs[(name, connections)])
            entry = models.get(name.removeprefix("ours, "), models["full"])
            rows.append(
                {
                    "D": dim,
                    "connections": connections,
                    "server": name,
                    "references": entry["references"],
                    "test_accuracy": entry["accuracy"],
                    "served_k": entry["k"],
                    "requests_per_second": rps,
                    "over_naive_full": rps / naive,
                    "rss_mib": memory[name],
                }
            )
    return rows


def search_rates(n_values=(60000, 1000000), d: int = 32) -> list[dict]:
    """FAISS Flat queries/s at N references and at 2% and 5% of them (one thread)."""
    import faiss

    faiss.omp_set_num_threads(1)
    rng = np.random.default_rng(0)
    queries = rng.normal(size=(4096, d)).astype(np.float32)
    rows = []
    for n in n_values:
        base = rng.normal(size=(n, d)).astype(np.float32)
        for label, size in (("full", n), ("5%", n // 20), ("2%", n // 50)):
            index = faiss.IndexFlatL2(d)
            index.add(base[:size])
            for per_call in (1, 256):
                done, started = 0, time.perf_counter()
                while time.perf_counter() - started < 2.0:
                    start = done % (len(queries) - per_call + 1)
                    index.search(queries[start : start + per_call], 5)
                    done += per_call
                rate = done / (time.perf_counter() - started)
                rows.append(
                    {
                        "N": n,
                        "kept": label,
                        "references": size,
                        "per_call": per_call,
                        "queries_per_second": rate,
                    }
                )
                print(rows[-1], flush=True)
    return rows


def plot(serving: list[dict], search: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for dim in sorted({r["D"] for r in serving}):
        for connections, marker in ((16, "o"), (64, "s")):
            rows = [r for r in serving if r["D"] == dim and r["connections"] == connections]
            left.plot(
                [
                    r["server"]
                    .replace("naive FastAPI+FAISS (full set)", "naive, full")
                    .replace("ours, ", "ours ")
                    for r in rows
                ],
                [r["requests_per_second"] for r in rows],
                marker=marker,
                label=f"D={dim}, {connections} connections",
            )
    left.set_ylabel("requests/s (1 worker, pinned)")
    left.set_title("/v1/classify: compressed vs full references")
    left.legend(fontsize=8)
    left.tick_params(axis="x", labelsize=8)
    for per_call, style in ((1, "-"), (256, "--")):
        for n in sorted({r["N"] for r in search}):
            rows = [r for r in search if r["N"] == n and r["per_call"] == per_call]
            right.loglog(
                [r["references"] for r in rows],
                [r["queries_per_second"] for r in rows],
                style,
                marker="o",
                label=f"N={n:,}, {per_call}/call",
            )
    right.set_xlabel("references searched (full, 5%, 2%)")
    right.set_ylabel("queries/s (FAISS Flat, d=32, 1 thread)")
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(RESULTS / "compressed_serving.png", dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dims", default="64,784")
    parser.add_argument("--model784", help="a full D=784 artifact this script wrote before")
    args = parser.parse_args()
    if shutil.which("wrk") is None or shutil.which("taskset") is None:
        sys.exit("wrk and taskset are needed: apt-get install wrk util-linux")
    from training.references.versions import condense_references

    work = Path(tempfile.mkdtemp(prefix="ncaknn-compressed-"))
    serving = []
    for dim in (int(d) for d in args.dims.split(",")):
        full, X_test, y_test = build(work, dim, args.model784)
        print(f"D={dim}: full model at {full}", flush=True)
        k, accuracy = test_accuracy(full, X_test, y_test)
        models = {"full": {"path": full, "k": k, "accuracy": accuracy, "references": 60000}}
        for name, reduction in FRACTIONS.items():
            out = work / f"{name.strip('%')}-{dim}"
            started = time.perf_counter()
            summary = condense_references(full, out=out, method="prototypes", reduction=reduction)
            k, accuracy = test_accuracy(out, X_test, y_test)
            models[name] = {
                "path": out,
                "k": k,
                "accuracy": accuracy,
                "references": summary["rows_after"],
                "condense_seconds": time.perf_counter() - started,
            }
            print(dim, name, {k: v for k, v in models[name].items() if k != "path"}, flush=True)
        serving += serve_and_load(models, dim, work, args.seconds, args.rounds)
    search = search_rates()
    print_table(
        serving,
        [
            "D",
            "connections",
            "server",
            "references",
            "test_accuracy",
            "requests_per_second",
            "over_naive_full",
            "rss_mib",
        ],
    )
    print_table(search, ["N", "kept", "references", "per_call", "queries_per_second"])
    save_json(
        "compressed_serving.json",
        {
            "machine": machine(),
            "serving": serving,
            "search": search,
            "seconds": args.seconds,
            "rounds": args.rounds,
        },
    )
    plot(serving, search)


if __name__ == "__main__":
    main()
