"""SIGINT and SIGTERM in ``python -m training`` (``training.errors.holding_interrupts``): in a
checkpointed stage a first signal is held to the iteration's end and saved there, but not
longer than HOLD_SECONDS, and a second one raises at once; once the artifact's write has
begun a first signal waits for the job's end (exit 0, the artifact whole), a second one
ends it with a line that says the artifact was written; during the imports a signal ends
the command in one line, never a traceback."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from service.core.artifact import read_artifact
from tests.training.problems import hard_noisy
from training import errors

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# SIGTERM sent (``signals``: how many) by the fit's callback at the end of the exact fit's
# 6th iteration, before its save, after which the iteration goes on for ``linger`` seconds
SIGNAL_AT_ITERATION_6 = """\
import os, signal, time
import training.job as job
import training.model.fitting as f
f.CHECKPOINT_SECONDS = 0.0  # a periodic save after every iteration
f.HOLD_SECONDS = {hold}
def signal_at_6(A, iteration):
    if iteration == 6:
        for _ in range({signals}):
            os.kill(os.getpid(), signal.SIGTERM)
        time.sleep({linger})
built = job.build_estimator
job.build_estimator = lambda config, n: built(config, n).set_params(callback=signal_at_6)
"""


def fit_args(tmp_path):
    # an exact fit that runs its 30 iterations: overlapping classes with noisy labels keep
    # the loss falling (4 well-separated blobs stopped on float32's precision after 5-7
    # iterations, as the sums' order moved)
    X, y = hard_noisy(600)[:2]
    np.save(tmp_path / "X.npy", X)
    np.save(tmp_path / "y.npy", y)
    args = ["--data", tmp_path / "X.npy", "--labels", tmp_path / "y.npy", "--n-components", "2"]
    return [*args, "--n-candidates", "exact", "--max-iter", "30", "--tol", "0", "--no-plots"]


def test_a_signal_held_past_its_limit_or_a_second_one_stops_the_fit_at_once(
    python_m_training, tmp_path
):
    """The 6th iteration outlasts the hold (2 s against 0.2 s), or a second SIGTERM follows
    the first: the fit stops inside the iteration, so the checkpoint is the 5th
    iteration's periodic save, and the run again resumes there to the uninterrupted map."""
    args = fit_args(tmp_path)
    code, _, err = python_m_training(*args, "--out", tmp_path / "whole", "--quiet")
    assert code == 0, err
    for name, prelude in {
        "outlasted": SIGNAL_AT_ITERATION_6.format(hold=0.2, signals=1, linger=2.0),
        "second": SIGNAL_AT_ITERATION_6.format(hold=60.0, signals=2, linger=0.0),
    }.items():
        out = tmp_path / name
        code, _, err = python_m_training(*args, "--out", out, "--quiet", prelude=prelude)
        assert code == 143 and "Traceback" not in err, err
        code, _, err = python_m_training(*args, "--out", out, "--quiet")
        assert code == 0, err
        assert "0 stage(s) were done, 5 iteration(s) in all" in err, (name, err)
        np.testing.assert_array_equal(
            read_artifact(out).projection, read_artifact(tmp_path / "whole").projection
        )


def test_a_signal_while_the_artifact_is_written_waits_for_the_job_to_end(
    python_m_training, tmp_path
):
    """SIGTERM as the artifact's write begins: the job finishes (the artifact, --publish,
    the checkpoint removed), says the signal came, and exits 0. A second signal, SIGINT
    while the page is written, ends it with 130 and a line saying the artifact was
    written, not that nothing was (its status the first signal's)."""
    args = [*fit_args(tmp_path), "--quiet"]
    drain_at_write = (
        "import os, signal\nimport training.job as job\nreal = job.save_artifact\n"
        "def save(*a, **k):\n    os.kill(os.getpid(), signal.SIGTERM)\n    return real(*a, **k)\n"
        "job.save_artifact = save\n"
    )
    out, current = tmp_path / "m", tmp_path / "current"
    code, _, err = python_m_training(
        *args, "--out", out, "--publish", current, prelude=drain_at_write
    )
    assert code == 0, err
    assert f"SIGTERM arrived while {out} was being written: the job finished first" in err
    assert read_artifact(out).projection.shape == (2, 40) and current.resolve() == out
    assert not (tmp_path / ".m.checkpoint").exists()
    second = drain_at_write + (
        "real_page = job._write_page\n"
        "def page(*a, **k):\n    os.kill(os.getpid(), signal.SIGINT)\n    return real_page(*a, **k)\n"
        "job._write_page = page\n"
    )
    code, _, err = python_m_training(*args, "--out", tmp_path / "m2", prelude=second)
    assert code == 143 and "Traceback" not in err, err
    line = err.strip().splitlines()[-1]
    assert (
        f"{tmp_path / 'm2'} was written whole first" in line and "nothing was written" not in line
    )
    assert read_artifact(tmp_path / "m2").projection.shape == (2, 40)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_during_the_imports_ends_the_command_in_one_line(tmp_path, signum):
    """A signal 0.3 s after ``python -m training`` starts (torch and the readers still being
    imported, ~2 s): exit 128 + signum (130, 143) and one line naming it; before, a
    KeyboardInterrupt traceback (or, in polars' import, a RuntimeError and exit 1). Whenever
    it lands, never a traceback, and nothing written."""
    command = [sys.executable, "-m", "training", "--data", "iris", "--out", str(tmp_path / "m")]
    process = subprocess.Popen(
        command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    time.sleep(0.3)
    process.send_signal(signum)
    _, err = process.communicate(timeout=120)
    assert process.returncode == 128 + signum, err
    assert "Traceback" not in err
    name = signal.Signals(signum).name
    assert err.strip().splitlines()[-1].startswith(f"error: interrupted by {name}"), err
    assert not (tmp_path / "m").exists()


@pytest.fixture
def our_handler():
    """raise_on_interrupt's handler for the test, the process's own restored after it."""
    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    errors.raise_on_interrupt()
    yield
    for signum, handler in previous.items():
        signal.signal(signum, handler)


def test_a_hold_keeps_the_first_signal_and_raises_the_second_at_once(our_handler):
    with errors.holding_interrupts(None) as hold:
        os.kill(os.getpid(), signal.SIGTERM)
        assert errors.held_interrupt() == signal.SIGTERM  # held, not raised
        with pytest.raises(errors.Interrupted) as caught:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)  # the handler runs at the next bytecode: never reached
        assert caught.value.signum == signal.SIGTERM  # the first signal's status
    assert hold.signum == signal.SIGTERM and errors.held_interrupt() is None
    with pytest.raises(errors.Interrupted):  # no hold: at once
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(1)


def test_a_holds_timer_raises_only_while_its_hold_is_in_force(our_handler):
    """The time limit raises the held signal wherever the work is; a timer that fires as
    its hold ends (too late to be cancelled) does nothing: before, it raised into
    whatever ran next, the job's error handling included."""
    with pytest.raises(errors.Interrupted):
        with errors.holding_interrupts(0.05):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the work outlasts the hold's 0.05 s
    with errors.holding_interrupts(60.0) as hold:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.01)  # the handler has run: the timer is armed
    errors._expire(hold)  # as a timer that fired just as the hold ended
    time.sleep(0.05)  # nothing raised


def test_a_line_for_a_written_artifact_does_not_ask_for_a_run_again(tmp_path):
    exc = errors.Interrupted(signal.SIGTERM)
    exc.written = str(tmp_path / "m")
    (tmp_path / ".m.checkpoint").mkdir()
    (tmp_path / ".m.checkpoint" / "fit-rank0.npz").write_bytes(b"")
    line = errors.interrupted_line(exc, 1.0, str(tmp_path / "m"), tmp_path / ".m.checkpoint")
    assert f"{tmp_path / 'm'} was written whole first" in line
    assert "nothing was written" not in line and "run the same command again" not in line


def test_a_second_signal_during_the_imports_is_one_line_too(tmp_path):
    command = [sys.executable, "-m", "training", "--data", "iris", "--out", str(tmp_path / "m")]
    process = subprocess.Popen(
        command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    time.sleep(0.3)
    process.send_signal(signal.SIGINT)
    time.sleep(0.3)
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=120)
    assert process.returncode == 130 and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1 and err.startswith("error: interrupted by SIGINT")


# SIGTERM sent by the second fit's callback (the cross-fit's first fold) at the end of its
# 3rd iteration, after which the iteration goes on for 0.3 s; each iteration's end is
# written to ``log``
SIGNAL_IN_A_FOLD = """\
import os, signal, time
import training.job as job
built, fits = job.build_estimator, []
def build_estimator(config, n_features):
    fits.append(len(fits) + 1)  # 1: the job's fit; 2, 3, 4: the cross-fit's folds
    fit = fits[-1]
    def at_iteration_end(A, iteration):
        if fit == 2 and iteration == 3:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.3)
        with open({log!r}, "a") as log:
            log.write(f"fit {{fit}} iteration {{iteration}} ended\\n")
    return built(config, n_features).set_params(callback=at_iteration_end)
job.build_estimator = build_estimator
"""


def test_a_signal_in_a_cross_fitted_fit_stops_it_at_its_iterations_end(python_m_training, tmp_path):
    """The cross-fit's fits have no checkpoint: a signal raised wherever it landed could leave
    their threads mid-work as the process ended (SIGABRT at exit in 3 of 12 tries by the
    hostile pass). It is held to the iteration's end, then the job ends in one line (143)
    with nothing written, and the run again writes the model."""
    args = fit_args(tmp_path)
    log = tmp_path / "iterations.log"
    prelude = SIGNAL_IN_A_FOLD.format(log=str(log))
    out = tmp_path / "m"
    code, _, err = python_m_training(
        *args, "--k-folds", "3", "--out", out, "--quiet", prelude=prelude, finalize=True
    )
    assert code == 143 and "Traceback" not in err and "terminate" not in err, err
    assert "choosing k: 3 maps" in err and "interrupted by SIGTERM" in err, err
    ended = log.read_text().splitlines()
    assert ended[-1] == "fit 2 iteration 3 ended", ended  # the signalled iteration's end
    assert not out.exists()
    code, _, err = python_m_training(*args, "--k-folds", "3", "--out", out, "--quiet")
    assert code == 0, err
    assert read_artifact(out).manifest["metrics"]["k_choice"]["method"] == "cross-fitted"
