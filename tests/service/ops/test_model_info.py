"""``ncaknn_model_info`` holds one series per worker, the model it serves now: loading
several versions leaves one series (in one process, and per worker in multiprocess mode),
and a worker that is gone is not listed."""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys

from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry, generate_latest

from service.app import create_app
from service.ops.model_info import ModelInfo
from tests.service.conftest import republish_scaled, settings_for


def info_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("ncaknn_model_info{")]


def test_loading_several_versions_leaves_one_series(model_dir):
    versions = []
    with TestClient(create_app(settings_for(model_dir))) as client:
        versions.append(client.get("/v1/model").json()["model_version"])
        for factor in (1.5, 2.0, 2.5, 3.0):
            versions.append(republish_scaled(model_dir, factor))
            answer = client.post("/v1/admin/reload")
            assert answer.status_code == 200 and answer.json()["status"] == "reloaded"
        lines = info_lines(client.get("/metrics").text)
    assert len(set(versions)) == 5
    assert lines == [f'ncaknn_model_info{{index_type="flat",model_version="{versions[-1]}"}} 1.0']


def scrape(info: ModelInfo) -> list[str]:
    registry = CollectorRegistry()
    registry.register(info)
    return info_lines(generate_latest(registry).decode())


def test_one_series_per_live_worker_in_multiprocess_mode(tmp_path):
    info = ModelInfo(tmp_path)
    for version in ("v1", "v2", "v3", "v4"):
        info.set(version, "flat")
    me = os.getpid()
    assert scrape(info) == [
        f'ncaknn_model_info{{index_type="flat",model_version="v4",pid="{me}"}} 1.0'
    ]
    # another live worker is listed with its own model; a worker that exited is not
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    try:
        for pid, version in ((other.pid, "v3"), (gone.pid, "v1")):
            record = {"model_version": version, "index_type": "ivf"}
            (tmp_path / f"model_info_{pid}.json").write_text(json.dumps(record))
        (tmp_path / "model_info_x.json").write_text("{}")  # not a worker's: ignored
        lines = scrape(info)
    finally:
        other.kill()
        other.wait()
    assert sorted(lines) == sorted(
        [
            f'ncaknn_model_info{{index_type="flat",model_version="v4",pid="{me}"}} 1.0',
            f'ncaknn_model_info{{index_type="ivf",model_version="v3",pid="{other.pid}"}} 1.0',
        ]
    )


def test_a_file_that_cannot_be_written_removes_the_series_without_raising(tmp_path):
    """The model is already swapped in when its series is set: a file the directory refuses
    (here the file-size limit, SIGXFSZ ignored: EFBIG, as a full disk gives ENOSPC) must not
    fail the load (before: the OSError made the reload answer 409 'the previous model keeps
    serving' while the worker served the new one), and leaves no series naming the previous
    model and no staging file; the next model that can be written is listed again."""
    info = ModelInfo(tmp_path)
    info.set("v1", "flat")
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (0, limit[1]))
    try:
        info.set("v2", "flat")
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limit)
        signal.signal(signal.SIGXFSZ, handler)
    assert scrape(info) == []
    assert sorted(path.name for path in tmp_path.iterdir()) == []
    info.set("v3", "flat")
    assert scrape(info) == [
        f'ncaknn_model_info{{index_type="flat",model_version="v3",pid="{os.getpid()}"}} 1.0'
    ]
