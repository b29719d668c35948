"""The staging entries of dead writers (``service.core.artifact.write.remove_stale_staging``):
removed for any name in the directory, a live writer's kept, another host's only when old
and of the name written, a dead writer's moved-aside artifact restored, and nothing else
touched."""

from __future__ import annotations

import os
import subprocess
import sys
import time

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
        name: tmp_path / f".{name}.tmp-otherhost-{pid}-abcdef"
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
