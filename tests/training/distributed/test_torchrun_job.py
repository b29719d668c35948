"""The training job under ``torchrun`` (2 ranks on gloo, CPU): the artifact equals the
1-rank one; a rank killed mid-fit fails the job without touching the previous artifact, or,
with ``--max-restarts``, the restarted world resumes from the checkpoint to the same map.

Slow (each torchrun start imports torch in every rank): run with ``make test-slow``.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[3]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
ARRAYS = ("embeddings", "labels", "projection", "offset", "mean", "scale")


def torchrun(n_ranks: int, *args: str, **kwargs) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        [*TORCHRUN, "--nproc_per_node", str(n_ranks), "-m", "training", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        **kwargs,
    )


def finished(process: subprocess.Popen, timeout: float = 300) -> tuple[int, str]:
    _, err = process.communicate(timeout=timeout)
    return process.returncode, err


def manifest(path: Path) -> dict:
    return json.loads((path / "manifest.json").read_text())


def test_two_ranks_write_the_artifact_one_rank_writes(tmp_path):
    # --tol 0: both runs take their 8 iterations (where L-BFGS converges depends on the
    # order of the float32 sums), so their iteration counts and stop reasons agree by budget
    common = ["--data", "digits", "--max-iter", "8", "--tol", "0", "--no-plots", "--quiet"]
    outs = {}
    for n_ranks in (1, 2):
        outs[n_ranks] = tmp_path / f"p{n_ranks}"
        code, err = finished(torchrun(n_ranks, *common, "--out", str(outs[n_ranks])))
        assert code == 0, err
    m1, m2 = manifest(outs[1]), manifest(outs[2])
    assert (m1["training"]["world_size"], m2["training"]["world_size"]) == (1, 2)
    assert m1["training"]["distributed_backend"] == m2["training"]["distributed_backend"] == "gloo"
    assert m1["data"] == m2["data"]  # the same rows: fingerprints agree across shardings
    for key in ("classes", "default_k", "n_references", "n_features_in", "standardization"):
        assert m1[key] == m2[key]
    for field in ("n_iter", "init", "standardization", "stop_reason"):
        assert m1["training"][field] == m2["training"][field]
    # float32 sums in another order (~1e-7), through 8 L-BFGS iterations
    for name in ARRAYS:
        a1, a2 = np.load(outs[1] / f"{name}.npy"), np.load(outs[2] / f"{name}.npy")
        np.testing.assert_allclose(a2, a1, rtol=0, atol=1e-3 * max(1.0, np.abs(a1).max()))
    assert m2["metrics"]["test_accuracy"] == pytest.approx(m1["metrics"]["test_accuracy"], abs=0.01)


def _rank_pid(parent: int, rank: int, timeout: float = 60) -> int:
    """The pid of the worker with RANK=rank below the torchrun process ``parent``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                environ = (entry / "environ").read_bytes().split(b"\0")
                stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if f"RANK={rank}".encode() in environ and int(stat[1]) == parent:
                return int(entry.name)
        time.sleep(0.2)
    raise AssertionError(f"no rank {rank} worker under pid {parent}")


def test_a_rank_killed_mid_fit_fails_the_job_and_the_previous_artifact_stays(tmp_path):
    rng = np.random.default_rng(0)
    X = rng.normal(size=(6000, 60)) + np.repeat(rng.normal(size=(6, 60)), 1000, 0) * 0.3
    y = np.repeat(np.arange(6), 1000)
    np.save(tmp_path / "X.npy", X)
    np.save(tmp_path / "y.npy", y)
    out, link = tmp_path / "model", tmp_path / "current"
    code, err = finished(
        torchrun(
            1,
            "--data",
            "digits",
            "--max-iter",
            "3",
            "--no-plots",
            "--quiet",
            "--out",
            str(out),
            "--publish",
            str(link),
        )
    )
    assert code == 0, err
    before = manifest(out)
    process = torchrun(
        2,
        "--data",
        str(tmp_path / "X.npy"),
        "--labels",
        str(tmp_path / "y.npy"),
        "--n-candidates",
        "exact",
        "--max-iter",
        "500",
        "--tol",
        "0",
        "--l2",
        "0",  # unpenalised: dozens of iterations, so rank 1 dies in the middle of the fit
        "--no-early-stopping",
        "--no-plots",
        "--out",
        str(out),
        "--publish",
        str(link),
    )
    victim = _rank_pid(process.pid, 1)
    # into the fit: wait for rank 0's first iteration line on stdout (data loaded, the
    # process group formed, the optimiser running), however fast this machine is, then kill
    # rank 1
    streams = {"stdout": [], "stderr": []}
    fitting = threading.Event()

    def read(name):
        for line in getattr(process, name):
            streams[name].append(line)
            if name == "stdout" and re.match(r"\[NCA\]\s+\d+\s", line):
                fitting.set()

    readers = [threading.Thread(target=read, args=(name,)) for name in streams]
    for reader in readers:
        reader.start()
    assert fitting.wait(120), "the fit never started: " + "".join(streams["stderr"])[-2000:]
    os.kill(victim, signal.SIGKILL)
    process.wait(120)
    for reader in readers:
        reader.join(30)
    code, err = process.returncode, "".join(streams["stderr"])
    assert code != 0
    assert "rank" in err.lower() and ("signal 9" in err.lower() or "sigkill" in err.lower()), err
    assert manifest(out) == before  # not replaced, not half-written
    assert Path(os.readlink(link)).resolve() == out.resolve() or (link.resolve() == out.resolve())
    # the writers' lock of "model" stays by design (service.core.artifact.ownership): it is
    # ours, empty of data, and freed by the kernel when its holder died
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.startswith((".model", "model."))]
    assert [name for name in leftovers if name != ".model.lock"] == []


def test_bad_rows_on_one_rank_fail_the_job_with_a_message_naming_that_rank(tmp_path):
    from training.data.datasets import Dataset, plan_split

    rng = np.random.default_rng(1)
    X = rng.normal(size=(400, 5))
    y = np.arange(400) % 4
    plan = plan_split(Dataset(X=X, y=y), test_size=0.2, val_size=0.1, seed=0)
    X[plan.train_idx[-1], 2] = np.nan  # the last training row: rank 1's shard
    np.save(tmp_path / "X.npy", X)
    np.save(tmp_path / "y.npy", y)
    code, err = finished(
        torchrun(
            2,
            "--data",
            str(tmp_path / "X.npy"),
            "--labels",
            str(tmp_path / "y.npy"),
            "--out",
            str(tmp_path / "model"),
        )
    )
    assert code != 0
    assert "error (rank 1 of 2): X (rank 1's training rows): contains NaN or Inf" in err, err
    assert not (tmp_path / "model").exists()


SAVE_EVERY_ITERATION = """\
import sys
import time
import training.job as job
import training.model.fitting as fitting
from training.cli import main
fitting.CHECKPOINT_SECONDS = 0.0  # a checkpoint after every iteration of the exact fit
def slow(A, iteration):  # 0.1 s an iteration: the kill lands mid-fit even on a loaded machine
    time.sleep(0.1)
built = job.build_estimator
job.build_estimator = lambda config, n: built(config, n).set_params(callback=slow)
sys.exit(main(sys.argv[1:]))
"""


def test_a_world_restarted_after_a_rank_is_killed_resumes_to_the_uninterrupted_map(tmp_path):
    """torchrun --max-restarts 1 (the multinode overlay's setting): rank 1 SIGKILLed in the
    middle of an exact fit that checkpoints every iteration; torchrun restarts both ranks,
    they resume from the newest point both saved, and the artifact's map is the one an
    uninterrupted 2-rank run writes, bit for bit."""
    rng = np.random.default_rng(0)
    X = rng.normal(size=(6000, 60)) + np.repeat(rng.normal(size=(6, 60)), 1000, 0) * 0.3
    np.save(tmp_path / "X.npy", X)
    np.save(tmp_path / "y.npy", np.repeat(np.arange(6), 1000))
    script = tmp_path / "train.py"
    script.write_text(SAVE_EVERY_ITERATION)
    args = ["--data", str(tmp_path / "X.npy"), "--labels", str(tmp_path / "y.npy")]
    args += ["--n-candidates", "exact", "--max-iter", "40", "--tol", "0", "--l2", "0"]
    args += ["--no-early-stopping", "--no-stop-stalled-stages", "--no-plots"]  # all 40 run

    def launch(out: Path, *extra: str) -> subprocess.Popen:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
        command = [*TORCHRUN, *extra, "--nproc_per_node", "2", str(script), *args]
        return subprocess.Popen(
            [*command, "--out", str(out)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=tmp_path,
        )

    code, err = finished(launch(tmp_path / "whole"))
    assert code == 0, err
    process = launch(tmp_path / "resumed", "--max-restarts", "1")
    victim = _rank_pid(process.pid, 1)
    streams = {"stdout": [], "stderr": []}
    iterating = threading.Event()

    def read(name):
        for line in getattr(process, name):
            streams[name].append(line)
            found = re.match(r"\[NCA\]\s+(\d+)\s", line)
            if name == "stdout" and found and int(found.group(1)) >= 10:
                iterating.set()

    readers = [threading.Thread(target=read, args=(name,)) for name in streams]
    for reader in readers:
        reader.start()
    assert iterating.wait(240), "".join(streams["stderr"])[-2000:]
    os.kill(victim, signal.SIGKILL)
    process.wait(300)
    for reader in readers:
        reader.join(30)
    err = "".join(streams["stderr"])
    assert process.returncode == 0, err[-3000:]
    resumed = re.search(r"resumed from \S+: 0 stage\(s\) were done, (\d+) iteration", err)
    assert resumed and 9 <= int(resumed.group(1)) < 40, err[-3000:]
    for name in ("projection", "embeddings"):
        np.testing.assert_array_equal(
            np.load(tmp_path / "resumed" / f"{name}.npy"),
            np.load(tmp_path / "whole" / f"{name}.npy"),
        )
    assert not (tmp_path / ".resumed.checkpoint").exists()
