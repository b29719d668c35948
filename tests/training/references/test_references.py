"""Reference-set changes (training.references.versions): add and remove without retraining, each a
new artifact version with its lineage, served by reload."""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest
from fastapi.testclient import TestClient

from service.app import create_app
from service.core.artifact import read_artifact, write_artifact
from service.core.knn import project
from tests.service.conftest import settings_for
from training.cli import main as cli_main
from training.evaluation.calibration import calibrate
from training.publish import publish
from training.references.versions import ReferenceError, add_references, remove_references


@pytest.fixture(scope="module")
def base(digits_like_model):
    return digits_like_model


def classify(path, rows, k=5, neighbours=True):
    with TestClient(create_app(settings_for(path))) as client:
        response = client.post(
            f"/v1/classify?k={k}&return_neighbors={str(neighbours).lower()}",
            json={"instances": rows.tolist()},
        )
        assert response.status_code == 200, response.text
        return response.json()


def test_add_answers_exactly_as_a_model_written_from_scratch_on_the_union(base, tmp_path):
    path, split = base
    X_new, y_new = split.X_test[:40], split.classes[split.y_test[:40]]
    summary = add_references(path, X_new, y_new, out=tmp_path / "added")
    parent = read_artifact(path)
    scratch = write_artifact(
        tmp_path / "scratch",
        projection=parent.projection,
        offset=parent.offset,
        embeddings=np.concatenate(
            [parent.embeddings, project(X_new, parent.projection, parent.offset)]
        ),
        labels=np.concatenate([parent.labels, np.searchsorted(parent.classes, y_new)]),
        classes=parent.classes,
        mean=parent.mean,
        scale=parent.scale,
        default_k=parent.default_k,
        ids=np.concatenate([parent.ids, np.arange(40) + parent.ids.max() + 1]),
        validation_embeddings=parent.validation_embeddings,
        validation_labels=parent.validation_labels,
        # what "far" means is measured on the reference set: recalibrated on the union
        metadata={
            "outlier_calibration": calibrate(
                np.concatenate(
                    [parent.embeddings, project(X_new, parent.projection, parent.offset)]
                ),
                parent.validation_embeddings,
            )
        },
    )
    added = read_artifact(tmp_path / "added")
    assert added.version == read_artifact(scratch).version  # the same bytes in every array
    queries = split.X_test[40:90]
    a, b = classify(tmp_path / "added", queries), classify(scratch, queries)
    assert a["predictions"] == b["predictions"]
    assert summary["rows_after"] == len(parent.ids) + 40 and summary["rows_added"] == 40
    # the new rows are found: each is its own nearest reference, at distance 0
    own = classify(tmp_path / "added", X_new[:5], k=1)
    assert [p["neighbors"][0]["id"] for p in own["predictions"]] == list(
        range(len(parent.ids), len(parent.ids) + 5)
    )


def test_add_takes_given_ids_refuses_used_or_repeated_ones_and_grows_the_classes(base, tmp_path):
    path, split = base
    parent = read_artifact(path)
    X_new = split.X_test[:3]
    fresh = "new" if isinstance(parent.classes[0], str) else 77
    given = [10**9, 10**9 + 1, 5 * 10**9]
    summary = add_references(
        path, X_new, np.array([fresh, fresh, parent.classes[0]]), out=tmp_path / "a", ids=given
    )
    added = read_artifact(tmp_path / "a")
    assert added.ids[-3:].tolist() == given
    new_label = summary["new_classes"][0]
    assert added.classes == [*parent.classes, new_label]
    assert [added.classes[i] for i in added.labels[-3:]] == [
        new_label,
        new_label,
        parent.classes[0],
    ]
    entry = added.manifest["lineage"][-1]
    assert entry["operation"] == "add" and "never saw them" in entry["warning"]
    assert entry["parent_version"] == parent.version
    with pytest.raises(
        ReferenceError, match=r"already references of the model, e.g. \[1000000000\]"
    ):
        add_references(
            tmp_path / "a",
            X_new[:1],
            np.array([parent.classes[0]]),
            out=tmp_path / "b",
            ids=[10**9],
        )
    with pytest.raises(ReferenceError, match=r"duplicate ids \[7\]"):
        add_references(
            path, X_new[:2], np.array([parent.classes[0]] * 2), out=tmp_path / "b", ids=[7, 7]
        )
    with pytest.raises(ReferenceError, match="ids must be int64 integers, got dtype float64"):
        add_references(
            path, X_new[:1], np.array([parent.classes[0]]), out=tmp_path / "b", ids=np.array([1.5])
        )
    with pytest.raises(ReferenceError, match="not of the model's label type"):
        add_references(
            path,
            X_new[:1],
            np.array(["x"] if isinstance(parent.classes[0], int) else [3]),
            out=tmp_path / "b",
        )
    assert not (tmp_path / "b").exists()


def test_add_refuses_default_ids_beyond_int64_and_takes_given_ones(base, tmp_path):
    """New rows' default ids follow the model's largest; where that is int64's maximum
    they have none to take: a ReferenceError asks for --ids (an OverflowError's traceback
    before), and ids given with --ids are still taken."""
    path, split = base
    parent = read_artifact(path)
    top = np.iinfo(np.int64).max
    label = np.array([parent.classes[0]])
    add_references(path, split.X_test[:1], label, out=tmp_path / "top", ids=[top])
    with pytest.raises(ReferenceError, match="would pass int64's maximum; give them ids"):
        add_references(tmp_path / "top", split.X_test[1:2], label, out=tmp_path / "b")
    assert not (tmp_path / "b").exists()
    add_references(tmp_path / "top", split.X_test[1:2], label, out=tmp_path / "b", ids=[-1])
    assert read_artifact(tmp_path / "b").ids[-2:].tolist() == [top, -1]


def test_removed_ids_never_appear_and_emptied_classes_are_recorded(base, tmp_path):
    path, split = base
    parent = read_artifact(path)
    target = parent.labels[0]
    whole_class = parent.ids[parent.labels == target]
    others = parent.ids[parent.labels != target][:25]
    drop = np.concatenate([whole_class, others])
    summary = remove_references(path, drop, out=tmp_path / "removed")
    removed = read_artifact(tmp_path / "removed")
    assert len(removed.ids) == len(parent.ids) - len(drop) == summary["rows_after"]
    assert not np.isin(removed.ids, drop).any()
    assert summary["classes_emptied"] == [parent.classes[target]]
    assert removed.classes == parent.classes  # class indices stay stable
    answers = classify(tmp_path / "removed", split.X_test[:60], k=30)
    seen = {n["id"] for p in answers["predictions"] for n in p["neighbors"]}
    assert seen and not seen & set(drop.tolist())
    assert all(p["label"] != parent.classes[target] for p in answers["predictions"])
    with pytest.raises(
        ReferenceError, match=r"2 ids are not references of the model: \[-5, 99999\]"
    ):
        remove_references(path, [int(parent.ids[0]), -5, 99999], out=tmp_path / "x")
    assert not (tmp_path / "x").exists()


def test_removing_below_the_default_k_lowers_it_and_everything_is_refused(base, tmp_path):
    path, _ = base
    parent = read_artifact(path)
    keep = parent.ids[: parent.default_k - 1]
    summary = remove_references(path, np.setdiff1d(parent.ids, keep), out=tmp_path / "few")
    assert read_artifact(tmp_path / "few").default_k == len(keep)
    assert summary["default_k_lowered"] == [parent.default_k, len(keep)]
    with pytest.raises(ReferenceError, match="removing every reference"):
        remove_references(path, parent.ids, out=tmp_path / "none")


def test_lineage_chains_versions_and_v1_model_shows_it(base, tmp_path):
    path, split = base
    parent = read_artifact(path)
    add_references(path, split.X_test[:4], split.classes[split.y_test[:4]], out=tmp_path / "v2")
    v2 = read_artifact(tmp_path / "v2")
    remove_references(tmp_path / "v2", v2.ids[-2:], out=tmp_path / "v3")
    with TestClient(create_app(settings_for(tmp_path / "v3"))) as client:
        lineage = client.get("/v1/model").json()["lineage"]
    assert [e["operation"] for e in lineage] == ["add", "remove"]
    assert lineage[0]["parent_version"] == parent.version
    assert lineage[1]["parent_version"] == v2.version
    assert (lineage[0]["rows_after"], lineage[1]["rows_after"]) == (
        len(parent.ids) + 4,
        len(parent.ids) + 2,
    )
    assert all(e["at"].endswith("+00:00") for e in lineage)


def test_the_old_version_serves_until_the_reload_and_no_request_is_lost(base, tmp_path):
    path, split = base
    link = tmp_path / "current"
    publish(str(link), path)
    parent_version = read_artifact(path).version
    rows = split.X_test[:8].tolist()
    seen, failures = [], []
    stop = threading.Event()
    with TestClient(create_app(settings_for(link, reload_poll_seconds=0))) as client:

        def loop():
            while not stop.is_set():
                r = client.post("/v1/classify", json={"instances": rows})
                (seen if r.status_code == 200 else failures).append(
                    r.json().get("model_version") if r.status_code == 200 else r.text
                )

        worker = threading.Thread(target=loop)
        worker.start()
        code = cli_main(
            [
                "references",
                "add",
                "--model",
                str(path),
                "--data",
                str(_npz(tmp_path, split)),
                "--out",
                str(tmp_path / "v2"),
                "--publish",
                str(link),
            ]
        )
        assert code == 0
        assert client.get("/v1/model").json()["model_version"] == parent_version  # not yet
        reload = client.post("/v1/admin/reload")
        assert reload.status_code == 200 and reload.json()["status"] == "reloaded"
        new_version = reload.json()["model_version"]
        for _ in range(3):  # a few answers from the new version
            client.post("/v1/classify", json={"instances": rows})
        stop.set()
        worker.join()
    assert failures == []
    assert set(seen) <= {parent_version, new_version} and parent_version in seen


def _npz(tmp_path, split):
    path = tmp_path / "new.npz"
    np.savez(path, X=split.X_test[:30], y=split.classes[split.y_test[:30]])
    return path


BAD_INPUTS = {
    "wrong D": (
        lambda t, s: {"X": s.X_test[:5, :-1], "y": s.classes[s.y_test[:5]]},
        "features, the model expects",
    ),
    "NaN": (
        lambda t, s: {
            "X": np.where(np.eye(5, s.X_test.shape[1]) > 0, np.nan, s.X_test[:5]),
            "y": s.classes[s.y_test[:5]],
        },
        "contains NaN or Inf",
    ),
    "labels vs rows": (
        lambda t, s: {"X": s.X_test[:5], "y": s.classes[s.y_test[:4]]},
        "has 5 rows but its labels have 4",
    ),
    # True and False compare equal to 1 and 0: they would be served as digits 1 and 0
    "boolean labels": (
        lambda t, s: {"X": s.X_test[:5], "y": s.y_test[:5] > 4},
        "must be integers or strings, got booleans",
    ),
}


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_cli_bad_data_exits_2_and_writes_nothing(base, tmp_path, capsys, case):
    path, split = base
    make, message = BAD_INPUTS[case]
    np.savez(tmp_path / "bad.npz", **make(tmp_path, split))
    out = tmp_path / "out"
    code = cli_main(
        [
            "references",
            "add",
            "--model",
            str(path),
            "--data",
            str(tmp_path / "bad.npz"),
            "--out",
            str(out),
        ]
    )
    assert code == 2 and message in capsys.readouterr().err
    assert not out.exists()


def test_cli_bad_ids_and_models_exit_2_and_write_nothing(base, tmp_path, capsys):
    path, split = base
    out = tmp_path / "out"
    np.save(tmp_path / "ids.npy", np.array([1.0, 2.0]))
    np.savez(tmp_path / "new.npz", X=split.X_test[:2], y=split.classes[split.y_test[:2]])
    cases = [
        (
            [
                "add",
                "--model",
                str(path),
                "--data",
                str(tmp_path / "new.npz"),
                "--ids",
                str(tmp_path / "ids.npy"),
            ],
            "ids must be integers, got dtype float64",
        ),
        (["remove", "--model", str(path), "--ids", "3", "x7"], "ids must be integers, got 'x7'"),
        (["remove", "--model", str(tmp_path), "--ids", "3"], "is not a readable artifact"),
        (["remove", "--model", str(path), "--ids", "3", "3"], "duplicate ids [3]"),
    ]
    for args, message in cases:
        assert cli_main(["references", *args, "--out", str(out)]) == 2
        assert message in capsys.readouterr().err
        assert not out.exists()


def test_cli_remove_prints_a_summary_and_publishes(base, tmp_path, capsys):
    path, _ = base
    parent = read_artifact(path)
    (tmp_path / "ids.txt").write_text(f"{parent.ids[3]}\n{parent.ids[4]}\n")
    code = cli_main(
        [
            "references",
            "remove",
            "--model",
            str(path),
            "--ids",
            str(parent.ids[0]),
            "--ids-file",
            str(tmp_path / "ids.txt"),
            "--out",
            str(tmp_path / "v2"),
            "--publish",
            str(tmp_path / "current"),
        ]
    )
    assert code == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["rows_removed"] == 3 and summary["published"] == str(tmp_path / "current")
    assert read_artifact(tmp_path / "current").version == read_artifact(tmp_path / "v2").version


def test_remove_add_a_class_remove_again_gives_three_versions_and_three_reloads(base, tmp_path):
    """Remove one reference; add three rows of a new class; remove those three again. The
    last model has the same arrays' shapes as the first but 11 classes: every step is a new
    version, and a reload of each says "reloaded" with 10, 11 and 11 probabilities."""
    path, split = base
    parent = read_artifact(path)
    link = tmp_path / "current"
    remove_references(path, [int(parent.ids[0])], out=tmp_path / "v1")
    publish(str(link), tmp_path / "v1")
    rows = split.X_test[:3]
    added = add_references(tmp_path / "v1", rows, np.array([99, 99, 99]), out=tmp_path / "v2")
    first_new, last_new = added["ids"]
    versions, widths = [], []
    with TestClient(create_app(settings_for(link))) as client:
        for step in ("v1", "v2", "v3"):
            if step == "v3":
                remove_references(
                    tmp_path / "v2", list(range(first_new, last_new + 1)), out=tmp_path / "v3"
                )
            if step != "v1":
                publish(str(link), tmp_path / step)
                reload = client.post("/v1/admin/reload").json()
                assert reload["status"] == "reloaded", (step, reload)
            r = client.post("/v1/classify", json={"instances": split.X_test[:2].tolist()})
            versions.append(r.headers["x-model-version"])
            widths.append(len(r.json()["predictions"][0]["probabilities"]))
    assert len(set(versions)) == 3, versions
    assert widths == [10, 11, 11]
    assert [read_artifact(tmp_path / s).version for s in ("v1", "v2", "v3")] == versions
