"""Nothing of the user's is lost by a command that writes an artifact (issue 57, targets 1
and 2): an ``--out`` holding what we did not write is refused before any work, exit 2 and
one line, and left as it was; writers of one artifact take turns, so that every edit that
exits 0 is in the result, nothing removed comes back, and the lineage lists exactly the
edits that landed; a writer that finds its ``--out`` replaced since it started exits 2 and
replaces nothing; a writer killed in the middle leaves the next one free to write.

The concurrent writers are forks of this process (which imported ``training.cli``): each is
the CLI's ``main`` in a process of its own, started while the test holds the artifact's
writer lock, so that all of them wait at once and race for it when it is released."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from service.core.artifact import read_artifact
from training.cli import main as cli_main

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def model(digits_like_model, tmp_path):
    """A copy of the digits-like model this test may change, and its split."""
    source, split = digits_like_model
    path = tmp_path / "m"
    shutil.copytree(source, path)
    return path, split


def save_rows(path: Path, X: np.ndarray, y: np.ndarray) -> Path:
    np.savez(path, X=X, y=y)
    return path


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
