"""A corpus of artifacts whose checksums and version are consistent but whose contents the
writer would never write: every manifest field and every array made non-finite, out of range,
of the wrong type, duplicated, or unreadable. Each is refused by the reader with an error
naming the field, and by a reload (409) with the old model kept serving."""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient

from service.app import create_app
from service.config import Settings
from service.core.artifact import ARRAY_SPECS, ArtifactError, model_version_of, read_artifact
from service.engine.model import load_model
from tests.service.conftest import npy, republish_scaled, settings_for

Manifest = dict


def tamper(path: Path, *, manifest: Callable[[Manifest], None] | None = None, arrays=None) -> None:
    """Change the artifact at ``path`` in place (``manifest(m)`` edits the manifest,
    ``arrays`` maps a name to its new array) and make its checksums, shapes and model
    version consistent again, as a careful forger would."""
    m = json.loads((path / "manifest.json").read_text())
    for name, array in (arrays or {}).items():
        data = npy(array)
        (path / ARRAY_SPECS[name][0]).write_bytes(data)
        m["files"][name].update(sha256=hashlib.sha256(data).hexdigest(), shape=list(array.shape))
    if manifest is not None:
        manifest(m)
    try:
        m["model_version"] = model_version_of(m)
    except (TypeError, KeyError):
        pass  # a files record the version cannot be computed from: the reader refuses it first
    (path / "manifest.json").write_text(json.dumps(m))


def setter(key: str, value) -> Callable[[Manifest], None]:
    return lambda m: m.__setitem__(key, value)


def nan_at(array: np.ndarray, value=np.nan) -> np.ndarray:
    out = np.array(array, copy=True)
    out.flat[len(out.flat) // 2] = value
    return out


N = 1250  # the session artifact's references; classes 0..9; D = 64, d = 16
MANIFEST_CORPUS = {
    "n_features_in as a string": (setter("n_features_in", "64"), "n_features_in"),
    "n_features_in as a float": (setter("n_features_in", 64.0), "n_features_in"),
    "n_features_in true": (setter("n_features_in", True), "n_features_in"),
    "n_components 0": (setter("n_components", 0), "n_components"),
    "n_components null": (setter("n_components", None), "n_components"),
    "n_references negative": (setter("n_references", -1), "n_references"),
    "n_references one more": (setter("n_references", N + 1), "expected shape"),
    "n_validation negative": (setter("n_validation", -1), "n_validation"),
    "classes duplicated": (setter("classes", [0, 0, 2, 3, 4, 5, 6, 7, 8, 9]), "classes"),
    "0 beside '0'": (setter("classes", [0, "0", 2, 3, 4, 5, 6, 7, 8, 9]), "classes"),
    "a float class": (setter("classes", [0.5, 1, 2, 3, 4, 5, 6, 7, 8, 9]), r"classes\[0\]"),
    "a bool class": (setter("classes", [True, 1, 2, 3, 4, 5, 6, 7, 8, 9]), r"classes\[0\]"),
    "a null class": (setter("classes", [None, 1, 2, 3, 4, 5, 6, 7, 8, 9]), r"classes\[0\]"),
    "a list class": (setter("classes", [[0], 1, 2, 3, 4, 5, 6, 7, 8, 9]), r"classes\[0\]"),
    "a dict class": (setter("classes", [{}, 1, 2, 3, 4, 5, 6, 7, 8, 9]), r"classes\[0\]"),
    "classes empty": (setter("classes", []), "classes"),
    "classes a string": (setter("classes", "0123456789"), "classes"),
    "fewer classes than labels": (setter("classes", [0, 1, 2]), "label indices"),
    "default_k 0": (setter("default_k", 0), "default_k"),
    "default_k -3": (setter("default_k", -3), "default_k"),
    "default_k N + 1": (setter("default_k", N + 1), "default_k"),
    "default_k 10^30": (setter("default_k", 10**30), "default_k"),
    "default_k 2.5": (setter("default_k", 2.5), "default_k"),
    "default_k '5'": (setter("default_k", "5"), "default_k"),
    "default_k true": (setter("default_k", True), "default_k"),
    "decision_rule unknown": (setter("decision_rule", "vote"), "decision_rule"),
    "decision_rule null": (setter("decision_rule", None), "decision_rule"),
    "outlier quantile not a number": (
        setter("outlier_calibration", {"quantiles": {"0.5": "x", "0.9": 1.0}}),
        "outlier_calibration",
    ),
    "outlier quantiles decreasing": (
        setter("outlier_calibration", {"quantiles": {"0.5": 2.0, "0.9": 1.0}}),
        "outlier_calibration",
    ),
    "index kind not a string": (setter("index", {"kind": 5, "params": {}}), "index"),
    "index parameter negative": (
        setter("index", {"kind": "ivf", "params": {"nprobe": -1}}),
        r"index\.params\.nprobe",
    ),
    "index parameter a string": (
        setter("index", {"kind": "ivf", "params": {"nprobe": "16"}}),
        r"index\.params\.nprobe",
    ),
    "metrics a string": (setter("metrics", "good"), "metrics"),
    "training a list": (setter("training", []), "training"),
    "lineage an object": (setter("lineage", {}), "lineage"),
    "lineage of numbers": (setter("lineage", [1, 2]), "lineage"),
    "reference_set a string": (setter("reference_set", "rows"), "reference_set"),
    "created_at a number": (setter("created_at", 5), "created_at"),
    "files entry not an object": (lambda m: m["files"].__setitem__("ids", 5), "files"),
    "file path outside": (lambda m: m["files"]["labels"].__setitem__("path", "../x"), "labels"),
}


ARRAY_CORPUS = {
    "projection NaN": (lambda a: {"projection": nan_at(a.projection)}, "projection.npy"),
    "projection inf": (lambda a: {"projection": nan_at(a.projection, np.inf)}, "projection.npy"),
    "offset NaN": (lambda a: {"offset": nan_at(a.offset)}, "offset.npy"),
    "offset -inf": (lambda a: {"offset": nan_at(a.offset, -np.inf)}, "offset.npy"),
    "an embedding row NaN": (lambda a: {"embeddings": nan_at(a.embeddings)}, "embeddings.npy"),
    "an embedding row inf": (
        lambda a: {"embeddings": nan_at(a.embeddings, np.inf)},
        "embeddings.npy",
    ),
    "mean inf": (lambda a: {"mean": nan_at(a.mean, np.inf)}, "mean.npy"),
    "scale 0": (lambda a: {"scale": nan_at(a.scale, 0.0)}, "scale.npy"),
    "scale negative": (lambda a: {"scale": nan_at(a.scale, -1.0)}, "scale.npy"),
    "scale NaN": (lambda a: {"scale": nan_at(a.scale)}, "scale.npy"),
    "validation embedding inf": (
        lambda a: {"validation_embeddings": nan_at(a.validation_embeddings, np.inf)},
        "validation_embeddings.npy",
    ),
    "a label -1": (lambda a: {"labels": nan_at(a.labels, -1)}, "labels.npy"),
    "a label past the classes": (lambda a: {"labels": nan_at(a.labels, 10)}, "labels.npy"),
    "a validation label past the classes": (
        lambda a: {"validation_labels": nan_at(a.validation_labels, 99)},
        "validation_labels.npy",
    ),
    "projection float64": (
        lambda a: {"projection": np.asarray(a.projection, np.float64)},
        "projection.npy: expected dtype",
    ),
}


def _fifo(path: Path) -> None:
    (path / "labels.npy").unlink()
    os.mkfifo(path / "labels.npy")


def _directory(path: Path) -> None:
    (path / "labels.npy").unlink()
    (path / "labels.npy").mkdir()


def _unix_socket(path: Path) -> None:
    (path / "labels.npy").unlink()
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(path / "labels.npy"))
    sock.close()


def _device(path: Path) -> None:
    (path / "labels.npy").unlink()
    (path / "labels.npy").symlink_to("/dev/zero")


def _unreadable(path: Path) -> None:
    if os.geteuid() == 0:
        pytest.skip("root reads a file whatever its mode")
    (path / "labels.npy").chmod(0)


def _deep_manifest(path: Path) -> None:
    (path / "manifest.json").write_text("[" * 200_000 + "]" * 200_000)


def _huge_manifest(path: Path) -> None:
    with open(path / "manifest.json", "ab") as fh:
        fh.truncate(17 * 2**20)  # sparse: no memory or disk spent


def _sparse_embeddings(path: Path) -> None:
    with open(path / "embeddings.npy", "ab") as fh:
        fh.truncate(3 * 2**30)  # 3 GiB the manifest's shape cannot hold


UNREADABLE_CORPUS = {
    "a manifest nested 200,000 deep": (_deep_manifest, "manifest.json: not valid JSON .*nested"),
    "a 17 MiB manifest": (_huge_manifest, "manifest.json: .* more than the"),
    "a sparse 3 GiB embeddings.npy": (_sparse_embeddings, "embeddings.npy: .* more than the"),
    "labels.npy a FIFO": (_fifo, "labels.npy: expected a regular file .* got a FIFO"),
    "labels.npy a directory": (_directory, "labels.npy: expected a regular file"),
    "labels.npy a socket": (_unix_socket, "labels.npy: cannot be opened"),
    "labels.npy -> /dev/zero": (_device, "got a character device"),
    "labels.npy not readable": (_unreadable, "labels.npy: cannot be opened"),
}


@pytest.mark.parametrize("case", sorted(MANIFEST_CORPUS))
def test_a_manifest_the_writer_would_refuse_is_refused_on_read(model_dir, case):
    edit, named = MANIFEST_CORPUS[case]
    tamper(model_dir, manifest=edit)
    with pytest.raises(ArtifactError, match=named):
        read_artifact(model_dir)


@pytest.mark.parametrize("case", sorted(ARRAY_CORPUS))
def test_arrays_the_writer_would_refuse_are_refused_on_read(model_dir, case):
    arrays, named = ARRAY_CORPUS[case]
    tamper(model_dir, arrays=arrays(read_artifact(model_dir)))
    with pytest.raises(ArtifactError, match=named):
        read_artifact(model_dir)


@pytest.mark.parametrize("case", sorted(UNREADABLE_CORPUS))
def test_files_that_cannot_be_read_are_refused_at_once(model_dir, case):
    make, named = UNREADABLE_CORPUS[case]
    make(model_dir)
    with pytest.raises(ArtifactError, match=named):
        read_artifact(model_dir)


def test_a_default_k_above_the_service_max_k_is_refused_at_load(model_dir):
    tamper(model_dir, manifest=setter("default_k", 300))
    read_artifact(model_dir)  # a valid artifact (300 <= N) ...
    with pytest.raises(ArtifactError, match=r"default_k=300 is above this service's max_k=256"):
        load_model(model_dir, Settings(model_path=model_dir))  # ... that this service cannot serve


RELOAD_CASES = [
    ("manifest", "0 beside '0'"),
    ("manifest", "default_k N + 1"),
    ("manifest", "a dict class"),
    ("manifest", "metrics a string"),
    ("arrays", "projection NaN"),
    ("arrays", "an embedding row inf"),
    ("unreadable", "labels.npy a FIFO"),
    ("max_k", "default_k 300"),
]


@pytest.mark.parametrize("kind, case", RELOAD_CASES)
def test_a_reload_refuses_it_and_keeps_the_old_model_serving(model_dir, kind, case):
    with TestClient(create_app(settings_for(model_dir))) as client:
        before = client.get("/v1/model").json()["model_version"]
        if kind == "manifest":
            edit, named = MANIFEST_CORPUS[case]
            tamper(model_dir, manifest=edit)
        elif kind == "arrays":
            arrays, named = ARRAY_CORPUS[case]
            tamper(model_dir, arrays=arrays(read_artifact(model_dir)))
        elif kind == "unreadable":
            make, named = UNREADABLE_CORPUS[case]
            make(model_dir)
        else:
            tamper(model_dir, manifest=setter("default_k", 300))
            named = "max_k"
        answer = client.post("/v1/admin/reload")
        assert answer.status_code == 409, answer.text
        assert answer.json()["error_type"] == "reload_failed"
        assert re.search(named, answer.json()["error"]), answer.json()["error"]
        info = client.get("/v1/model")
        assert info.status_code == 200 and info.json()["model_version"] == before
        assert client.post("/v1/classify", json={"instances": [[0.5] * 64]}).status_code == 200


def test_a_reload_has_a_deadline_and_loads_do_not_queue(model_dir, monkeypatch):
    """A load that takes 2 s: the reload answers 409 at its 0.5 s deadline, a second reload
    meanwhile is refused at once (not queued), and the slow load, once done, swaps in."""
    import time

    from service.engine import slot

    real_load = slot.load_model

    def slow_load(*args, **kwargs):
        time.sleep(2.0)
        return real_load(*args, **kwargs)

    with TestClient(create_app(settings_for(model_dir, reload_timeout_seconds=0.5))) as client:
        before = client.get("/v1/model").json()["model_version"]
        republished = republish_scaled(model_dir, 1.5)
        monkeypatch.setattr(slot, "load_model", slow_load)
        started = time.perf_counter()
        first = client.post("/v1/admin/reload")
        waited = time.perf_counter() - started
        second = client.post("/v1/admin/reload")
        assert first.status_code == 409 and "did not finish within 0.5 s" in first.json()["error"]
        assert 0.4 < waited < 1.5
        assert second.status_code == 409 and "another load" in second.json()["error"]
        assert client.get("/v1/model").json()["model_version"] == before
        deadline = time.monotonic() + 10
        while client.get("/v1/model").json()["model_version"] != republished:
            assert time.monotonic() < deadline, "the slow load never swapped in"
            time.sleep(0.1)


def test_the_poller_outlives_an_artifact_it_cannot_parse(model_dir, tmp_path):
    """A manifest nested 200,000 deep once stopped the model sync for good; the poller
    now refuses it and picks up the valid artifact written after it."""
    import shutil
    import time

    good = tmp_path / "good"
    shutil.copytree(model_dir, good)
    with TestClient(create_app(settings_for(model_dir, reload_poll_seconds=0.1))) as client:
        before = client.get("/v1/model").json()["model_version"]
        _deep_manifest(model_dir)
        deadline = time.monotonic() + 10
        while "ncaknn_model_load_failures_total 1.0" not in client.get("/metrics").text:
            assert time.monotonic() < deadline, "the poller never tried the deep manifest"
            time.sleep(0.05)
        assert client.get("/v1/model").json()["model_version"] == before
        republished = republish_scaled(good, 1.3)
        shutil.rmtree(model_dir)
        shutil.copytree(good, model_dir)
        deadline = time.monotonic() + 10
        while client.get("/v1/model").json()["model_version"] != republished:
            assert time.monotonic() < deadline, "the poller stopped"
            time.sleep(0.1)
