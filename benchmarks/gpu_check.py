"""The GPU check of issue 34: one script, one JSON, sized to finish in under 8 minutes.

On a machine with a CUDA device it

1. runs the CUDA tests (tests/training/objectives/test_cuda.py, test_nca_flex.py) under pytest and
   counts passed / failed / skipped;
2. times the exact objective (value and gradient, the fused flex_attention path) at
   N = 250k and 1M (synthetic, D = 128, d = 32): seconds per evaluation after the first
   (compiling) one, achieved TFLOP/s against the card's dense FP32 and TF32 rates, peak GPU
   memory; and, where time is left, a short exact fit (5 L-BFGS iterations) at each N;
3. fits the estimator with its defaults on the 60k x 784 digits (``harness.data.usps_784``, when
   ``--usps`` names usps.npz; else the 60k x 784 synthetic set) and records the fit time and
   test accuracy (the CPU's, on the same data and seed, is in benchmarks/results/cpu_fit_60k.json);
4. with time left, the estimator's default fit at N = 1M (candidates and the exact finish).

Every step is guarded: a failure is recorded in its entry (``error``) and the script goes
on; a step that would start with less than its minimum of the ``--budget-s`` left is
recorded as skipped. ``--smoke`` runs the same plumbing on the CPU at toy sizes (no tests,
no flex kernels), which tests/training/test_gpu_check.py does.

Usage (device): python benchmarks/gpu_check.py --out $OUT/gpu.json [--usps data/usps.npz]
Usage (check):  python benchmarks/gpu_check.py --smoke --out /tmp/gpu.json
Commit the device's output as benchmarks/results/gpu.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
import traceback
import xml.etree.ElementTree as ElementTree
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import torch  # noqa: E402
from harness import data  # noqa: E402
from harness.data import synthetic  # noqa: E402

from training import NCA  # noqa: E402
from training.evaluation.evaluate import knn_accuracies  # noqa: E402
from training.model.options import with_options  # noqa: E402
from training.objectives.nca_kernel import nca_value_and_grad  # noqa: E402

# dense (no sparsity) TFLOP/s from the vendor's data sheets, by a substring of the name
DENSE_TFLOPS = {
    "H200": {"fp32": 66.9, "tf32": 494.7},
    "H100 NVL": {"fp32": 60.0, "tf32": 417.5},
    "H100 PCIe": {"fp32": 51.2, "tf32": 378.0},
    "H100": {"fp32": 66.9, "tf32": 494.7},  # SXM
    "A100": {"fp32": 19.5, "tf32": 156.0},
    "L4": {"fp32": 30.3, "tf32": 60.0},
}
CUDA_TESTS = [
    "tests/training/objectives/test_cuda.py",
    "tests/training/objectives/test_nca_flex.py",
]


def device_facts(device: torch.device) -> dict:
    facts = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "device": str(device),
        "allow_tf32": bool(torch.backends.cuda.matmul.allow_tf32),
    }
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        facts["device_name"] = name
        facts["memory_gib"] = torch.cuda.get_device_properties(device).total_memory / 2**30
        facts["dense_tflops"] = next((v for k, v in DENSE_TFLOPS.items() if k in name), None)
    return facts


def run_cuda_tests(timeout_s: float) -> dict:
    """pytest over CUDA_TESTS; {passed, failed, skipped, failures}."""
    report = Path(os.environ.get("TMPDIR", "/tmp")) / "gpu_check_junit.xml"
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *CUDA_TESTS]
    done = subprocess.run(
        [*command, f"--junitxml={report}"],
        cwd=HERE.parent,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    suite = ElementTree.parse(report).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    total, skipped = int(suite.get("tests")), int(suite.get("skipped"))
    failed = int(suite.get("failures")) + int(suite.get("errors"))
    failures = [
        f"{case.get('classname')}::{case.get('name')}"
        for case in suite.iter("testcase")
        if case.find("failure") is not None or case.find("error") is not None
    ]
    return {
        "passed": total - failed - skipped,
        "failed": failed,
        "skipped": skipped,
        "failures": failures,
        "exit_code": done.returncode,
        "tail": done.stdout[-3000:],
    }


def exact_flops(labels: np.ndarray, d: int) -> float:
    """Floating-point operations of one fused exact evaluation, all rows queried: the two
    full passes (rows against every point, points against every row) and the two
    same-class ones, each 2 x pairs x (query-key width + value width), widths padded as
    nca_flex pads them."""
    from training.objectives.nca_flex import _width

    n = len(labels)
    same_pairs = float((np.bincount(labels).astype(np.float64) ** 2).sum())
    rows = 2.0 * (_width(d + 1) + _width(d))  # per pair, row passes
    cols = 2.0 * (_width(d + 2) + _width(d + 1))  # per pair, column passes
    return (float(n) * n + same_pairs) * (rows + cols)


def synchronise(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_gib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def time_exact(n: int, D: int, d: int, device: torch.device, repeats: int, facts: dict) -> dict:
    """Seconds per exact evaluation (value and gradient) at N = n on a random map."""
    X, y = synthetic(n, n_features=D)
    A = torch.as_tensor(np.random.default_rng(0).normal(0, D**-0.5, (d, D)), dtype=torch.float32)
    z = torch.as_tensor(X, device=device) @ A.to(device).T  # (n, d)
    labels = torch.as_tensor(y, device=device)
    del X
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(repeats + 1):  # the first compiles the kernels
        synchronise(device)
        started = time.perf_counter()
        value, grad = nca_value_and_grad(z, labels, log_form=False)
        synchronise(device)
        times.append(time.perf_counter() - started)
    seconds = float(np.median(times[1:]))
    flops = exact_flops(y, d)
    entry = {
        "first_evaluation_s": times[0],
        "seconds_per_evaluation": seconds,
        "tflops": flops / seconds / 1e12,
        "peak_gpu_mem_gib": peak_gib(device),
        "finite": bool(torch.isfinite(value)) and bool(torch.isfinite(grad).all()),
    }
    rates = facts.get("dense_tflops")
    if rates:
        entry["fraction_of_dense_fp32"] = entry["tflops"] / rates["fp32"]
        entry["fraction_of_dense_tf32"] = entry["tflops"] / rates["tf32"]
    return entry


def fit_run(X, y, Xt, yt, device: torch.device, **params) -> dict:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    started = time.perf_counter()
    model = NCA(
        **with_options(dict(n_components=32, random_state=0, device=str(device), **params))
    ).fit(X, y)
    fit_s = time.perf_counter() - started
    entry = {
        "fit_s": fit_s,
        "n_iter": model.n_iter_,
        "n_evaluations": model.n_evaluations_,
        "stop_reason": model.stop_reason_,
        "plan": model.plan_.describe(),
        "peak_gpu_mem_gib": peak_gib(device),
    }
    if Xt is not None:
        n_classes = int(max(y.max(), yt.max())) + 1
        acc = knn_accuracies(model.transform(X), y, model.transform(Xt), yt, n_classes, (1, 5))
        entry.update(test_acc_1nn=acc[1], test_acc_5nn=acc[5])
    return entry


def digits_set(usps: Path | None, n: int):
    """(name, X, y, X_test, y_test): the 60k x 784 digits when usps.npz is given, else the
    synthetic 784-feature set of the same size."""
    if usps is not None and usps.is_file():
        data.USPS_PATH = usps  # usps_784 reads the path given on the command line
        X, y, _, _, Xt, yt = data.usps_784(n, 1000, 2007)
        return "digits (usps_784)", X, y, Xt, yt
    X, y = synthetic(n + 2007)
    return "synthetic 784", X[:n], y[:n], X[n:], y[n:]


class Budget:
    def __init__(self, seconds: float):
        self.deadline = time.monotonic() + seconds

    def left(self) -> float:
        return self.deadline - time.monotonic()


def guarded(entry: dict, budget: Budget, minimum_s: float, step) -> dict:
    """entry updated with step()'s figures, or with why it was skipped or failed."""
    if budget.left() < minimum_s:
        return {**entry, "skipped": f"{budget.left():.0f} s left, step needs {minimum_s:.0f}"}
    try:
        return {**entry, **step()}
    except Exception as error:  # recorded, and the next step runs
        return {
            **entry,
            "error": f"{type(error).__name__}: {error}",
            "trace": traceback.format_exc()[-2000:],
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=HERE / "results" / "gpu.json")
    parser.add_argument("--budget-s", type=float, default=450.0)
    parser.add_argument("--usps", type=Path, default=None)
    parser.add_argument("--smoke", action="store_true", help="CPU plumbing check, toy sizes")
    args = parser.parse_args()
    device = torch.device("cpu" if args.smoke else "cuda")
    if not args.smoke and not torch.cuda.is_available():
        sys.exit("gpu_check: no CUDA device (use --smoke for the CPU plumbing check)")
    budget = Budget(args.budget_s)
    facts = device_facts(device)
    sizes = (600, 1200) if args.smoke else (250_000, 1_000_000)
    n_digits = 1500 if args.smoke else 60_000
    result = {**facts, "date": time.strftime("%Y-%m-%d"), "runs": []}

    def save() -> None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        partial = args.out.with_suffix(".json.partial")
        partial.write_text(json.dumps(result, indent=2, default=str))
        partial.replace(args.out)  # a reader never sees a half-written file

    if args.smoke:
        result["cuda_tests"] = {"skipped_by": "--smoke"}
    else:
        result["cuda_tests"] = guarded({}, budget, 60, lambda: run_cuda_tests(budget.left() - 240))
    save()
    for n in sizes:
        entry = {"name": "exact objective", "n": n, "d": 32, "D": 128, "objective": "nca"}
        entry["exact"] = True
        step = lambda n=n: time_exact(n, 128, 32, device, 2 if args.smoke else 3, facts)  # noqa: E731
        result["runs"].append(guarded(entry, budget, 20 if n < 10**6 else 60, step))
        save()
    name, X, y, Xt, yt = digits_set(args.usps, n_digits)
    entry = {"name": "default fit", "data": name, "n": len(y), "d": 32, "D": X.shape[1]}
    entry.update(objective="nca", exact=False)
    params = {"max_iter": 3} if args.smoke else {}
    result["runs"].append(
        guarded(entry, budget, 90, lambda: fit_run(X, y, Xt, yt, device, **params))
    )
    save()
    for n in sizes:
        entry = {"name": "exact fit, 5 iterations", "n": n, "d": 32, "D": 128, "objective": "nca"}
        entry.update(exact=True, max_iter=5)

        def short_fit(n=n):
            Xs, ys = synthetic(n, n_features=128)
            return fit_run(Xs, ys, None, None, device, n_candidates=None, max_iter=5)

        result["runs"].append(guarded(entry, budget, 60 if n < 10**6 else 150, short_fit))
        save()
    entry = {"name": "default fit", "data": "synthetic 128", "n": sizes[-1], "d": 32, "D": 128}
    entry.update(objective="nca", exact=False)

    def large_default_fit():
        Xs, ys = synthetic(sizes[-1], n_features=128)
        return fit_run(Xs, ys, None, None, device, **params)

    result["runs"].append(guarded(entry, budget, 200, large_default_fit))
    save()
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=2, default=str))
    for run in result["runs"]:
        print({k: v for k, v in run.items() if k not in ("trace", "plan")})


if __name__ == "__main__":
    main()
