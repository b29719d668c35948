"""The artifact contract: round trip, refusal of damaged artifacts, atomic replacement."""

from __future__ import annotations

import json

import numpy as np
import pytest

from service.core.artifact import ArtifactError, read_artifact, read_manifest, write_artifact
from service.core.artifact import write as artifact_writer


def pieces(rng, n=20, d=3, D=5, classes=("a", "b")):
    return dict(
        projection=rng.normal(size=(d, D)).astype(np.float32),
        offset=rng.normal(size=d).astype(np.float32),
        embeddings=rng.normal(size=(n, d)).astype(np.float32),
        labels=rng.integers(0, len(classes), n).astype(np.int32),
        classes=list(classes),
        mean=rng.normal(size=D),
        scale=rng.uniform(0.5, 2.0, size=D),
        default_k=3,
    )


def test_round_trip_keeps_every_array_and_key(tmp_path, rng):
    p = pieces(rng)
    ids = np.arange(100, 120, dtype=np.int64)
    path = write_artifact(
        tmp_path / "m",
        **p,
        ids=ids,
        decision_rule="soft",
        metadata={"training": {"seed": 7}},
        extra_files={"report.json": b"{}"},
    )
    art = read_artifact(path)
    for name in ("projection", "offset", "embeddings", "labels", "mean", "scale"):
        np.testing.assert_array_equal(
            getattr(art, name), np.asarray(p[name]).astype(getattr(art, name).dtype)
        )
    np.testing.assert_array_equal(art.ids, ids)
    assert art.classes == ["a", "b"]
    assert (art.n_features_in, art.n_components, art.default_k) == (5, 3, 3)
    assert art.decision_rule == "soft"
    assert art.manifest["training"] == {"seed": 7}
    assert art.manifest["extras"]["report.json"]["bytes"] == 2
    assert art.projection.dtype == np.float32 and art.labels.dtype == np.int32
    assert len(art.version) == 16
    np.testing.assert_allclose(
        np.asarray(art.projection, np.float64) * art.scale,
        p["projection"].astype(np.float64) * p["scale"],
    )


def test_default_ids_and_integer_classes(tmp_path, rng):
    p = pieces(rng, classes=(3, 7))
    art = read_artifact(write_artifact(tmp_path / "m", **p))
    np.testing.assert_array_equal(art.ids, np.arange(20))
    assert art.classes == [3, 7]


def test_model_version_changes_with_content(tmp_path, rng):
    p = pieces(rng)
    v1 = read_artifact(write_artifact(tmp_path / "a", **p)).version
    p["projection"] = p["projection"] + 1
    v2 = read_artifact(write_artifact(tmp_path / "b", **p)).version
    assert v1 != v2


def test_corrupted_array_is_refused_naming_the_file(tmp_path, rng):
    path = write_artifact(tmp_path / "m", **pieces(rng))
    target = path / "embeddings.npy"
    raw = bytearray(target.read_bytes())
    raw[-1] ^= 0xFF
    target.write_bytes(bytes(raw))
    with pytest.raises(ArtifactError, match=r"embeddings\.npy: checksum mismatch"):
        read_artifact(path)


def test_truncated_file_is_refused_naming_the_file(tmp_path, rng):
    path = write_artifact(tmp_path / "m", **pieces(rng))
    target = path / "projection.npy"
    target.write_bytes(target.read_bytes()[:40])
    with pytest.raises(ArtifactError, match=r"projection\.npy"):
        read_artifact(path)


def test_truncated_file_with_matching_checksum_is_still_refused(tmp_path, rng):
    path = write_artifact(tmp_path / "m", **pieces(rng))
    target = path / "labels.npy"
    short = target.read_bytes()[:-8]
    target.write_bytes(short)
    manifest = json.loads((path / "manifest.json").read_text())
    import hashlib

    manifest["files"]["labels"]["sha256"] = hashlib.sha256(short).hexdigest()
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match=r"labels\.npy: cannot be read"):
        read_artifact(path)


def test_wrong_schema_version_is_refused(tmp_path, rng):
    path = write_artifact(tmp_path / "m", **pieces(rng))
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["schema_version"] = 99
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(
        ArtifactError, match=r"manifest\.json: schema_version is 99.*reads schema_version 1"
    ):
        read_artifact(path)


@pytest.mark.parametrize(
    "mutate, pattern",
    [
        (lambda m: m.pop("classes"), r"missing keys \['classes'\]"),
        (lambda m: m.__setitem__("format", "other"), r"format is 'other'"),
        (
            lambda m: m.__setitem__("decision_rule", "vote"),
            r"decision_rule: expected one of .*got 'vote'",
        ),
        (lambda m: m.__setitem__("n_components", 4), r"projection\.npy: expected shape \(4, 5\)"),
    ],
)
def test_inconsistent_manifest_is_refused(tmp_path, rng, mutate, pattern):
    path = write_artifact(tmp_path / "m", **pieces(rng))
    manifest = json.loads((path / "manifest.json").read_text())
    mutate(manifest)
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match=pattern):
        read_artifact(path)


def test_missing_directory_and_manifest_are_refused(tmp_path):
    with pytest.raises(ArtifactError, match="no artifact directory"):
        read_manifest(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ArtifactError, match=r"manifest\.json: missing"):
        read_manifest(tmp_path / "empty")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "manifest.json").write_text("{not json")
    with pytest.raises(ArtifactError, match="not valid JSON"):
        read_manifest(tmp_path / "bad")


@pytest.mark.parametrize(
    "change, pattern",
    [
        (dict(offset=np.zeros(4, np.float32)), r"offset\.npy: expected shape \(3,\)"),
        (dict(labels=np.full(20, 5, np.int32)), r"labels\.npy: label indices must lie in \[0, 2\)"),
        (dict(scale=np.zeros(5)), r"scale\.npy: every standardisation scale must be > 0"),
        (dict(default_k=0), r"default_k: expected an integer in \[1, 20\]"),
        (dict(classes=["a", "a"]), r"classes: expected distinct classes .*\['a'\]"),
        (dict(classes=[0, "0"]), r"classes: expected distinct classes .*\['0'\]"),
        (dict(classes=[0.5, 1]), r"classes\[0\]: expected an integer or a string"),
        (dict(projection=np.full((3, 5), 1e300)), r"projection\.npy: expected finite values"),
        (dict(projection=np.full((3, 5), np.nan, np.float32)), r"projection\.npy: contains NaN"),
    ],
)
def test_write_refuses_bad_pieces_and_writes_nothing(tmp_path, rng, change, pattern):
    p = pieces(rng)
    p.update(change)
    with pytest.raises(ArtifactError, match=pattern):
        write_artifact(tmp_path / "m", **p)
    assert list(tmp_path.iterdir()) == []


def test_replacing_an_artifact_swaps_it_whole(tmp_path, rng):
    first = pieces(rng)
    path = write_artifact(tmp_path / "m", **first)
    second = pieces(rng, n=30)
    write_artifact(path, **second)
    art = read_artifact(path)
    assert art.embeddings.shape == (30, 3)
    assert [p.name for p in tmp_path.iterdir()] == ["m"]  # no staging or backup left behind


def test_replacement_without_rename_exchange_uses_the_fallback(tmp_path, rng, monkeypatch):
    monkeypatch.setattr(artifact_writer, "_exchange_paths", lambda a, b: False)
    path = write_artifact(tmp_path / "m", **pieces(rng))
    write_artifact(path, **pieces(rng, n=11))
    assert read_artifact(path).embeddings.shape == (11, 3)
    assert [p.name for p in tmp_path.iterdir()] == ["m"]


def test_interrupted_write_leaves_no_artifact_and_old_one_intact(tmp_path, rng, monkeypatch):
    path = write_artifact(tmp_path / "m", **pieces(rng))
    before = read_artifact(path).embeddings.copy()
    calls = {"n": 0}
    real = artifact_writer._write_bytes_synced

    def failing(file_path, data):
        calls["n"] += 1
        if calls["n"] == 3:
            raise OSError(28, "No space left on device")
        real(file_path, data)

    monkeypatch.setattr(artifact_writer, "_write_bytes_synced", failing)
    with pytest.raises(OSError, match="No space left"):
        write_artifact(path, **pieces(rng, n=50))
    calls["n"] = 0
    with pytest.raises(OSError, match="No space left"):
        write_artifact(tmp_path / "fresh", **pieces(rng))
    monkeypatch.setattr(artifact_writer, "_write_bytes_synced", real)
    np.testing.assert_array_equal(read_artifact(path).embeddings, before)
    assert [p.name for p in tmp_path.iterdir()] == ["m"]


def test_crash_before_rename_keeps_old_artifact(tmp_path, rng, monkeypatch):
    path = write_artifact(tmp_path / "m", **pieces(rng))
    version = read_artifact(path).version

    def crash(staging, final):
        raise KeyboardInterrupt

    monkeypatch.setattr(artifact_writer, "_move_into_place", crash)
    with pytest.raises(KeyboardInterrupt):
        write_artifact(path, **pieces(rng, n=40))
    assert read_artifact(path).version == version
    assert [p.name for p in tmp_path.iterdir()] == ["m"]


def test_refuses_to_replace_a_regular_file(tmp_path, rng):
    (tmp_path / "m").write_text("not an artifact")
    with pytest.raises(ArtifactError, match="is not a directory; refusing to replace"):
        write_artifact(tmp_path / "m", **pieces(rng))
    assert (tmp_path / "m").read_text() == "not an artifact"
