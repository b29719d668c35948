"""Fixtures shared by the training tests."""

from __future__ import annotations

import pytest

from tests.service.conftest import build_model_artifact, digits_like_split


@pytest.fixture(scope="session")
def digits_like_model(tmp_path_factory):
    """(artifact path, split): a model on the service tests' digits-like split, whose test
    rows serve as new data. Tests must not change it (they write new versions elsewhere)."""
    out = tmp_path_factory.mktemp("digits-like-model") / "base"
    split = digits_like_split()
    build_model_artifact(out, split)
    return out, split


def refused_in_one_line(python_m_training, tmp_path, lay_out) -> str:
    """Lay out files with ``lay_out(folder)`` (it returns the job's data arguments), run
    ``python -m training`` on them, and return its one line of refusal, after checking
    that the job exited 2 with that line alone on stderr, no traceback, and nothing
    written at --out."""
    data = tmp_path / "data"
    data.mkdir()
    out = tmp_path / "out"
    code, _, stderr = python_m_training(*lay_out(data), "--out", out, "--quiet", "--max-iter", "2")
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert code == 2, stderr
    assert "Traceback" not in stderr, stderr
    assert len(lines) == 1 and lines[0].startswith("error"), lines
    assert not out.exists()
    return lines[0]
