"""Data editing (training.references.condense) and the ``references condense`` operation."""

from __future__ import annotations

import numpy as np
import pytest

from service.core.artifact import read_artifact
from service.core.knn import exact_knn
from training.cli import main as cli_main
from training.references.condense import (
    _nearest,
    condense,
    condensed_keep,
    kmeans,
    knn_within,
    prototypes,
    wilson_keep,
)
from training.references.versions import ReferenceError, condense_references


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


@pytest.mark.parametrize(
    "n, d, k, chunk_rows", [(50, 3, 1, 7), (50, 3, 4, 50), (3000, 8, 30, 1000)]
)
def test_the_neighbours_within_a_set_are_exact_knns(n, d, k, chunk_rows):
    """Wilson editing's search (torch GEMM and top-k, then the exact rerank) returns what
    exact_knn of the set against itself returns: the same neighbours, in the same order, at
    the same float64 distances, with duplicated rows (ties by smaller index) and across
    blocks."""
    rng = np.random.default_rng(0)
    z = np.round(rng.normal(size=(n, d)), 1).astype(np.float32)
    z[10:14] = z[0]  # five identical rows: fewer than the rerank margin
    want_d, want_i = exact_knn(z, z, k)
    got_d, got_i = knn_within(z, k, chunk_rows=chunk_rows)
    np.testing.assert_array_equal(got_i, want_i)
    np.testing.assert_array_equal(got_d, want_d)
    assert set(got_i[0, :5]) == {0, 10, 11, 12, 13} or k < 5


def test_the_neighbours_within_a_set_refuse_a_k_out_of_range():
    z = np.zeros((4, 2), dtype=np.float32)
    for k in (0, 5):
        with pytest.raises(ValueError, match="k must lie in"):
            knn_within(z, k)


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
        [
            "references",
            "condense",
            "--model",
            str(path),
            "--data",
            str(tmp_path / "bad.npz"),
            "--out",
            str(tmp_path / "x"),
        ]
    )
    assert code == 2 and "features, the model expects" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_prototypes_of_well_separated_clumps_are_their_means():
    # two classes, three clumps of three points each, clumps 1,000 apart: reduction 3 must
    # find the clumps, and each prototype is its clump's mean with the id of its middle point
    rng = np.random.default_rng(0)
    centres = np.array([[0, 0], [1000, 0], [0, 1000], [1000, 1000], [2000, 0], [0, 2000]])
    offsets = np.array([[-0.1, 0.0], [0.0, 0.0], [0.1, 0.05]])
    z = (centres[:, None, :] + offsets[None]).reshape(-1, 2)
    y = np.repeat([0, 0, 0, 1, 1, 1], 3)
    shuffle = rng.permutation(len(z))
    z, y = z[shuffle], y[shuffle]
    P, labels, representative, assignment = prototypes(z, y, reduction=3.0, seed=1)
    assert len(P) == 6 and sorted(labels.tolist()) == [0, 0, 0, 1, 1, 1]
    expected = centres + offsets.mean(0)
    for p, c in zip(P, labels, strict=True):
        j = np.abs(expected - p).sum(1).argmin()
        np.testing.assert_allclose(p, expected[j], atol=1e-3)
        assert (j < 3) == (c == 0)
    # the representative is the middle point (offset 0, 0), nearest the mean
    np.testing.assert_allclose(
        z[representative], centres[[np.abs(centres - p).sum(1).argmin() for p in P]]
    )
    assert (np.bincount(assignment) == 3).all()


@pytest.mark.parametrize("reduction", [1.0, 2.5, 4.0])
def test_prototypes_partition_each_class_and_sit_at_their_clusters_means(reduction):
    # each prototype is its cluster's mean, the clusters partition each class and the
    # representative is the member nearest the prototype
    z, y = overlapping_blobs(n=500, seed=3)
    z = z.astype(np.float32)
    P, labels, representative, assignment = prototypes(z, y, reduction=reduction, seed=0)
    for c in np.unique(y):
        members = np.flatnonzero(y == c)
        # at most round(N_c / reduction) prototypes (k-means may leave a centre empty)
        assert 1 <= (labels == c).sum() <= max(1, round(len(members) / reduction))
        assert (labels[assignment[members]] == c).all()  # a class's clusters stay in it
    assert (np.bincount(assignment, minlength=len(P)) > 0).all()  # a partition, none empty
    for j in range(len(P)):
        cluster = np.flatnonzero(assignment == j)
        np.testing.assert_allclose(P[j], z[cluster].astype(np.float64).mean(0), atol=1e-5)
        d2 = ((z[cluster] - P[j]) ** 2).sum(1)  # a two-point cluster ties: either is nearest
        assert representative[j] in cluster
        assert d2[cluster == representative[j]][0] <= d2.min() * (1 + 1e-5)
    if reduction == 1.0:  # one reference per prototype: the set itself
        np.testing.assert_array_equal(np.sort(representative), np.arange(len(z)))


def test_nearest_search_in_bounded_chunks_equals_brute_force():
    # a budget of 50 distances a chunk: 3 queries per chunk against 17 references, so the
    # 100 queries take 34 chunks and the last one is short
    rng = np.random.default_rng(9)
    queries, references = rng.normal(size=(100, 3)), rng.normal(size=(17, 3))
    d2 = ((queries[:, None, :] - references[None]) ** 2).sum(-1)
    np.testing.assert_array_equal(_nearest(queries, references, max_floats=50), d2.argmin(1))
    np.testing.assert_array_equal(_nearest(queries, references, max_floats=1), d2.argmin(1))


def test_kmeans_reaches_a_fixed_point_of_lloyds_iteration():
    z, _ = overlapping_blobs(n=400, seed=4)
    centres, assignment = kmeans(z, 12, seed=0, iterations=200)
    d2 = ((z[:, None, :] - centres[None]) ** 2).sum(-1)
    np.testing.assert_array_equal(d2.argmin(1), assignment)  # each point at its nearest centre
    for j in range(len(centres)):
        np.testing.assert_allclose(centres[j], z[assignment == j].mean(0))


def test_condensing_to_prototypes_writes_cluster_means_with_real_ids(model, tmp_path):
    path, split = model
    parent = read_artifact(path)
    summary = condense_references(
        path,
        out=tmp_path / "p1",
        method="prototypes",
        reduction=3,
        refine="none",
        X_test=split.X_test,
        y_test=split.classes[split.y_test],
    )
    first = read_artifact(tmp_path / "p1")
    sizes = np.bincount(np.asarray(parent.labels))
    assert len(first.ids) == summary["rows_after"] <= sum(max(1, round(n / 3)) for n in sizes)
    assert summary["rows_after"] > 0.9 * sum(round(n / 3) for n in sizes)
    assert len(np.unique(first.ids)) == len(first.ids) and np.isin(first.ids, parent.ids).all()
    entry = first.manifest["lineage"][-1]
    assert entry["settings"] == {
        "method": "prototypes",
        "refine": "none",
        "reduction": 3.0,
        "refine_epochs": 0,
        "seed": 0,
    }
    assert "prototypes" in entry["method"] and set(summary["accuracy"]) == {"validation", "test"}
    # each prototype carries the label of the reference whose id it has
    parent_label = dict(zip(parent.ids.tolist(), np.asarray(parent.labels).tolist(), strict=True))
    assert [parent_label[i] for i in first.ids.tolist()] == np.asarray(first.labels).tolist()
    condense_references(
        tmp_path / "p1", out=tmp_path / "p2", method="prototypes", reduction=3, refine="none"
    )
    assert read_artifact(tmp_path / "p2").version == first.version  # idempotent


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"method": "prototypes", "reduction": 0.5}, "--reduction must be a number > 1"),
        ({"method": "prototypes", "reduction": 1}, "--reduction must be a number > 1"),
        ({"method": "prototypes", "refine": "lvq"}, "--refine must be one of nca, none"),
        ({"method": "prototypes", "reduction": float("nan")}, "--reduction must be a number"),
        ({"method": "prototypes", "check_k": 3}, "apply to --method hart only"),
        ({"method": "prototypes", "edit_k": 3}, "apply to --method hart only"),
        ({"method": "prototypes", "refine_epochs": -1}, "--refine-epochs must be an integer"),
        ({"method": "prototypes", "refine_epochs": 2.5}, "--refine-epochs must be an integer"),
        (
            {"reduction": 3},
            "--reduction, --refine, --refine-epochs and --min-per-class apply to --method protot",
        ),
        (
            {"refine_epochs": 3},
            "--reduction, --refine, --refine-epochs and --min-per-class apply to --method",
        ),
        (
            {"refine": "nca"},
            "--reduction, --refine, --refine-epochs and --min-per-class apply to --method",
        ),
        ({"method": "kmeans"}, "--method must be one of hart, prototypes"),
    ],
)
def test_condense_settings_that_do_not_fit_the_method_are_refused(model, tmp_path, kwargs, message):
    path, _ = model
    with pytest.raises(ReferenceError, match=message):
        condense_references(path, out=tmp_path / "x", **kwargs)
    assert not (tmp_path / "x").exists()


def test_condense_cli_prototypes_and_a_bad_reduction(model, tmp_path, capsys):
    path, _ = model
    base = ["references", "condense", "--model", str(path), "--method", "prototypes"]
    assert cli_main([*base, "--reduction", "0", "--out", str(tmp_path / "x")]) == 2
    assert "--reduction must be a number > 1 (rows per prototype), got 0.0" in (
        capsys.readouterr().err
    )
    assert not (tmp_path / "x").exists()
    assert cli_main([*base, "--out", str(tmp_path / "p")]) == 0
    assert read_artifact(tmp_path / "p").manifest["lineage"][-1]["settings"]["method"] == (
        "prototypes"
    )
    assert cli_main([*base, "--refine-epochs", "0", "--out", str(tmp_path / "m")]) == 0
    assert read_artifact(tmp_path / "m").manifest["lineage"][-1]["settings"]["refine_epochs"] == 0
    assert cli_main([*base, "--refine-epochs", "-2", "--out", str(tmp_path / "y")]) == 2
    assert "--refine-epochs must be an integer >= 0, got -2" in capsys.readouterr().err
    # --refine glvq was removed: a usage error that names the refiners left
    with pytest.raises(SystemExit) as usage:
        cli_main([*base, "--refine", "glvq", "--out", str(tmp_path / "g")])
    err = capsys.readouterr().err
    assert usage.value.code == 2 and "argument --refine: invalid choice: 'glvq'" in err, err
    assert "nca" in err and "none" in err and not (tmp_path / "g").exists()
