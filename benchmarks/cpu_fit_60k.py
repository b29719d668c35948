"""Where the 60k x 784 CPU fit spends its time, real digits against the synthetic set.

Fits the estimator with its defaults (d = 32, seed 0) on two 60,000-row, 784-feature sets:

* digits: ``common.usps_784`` (USPS resampled to 28 x 28 and augmented to 60,000 references;
  test queries from the 2,007 USPS test images);
* synthetic: ``common.synthetic`` (10 classes of 3 blobs in a 40-dim subspace; 10,000 test
  rows from the same generator).

For each fit it records the wall time of each phase (preparation, i.e. the choice of
standardisation and the initial map; the candidate stage, with its candidate refreshes; the
exact finish), the number of objective evaluations of each L-BFGS stage, the candidate
refreshes and the K they chose, and test 1-NN / 5-NN accuracy. ``--finish-rows`` repeats each
fit with other values of ``plan.EXACT_FINISH_MAX_ROWS`` (query rows a finishing
iteration averages over) to show what the finish's row count costs and buys.

Usage: taskset -c 0,1 python benchmarks/cpu_fit_60k.py [--sets digits,synthetic]
                                                       [--finish-rows 32768,65536] [--repeats 1]
Writes benchmarks/results/cpu_fit_60k.json (rows of sets not run are kept). Run it alone:
each fit takes 2-4 minutes here.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, machine, peak_rss_mib, print_table, save_json, synthetic, usps_784

from training import NCA
from training.evaluation.evaluate import knn_accuracies
from training.model import plan as fit_plan
from training.model import preparation
from training.objectives import native
from training.optim import candidates as candidate_module


def digits():
    data = usps_784(60000, 1000, 2007)
    if data is None:
        return None
    X, y, _, _, Xt, yt = data
    return X, y, Xt, yt


def synthetic_set():
    X, y = synthetic(70000)  # 10,000 test rows: a point of accuracy is about 2 standard errors
    return X[:60000], y[:60000], X[60000:], y[60000:]


SETS = {"digits": digits, "synthetic": synthetic_set}


class PhaseClock:
    """Wall time of the preparation, of every candidate refresh and of every exact
    evaluation in the native kernel, by wrapping them."""

    def __init__(self):
        self.prepare_s = 0.0
        self.refresh_s: list[float] = []
        self.exact_s: list[float] = []

    def __enter__(self):
        self._prepare = preparation.prepare
        self._refresh = candidate_module.CandidateWatch.refresh
        self._exact = native.exact_value_and_grad
        clock = self

        def exact(*args, **kwargs):
            started = time.perf_counter()
            try:
                return clock._exact(*args, **kwargs)
            finally:
                clock.exact_s.append(time.perf_counter() - started)

        def prepare(*args, **kwargs):
            started = time.perf_counter()
            try:
                return clock._prepare(*args, **kwargs)
            finally:
                clock.prepare_s += time.perf_counter() - started

        def refresh(watch, theta):
            started = time.perf_counter()
            try:
                return clock._refresh(watch, theta)
            finally:
                clock.refresh_s.append(time.perf_counter() - started)

        preparation.prepare = prepare
        candidate_module.CandidateWatch.refresh = refresh
        native.exact_value_and_grad = exact
        return self

    def __exit__(self, *exc):
        preparation.prepare = self._prepare
        candidate_module.CandidateWatch.refresh = self._refresh
        native.exact_value_and_grad = self._exact


def fit_once(X, y, Xt, yt, finish_rows: int) -> dict:
    saved = fit_plan.EXACT_FINISH_MAX_ROWS
    fit_plan.EXACT_FINISH_MAX_ROWS = finish_rows
    try:
        with PhaseClock() as clock, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            started = time.perf_counter()
            model = NCA(n_components=32, random_state=0).fit(X, y)
            fit_s = time.perf_counter() - started
    finally:
        fit_plan.EXACT_FINISH_MAX_ROWS = saved
    history = model.history_
    first = [r for r in history if r.get("stage") != "exact finish"]
    finish = [r for r in history if r.get("stage") == "exact finish"]
    candidate_s = first[-1]["seconds"] if first else 0.0
    finish_s = (finish[-1]["seconds"] - candidate_s) if finish else 0.0
    n_classes = int(max(y.max(), yt.max())) + 1
    acc = knn_accuracies(model.transform(X), y, model.transform(Xt), yt, n_classes, (1, 5))
    return {
        "finish_rows": min(finish_rows, len(y)),
        "fit_s": fit_s,
        "prepare_s": clock.prepare_s,
        "candidate_stage_s": candidate_s,
        "refreshes": len(clock.refresh_s),
        "refresh_s": sum(clock.refresh_s),
        "finish_s": finish_s,
        "exact_evaluations": len(clock.exact_s),
        "exact_evaluation_s": statistics.median(clock.exact_s) if clock.exact_s else None,
        "n_iter": model.n_iter_,
        "n_evaluations": model.n_evaluations_,
        "n_candidates_end": model.n_candidates_,
        "standardization": model.standardization_,
        "stop_reason": model.stop_reason_,
        "test_acc_1nn": acc[1],
        "test_acc_5nn": acc[5],
        "peak_rss_mib": peak_rss_mib(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sets", default="digits,synthetic")
    parser.add_argument("--finish-rows", default=str(fit_plan.EXACT_FINISH_MAX_ROWS))
    parser.add_argument("--repeats", type=int, default=1, help="fits per setting (median)")
    args = parser.parse_args()
    rows = []
    for name in args.sets.split(","):
        data = SETS[name]()
        if data is None:
            print(f"{name}: ../shared/data/usps.npz is absent, skipped")
            continue
        finish_rows = [int(r) for r in args.finish_rows.split(",")]
        for rows_per_finish in finish_rows:
            fits = [fit_once(*data, rows_per_finish) for _ in range(args.repeats)]
            row = {"set": name, **fits[len(fits) // 2]}
            row["fit_s"] = statistics.median(f["fit_s"] for f in fits)
            row["fit_s_all"] = [round(f["fit_s"], 1) for f in fits]
            rows.append(row)
            print(row, flush=True)
    columns = [
        "set",
        "finish_rows",
        "fit_s",
        "prepare_s",
        "candidate_stage_s",
        "refreshes",
        "refresh_s",
        "finish_s",
        "exact_evaluations",
        "exact_evaluation_s",
        "n_iter",
        "n_evaluations",
        "test_acc_1nn",
        "test_acc_5nn",
    ]
    previous = RESULTS / "cpu_fit_60k.json"
    if previous.exists():  # rows of sets not run this time are kept
        ran = set(args.sets.split(","))
        kept = [r for r in json.loads(previous.read_text())["rows"] if r["set"] not in ran]
        rows = kept + rows
    print_table(rows, columns)
    save_json("cpu_fit_60k.json", {"machine": machine(), "rows": rows})


if __name__ == "__main__":
    main()
