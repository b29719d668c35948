"""Two workers with the poller against a real ``python -m service``: the model path repointed
between two artifacts thousands of times in quick succession (a symlink renamed over, and
the directories it names exchanged by renameat2), then left alone. Both workers end on what
the path names, within a deadline: ``ncaknn_model_info`` shows one series per worker with
the path's version, and ``GET /v1/model`` on fresh connections shows the path's version and
fingerprint for every worker that answers."""

from __future__ import annotations

import ctypes
import os
import shutil
import time
from pathlib import Path

import httpx
import pytest

from service.core.artifact import read_artifact
from tests.service.conftest import republish_scaled
from tests.service.servers import running_server, wait_for

POLL_SECONDS = 0.1
CONVERGENCE_SECONDS = 20.0  # a poll, a load of the digits model, and a slow shared machine
_libc = ctypes.CDLL(None, use_errno=True)
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def exchange(a: Path, b: Path) -> None:
    """Swap two directories in one renameat2(RENAME_EXCHANGE)."""
    if _libc.renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE):
        errno = ctypes.get_errno()
        raise OSError(errno, os.strerror(errno))


def point(link: Path, target: Path) -> None:
    tmp = link.with_name(f".{link.name}.flip")
    tmp.symlink_to(target)
    os.replace(tmp, link)


def model_info(url: str) -> list[tuple[str, str]]:
    """(pid, model_version) of every ncaknn_model_info series."""
    series = []
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith("ncaknn_model_info{"):
            labels = dict(
                part.split("=", 1)
                for part in line[line.index("{") + 1 : line.index("}")].split(",")
            )
            series.append((labels["pid"].strip('"'), labels["model_version"].strip('"')))
    return series


def storm(flip, seconds: float) -> int:
    """``flip()`` every 0.5 ms or so for ``seconds``; how many flips."""
    flips = 0
    stop = time.monotonic() + seconds
    while time.monotonic() < stop:
        flip()
        flips += 1
        time.sleep(0.0005)
    return flips


def workers_on(url: str, version: str) -> list[tuple[str, str]] | None:
    """The model_info series once there are exactly two, one per worker, both on
    ``version``; else None."""
    series = model_info(url)
    pids = {pid for pid, _ in series}
    if len(series) == 2 and len(pids) == 2 and {v for _, v in series} == {version}:
        return series
    return None


def check_convergence(model_artifact, tmp_path, rounds: int, storm_seconds: float) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    shutil.copytree(model_artifact[0], a)
    shutil.copytree(model_artifact[0], b)
    republish_scaled(b, 1.7)
    link = tmp_path / "current"
    link.symlink_to(a)
    flips = {"symlink": lambda: point(link, b if os.readlink(link) == str(a) else a)}
    flips["exchange"] = lambda: exchange(a, b)  # the link stays on a; a's contents swap
    with running_server(link, NCAKNN_WORKERS=2, NCAKNN_RELOAD_POLL_SECONDS=POLL_SECONDS) as run:
        url = run[1]
        wait_for(
            lambda: workers_on(url, read_artifact(link).version),
            timeout=60,
            what="both workers reporting their model",
        )
        timings = []
        for round_ in range(rounds):
            for kind, flip in flips.items():
                count = storm(flip, storm_seconds)
                settled = time.monotonic()
                final = read_artifact(link)
                series = wait_for(
                    lambda final=final: workers_on(url, final.version),
                    timeout=CONVERGENCE_SECONDS,
                    what=f"round {round_} ({kind}, {count} flips): both workers on {final.version}"
                    f" (series: {model_info(url)})",
                )
                timings.append(time.monotonic() - settled)  # both on it in /metrics
                # every worker that answers says it serves what the path names, read there
                seen = {}
                for _ in range(40):
                    with httpx.Client(timeout=10, headers={"connection": "close"}) as client:
                        info = client.get(f"{url}/v1/model").json()
                    seen[str(info["worker_pid"])] = info
                assert set(seen) <= {pid for pid, _ in series}
                for info in seen.values():
                    assert info["model_version"] == final.version
                    assert info["artifact_fingerprint"] == final.fingerprint_id
                    if kind == "symlink":  # an exchanged directory changes its name
                        assert info["artifact_directory"] == os.path.realpath(link)
                print(
                    f"round {round_} {kind}: {count} flips, both workers on the path's version "
                    f"{timings[-1]:.2f} s after the last ({len(seen)} answered GET /v1/model)"
                )
    print(f"converged in at most {max(timings):.2f} s ({len(timings)} storms)")


def test_two_workers_end_on_what_the_path_names(model_artifact, tmp_path):
    check_convergence(model_artifact, tmp_path, rounds=1, storm_seconds=1.0)


@pytest.mark.slow  # a long real-server scenario: make test-slow
def test_two_workers_end_on_what_the_path_names_over_eight_rounds(model_artifact, tmp_path):
    check_convergence(model_artifact, tmp_path, rounds=8, storm_seconds=3.0)


def test_repository_actions_recorded_at_once_lose_nothing(tmp_path):
    """Eight writers record 40 actions each at once: the file holds every name's last
    action, each writer's applied tokens are the file's, and a fresh reader has applied
    none of them."""
    import threading

    from service.server.workers import RepositoryActions

    writers = [RepositoryActions(tmp_path) for _ in range(8)]

    def record(writer: int) -> None:
        for i in range(40):
            writers[writer].record(f"model-{writer}-{i}", "unload" if i % 2 else "load")

    threads = [threading.Thread(target=record, args=(w,)) for w in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wanted = RepositoryActions(tmp_path).wanted()
    assert len(wanted) == 320
    assert wanted["model-3-7"][0] == "unload" and wanted["model-3-8"][0] == "load"
    for writer in writers:
        assert all(wanted[name][1] == token for name, token in writer.applied.items())
        assert len(writer.applied) == 40
    assert RepositoryActions(tmp_path).applied == {}
