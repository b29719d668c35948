"""The staging entries of dead writers (``service.core.artifact.write.remove_stale_staging``):
removed for any name in the directory, a live writer's kept, another host's only when old
and of the name written, a dead writer's moved-aside artifact restored, and nothing else
touched."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import pytest

from service.core.artifact.write import remove_stale_staging, staging_path


def dead_pid() -> int:
    """The pid of a process that has ended (and was reaped)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def named(path, pid: int):
    """``path``'s staging name for a writer on this host with ``pid``."""
    own = staging_path(path).name  # .NAME.tmp-HOST-PID-HEX, with this process's pid
    head, _, _ = own.rpartition(f"-{os.getpid()}-")
    return path.with_name(f"{head}-{pid}-0123456789ab")


def test_a_dead_writers_entries_go_for_any_name_and_a_live_ones_stay(tmp_path):
    pid = dead_pid()
    stale_dir = named(tmp_path / "v3", pid)  # a killed `--out v3`
    stale_dir.mkdir()
    (stale_dir / "embeddings.npy").write_bytes(b"half")
    stale_link = named(tmp_path / "current", pid)  # a killed `--publish current`
    stale_link.symlink_to("v3")
    live = staging_path(tmp_path / "v5")  # this process: still writing
    live.mkdir()
    unrelated = [tmp_path / ".v3.tmp-notes", tmp_path / ".cache", tmp_path / "v3.tmp-x-1-ab"]
    for path in unrelated:
        path.write_text("keep")
    removed = remove_stale_staging(tmp_path / "v4")  # the next write, of another name
    assert sorted(removed) == sorted([stale_dir, stale_link])
    assert not stale_dir.exists() and not os.path.lexists(stale_link)
    assert live.is_dir() and all(path.exists() for path in unrelated)


def test_an_old_entry_whose_artifact_is_missing_is_restored_not_removed(tmp_path):
    """A writer that died between moving the old artifact aside and moving the new one in
    left the only copy under .NAME.old-*: it goes back to NAME. Where NAME exists, the
    old copy is a leftover and is removed."""
    pid = dead_pid()
    aside = named(tmp_path / "m", pid)
    aside = aside.with_name(aside.name.replace(".tmp-", ".old-"))
    aside.mkdir()
    (aside / "manifest.json").write_text("{}")
    remove_stale_staging(tmp_path / "other")
    assert (tmp_path / "m" / "manifest.json").read_text() == "{}" and not aside.exists()
    aside.mkdir()
    remove_stale_staging(tmp_path / "other")
    assert not aside.exists() and (tmp_path / "m").is_dir()


def test_another_hosts_entries_go_only_when_old_and_of_the_name_written(tmp_path):
    """Another host's writer cannot be asked whether it lives: its entry goes when it is
    over a day old, and only when the same name is written again."""
    entries = {
        name: tmp_path / f".{name}.tmp-otherhost-{pid}-abcdef012345"
        for pid, name in enumerate(["m", "n", "m2"])
    }
    for entry in entries.values():
        entry.mkdir()
    os.utime(entries["m"], (time.time() - 2 * 86400,) * 2)
    os.utime(entries["m2"], (time.time() - 2 * 86400,) * 2)
    assert remove_stale_staging(tmp_path / "m") == [entries["m"]]
    assert entries["n"].exists() and entries["m2"].exists()


def test_a_directory_that_does_not_exist_has_nothing_to_clean(tmp_path):
    assert remove_stale_staging(tmp_path / "missing" / "m") == []


def test_a_live_writer_in_another_pid_namespace_is_not_taken_for_a_dead_one(tmp_path):
    """A writer in its own PID namespace (a container with the host's name, as with host
    networking) numbers its process apart from ours: its pid here is no process at all. Its
    live staging must stay (before: HOST-PID matched this host and the pid was unknown here,
    so its entry was removed under it, and its rename then failed)."""
    unshare = shutil.which("unshare")
    if unshare is None or os.geteuid() != 0:
        pytest.skip("needs unshare(1) and root for a PID namespace")
    pid = 424242  # the writer's pid in its namespace: no process here
    if os.path.exists(f"/proc/{pid}"):
        pytest.skip(f"pid {pid} is in use here")
    writer = (
        "import sys, time\n"
        "from service.core.artifact.write import staging_path\n"
        "entry = staging_path(sys.argv[1])\n"
        "entry.mkdir()\n"
        "print(entry, flush=True)\n"
        "time.sleep(60)\n"
    )
    # the namespace's init (sh) sets its next pid, then forks the writer
    script = f'echo {pid - 1} > /proc/sys/kernel/ns_last_pid && {sys.executable} -c "$0" $1; true'
    proc = subprocess.Popen(
        [
            unshare,
            "--pid",
            "--fork",
            "--kill-child",
            "--mount-proc",
            "sh",
            "-c",
            script,
            writer,
            str(tmp_path / "v1"),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline().strip()
        if not line:
            pytest.skip("no writer could start in a PID namespace here")
        live = tmp_path / os.path.basename(line)
        assert f"-{pid}-" in live.name and live.is_dir()
        assert remove_stale_staging(tmp_path / "v2") == []
        assert live.is_dir()
    finally:
        proc.kill()
        proc.wait()
