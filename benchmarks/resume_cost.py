"""What a kill costs a fit that resumes from its checkpoint (issue 57).

On the real MNIST training set (60,000 x 784), ``NCA(n_components=32, random_state=0)``:

1. an uninterrupted fit, timed (T), its map saved;
2. the same fit with a checkpoint directory, in a process SIGKILLed at ``--kill-at`` x T;
3. the same fit again with that checkpoint, timed (R), its map compared with 1's.

Prints T, the kill time, R, the overhead (kill time + R - T) / T, the stages the resume
and iterations skipped, whether the maps are equal bit for bit, and the machine's float32 GEMM
rate; saves
``benchmarks/results/resume_cost.json``. Each fit runs alone, in a process of its own.

    taskset -c 0,1 python benchmarks/resume_cost.py [--kill-at 0.7]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness.report import gemm_gflops, save_json

ROOT = Path(__file__).resolve().parents[1]
MNIST = ROOT.parent / "shared" / "data" / "mnist.npz"

FIT = """
import json, sys, time, warnings
import numpy as np
from training import NCA
X = np.load(sys.argv[1])["X"].astype(np.float32)
y = np.load(sys.argv[1])["y"]
checkpoint = None if sys.argv[3] == "none" else sys.argv[3]
started = time.perf_counter()
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    model = NCA(n_components=32, random_state=0).fit(X, y, checkpoint=checkpoint)
np.save(sys.argv[2], model.components_)
print(json.dumps({"seconds": time.perf_counter() - started,
                  "resumed_stages": model.resumed_stages_,
                  "resumed_iterations": getattr(model, "resumed_iterations_", None),
                  "stages": [(r["stage"], r["seconds"]) for r in model.stages_]}))
"""


def run_fit(data: Path, out: Path, checkpoint: str, kill_after: float | None = None) -> dict:
    process = subprocess.Popen(
        [sys.executable, "-c", FIT, str(data), str(out), checkpoint],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    if kill_after is not None:
        time.sleep(kill_after)
        process.kill()
        process.wait()
        return {}
    stdout, _ = process.communicate()
    return json.loads(stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kill-at", type=float, default=0.7)
    args = parser.parse_args()
    if not MNIST.exists():
        print(f"{MNIST} is absent: nothing measured")
        return
    gemm = gemm_gflops()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        with np.load(MNIST) as data:  # the training rows only
            np.savez(tmp / "train.npz", X=data["X"], y=data["y"])
        whole = run_fit(tmp / "train.npz", tmp / "whole.npy", "none")
        kill_after = args.kill_at * whole["seconds"]
        run_fit(tmp / "train.npz", tmp / "killed.npy", str(tmp / "ckpt"), kill_after)
        resumed = run_fit(tmp / "train.npz", tmp / "resumed.npy", str(tmp / "ckpt"))
        same = bool(np.array_equal(np.load(tmp / "whole.npy"), np.load(tmp / "resumed.npy")))
    overhead = (kill_after + resumed["seconds"] - whole["seconds"]) / whole["seconds"]
    print(f"uninterrupted fit   {whole['seconds']:7.1f} s  stages {whole['stages']}")
    print(f"killed at           {kill_after:7.1f} s  ({args.kill_at:.0%})")
    print(
        f"resumed fit         {resumed['seconds']:7.1f} s  skipped {resumed['resumed_stages']} "
        f"stage(s) and {resumed.get('resumed_iterations')} iteration(s) in all; the same map: "
        f"{same}"
    )
    print(f"overhead of the kill: {overhead:.0%} of an uninterrupted fit")
    print(f"float32 GEMM {gemm:.1f} GFLOP/s")
    save_json(
        "resume_cost.json",
        {
            "gemm_gflops": gemm,
            "kill_at": args.kill_at,
            "uninterrupted": whole,
            "killed_after_s": kill_after,
            "resumed": resumed,
            "same_map": same,
            "overhead": overhead,
        },
    )


if __name__ == "__main__":
    main()
