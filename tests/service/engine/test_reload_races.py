"""The model path repointed while the engine loads: whatever moment the flip comes, the
engine remembers the fingerprint of exactly the bytes it read, so the poller's next look
(``Engine.changed_on_disk``) sees whether the path still names what is served, and a reload
ends on what the path names. A failure is remembered by what failed, never by what the path
named before or after."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from service.core.artifact import ArtifactError, artifact_fingerprint, read_artifact
from service.core.artifact import read as artifact_reader
from service.engine.engine import Engine
from tests.service.conftest import republish_scaled, settings_for


def point(link: Path, target: Path) -> None:
    """Repoint the symlink ``link`` at ``target`` in one rename."""
    tmp = link.with_name(f".{link.name}.flip")
    tmp.symlink_to(target)
    os.replace(tmp, link)


@pytest.fixture
def two_versions(model_dir, tmp_path):
    """(link, v1, v2, version of v1, version of v2): two artifacts, the link on v1."""
    v1, v2 = tmp_path / "v1", tmp_path / "v2"
    shutil.copytree(model_dir, v1)
    shutil.copytree(model_dir, v2)
    version2 = republish_scaled(v2, 2.0)
    link = tmp_path / "current"
    link.symlink_to(v1)
    return link, v1, v2, read_artifact(v1).version, version2


def flip_after(monkeypatch, pins: int, flip) -> None:
    """Call ``flip()`` once, right after the ``pins``-th artifact directory is opened from
    now on (the first is the load's first look at the path)."""
    original = artifact_reader._PinnedDirectory.__init__
    opened = [0]

    def pin_then_flip(self, root):
        original(self, root)
        opened[0] += 1
        if opened[0] == pins:
            flip()

    monkeypatch.setattr(artifact_reader._PinnedDirectory, "__init__", pin_then_flip)


def flip_mid_read(monkeypatch, flip) -> None:
    """Call ``flip()`` once, after the manifest and one array of the next read."""
    original = artifact_reader._PinnedDirectory.read
    reads = [0]

    def read_then_flip(self, name, what, max_bytes=None):
        reads[0] += 1
        if reads[0] == 3:
            flip()
        return original(self, name, what, max_bytes)

    monkeypatch.setattr(artifact_reader._PinnedDirectory, "read", read_then_flip)


def poll_once(engine: Engine) -> None:
    """What the poller does at one tick."""
    if engine.changed_on_disk():
        engine.load()


@pytest.mark.parametrize("where", ["after the first look at the path", "in the middle of the read"])
def test_a_flip_during_a_load_is_seen_by_the_next_poll(two_versions, monkeypatch, where):
    """v2 published, then during the load the path goes back to v1 for a moment and
    forward to v2 again: the worker may load either, but once the path has settled it ends
    on v2, with the fingerprint of v2 (the defect: the fingerprint taken before the read
    named v2 while v1 was read, and the poller then saw nothing to do, for good)."""
    link, v1, v2, version1, version2 = two_versions
    engine = Engine(settings_for(link))
    assert engine.load().version == version1
    point(link, v2)
    assert engine.changed_on_disk()
    if where == "after the first look at the path":
        flip_after(monkeypatch, 1, lambda: point(link, v1))
    else:
        flip_mid_read(monkeypatch, lambda: point(link, v1))
    loaded = engine.load()
    monkeypatch.undo()
    # what was loaded is one whole artifact, and its fingerprint names exactly that one
    assert loaded.version in (version1, version2)
    assert loaded.artifact.fingerprint == artifact_fingerprint(
        v1 if loaded.version == version1 else v2
    )
    point(link, v2)  # the path settles on v2
    poll_once(engine)
    assert engine.current().version == version2
    assert engine.current().artifact.fingerprint == artifact_fingerprint(link)
    assert not engine.changed_on_disk()


def test_a_failed_load_is_remembered_by_what_failed(two_versions, monkeypatch):
    """A broken v2 is published; during its (failing) load the path moves to the good v1
    and stays: the failure must not be pinned on v1, which the next poll loads."""
    link, v1, v2, version1, _ = two_versions
    engine = Engine(settings_for(link))
    engine.load()
    healthy = read_artifact(v2).version
    good_labels = (v2 / "labels.npy").read_bytes()
    (v2 / "labels.npy").write_bytes(good_labels[:-4])  # caught half-copied
    point(link, v2)
    flip_mid_read(monkeypatch, lambda: point(link, v1))
    with pytest.raises(ArtifactError) as failed:
        engine.load()
    monkeypatch.undo()
    assert "labels.npy" in str(failed.value)
    assert failed.value.fingerprint == artifact_fingerprint(v2)  # what failed, read through v2
    assert engine.current().version == version1
    # the path names v1, which is served, and v1 is not taken for the failed artifact
    assert not engine.changed_on_disk()
    point(link, v2)
    assert not engine.changed_on_disk()  # the same broken v2 is not retried at once...
    (v2 / "labels.npy").write_bytes(good_labels)
    assert engine.changed_on_disk()  # ...but once it changes
    poll_once(engine)
    assert engine.current().version == healthy


def test_an_exchanged_directory_is_seen_by_the_next_poll(two_versions, monkeypatch):
    """The model path is a directory exchanged with another (renameat2) right after the
    load opened it: the model read is the one opened, and the next poll loads the other."""
    from service.core.artifact.write import _exchange_paths

    _, v1, v2, version1, version2 = two_versions
    engine = Engine(settings_for(v1))
    assert engine.load().version == version1
    flip_after(monkeypatch, 1, lambda: _exchange_paths(v1, v2))
    assert engine.load().version == version1  # the directory it opened
    monkeypatch.undo()
    assert read_artifact(v1).version == version2
    poll_once(engine)
    assert engine.current().version == version2
    assert not engine.changed_on_disk()
