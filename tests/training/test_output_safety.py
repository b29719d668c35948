"""Nothing of the user's is lost by a command that writes an artifact (issue 57, targets 1
and 2): an ``--out`` holding what we did not write is refused before any work, exit 2 and
one line, and left as it was; writers of one artifact take turns, so that every edit that
exits 0 is in the result, nothing removed comes back, and the lineage lists exactly the
edits that landed; a writer that finds its ``--out`` replaced since it started exits 2 and
replaces nothing; a writer killed in the middle leaves the next one free to write.

The concurrent writers are ``python -m training`` processes, started while another process
holds the artifact's writer lock, so that all of them wait at once and race for it when it
is released."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

from service.core.artifact import read_artifact, writer_lock
from service.core.artifact.ownership import lock_path
from training.cli import main as cli_main

ROOT = Path(__file__).resolve().parents[2]


def start_cli(args: list, stderr: Path) -> subprocess.Popen:
    """``python -m training ARGS`` in a fresh interpreter, its stderr into ``stderr``. (A fork
    of this process would share whatever locks its threads held at the fork: a child of a
    process that has run torch's or the test server's threads can hang on one.)"""
    with open(stderr, "w") as err:
        return subprocess.Popen(
            [sys.executable, "-m", "training", *map(str, args)],
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=err,
        )


def exit_status(process: subprocess.Popen, timeout: float = 120) -> int:
    try:
        return process.wait(timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        pytest.fail(f"writer {process.args} still running after {timeout} s")


def wait_until(predicate, timeout: float = 60, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"waited {timeout} s for {what}")
        time.sleep(0.02)


HOLDER = """
import sys, time
from pathlib import Path
from service.core.artifact import writer_lock
path, ready, release = sys.argv[1:]
with writer_lock(path, wait_notice=None):
    Path(ready).touch()
    deadline = time.monotonic() + 120
    while not Path(release).exists() and time.monotonic() < deadline:
        time.sleep(0.01)
"""


@contextmanager
def lock_held_elsewhere(path: Path, tmp_path: Path):
    """``path``'s writer lock, held by a process of its own until the block ends (a lock
    taken here would be inherited by the writers forked meanwhile: flock belongs to the open
    file, which a fork shares)."""
    ready, release = tmp_path / "held", tmp_path / "release"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(path), str(ready), str(release)], cwd=ROOT
    )
    wait_until(ready.exists, what="the lock holder")
    try:
        yield
    finally:
        release.touch()
        holder.wait(60)
        ready.unlink()
        release.unlink()


def race(commands: list[list[str]], lock_of: Path, tmp_path: Path) -> list[tuple[int, str]]:
    """Start every command while another process holds ``lock_of``'s writer lock, wait
    until each says it waits for it, release it: (exit status, stderr) of each, in order."""
    logs = [tmp_path / f"writer-{i}.err" for i in range(len(commands))]
    with lock_held_elsewhere(lock_of, tmp_path):
        writers = [start_cli(args, log) for args, log in zip(commands, logs, strict=False)]
        wait_until(
            lambda: all(log.exists() and "waiting for" in log.read_text() for log in logs),
            what="every writer to wait for the lock",
        )
    return [(exit_status(w), log.read_text()) for w, log in zip(writers, logs, strict=False)]


def save_rows(path: Path, X: np.ndarray, y: np.ndarray) -> Path:
    np.savez(path, X=X, y=y)
    return path


@pytest.fixture
def model(digits_like_model, tmp_path):
    """A copy of the digits-like model this test may change, and its split."""
    source, split = digits_like_model
    path = tmp_path / "m"
    shutil.copytree(source, path)
    return path, split


def lineage(path: Path) -> list[dict]:
    return read_artifact(path).manifest.get("lineage", [])


def test_concurrent_adds_in_place_all_land(model, tmp_path):
    path, split = model
    n_before = len(read_artifact(path).ids)
    commands = []
    for i in range(4):
        rows = save_rows(
            tmp_path / f"rows{i}.npz", split.X_test[i * 5 : i * 5 + 5], split.y_test[:5]
        )
        ids = tmp_path / f"ids{i}.txt"
        ids.write_text("\n".join(str(10_000 + 10 * i + j) for j in range(5)))
        commands.append(
            ["references", "add", "--model", path, "--data", rows, "--ids", ids, "--out", path]
        )
    results = race(commands, path, tmp_path)
    assert [code for code, _ in results] == [0] * 4, results
    artifact = read_artifact(path)
    added = {10_000 + 10 * i + j for i in range(4) for j in range(5)}
    assert added <= set(artifact.ids.tolist())
    assert len(artifact.ids) == n_before + 20
    assert [e["operation"] for e in lineage(path)] == ["add"] * 4
    # each edit's parent is the version the one before it wrote: a chain, none lost
    parents = [e["parent_version"] for e in lineage(path)]
    assert len(set(parents)) == 4


@pytest.mark.parametrize("round_", range(2))
def test_a_remove_racing_an_add_keeps_both(model, tmp_path, round_):
    path, split = model
    ids = read_artifact(path).ids
    drop = ids[round_ * 7 : round_ * 7 + 7]
    rows = save_rows(tmp_path / "rows.npz", split.X_test[:4], split.y_test[:4])
    commands = [
        ["references", "add", "--model", path, "--data", rows, "--out", path],
        ["references", "remove", "--model", path, "--ids", *map(str, drop), "--out", path],
    ]
    if round_ % 2:
        commands.reverse()
    results = race(commands, path, tmp_path)
    assert [code for code, _ in results] == [0, 0], results
    after = read_artifact(path)
    assert not set(drop.tolist()) & set(after.ids.tolist())  # nothing removed comes back
    assert len(after.ids) == len(ids) - 7 + 4  # and the add landed
    assert sorted(e["operation"] for e in lineage(path)) == ["add", "remove"]


def test_two_adds_to_one_new_out_one_lands_the_other_refuses(model, tmp_path):
    path, split = model
    out = tmp_path / "new"
    rows = [
        save_rows(tmp_path / f"rows{i}.npz", split.X_test[i : i + 3], split.y_test[:3])
        for i in range(2)
    ]
    commands = [["references", "add", "--model", path, "--data", r, "--out", out] for r in rows]
    results = race(commands, out, tmp_path)
    codes = sorted(code for code, _ in results)
    assert codes == [0, 2], results
    refused = next(err for code, err in results if code == 2)
    lines = [line for line in refused.splitlines() if line.startswith("error")]
    assert len(lines) == 1 and "written by another process" in lines[0] and str(out) in lines[0]
    assert "Traceback" not in refused
    assert len(lineage(out)) == 1  # the one that exited 0, and only it


def test_a_writer_killed_in_the_middle_leaves_the_next_free(model, tmp_path):
    path, split = model
    rows = save_rows(tmp_path / "rows.npz", split.X_test[:4], split.y_test[:4])
    n_before = len(read_artifact(path).ids)
    for delay in (1.0, 2.5, 3.5):  # in its imports, its reads, its write
        writer = start_cli(
            ["references", "add", "--model", path, "--data", rows, "--out", path],
            tmp_path / "killed.err",
        )
        time.sleep(delay)
        writer.send_signal(signal.SIGKILL)
        writer.wait()
    code = cli_main(
        ["references", "add", "--model", str(path), "--data", str(rows), "--out", str(path)]
    )
    assert code == 0
    after = read_artifact(path)
    adds = [e for e in lineage(path) if e["operation"] == "add"]
    assert len(after.ids) == n_before + 4 * len(adds)  # every listed edit is there, whole
    assert adds and adds[-1]["rows_after"] == len(after.ids)


def user_directory(tmp_path: Path, split) -> tuple[Path, dict[str, bytes]]:
    """A directory of the user's: data files and notes."""
    d = tmp_path / "d"
    d.mkdir()
    np.save(d / "X.npy", split.X_train)
    np.save(d / "y.npy", split.y_train)
    (d / "notes.txt").write_text("my notes")
    return d, {p.name: p.read_bytes() for p in d.iterdir()}


def assert_one_line_refusal(code: int, stderr: str, path: Path) -> None:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert code == 2, stderr
    assert "Traceback" not in stderr
    assert len(lines) == 1 and lines[0].startswith("error"), lines
    assert str(path) in lines[0] and "not an artifact" in lines[0], lines[0]


def test_the_training_job_refuses_an_out_holding_the_users_files(tmp_path, digits_like_model):
    _, split = digits_like_model
    d, before = user_directory(tmp_path, split)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "training",
            "--data",
            d / "X.npy",
            "--labels",
            d / "y.npy",
            "--out",
            d,
            "--quiet",
            "--max-iter",
            "2",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert_one_line_refusal(done.returncode, done.stderr, d)
    assert {p.name: p.read_bytes() for p in d.iterdir()} == before
    assert not lock_path(d).exists()  # refused before any work: not even the lock


@pytest.mark.parametrize("command", ["add", "remove", "condense"])
def test_the_references_commands_refuse_an_out_holding_the_users_files(
    model, tmp_path, command, capsys
):
    path, split = model
    d, before = user_directory(tmp_path, split)
    rows = save_rows(tmp_path / "rows.npz", split.X_test[:4], split.y_test[:4])
    extra = {
        "add": ["--data", rows],
        "remove": ["--ids", str(read_artifact(path).ids[0])],
        "condense": [],
    }[command]
    code = cli_main(
        ["references", command, "--model", str(path), *map(str, extra), "--out", str(d)]
    )
    assert_one_line_refusal(code, capsys.readouterr().err, d)
    assert {p.name: p.read_bytes() for p in d.iterdir()} == before


def test_the_index_builder_refuses_an_out_holding_the_users_files(model, tmp_path, capsys):
    from service.search.tuning import main as index_main

    path, split = model
    d, before = user_directory(tmp_path, split)
    assert index_main([str(path), "--index", "hnsw", "--out", str(d)]) == 1
    assert "not an artifact" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in d.iterdir()} == before


def test_a_retrain_does_not_replace_an_edit_that_landed_while_it_ran(model, tmp_path):
    """The job claims --out when it starts; a references add lands there while the fit runs
    (here: while the job waits for its turn, the lock held by the test); the job then exits 2
    and the add is kept."""
    from training.references.versions import add_references

    path, split = model
    X, y = tmp_path / "X.npy", tmp_path / "y.npy"
    np.save(X, split.X_train)
    np.save(y, split.y_train)
    err = tmp_path / "job.err"
    with writer_lock(path, wait_notice=None), open(err, "w") as stderr:
        job = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "training",
                "--data",
                X,
                "--labels",
                y,
                "--out",
                path,
                "--quiet",
                "--max-iter",
                "2",
            ],
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=stderr,
        )
        wait_until(lambda: "waiting for" in err.read_text(), 300, "the job to reach its turn")
        add_references(path, split.X_test[:4], split.y_test[:4], out=path)
    code = job.wait(300)
    text = err.read_text()
    assert code == 2, text
    assert "written by another process" in text and "Traceback" not in text
    assert [e["operation"] for e in lineage(path)] == ["add"]  # the add is kept


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signalled_job_ends_within_seconds_with_one_line_and_writes_nothing(
    model, tmp_path, signum
):
    """A node drain sends SIGTERM, Ctrl-C SIGINT: the job ends within 10 s, exit 128 + the
    signal, one line saying what happened, no traceback; the version at --out is intact."""
    path, _ = model
    before = {p.name: p.read_bytes() for p in path.iterdir()}
    X, y = tmp_path / "X.npy", tmp_path / "y.npy"
    rng = np.random.default_rng(0)
    np.save(X, rng.normal(size=(6000, 64)))  # a fit of several seconds
    np.save(y, np.arange(6000) % 10)
    err = tmp_path / "job.err"
    job = start_cli(["--data", X, "--labels", y, "--out", path, "--quiet"], err)
    wait_until(lambda: "learning d=" in err.read_text(), 60, "the fit to start")
    job.send_signal(signum)
    started = time.monotonic()
    code = exit_status(job, 60)
    assert time.monotonic() - started < 10
    text = err.read_text()
    errors = [line for line in text.splitlines() if line.startswith("error")]
    assert code == 128 + signum, text
    assert "Traceback" not in text and len(errors) == 1, text
    assert f"interrupted by {signal.Signals(signum).name}" in errors[0]
    assert text.splitlines()[-1] == errors[0]
    assert {p.name: p.read_bytes() for p in path.iterdir()} == before
    assert not [p for p in path.parent.iterdir() if ".tmp-" in p.name]  # no staging left


def test_edits_published_through_one_link_all_land(model, tmp_path):
    """The workflow of docs/reference-set.md: each edit reads the published 'current', writes
    a new version and repoints 'current' at it. Two at once both land (before: each read
    the same version, and the last to publish dropped the other's rows)."""
    path, split = model
    pub = tmp_path / "pub"
    pub.mkdir()
    shutil.move(path, pub / "v1")
    (pub / "current").symlink_to("v1")
    n_before = len(read_artifact(pub / "v1").ids)
    commands = []
    for i in range(2):
        rows = save_rows(
            tmp_path / f"rows{i}.npz", split.X_test[i * 3 : i * 3 + 3], split.y_test[:3]
        )
        commands.append(
            [
                "references",
                "add",
                "--model",
                pub / "current",
                "--data",
                rows,
                "--out",
                pub / f"v{i + 2}",
                "--publish",
                pub / "current",
            ]
        )
    results = race(commands, pub / "current", tmp_path)
    assert [code for code, _ in results] == [0, 0], results
    assert len(read_artifact(pub / "current").ids) == n_before + 6
    assert [e["operation"] for e in lineage(pub / "current")] == ["add", "add"]


def test_a_lock_file_planted_as_a_link_is_never_written_through(model, tmp_path, capsys):
    path, _ = model
    notes = tmp_path / "notes.txt"
    notes.write_text("precious")
    (tmp_path / ".q.lock").symlink_to(notes)
    ids = str(read_artifact(path).ids[0])
    code = cli_main(
        ["references", "remove", "--model", str(path), "--ids", ids, "--out", str(tmp_path / "q")]
    )
    assert code == 2 and "Traceback" not in capsys.readouterr().err
    assert notes.read_text() == "precious" and not (tmp_path / "q").exists()


def test_a_users_dated_backup_beside_the_model_is_not_taken_for_staging(model, tmp_path):
    path, _ = model
    backup = tmp_path / ".m.old-2023-11-05"
    backup.mkdir()
    (backup / "README").write_text("backup")
    old = time.time() - 3 * 86400
    os.utime(backup, (old, old))
    ids = str(read_artifact(path).ids[0])
    assert (
        cli_main(["references", "remove", "--model", str(path), "--ids", ids, "--out", str(path)])
        == 0
    )
    assert (backup / "README").read_text() == "backup"


@pytest.mark.parametrize("where", ["out inside the model", "publish is out"])
def test_refused_before_any_work(model, tmp_path, capsys, where):
    path, _ = model
    before = {p.name: p.read_bytes() for p in path.iterdir()}
    ids = str(read_artifact(path).ids[0])
    out = path / "sub" if where == "out inside the model" else tmp_path / "m2"
    extra = ["--publish", str(out)] if where == "publish is out" else []
    code = cli_main(
        ["references", "remove", "--model", str(path), "--ids", ids, "--out", str(out), *extra]
    )
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert not out.exists()
    assert {p.name: p.read_bytes() for p in path.iterdir()} == before


def test_a_writer_stopped_with_sigstop_is_named_and_a_bounded_wait_gives_up(model, tmp_path):
    """A writer stopped mid-turn (SIGSTOP) holds the lock until continued: the waiting add
    says the holder is stopped, and with --lock-timeout gives up in one line, exit 2, the
    model as it was; once the holder is continued, the same add lands."""
    path, split = model
    rows = save_rows(tmp_path / "rows.npz", split.X_test[:4], split.y_test[:4])
    before = read_artifact(path).version
    ready, release = tmp_path / "held", tmp_path / "release"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(path), str(ready), str(release)], cwd=ROOT
    )
    try:
        wait_until(ready.exists, what="the lock holder")
        holder.send_signal(signal.SIGSTOP)
        log = tmp_path / "waiter.err"
        started = time.monotonic()
        args = ["references", "add", "--model", path, "--data", rows, "--out", path]
        waiter = start_cli([*args, "--lock-timeout", "1.5"], log)
        code = exit_status(waiter)
        waited = time.monotonic() - started
        err = log.read_text()
        lines = [line for line in err.splitlines() if line.strip()]
        assert code == 2, err
        assert "Traceback" not in err
        assert lines[0].startswith("waiting for pid") and "for at most 1.5 s" in lines[0]
        assert "(stopped: it holds the lock until it is continued with SIGCONT)" in lines[0]
        assert lines[-1].startswith("error: ") and "after 1.5 s of waiting" in lines[-1]
        assert "nothing written" in lines[-1] and len(lines) == 2
        assert waited >= 1.5
        assert read_artifact(path).version == before
    finally:
        holder.send_signal(signal.SIGCONT)
        release.touch()
        holder.wait(60)
    assert cli_main([*map(str, args), "--lock-timeout", "30"]) == 0
    assert len(read_artifact(path).ids) == len(split.y_train) + 4


@pytest.mark.parametrize("value", ["-1", "nan", "inf"])
def test_a_lock_timeout_that_is_not_seconds_is_refused_before_any_work(
    model, tmp_path, capsys, value
):
    path, split = model
    rows = save_rows(tmp_path / "rows.npz", split.X_test[:4], split.y_test[:4])
    args = ["references", "add", "--model", str(path), "--data", str(rows), "--out", str(path)]
    assert cli_main([*args, "--lock-timeout", value]) == 2
    err = capsys.readouterr().err
    assert f"--lock-timeout={float(value)!r} must be a finite number of seconds >= 0" in err
    assert (
        cli_main(["--data", "digits", "--out", str(tmp_path / "x"), "--lock-timeout", value]) == 2
    )
    assert "--lock-timeout=" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_a_released_lock_names_no_holder_and_none_means_no_bound(model, tmp_path):
    """The holder's line is cleared when its lock is released, so a later waiter never
    names a writer that is gone; --lock-timeout none waits as long as it takes."""
    path, split = model
    with lock_held_elsewhere(path, tmp_path):
        assert lock_path(path).read_text().startswith("pid ")
    assert lock_path(path).read_text() == ""
    rows = save_rows(tmp_path / "rows.npz", split.X_test[:4], split.y_test[:4])
    args = ["references", "add", "--model", path, "--data", rows, "--out", path]
    assert cli_main([*map(str, args), "--lock-timeout", "none"]) == 0
    assert lock_path(path).read_text() == ""


@pytest.mark.parametrize("where", ["a file", "under a file"])
def test_a_checkpoint_dir_that_cannot_be_a_directory_is_refused_before_the_data_is_read(
    tmp_path, capsys, where
):
    """--checkpoint-dir naming a file of the user's, or a path under one: one line naming
    it, exit 2, before the data is read (the data file here does not exist), the file as
    it was. Before, the fit ran, warned that the checkpoint could not be written, wrote
    the artifact and then failed removing the checkpoint (three lines, exit 2)."""
    notes = tmp_path / "notes.txt"
    notes.write_text("mine")
    given = notes if where == "a file" else notes / "checkpoints"
    args = ["--data", str(tmp_path / "absent.npy"), "--labels", str(tmp_path / "absent-y.npy")]
    code = cli_main([*args, "--out", str(tmp_path / "m"), "--checkpoint-dir", str(given)])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert f"--checkpoint-dir {given} " in err and "not a directory" in err
    assert notes.read_text() == "mine" and not (tmp_path / "m").exists()


def test_a_checkpoint_dir_in_a_loop_of_links_is_one_line(tmp_path, capsys):
    """--checkpoint-dir a link to itself: one line, exit 2 (resolving it raised a
    RuntimeError's traceback)."""
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    args = ["--data", str(tmp_path / "absent.npy"), "--labels", str(tmp_path / "absent-y.npy")]
    code = cli_main([*args, "--out", str(tmp_path / "new"), "--checkpoint-dir", str(loop)])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert f"--checkpoint-dir {loop}: cannot follow it" in err and "Traceback" not in err


@pytest.mark.parametrize("where", ["a link to --out", "another artifact", "inside an artifact"])
def test_a_checkpoint_dir_at_an_artifact_is_refused_before_the_data_is_read(
    model, tmp_path, capsys, where
):
    """--checkpoint-dir a symbolic link to --out, another model, or a folder inside one: one
    line, exit 2, before the data is read, the model as it was. Before, a link to --out
    passed (paths compared unresolved): the fit ran, wrote its checkpoint into the
    artifact and then refused to replace it; another model took the checkpoint's files,
    which a killed fit left there for every later writer to refuse."""
    path, _ = model
    before = sorted(p.name for p in Path(path).iterdir())
    out = tmp_path / "new-model"
    if where == "a link to --out":
        given = tmp_path / "link"
        given.symlink_to(out, target_is_directory=True)
    else:
        given = Path(path) if where == "another artifact" else Path(path) / "checkpoints"
    args = ["--data", str(tmp_path / "absent.npy"), "--labels", str(tmp_path / "absent-y.npy")]
    code = cli_main([*args, "--out", str(out), "--checkpoint-dir", str(given)])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    said = "is --out or inside it" if where == "a link to --out" else "is an artifact or inside"
    assert f"--checkpoint-dir {given} " in err and said in err
    assert sorted(p.name for p in Path(path).iterdir()) == before and not out.exists()


def test_a_signal_while_an_edit_is_written_says_the_version_was_written(
    model, tmp_path, capsys, monkeypatch
):
    """SIGTERM as `references add` starts writing its version: the write ends first (the
    signal is held), then the command exits 143 with one line saying the version was
    written, where before it said 'nothing was written' of a version that had landed."""
    import training.references.versions as versions

    path, split = model
    rows = save_rows(tmp_path / "rows.npz", split.X_test[:4], split.y_test[:4])
    before = len(read_artifact(path).labels)
    real = versions.write_artifact

    def write_with_a_signal(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        return real(*args, **kwargs)

    monkeypatch.setattr(versions, "write_artifact", write_with_a_signal)
    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        code = cli_main(
            ["references", "add", "--model", str(path), "--data", str(rows), "--out", str(path)]
        )
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    err = capsys.readouterr().err
    assert code == 143 and len(err.strip().splitlines()) == 1, err
    assert f"{path} was written whole first" in err and "nothing was written" not in err
    assert len(read_artifact(path).labels) == before + 4
    assert lineage(path)[-1]["operation"] == "add"


def small_job(tmp_path: Path) -> list[str]:
    """A job of a few seconds: 240 rows of 6 features, 3 classes, an exact fit."""
    rng = np.random.default_rng(0)
    y = np.arange(240) % 3
    X = rng.normal(size=(240, 6)) + y[:, None]
    np.save(tmp_path / "X.npy", X)
    np.save(tmp_path / "y.npy", y)
    data = ["--data", tmp_path / "X.npy", "--labels", tmp_path / "y.npy", "--n-components", "2"]
    return [*map(str, data), "--max-iter", "5", "--no-plots", "--quiet", "--k-folds", "0"]


def test_the_default_checkpoint_dir_keeps_the_users_files_and_loses_only_the_fits(tmp_path, capsys):
    """A hostile pass put notes and a folder of its own in ``.m.checkpoint`` (the job's
    default checkpoint directory beside --out); the job removed the directory whole, the
    user's files with it. Now only the fit's files go (fit-rank*.npz and a killed save's
    temporary files), and the directory stays because it is not empty."""
    checkpoint = tmp_path / ".m.checkpoint"
    (checkpoint / "sub").mkdir(parents=True)
    (checkpoint / "notes.txt").write_text("mine")
    (checkpoint / "sub" / "data.bin").write_bytes(b"\x00\x01")
    (checkpoint / ".fit-rank0.abc123.tmp").write_bytes(b"half a save")  # a killed save's
    assert cli_main([*small_job(tmp_path), "--out", str(tmp_path / "m")]) == 0
    assert read_artifact(tmp_path / "m").projection.shape == (2, 6)
    assert (checkpoint / "notes.txt").read_text() == "mine"
    assert (checkpoint / "sub" / "data.bin").read_bytes() == b"\x00\x01"
    assert sorted(p.name for p in checkpoint.iterdir()) == ["notes.txt", "sub"]


def test_the_default_checkpoint_dir_goes_when_only_the_fits_files_were_in_it(tmp_path):
    assert cli_main([*small_job(tmp_path), "--out", str(tmp_path / "m")]) == 0
    assert not (tmp_path / ".m.checkpoint").exists()


def test_a_checkpoint_that_cannot_be_removed_is_a_warning_after_a_written_artifact(
    tmp_path, capsys, monkeypatch
):
    """The fit's checkpoint file in a directory the user cannot write (a hostile pass, as a
    user without root; here the unlink is refused as such a directory refuses it): the job
    wrote and published the artifact, then exited 2 on the removal, without its 'wrote'
    line. Now the removal's failure is a warning and the job exits 0."""
    import errno

    refused = []
    real_unlink = Path.unlink

    def unlink(self, missing_ok=False):
        if self.name.startswith("fit-rank") and self.exists():
            refused.append(self.name)
            raise PermissionError(errno.EACCES, "Permission denied", str(self))
        return real_unlink(self, missing_ok=missing_ok)

    monkeypatch.setattr(Path, "unlink", unlink)
    ck, out, link = tmp_path / "ck", tmp_path / "m", tmp_path / "current"
    args = [*small_job(tmp_path), "--out", str(out), "--checkpoint-dir", str(ck)]
    code = cli_main([*args, "--publish", str(link)])
    err = capsys.readouterr().err
    assert code == 0, err
    assert "fit-rank0.npz" in refused  # the fit saved its state and the removal was refused
    assert f"warning: the artifact is written, but its checkpoint stays: {ck}" in err
    assert f"wrote {out}" in err and link.resolve() == out.resolve()
    assert read_artifact(out).projection.shape == (2, 6)


def test_a_publish_link_that_fails_after_the_write_says_the_artifact_is_written(
    tmp_path, capsys, monkeypatch
):
    """--publish refused by the file system after the artifact's write (a sticky directory
    whose link is another user's, in a hostile pass): one line that says the artifact is
    written and the link is not, exit 2 (before, the line spoke of the link alone)."""
    import errno

    import training.job as job
    from training.errors import WriteError

    def publish(link, target):
        cause = PermissionError(errno.EPERM, "Operation not permitted")
        raise WriteError("the --publish link", link, cause)

    monkeypatch.setattr(job, "publish", publish)
    out, link = tmp_path / "m", tmp_path / "current"
    code = cli_main([*small_job(tmp_path), "--out", str(out), "--publish", str(link)])
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error")]
    assert code == 2 and len(errors) == 1 and "Traceback" not in err, err
    assert errors[0].startswith(f"error: {out} is written, but cannot write the --publish link")
    assert read_artifact(out).projection.shape == (2, 6) and not link.exists()


def test_references_refuse_a_publish_link_they_cannot_make_before_any_work(
    model, tmp_path, capsys, monkeypatch
):
    """`references remove --publish pub/current` with `pub` read-only to this user (here
    os.access says so, as it does for such a user; the tests may run as root): it was
    refused by the link's lock, as ENOENT. Now one line names the link and EACCES, before
    any work: nothing is written at --out."""
    path, _ = model
    pub = tmp_path / "pub"
    pub.mkdir()
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: Path(p) != pub and real_access(p, mode))
    ids = str(read_artifact(path).ids[0])
    args = ["references", "remove", "--model", str(path), "--ids", ids]
    code = cli_main([*args, "--out", str(tmp_path / "q"), "--publish", str(pub / "current")])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert f"cannot write the --publish link {pub / 'current'}" in err and "EACCES" in err
    assert not (tmp_path / "q").exists() and not (pub / "current").exists()
