"""The commands' own output on a disk that refuses it: a references command whose summary
cannot be written to stdout (redirected to a full device), and ``python -m training report``
whose page path cannot, print one line on stderr saying so and where the new version (or
page) was written, and exit 2: no traceback, no exit status 120 from the interpreter's last
flush. Run as real processes, stdout on ``/dev/full`` (ENOSPC on every write)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from service.core.artifact import read_artifact
from tests.service.conftest import build_model_artifact, digits_like_split

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")


def run_to_full(*args: str) -> tuple[int, list[str]]:
    """``python -m training ARGS`` with stdout on /dev/full: (exit status, stderr lines)."""
    with open("/dev/full", "w") as full:
        done = subprocess.run(
            [sys.executable, "-m", "training", *args],
            cwd=ROOT,
            stdout=full,
            stderr=subprocess.PIPE,
            text=True,
            timeout=300,
        )
    return done.returncode, done.stderr.splitlines()


def test_a_summary_that_cannot_be_written_is_one_line_naming_the_new_version(tmp_path):
    model = tmp_path / "v1"
    build_model_artifact(model, digits_like_split())
    out, link = tmp_path / "v2", tmp_path / "current"
    command = ["references", "remove", "--model", str(model), "--ids", "3"]
    code, lines = run_to_full(*command, "--out", str(out), "--publish", str(link))
    print(lines)
    assert code == 2 and len(lines) == 1 and "Traceback" not in lines[0], lines
    assert lines[0].startswith("error: cannot write the summary to standard output: ")
    assert "(ENOSPC)" in lines[0] and str(out) in lines[0]
    assert read_artifact(link).path.resolve() == out.resolve()


def test_a_report_path_that_cannot_be_written_is_one_line(tmp_path):
    model = tmp_path / "v1"
    build_model_artifact(model, digits_like_split())
    code, lines = run_to_full("report", str(model))
    print(lines)
    assert code == 2 and len(lines) == 1, lines
    assert "(ENOSPC)" in lines[0] and str(model / "report.html") in lines[0]
