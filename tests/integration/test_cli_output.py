"""The commands' own output on a disk that refuses it: a references command whose summary
cannot be written to stdout (redirected to a full device), and ``python -m training report``
whose page path cannot, print one line on stderr saying so and where the new version (or
page) was written, and exit 2: no traceback, no exit status 120 from the interpreter's last
flush. Run as real processes, stdout on ``/dev/full`` (ENOSPC on every write): forks of
one process that imported training.cli (the ``python_m_training`` fixture), each ending as
an interpreter ends, its last flush of stdout included."""

from __future__ import annotations

import os

import pytest

from service.core.artifact import read_artifact
from tests.service.conftest import build_model_artifact, digits_like_split

pytestmark = pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")


@pytest.fixture
def run_to_full(python_m_training):
    """``run_to_full(*args)``: ``python -m training ARGS`` with stdout on /dev/full, ended as
    the interpreter ends: (exit status, stderr lines)."""

    def run(*args: str) -> tuple[int, list[str]]:
        code, _, err = python_m_training(*args, stdout="/dev/full", finalize=True)
        return code, err.splitlines()

    return run


def test_a_summary_that_cannot_be_written_is_one_line_naming_the_new_version(tmp_path, run_to_full):
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


def test_a_report_path_that_cannot_be_written_is_one_line(tmp_path, run_to_full):
    model = tmp_path / "v1"
    build_model_artifact(model, digits_like_split())
    code, lines = run_to_full("report", str(model))
    print(lines)
    assert code == 2 and len(lines) == 1, lines
    assert "(ENOSPC)" in lines[0] and str(model / "report.html") in lines[0]
