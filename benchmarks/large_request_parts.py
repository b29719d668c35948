"""Where the time of a 1,024-row /v1/classify request goes, in process (no HTTP): parsing
the body (JSON or npy), projecting, the exact search, and encoding the answer (JSON or npy).

Same model as ``http_load.py`` (D = 64, 60k references at d = 32, exact Flat). Medians of
``--repeats``. Pin it to one core to compare with http_load's server:

    taskset -c 1 python benchmarks/large_request_parts.py [--rows 1024] [--repeats 7]
"""

from __future__ import annotations

import argparse
import io
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import median, print_table

from service.config import Settings
from service.engine.engine import Engine
from service.engine.infer import Query, embed, infer_one, resolve
from service.http.routes.inference import ClassifyBody, classify_json, classify_npy, json_encoder
from service.wire import parse_json, parse_npy, to_rows


def timed(fn, repeats: int) -> float:
    """Median milliseconds of fn()."""
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    from http_load import build_models

    plain, _ = build_models(Path(tempfile.mkdtemp(prefix="ncaknn-parts-")))
    engine = Engine(Settings(model_path=plain, max_batch_rows=args.rows))
    model = engine.load()
    X = np.random.default_rng(0).normal(size=(args.rows, model.n_features))
    json_body = json.dumps({"instances": X.tolist()}).encode()
    buffer = io.BytesIO()
    np.save(buffer, X.astype(np.float32))
    npy_body = buffer.getvalue()
    d, limit = model.n_features, model.input_abs_max

    def parse_json_body():
        instances = parse_json(json_body, ClassifyBody, n_features=d, max_rows=args.rows)
        return to_rows(instances.instances, n_features=d, max_rows=args.rows, abs_max=limit)

    def parse_npy_body():
        instances = parse_npy(npy_body, n_features=d, max_rows=args.rows)
        return to_rows(instances, n_features=d, max_rows=args.rows, abs_max=limit)

    rows = parse_npy_body()
    query = resolve(model, args.rows)
    answer = infer_one(model, rows, query)
    steps = [
        ("parse JSON body", lambda: parse_json_body()),
        ("parse npy body", lambda: parse_npy_body()),
        ("project", lambda: embed(model, rows)),
        ("project + exact search + decision", lambda: infer_one(model, rows, Query(5, "majority"))),
        (
            "encode JSON answer",
            lambda: json_encoder.encode(classify_json(model, answer, False, None)),
        ),
        ("encode npy answer", lambda: classify_npy(model, answer, False, None)),
    ]
    out = [{"step": name, "ms": timed(fn, args.repeats)} for name, fn in steps]
    print(f"{args.rows}-row classify, in process, median of {args.repeats}")
    print_table(out, ["step", "ms"])
    by = {r["step"]: r["ms"] for r in out}
    common = by["project + exact search + decision"]
    json_total = by["parse JSON body"] + common + by["encode JSON answer"]
    npy_total = by["parse npy body"] + common + by["encode npy answer"]
    encoding = (by["parse JSON body"] + by["encode JSON answer"]) / (
        by["parse npy body"] + by["encode npy answer"]
    )
    print(
        f"JSON total {json_total:.1f} ms, npy total {npy_total:.1f} ms: {json_total / npy_total:.2f}x"
    )
    print(f"encoding alone (parse + answer): npy {encoding:.0f}x cheaper than JSON")


if __name__ == "__main__":
    main()
