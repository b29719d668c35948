"""What a writer may replace and how writers of one path take turns
(``service.core.artifact.ownership``): a table of what may be found at an output path, the
lock between processes (a waiter waits, a killed holder frees it), and the version check."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from service.core.artifact import (
    ArtifactError,
    check_replaceable,
    write_artifact,
)


def tiny_artifact(path: Path, n: int = 6) -> Path:
    rng = np.random.default_rng(n)
    return write_artifact(
        path,
        projection=np.eye(2, 3, dtype=np.float32),
        offset=np.zeros(2, np.float32),
        embeddings=rng.normal(size=(n, 2)).astype(np.float32),
        labels=(np.arange(n) % 2).astype(np.int32),
        classes=[0, 1],
        mean=np.zeros(3),
        scale=np.ones(3),
        default_k=1,
        extra_files={"report.json": b"{}"},
    )


def _user_directory(path: Path) -> None:
    path.mkdir()
    (path / "X.npy").write_bytes(b"data")
    (path / "notes.txt").write_text("mine")


def _artifact_with_notes(path: Path) -> None:
    tiny_artifact(path)
    (path / "notes.txt").write_text("mine")


def _foreign_manifest(path: Path) -> None:
    path.mkdir()
    (path / "manifest.json").write_text(json.dumps({"format": "another-tool"}))


def _file(path: Path) -> None:
    path.write_text("a file")


def _link_to_artifact(path: Path) -> None:
    tiny_artifact(path.with_name("target"))
    path.symlink_to(path.with_name("target"))


def _under_a_file(path: Path) -> None:
    path.parent.mkdir()
    path.parent.rmdir()
    path.parent.write_text("a file where a directory should be")


# (name, how the path is laid out, refused?, words the message must hold)
CASES = [
    ("absent", lambda p: None, False, ""),
    ("empty directory", lambda p: p.mkdir(), False, ""),
    ("an artifact", tiny_artifact, False, ""),
    (
        "an artifact with its report page",
        lambda p: (tiny_artifact(p), (p / "report.html").write_text("<html>")),
        False,
        "",
    ),
    ("the user's data", _user_directory, True, "is not an artifact"),
    ("an artifact the user added a file to", _artifact_with_notes, True, "notes.txt"),
    ("another tool's manifest", _foreign_manifest, True, "is not an artifact"),
    ("a file", _file, True, "is not a directory"),
    ("a symbolic link", _link_to_artifact, True, "symbolic link"),
    ("a path under a file", _under_a_file, True, "is not a directory"),
]


@pytest.mark.parametrize("name, lay_out, refused, words", CASES, ids=[c[0] for c in CASES])
def test_what_may_be_replaced(tmp_path, name, lay_out, refused, words):
    path = tmp_path / "sub" / "out" if name == "a path under a file" else tmp_path / "out"
    lay_out(path)
    before = sorted(p.name for p in path.iterdir()) if path.is_dir() else None
    if not refused:
        check_replaceable(path)
        tiny_artifact(path, n=9)  # and the writer replaces it
        return
    with pytest.raises(ArtifactError) as caught:
        check_replaceable(path)
    assert str(path) in str(caught.value) and words in str(caught.value)
    with pytest.raises(ArtifactError):  # the writer itself refuses too
        tiny_artifact(path, n=9)
    if before is not None:
        assert sorted(p.name for p in path.iterdir()) == before
