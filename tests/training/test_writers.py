"""What the writers do when the disk refuses them (``training.errors``, ``training.publish``,
the staging of ``service.core.artifact.write``): the training job and the references
commands, run as real processes over the file-size limit (RLIMIT_FSIZE, anywhere), on a
full tmpfs and on a read-only mount (skipped where this process cannot mount), print one
line naming the path and the cause and exit 2; the previous version and the --publish link
stay as they were, and no staging is left after a later write. The staging a killed writer
left is removed by the next write into that directory (a live writer's never); a report
page that does not fit is said, not claimed, and leaves no partial file.

The training job over the limit runs in a fresh interpreter (``python -m training`` with
the limit from its first instruction, its imports included); the references commands run
as forks of one process that imported training.cli (the ``python_m_training`` fixture):
the same command in a process of its own, without the ~3 s of imports each."""

from __future__ import annotations

import errno
import json
import os
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from service.core.artifact import read_artifact
from service.core.artifact.write import staging_path
from training.cli import main as cli_main

ROOT = Path(__file__).resolve().parents[2]
FILE_SIZE_LIMIT = 16 * 1024  # bytes: less than any model's embeddings.npy here


def run_cli(*args: str, file_size_limit: int | None = None) -> tuple[int, list[str]]:
    """``python -m training ARGS`` in a fresh interpreter: (exit status, stderr lines).
    Python writes no bytecode there: a .pyc over the limit would be written before the
    command's own code runs."""

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (file_size_limit, file_size_limit))

    done = subprocess.run(
        [sys.executable, "-m", "training", *map(str, args)],
        cwd=ROOT,
        env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},
        preexec_fn=limit if file_size_limit else None,
        capture_output=True,
        text=True,
        timeout=300,
    )
    return done.returncode, done.stderr.splitlines()


@pytest.fixture
def forked_cli(python_m_training):
    """``python -m training ARGS`` as a fork of the preloaded process: (exit status, stderr
    lines); ``prelude`` runs first."""

    def run(*args, file_size_limit: int | None = None, prelude: str = ""):
        code, _, err = python_m_training(*args, file_size_limit=file_size_limit, prelude=prelude)
        return code, err.splitlines()

    return run


def assert_refused(code: int, lines: list[str], path: Path, cause: str) -> None:
    """Exit status 2 and one error line that names ``path`` and ``cause``, no traceback."""
    errors = [line for line in lines if line.startswith("error")]
    assert code == 2, lines
    assert not any("Traceback" in line for line in lines), lines
    assert len(errors) == 1 and errors == lines[-1:], lines
    assert str(path) in errors[0] and cause in errors[0], errors[0]


def contents(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def leftovers(directory: Path) -> list[str]:
    """Staging entries (``.NAME.tmp-*``, ``.NAME.old-*``) and partial files in ``directory``."""
    return sorted(
        p.name
        for p in directory.iterdir()
        if ".tmp-" in p.name or ".old-" in p.name or p.name.endswith(".partial")
    )


@pytest.fixture
def versions(tmp_path, digits_like_model):
    """A directory with v1 (the digits-like model) and ``current`` -> v1."""
    root = tmp_path / "versions"
    root.mkdir()
    shutil.copytree(digits_like_model[0], root / "v1")
    (root / "current").symlink_to("v1")
    return root


def remove_args(root: Path, out: str, publish: str | None = "current") -> list[str]:
    ids = read_artifact(root / "v1").ids
    args = ["references", "remove", "--model", root / "v1", "--ids", ids[0], "--out", root / out]
    return [str(a) for a in args + (["--publish", root / publish] if publish else [])]


def assert_unchanged(root: Path, v1: dict[str, bytes]) -> None:
    """v1 byte for byte, ``current`` still -> v1, and no staging left."""
    assert contents(root / "v1") == v1
    assert os.readlink(root / "current") == "v1"
    assert leftovers(root) == []


# ---------------------------------------------------------------- the file-size limit


@pytest.mark.parametrize(
    "command",
    # add and condense end in the same write as remove (references.versions.write_version)
    [
        "remove",
        pytest.param("add", marks=pytest.mark.slow),
        pytest.param("condense", marks=pytest.mark.slow),
    ],
)
def test_references_commands_over_the_file_size_limit_exit_2_and_replace_nothing(
    versions, digits_like_model, forked_cli, command
):
    """remove, add and condense under RLIMIT_FSIZE: SIGXFSZ does not kill them; the write
    fails with EFBIG, said in one line naming the version; v1 and the link stay; the next
    write, without the limit, succeeds and leaves no staging."""
    v1 = contents(versions / "v1")
    split = digits_like_model[1]
    np.savez(versions.parent / "new.npz", X=split.X_test[:20], y=split.y_test[:20])
    model = ["--model", versions / "v1"]
    out = ["--out", versions / "v2", "--publish", versions / "current"]
    args = {
        "remove": remove_args(versions, "v2"),
        "add": ["references", "add", *model, "--data", versions.parent / "new.npz", *out],
        "condense": ["references", "condense", *model, *out],
    }[command]
    code, lines = forked_cli(*args, file_size_limit=FILE_SIZE_LIMIT)
    assert_refused(code, lines, versions / "v2", "File too large (EFBIG)")
    assert not (versions / "v2").exists()
    assert_unchanged(versions, v1)
    assert cli_main([str(a) for a in args]) == 0
    assert os.readlink(versions / "current") == "v2" and leftovers(versions) == []


def test_the_training_job_over_the_file_size_limit_exits_2_and_replaces_nothing(tmp_path):
    out = tmp_path / "iris"
    job = ["--data", "iris", "--no-plots", "--quiet", "--max-iter", "5", "--out", out]
    assert cli_main(list(map(str, job))) == 0
    before = contents(out)
    code, lines = run_cli(*job, file_size_limit=1024)
    assert_refused(code, lines, out, "File too large (EFBIG)")
    assert contents(out) == before and leftovers(tmp_path) == []


# ---------------------------------------------------------------- a full or read-only disk


@pytest.fixture
def small_mount(tmp_path):
    """A tmpfs of 200 KiB mounted at tmp_path/disk (a function to remount it with other
    options); skipped where this process cannot mount."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=200k", "tmpfs", str(disk)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")

    def remount(options: str) -> None:
        subprocess.run(["mount", "-o", f"remount,{options}", str(disk)], check=True)

    try:
        yield disk, remount
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def test_a_full_disk_exits_2_and_a_later_write_leaves_no_staging(
    small_mount, digits_like_model, forked_cli
):
    """v1 fills most of a 200 KiB tmpfs: removing a reference into v2 runs out of space
    (ENOSPC), said in one line naming v2; v1 and the link stay. Once there is room, the
    same command writes v2 and leaves no staging."""
    disk, remount = small_mount
    shutil.copytree(digits_like_model[0], disk / "v1")
    (disk / "current").symlink_to("v1")
    v1 = contents(disk / "v1")
    code, lines = forked_cli(*remove_args(disk, "v2"))
    assert_refused(code, lines, disk / "v2", "No space left on device (ENOSPC)")
    assert not (disk / "v2").exists()
    assert_unchanged(disk, v1)
    remount("size=2m")
    assert cli_main(remove_args(disk, "v2")) == 0
    assert os.readlink(disk / "current") == "v2" and leftovers(disk) == []
    assert len(read_artifact(disk / "current").ids) == len(read_artifact(disk / "v1").ids) - 1


def test_a_read_only_disk_exits_2_and_replaces_nothing(small_mount, digits_like_model, forked_cli):
    disk, remount = small_mount
    shutil.copytree(digits_like_model[0], disk / "v1")
    (disk / "current").symlink_to("v1")
    v1 = contents(disk / "v1")
    remount("ro")
    code, lines = forked_cli(*remove_args(disk, "v2"))
    assert_refused(code, lines, disk / "v2", "Read-only file system (EROFS)")
    assert_unchanged(disk, v1)
    assert not (disk / "v2").exists()


@pytest.mark.slow  # the job's write fails as the references' does (save_artifact, write_artifact)
def test_the_training_job_on_a_read_only_disk_exits_2(small_mount):
    disk, remount = small_mount
    remount("ro")
    code, lines = run_cli("--data", "iris", "--no-plots", "--max-iter", "2", "--out", disk / "v1")
    assert_refused(code, lines, disk / "v1", "Read-only file system (EROFS)")
    assert list(disk.iterdir()) == []


# ---------------------------------------------------------------- staging of killed writers

KILLED_AT = {
    # the artifact staged in full, killed before its rename into place
    "artifact": "import os\n"
    "from service.core.artifact import write\n"
    "write._move_into_place = lambda *args: os._exit(9)\n",
    # v2 written, the new link made under its temporary name, killed before the rename
    "link": "import os, types, training.publish\n"
    "replace = lambda *args: os._exit(9)\n"
    "training.publish.os = types.SimpleNamespace(**{**vars(os), 'replace': replace})\n",
}


def killed_remove(forked_cli, root: Path, out: str, where: str) -> None:
    """``references remove --out OUT --publish current`` in a process killed at ``where``."""
    code, lines = forked_cli(*remove_args(root, out), prelude=KILLED_AT[where])
    assert code == 9, lines


def test_the_staging_of_killed_writers_is_removed_by_the_next_write(versions, forked_cli):
    """A remove killed before its artifact's rename leaves .v2.tmp-*: the next write (of v3)
    removes it. That one, killed before its link's rename, leaves .current.tmp-* (a link):
    the next write (of v4) removes it, and leaves the staging of a writer that is still
    running (this process's)."""
    killed_remove(forked_cli, versions, "v2", "artifact")
    left = leftovers(versions)
    assert len(left) == 1 and left[0].startswith(".v2.tmp-") and (versions / left[0]).is_dir()
    killed_remove(forked_cli, versions, "v3", "link")
    left = leftovers(versions)
    assert len(left) == 1 and left[0].startswith(".current.tmp-"), left
    assert (versions / left[0]).is_symlink() and read_artifact(versions / "v3")
    assert os.readlink(versions / "current") == "v1"
    live = staging_path(versions / "v9")  # this process's: alive
    live.mkdir()
    assert cli_main(remove_args(versions, "v4")) == 0
    assert leftovers(versions) == [live.name]
    assert os.readlink(versions / "current") == "v4"


# ---------------------------------------------------------------- the report page


def fail_the_report_page(monkeypatch) -> None:
    """Writing report.html's partial file writes half the page, then the disk is full."""
    real_write_text = Path.write_text

    def write_text(self, data, *args, **kwargs):
        if self.name.endswith(".partial"):
            real_write_text(self, data[: len(data) // 2], *args, **kwargs)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write_text(self, data, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", write_text)


def test_a_report_page_that_does_not_fit_is_said_and_leaves_no_partial_file(
    tmp_path, monkeypatch, capsys
):
    """The artifact fits, report.html does not: the job succeeds (the model is valid) with a
    warning naming the page and the cause, claims no ``report:`` path, and leaves no
    partial file in the served directory; ``python -m training report`` then exits 2."""
    fail_the_report_page(monkeypatch)
    out = tmp_path / "iris"
    assert cli_main(["--data", "iris", "--no-plots", "--max-iter", "5", "--out", str(out)]) == 0
    err = capsys.readouterr().err
    page = out / "report.html"
    warning = [line for line in err.splitlines() if "report.html not written" in line]
    assert len(warning) == 1 and str(page) in warning[0], err
    assert "No space left on device (ENOSPC)" in warning[0]
    assert "report:" not in err and not page.exists() and leftovers(out) == []
    assert read_artifact(out).n_features_in == 4
    assert cli_main(["report", str(out)]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and str(page) in lines[0] and "ENOSPC" in lines[0]
    assert leftovers(out) == []
    json.loads((out / "report.json").read_text())  # the artifact's own report is whole


def test_a_publish_link_on_a_read_only_disk_is_refused_before_the_fit(small_mount, tmp_path):
    """The job's --publish into a read-only folder was found only after the fit: --out was
    replaced by the new version, then the link failed with "nothing at that path was
    replaced". It is refused first, and --out is left as it was (here: never written)."""
    disk, remount = small_mount
    remount("ro")
    out = tmp_path / "v1"
    options = ["--data", "iris", "--no-plots", "--max-iter", "2", "--out", out]
    code, lines = run_cli(*options, "--publish", disk / "current")
    assert_refused(code, lines, disk / "current", "Read-only file system (EROFS)")
    assert not out.exists() and list(disk.iterdir()) == []
