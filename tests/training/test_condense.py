"""Data editing (training.condense) and the ``references condense`` operation."""

from __future__ import annotations

import numpy as np
import pytest

from service.artifact import read_artifact
from training.cli import main as cli_main
from training.condense import condense, condensed_keep, wilson_keep
from training.references import ReferenceError, condense_references


def overlapping_blobs(n=600, n_classes=4, d=3, seed=0):
    rng = np.random.default_rng(seed)
    y = rng.integers(0, n_classes, n)
    centres = rng.normal(0, 1.5, (n_classes, d))
    return centres[y] + rng.normal(0, 1.0, (n, d)), y


@pytest.mark.parametrize("block", [1, 64])
@pytest.mark.parametrize("check_k", [1, 3, 5])
@pytest.mark.parametrize("seed", [0, 1])
def test_every_removed_point_has_its_check_k_nearest_kept_of_its_own_label(check_k, block, seed):
    z, y = overlapping_blobs(seed=seed)
    keep = condensed_keep(z.astype(np.float32), y, check_k=check_k, seed=seed, block=block)
    assert 0 < keep.sum() < len(z)
    kept = np.flatnonzero(keep)
    d2 = ((z[~keep][:, None, :] - z[kept][None, :, :]) ** 2).sum(-1)  # brute force, float64
    nearest = kept[np.argsort(d2, axis=1, kind="stable")[:, :check_k]]
    assert (y[nearest] == y[~keep][:, None]).all()


def test_more_neighbours_to_vouch_keep_more_references():
    z, y = overlapping_blobs(seed=2)
    sizes = [condensed_keep(z.astype(np.float32), y, check_k=k).sum() for k in (1, 3, 5, 9)]
    assert sizes == sorted(sizes) and sizes[0] < sizes[-1]


def test_wilson_removes_a_planted_mislabelled_point_and_keeps_clean_clusters():
    rng = np.random.default_rng(0)
    z = np.r_[rng.normal(0, 0.3, (50, 2)), rng.normal(10, 0.3, (50, 2))].astype(np.float32)
    y = np.r_[np.zeros(50, int), np.ones(50, int)]
    y[7] = 1  # deep inside class 0
    keep = wilson_keep(z, y, 2, edit_k=3)
    assert not keep[7] and keep.sum() == 99
    keep, counts = condense(z, y, 2, check_k=3, edit_k=3)
    assert not keep[7] and counts["removed_by_editing"] == 1


@pytest.fixture(scope="module")
def model(digits_like_model):
    return digits_like_model


def test_condensing_reports_accuracy_writes_fewer_references_and_is_idempotent(model, tmp_path):
    path, split = model
    parent = read_artifact(path)
    summary = condense_references(
        path, out=tmp_path / "c1", X_test=split.X_test, y_test=split.classes[split.y_test]
    )
    first = read_artifact(tmp_path / "c1")
    assert summary["rows_after"] == len(first.ids) < len(parent.ids) == summary["rows_before"]
    assert set(summary["accuracy"]) == {"validation", "test"}
    k = str(parent.default_k)
    for split_name in ("validation", "test"):
        before = summary["accuracy"][split_name]["before"][k]
        after = summary["accuracy"][split_name]["after"][k]
        assert 0 < after <= 1 and 0 < before <= 1
    assert np.isin(first.ids, parent.ids).all()
    again = condense_references(tmp_path / "c1", out=tmp_path / "c2")
    second = read_artifact(tmp_path / "c2")
    assert second.version == first.version and again["rows_after"] == again["rows_before"]
    assert [e["operation"] for e in second.manifest["lineage"]] == ["condense", "condense"]
    # other settings condense again
    condense_references(tmp_path / "c1", out=tmp_path / "c3", check_k=1)
    assert len(read_artifact(tmp_path / "c3").ids) < len(first.ids)


def test_condense_bad_input_exits_2_and_writes_nothing(model, tmp_path, capsys):
    path, split = model
    with pytest.raises(ReferenceError, match="--check-k must be >= 1"):
        condense_references(path, out=tmp_path / "x", check_k=0)
    np.savez(tmp_path / "bad.npz", X=split.X_test[:5, :-1], y=split.classes[split.y_test[:5]])
    code = cli_main(
        ["references", "condense", "--model", str(path), "--data", str(tmp_path / "bad.npz"),
         "--out", str(tmp_path / "x")]
    )  # fmt: skip
    assert code == 2 and "features, the model expects" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
