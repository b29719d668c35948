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
