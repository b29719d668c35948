"""What a writer may replace and how writers of one path take turns
(``service.core.artifact.ownership``): a table of what may be found at an output path, the
lock between processes (a waiter waits, a killed holder frees it), and the version check."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest

from service.core.artifact import (
    ArtifactError,
    OutputClaim,
    check_replaceable,
    version_at,
    write_artifact,
    writer_lock,
)
from service.core.artifact.ownership import lock_path


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


def test_version_at_and_the_version_check(tmp_path):
    path = tmp_path / "m"
    assert version_at(path) is None
    claim = OutputClaim(path)
    tiny_artifact(path)  # another writer lands while this one works
    with pytest.raises(ArtifactError, match="written by another process"):
        with claim.turn(wait_notice=None):
            pass
    version = version_at(path)
    assert version is not None
    with OutputClaim(path).turn(wait_notice=None):  # unchanged since the claim: its turn
        tiny_artifact(path, n=8)
    assert version_at(path) != version
    # an edit in place reads its source in its turn: a change before the turn is no conflict
    claim = OutputClaim(path)
    tiny_artifact(path, n=10)
    with claim.turn(source=path, wait_notice=None):
        pass


def _fork(body) -> int:
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            body()
            code = 0
        finally:
            os._exit(code)
    return pid


def test_a_second_writer_waits_for_the_first(tmp_path):
    path = tmp_path / "m"
    log = tmp_path / "log"

    def write(tag: str, hold: float):
        def body():
            with writer_lock(path, wait_notice=None):
                with open(log, "a") as fh:
                    fh.write(f"{tag} in\n")
                time.sleep(hold)
                with open(log, "a") as fh:
                    fh.write(f"{tag} out\n")

        return body

    first = _fork(write("a", 0.5))
    deadline = time.monotonic() + 10
    while not (log.exists() and "a in" in log.read_text()):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    second = _fork(write("b", 0.0))
    for pid in (first, second):
        assert os.waitpid(pid, 0)[1] == 0
    assert log.read_text().split("\n")[:4] == ["a in", "a out", "b in", "b out"]


def test_a_killed_holder_frees_the_lock(tmp_path):
    path = tmp_path / "m"
    ready = tmp_path / "ready"

    def hold():
        with writer_lock(path, wait_notice=None):
            ready.touch()
            time.sleep(60)

    holder = _fork(hold)
    deadline = time.monotonic() + 10
    while not ready.exists():
        assert time.monotonic() < deadline
        time.sleep(0.01)
    os.kill(holder, signal.SIGKILL)
    os.waitpid(holder, 0)
    started = time.monotonic()
    with writer_lock(path, wait_notice=None):
        assert time.monotonic() - started < 5
    assert lock_path(path).name == ".m.lock"


# What a non-root hostile pass found, tested here as root can: the tests may run as root,
# who reads any file and replaces any entry, so the refusals are what such a user meets,
# made by the calls that refuse them (open, geteuid).


def test_a_manifest_that_cannot_be_read_is_said_so(tmp_path, monkeypatch):
    """An artifact whose manifest.json this user cannot read was refused as 'not an
    artifact (no manifest.json; it holds ..., manifest.json, ...)': a reason that
    contradicts itself. It is refused for what it is."""
    import errno

    out = tiny_artifact(tmp_path / "out")
    real = Path.read_bytes

    def read_bytes(self):
        if self.name == "manifest.json":
            raise PermissionError(errno.EACCES, "Permission denied", str(self))
        return real(self)

    monkeypatch.setattr(Path, "read_bytes", read_bytes)
    monkeypatch.setattr(Path, "read_text", lambda self, **kw: read_bytes(self).decode())
    with pytest.raises(ArtifactError, match=r"cannot read its manifest\.json \(Permission denied"):
        check_replaceable(out)


@pytest.mark.parametrize("entry_owner, refused", [(0, True), (4242, False)])
def test_an_entry_of_another_user_in_a_sticky_directory_is_refused_before_work(
    tmp_path, monkeypatch, entry_owner, refused
):
    """In a sticky directory (mode 1777, as /tmp) only an entry's owner (or the directory's)
    may replace it: an --out or a --publish link there that belonged to another user was
    found only after the fit, when the rename failed with EPERM. check_writable says it
    before. This user is uid 4242; the directory is root's."""
    import errno

    from service.core.artifact.ownership import check_writable

    sticky = tmp_path / "shared"
    sticky.mkdir()
    sticky.chmod(0o1777)
    (sticky / "model").mkdir()
    os.chown(sticky / "model", entry_owner, entry_owner)
    monkeypatch.setattr(os, "geteuid", lambda: 4242)
    if refused:
        with pytest.raises(OSError) as caught:
            check_writable(sticky / "model")
        assert caught.value.errno == errno.EPERM
        assert caught.value.filename == str(sticky / "model")
    else:
        check_writable(sticky / "model")
    check_writable(sticky / "new")  # a new name may be made there by anyone


def test_a_writer_lock_that_cannot_serve_is_refused_when_the_claim_is_made(tmp_path, monkeypatch):
    """A lock planted as a link, or one this user cannot open (another user's, mode 0600):
    the writer learned it after its work, from flock's open (ELOOP, EACCES). The claim,
    made before any work, refuses it naming the lock and what to do."""
    import errno

    out = tmp_path / "out"
    lock = lock_path(out)
    lock.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(ArtifactError, match="is a symbolic link, which a writer never follows"):
        OutputClaim(out)
    lock.unlink()
    lock.write_text("")
    real_open = os.open

    def refusing_open(path, flags, *args):
        if Path(path) == lock:
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", refusing_open)
    with pytest.raises(ArtifactError, match=r"cannot be opened by this user \(Permission denied"):
        OutputClaim(out)
    monkeypatch.setattr(os, "open", real_open)
    OutputClaim(out)  # a plain lock file the user can open serves


def test_a_lock_that_cannot_be_made_names_the_directorys_refusal(tmp_path, monkeypatch):
    """A lock that cannot be made (its directory read-only to this user) was reported as
    ENOENT, from the read-only retry that followed the refusal; the refusal is the cause."""
    import errno

    out = tmp_path / "out"
    real_open = os.open

    def refusing_open(path, flags, *args):
        if Path(path) == lock_path(out):
            if flags & os.O_CREAT:
                raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", refusing_open)
    with pytest.raises(OSError) as caught:
        with writer_lock(out):
            pass
    assert caught.value.errno == errno.EACCES


def _unlink_as_a_user(monkeypatch) -> None:
    """os.unlink as a user without root meets it: refused in a directory without the
    owner's write bit (the tests may run as root, whom no mode refuses)."""
    import errno
    import stat

    real_unlink = os.unlink

    def unlink(path, *, dir_fd=None):
        where = os.fstat(dir_fd) if dir_fd is not None else os.stat(Path(path).absolute().parent)
        if not where.st_mode & stat.S_IWUSR:
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_unlink(path, dir_fd=dir_fd)

    monkeypatch.setattr(os, "unlink", unlink)


def test_replacing_a_read_only_artifact_of_ones_own_leaves_no_old_copy(tmp_path, monkeypatch):
    """A model directory the user made read-only (mode 555) and then replaced: the new
    version went in, and the old one stayed beside it as .m.tmp-HOST-PID-HEX, which no
    later write removed and the user's rm could not. Its directory is now made writable
    to be removed."""
    _unlink_as_a_user(monkeypatch)
    out = tiny_artifact(tmp_path / "m")
    out.chmod(0o555)
    tiny_artifact(out, n=9)  # the replacement
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith((".m.tmp", ".m.old"))]
    assert len(np.load(out / "labels.npy")) == 9


def test_a_directory_of_another_user_that_cannot_be_emptied_is_refused_before_work(
    tmp_path, monkeypatch
):
    """--out a model of another user's (root's, mode 755) in the user's own directory: the
    exchange of the two directories works (the parent is the user's), the old one's files
    cannot be removed, and it stayed for good. Refused before any work instead."""
    import errno

    from service.core.artifact.ownership import check_writable

    out = tiny_artifact(tmp_path / "m")
    os.chown(out, 4242, 4242)  # another user's: this user is root here
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: Path(p) != out and real_access(p, mode))
    with pytest.raises(OSError) as caught:
        check_writable(out)
    assert caught.value.errno == errno.EACCES and caught.value.filename == str(out)
    monkeypatch.setattr(os, "access", real_access)
    check_writable(out)  # one whose files the user can remove may be replaced
