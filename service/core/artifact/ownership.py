"""What a writer of an artifact may replace, and how writers of one path take turns.

Two rules keep a user's data safe from the commands that write artifacts (the training job,
``references add|remove|condense``, ``nca-index``):

* **Only what we wrote is replaced.** A path is replaceable when it does not exist, is an
  empty directory, or is an artifact directory: its ``manifest.json`` says it is of this
  format, and every entry in it is a file the manifest names (its arrays, index and extras)
  or ``report.html``, the page the training job renders there, each a plain file. Anything
  else (a directory of the user's data, a file, a symlink, an artifact the user put a notes
  file into, or a directory or link under a name the artifact lists) is
  refused before any work: :func:`check_replaceable` raises an ``ArtifactError`` that
  names the path and the entry that is not ours.

* **Writers of one path take turns.** :func:`writer_lock` holds an exclusive ``flock`` on
  ``.NAME.lock`` beside the path for as long as a command reads, changes and writes it:
  a second writer waits (and says once on stderr whom it waits for), then reads the version
  the first one wrote, so no edit is lost. The kernel drops the lock when its holder dies,
  however it dies, so a killed writer never blocks the next one. The lock file is ours and
  stays (removing it would race with a writer that just opened it); it holds the last
  holder's pid, for the wait notice. It is never opened through a symbolic link.

A writer whose result does not derive from the path it replaces (a retrain, or an edit of
model ``m`` written to another ``--out``) also compares versions: it records
:func:`version_at` when it starts and, holding the lock, refuses to replace a path whose
version changed since (:func:`check_unchanged`): another writer's work landed there while
this one ran, and replacing it would lose that work silently.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import stat
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TextIO

from service.core.artifact.format import FORMAT_NAME, INDEX_FILE, MANIFEST_FILE, ArtifactError

# written into an artifact directory after the artifact by the training job (report_page.py)
PAGES_BESIDE_ARTIFACT = frozenset({"report.html"})
# the page's temporary file while it is written (left by a writer killed in the middle)
_PARTIAL_PAGE = re.compile(r"\.report\.html\.[0-9]+\.partial")


def _owned_names(manifest: dict) -> set[str]:
    """The entries an artifact directory may hold: the manifest, the files it lists (arrays
    by their ``path``, the index) and its extras, and the report page."""
    names = {MANIFEST_FILE, INDEX_FILE, *PAGES_BESIDE_ARTIFACT}
    files = manifest.get("files")
    if isinstance(files, dict):
        names.update(r["path"] for r in files.values() if isinstance(r, dict) and "path" in r)
    extras = manifest.get("extras")
    if isinstance(extras, dict):
        names.update(str(name) for name in extras)
    return names


def _manifest_of(directory: Path) -> dict | None:
    """The parsed manifest when ``directory`` holds one of this format, else None."""
    try:
        text = (directory / MANIFEST_FILE).read_text(encoding="utf-8")
        manifest = json.loads(text)
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_NAME:
        return None
    return manifest


def is_artifact(directory: str | os.PathLike) -> bool:
    """Whether ``directory`` holds an artifact of this format (its manifest.json)."""
    return _manifest_of(Path(directory)) is not None


def check_replaceable(path: str | os.PathLike, option: str = "--out") -> None:
    """Raise ``ArtifactError`` unless ``path`` is absent, an empty directory, or an artifact
    directory holding nothing but its own files (see the module's docstring). The message
    names ``option``, the path and what was found there."""
    target = Path(path)
    where = f"{option} {str(path)!r}"
    if target.is_symlink():
        raise ArtifactError(
            f"{where} is a symbolic link; refusing to replace it (give the directory it "
            "points to, or use --publish for a link to the new version)"
        )
    container = target.absolute().parent
    if _manifest_of(container) is not None:
        raise ArtifactError(
            f"{where} is inside the artifact {str(container)!r}; refusing to write into a "
            "model: choose a path beside it"
        )
    if not target.exists():
        parent = target.parent
        for ancestor in (parent, *parent.parents):
            if ancestor.exists():
                if not ancestor.is_dir():
                    raise ArtifactError(f"{where}: {str(ancestor)!r} is not a directory")
                break
        return
    if not target.is_dir():
        raise ArtifactError(
            f"{where} exists and is not a directory; refusing to replace a file we did not write"
        )
    try:
        entries = sorted(entry.name for entry in target.iterdir())
    except OSError as exc:
        raise ArtifactError(f"{where}: cannot list it ({exc.strerror or exc})") from None
    if not entries:
        return
    manifest = _manifest_of(target)
    if manifest is None and MANIFEST_FILE in entries:
        try:  # a manifest this user cannot read is not a directory of someone else's data
            (target / MANIFEST_FILE).read_bytes()
        except OSError as exc:
            raise ArtifactError(
                f"{where}: cannot read its {MANIFEST_FILE} ({exc.strerror or exc}), so it "
                "cannot be told from a model's; refusing to replace it: make it readable, or "
                "choose a new or empty directory"
            ) from None
    if manifest is None:
        shown = ", ".join(entries[:3]) + (", ..." if len(entries) > 3 else "")
        raise ArtifactError(
            f"{where} exists and is not an artifact (no {FORMAT_NAME} manifest.json; it holds "
            f"{shown}); refusing to replace it: choose a new or empty directory"
        )
    owned = _owned_names(manifest)
    foreign = [n for n in entries if n not in owned and not _PARTIAL_PAGE.fullmatch(n)]
    if foreign:
        raise ArtifactError(
            f"{where} is an artifact that also holds {foreign[:3]} which the artifact does not "
            "list; refusing to replace it and lose them: move them out first"
        )
    # we write plain files only: a directory or a link under a name we list is not ours
    not_files = [n for n in entries if not _is_plain_file(target / n)]
    if not_files:
        raise ArtifactError(
            f"{where} is an artifact whose {not_files[:3]} are not the files it wrote (a "
            "directory or a link under a name it lists); refusing to replace it and lose "
            "what they hold: move them out first"
        )


def _is_plain_file(path: Path) -> bool:
    """Whether ``path`` is a regular file itself, not a link to one (``lstat``)."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except FileNotFoundError:  # removed since it was listed: nothing there to lose
        return True


def check_writable(path: str | os.PathLike) -> None:
    """Raise ``OSError`` (``filename`` the path) when the directory that will hold ``path``
    (its nearest existing ancestor) cannot take new entries (EROFS or EACCES); when ``path``
    exists in a sticky directory (``/tmp``'s mode 1777) and belongs to another user, who
    alone may replace it there (EPERM); or when ``path`` is a directory of another user's
    whose files this user cannot remove, so that its old version would stay beside the new
    one for good (EACCES). A writer learns it before its work, not after."""
    target = Path(path).absolute()
    ancestor = target.parent
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if os.access(ancestor, os.W_OK | os.X_OK):
        if _sticky_refuses(target):
            raise OSError(errno.EPERM, os.strerror(errno.EPERM), str(target))
        if _old_version_stays(target):
            raise OSError(errno.EACCES, os.strerror(errno.EACCES), str(target))
        return
    try:
        read_only = bool(os.statvfs(ancestor).f_flag & os.ST_RDONLY)
    except OSError:
        read_only = False
    code = errno.EROFS if read_only else errno.EACCES
    raise OSError(code, os.strerror(code), str(target))


def _old_version_stays(target: Path) -> bool:
    """Whether ``target`` is a directory (not a link) of another user's whose files this user
    cannot remove: replacing it would leave its old version beside the new one for good."""
    try:
        entry = os.lstat(target)
    except OSError:
        return False
    if not stat.S_ISDIR(entry.st_mode) or entry.st_uid == os.geteuid():
        return False  # a directory of this user's is made writable to be removed
    return not os.access(target, os.W_OK | os.X_OK)


def _sticky_refuses(target: Path) -> bool:
    """Whether ``target`` exists in a sticky directory that will not let this user replace
    it: neither the entry nor the directory is this user's (root may replace anything)."""
    try:
        directory, entry = os.stat(target.parent), os.lstat(target)
    except OSError:  # absent: a new name may be made in a writable sticky directory
        return False
    user = os.geteuid()
    sticky = bool(directory.st_mode & stat.S_ISVTX)
    return sticky and user != 0 and user not in (entry.st_uid, directory.st_uid)


def check_lock_usable(path: str | os.PathLike) -> None:
    """Raise ``ArtifactError`` when the writer lock of ``path`` (:func:`lock_path`) exists
    and cannot serve: a symbolic link (never followed), not a regular file, or a file this
    user cannot open. A writer learns it before its work; an absent lock is made in its
    turn (its directory's writability is :func:`check_writable`'s)."""
    lock_file = lock_path(path)
    try:
        mode = os.lstat(lock_file).st_mode
    except FileNotFoundError:
        return
    except OSError as exc:
        raise ArtifactError(f"the writer lock {lock_file}: {exc.strerror or exc}") from None
    if stat.S_ISLNK(mode):
        raise ArtifactError(
            f"the writer lock {lock_file} is a symbolic link, which a writer never follows; "
            "remove it (it is made again as a plain file)"
        )
    if not stat.S_ISREG(mode):
        raise ArtifactError(f"the writer lock {lock_file} is not a regular file; remove it")
    try:
        os.close(os.open(lock_file, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC))
    except OSError as exc:
        raise ArtifactError(
            f"the writer lock {lock_file} cannot be opened by this user "
            f"({exc.strerror or exc}); ask its owner to remove it, or make it readable"
        ) from None


def version_at(path: str | os.PathLike) -> str | None:
    """The ``model_version`` of the artifact at ``path``; None where there is none (absent,
    empty, or a manifest without a version)."""
    manifest = _manifest_of(Path(path))
    if manifest is None:
        return None
    version = manifest.get("model_version")
    return version if isinstance(version, str) else None


def check_unchanged(path: str | os.PathLike, expected: str | None, option: str = "--out") -> None:
    """Raise ``ArtifactError`` when the version at ``path`` is no longer ``expected`` (what
    :func:`version_at` said when this writer started): another writer replaced it since."""
    now = version_at(path)
    if now != expected:
        before = "nothing" if expected is None else f"version {expected}"
        raise ArtifactError(
            f"{option} {str(path)!r} was written by another process while this one ran "
            f"({before} when it started, version {now} now); not replaced: run again to "
            "build on what is there now"
        )


class OutputClaim:
    """A writer's claim on ``path``, made when its command starts: the path is checked
    replaceable (:func:`check_replaceable`) and its version recorded. :meth:`turn` is the
    writer's turn to write, under :func:`writer_lock`."""

    def __init__(self, path: str | os.PathLike, option: str = "--out"):
        self.path = Path(path)
        self.option = option
        check_replaceable(self.path, option)
        check_writable(self.path)
        check_lock_usable(self.path)
        self.expected = version_at(self.path)

    @contextmanager
    def turn(
        self,
        *,
        source: str | os.PathLike | None = None,
        wait_notice: TextIO | str | None = "stderr",
        timeout: float | None = None,
    ) -> Iterator[None]:
        """Hold the path's writer lock. A writer that reads ``source`` inside its turn and
        writes the path it read (an edit in place) builds on the latest version, so nothing
        more is checked; any other writer must find the version it recorded at the start
        (:func:`check_unchanged`). The path is checked replaceable again, under the lock."""
        with writer_lock(self.path, wait_notice=wait_notice, timeout=timeout):
            check_replaceable(self.path, self.option)
            if not (source is not None and _same_path(source, self.path)):
                check_unchanged(self.path, self.expected, self.option)
            yield


def _same_path(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return Path(a).absolute() == Path(b).absolute()


def lock_path(path: str | os.PathLike) -> Path:
    """``.NAME.lock`` beside ``path``: the file a writer of ``path`` locks."""
    target = Path(path).absolute()
    return target.with_name(f".{target.name}.lock")


class WriterLockTimeout(ArtifactError):
    """Another writer held ``path``'s lock for longer than the wait allowed."""


LOCK_POLL_SECONDS = 0.05  # how often a bounded wait tries the lock again


@contextmanager
def writer_lock(
    path: str | os.PathLike,
    *,
    wait_notice: TextIO | str | None = "stderr",
    timeout: float | None = None,
) -> Iterator[Path]:
    """Hold the exclusive writer lock of ``path`` (``flock`` on :func:`lock_path`, created with
    its directory where missing). Waits while another process holds it: for as long as it
    takes (``timeout`` None), else at most ``timeout`` seconds, then raises
    :class:`WriterLockTimeout` naming the holder (a writer stopped by SIGSTOP holds the lock
    until it is continued: the bound is what keeps a waiter from waiting for ever). With
    ``wait_notice`` (a stream; "stderr": ``sys.stderr`` at the time), says once there that it
    waits and for which process (and whether it is stopped). Yields the lock file's path."""
    if wait_notice == "stderr":
        wait_notice = sys.stderr
    lock_file = lock_path(path)
    try:
        lock_file.parent.mkdir(parents=True, exist_ok=True)
        fd = _open_lock_file(lock_file)
    except OSError as exc:  # a read-only or full disk: the path being written, and why
        raise OSError(exc.errno, exc.strerror, str(path), None, str(lock_file)) from exc
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if wait_notice is not None:
                bound = "" if timeout is None else f", for at most {_seconds(timeout)} s"
                print(
                    f"waiting for {_holder(fd)} to finish writing {path} (lock {lock_file}){bound}",
                    file=wait_notice,
                    flush=True,
                )
            _wait_for_lock(fd, timeout, path, lock_file)
        _record_holder(fd)
        try:
            yield lock_file
        finally:
            _clear_holder(fd)  # a waiter never names a writer that is gone
    finally:
        os.close(fd)  # closing the descriptor releases the lock


def _wait_for_lock(fd: int, timeout: float | None, path, lock_file: Path) -> None:
    """Take the lock on ``fd``: blocking when ``timeout`` is None, else trying every
    LOCK_POLL_SECONDS until ``timeout`` seconds have passed (WriterLockTimeout)."""
    if timeout is None:
        fcntl.flock(fd, fcntl.LOCK_EX)
        return
    deadline = time.monotonic() + timeout
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            left = deadline - time.monotonic()
            if left <= 0:
                raise WriterLockTimeout(
                    f"{path}: {_holder(fd)} still holds its writer lock ({lock_file}) after "
                    f"{_seconds(timeout)} s of waiting (--lock-timeout); nothing written"
                ) from None
            time.sleep(min(LOCK_POLL_SECONDS, left))


def _seconds(value: float) -> str:
    """Seconds as a person writes them: 1.5, 30, 0.05 (what is left of a bound prints as
    the bound did, not 1.49999)."""
    return f"{value:.2f}".rstrip("0").rstrip(".")


def _open_lock_file(lock_file: Path) -> int:
    """A descriptor of the lock file, never through a symbolic link (a link planted at
    ``.NAME.lock`` would have the holder's line written into whatever it points at). Made
    with mode 0666 less the umask, so that other users who may write the model can lock it
    too; one made by another user is opened read-only (flock needs no write access)."""
    flags = os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        return os.open(lock_file, os.O_RDWR | flags, 0o666)
    except PermissionError as refused:
        try:
            return os.open(lock_file, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:  # it could not be made: the directory's refusal is the cause
            raise refused from None


def _record_holder(fd: int) -> None:
    """Write this process's pid and start time into the lock file (for the wait notice);
    nothing on a descriptor opened read-only."""
    if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE != os.O_RDWR:
        return
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} since {time.strftime('%H:%M:%S')}\n".encode(), 0)
    except OSError:  # a lock file we cannot write still locks
        pass


def _clear_holder(fd: int) -> None:
    """Empty the lock file's holder line before the lock is released (nothing on a
    descriptor opened read-only)."""
    if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE != os.O_RDWR:
        return
    try:
        os.ftruncate(fd, 0)
    except OSError:
        pass


def _holder(fd: int) -> str:
    """The holder's line from the lock file ("pid N since HH:MM:SS"), and "stopped" when
    that process is stopped (SIGSTOP, a debugger): it releases nothing until continued."""
    try:
        text = os.pread(fd, 200, 0).decode("utf-8", "replace").strip()
    except OSError:
        text = ""
    found = re.match(r"pid (\d+)", text)
    if found and not Path(f"/proc/{found.group(1)}").exists():
        return "another writer"  # the line of one that is gone (or in another PID namespace)
    if found and _is_stopped(int(found.group(1))):
        text += " (stopped: it holds the lock until it is continued with SIGCONT)"
    return text or "another writer"


def _is_stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped (state T or t in /proc/PID/stat; False where it
    cannot be read, or the process is gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[:1] in (["T"], ["t"])
