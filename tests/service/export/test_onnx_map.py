"""The learned map exported as ONNX (service.export, nca-export): ONNX Runtime's answer
against /v1/embed's on the same rows, the graph's metadata against the manifest, and the
command as a hostile user meets it (existing files, folders, links, broken artifacts)."""

from __future__ import annotations

import json
import os

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from service.core.artifact import read_artifact
from service.export.__main__ import main
from service.export.onnx_map import map_graph


def run_graph(path_or_model, x: np.ndarray) -> np.ndarray:
    data = path_or_model if isinstance(path_or_model, (str, os.PathLike)) else None
    if data is None:
        data = path_or_model.SerializeToString()
    session = ort.InferenceSession(
        str(data) if isinstance(data, os.PathLike) else data, providers=["CPUExecutionProvider"]
    )
    return session.run(["z"], {"x": np.asarray(x, dtype=np.float32)})[0]


@pytest.fixture
def exported(model_dir, tmp_path):
    out = tmp_path / "map.onnx"
    assert main([str(model_dir), "--onnx", str(out)]) == 0
    return out


def test_onnx_runtime_answers_what_v1_embed_answers(client, model_artifact, exported):
    rows = model_artifact[2].X_test[:50]
    served = np.array(
        client.post("/v1/embed", json={"instances": rows.tolist()}).json()["embeddings"],
        np.float32,
    )
    onnx_z = run_graph(exported, rows)
    assert onnx_z.dtype == np.float32 and onnx_z.shape == served.shape
    np.testing.assert_allclose(onnx_z, served, rtol=1e-6, atol=1e-6)
    # far from the training data (inputs 1,000 times larger) the two still agree
    far = rows * 1000.0
    served_far = np.array(
        client.post("/v1/embed", json={"instances": far.tolist()}).json()["embeddings"],
        np.float32,
    )
    np.testing.assert_allclose(run_graph(exported, far), served_far, rtol=1e-6)


def test_the_graph_is_three_nodes_and_carries_the_models_description(model_dir, exported):
    model = onnx.load(str(exported))
    onnx.checker.check_model(model, full_check=True)
    assert [node.op_type for node in model.graph.node] == ["Cast", "Gemm", "Cast"]
    assert model.producer_name == "nca-knn"
    art = read_artifact(model_dir)
    props = {p.key: p.value for p in model.metadata_props}
    assert json.loads(props["classes"]) == art.classes
    assert int(props["n_features_in"]) == art.n_features_in
    assert int(props["n_components"]) == art.n_components
    assert props["model_version"] == art.version
    dims = [d.dim_value or d.dim_param for d in model.graph.input[0].type.tensor_type.shape.dim]
    assert dims == ["batch", art.n_features_in]


def test_the_graph_is_the_map_on_a_toy_problem():
    """z = x @ W.T + b exactly, on numbers small enough to check by hand."""
    W = np.array([[1.0, 0.0, 2.0], [0.0, -1.0, 0.5]], np.float32)
    b = np.array([0.5, -2.0], np.float32)
    x = np.array([[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]], np.float32)
    np.testing.assert_array_equal(run_graph(map_graph(W, b), x), [[7.5, -2.5], [0.5, -2.0]])


@pytest.mark.parametrize(
    "projection, offset, message",
    [
        (np.ones((2, 3)), np.ones(3), r"projection \(d, D\) and offset \(d,\)"),
        (np.ones(3), np.ones(3), r"projection \(d, D\)"),
        (np.full((2, 3), np.nan), np.ones(2), "non-finite"),
    ],
)
def test_a_map_that_is_not_one_is_refused(projection, offset, message):
    with pytest.raises(ValueError, match=message):
        map_graph(projection, offset)


def test_an_existing_file_is_kept_unless_overwrite_is_given(model_dir, tmp_path, capsys):
    out = tmp_path / "notes.onnx"
    out.write_text("the user's file")
    assert main([str(model_dir), "--onnx", str(out)]) == 2
    assert "exists: pass --overwrite" in capsys.readouterr().err
    assert out.read_text() == "the user's file"
    assert main([str(model_dir), "--onnx", str(out), "--overwrite"]) == 0
    onnx.checker.check_model(onnx.load(str(out)))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model", "notes.onnx"]  # no temp


@pytest.mark.parametrize("kind", ["directory", "symlink", "missing folder"])
def test_what_is_not_a_file_to_write_is_refused_and_left_alone(model_dir, tmp_path, kind, capsys):
    if kind == "directory":
        out = tmp_path / "data"
        out.mkdir()
        (out / "keep.txt").write_text("keep")
    elif kind == "symlink":
        target = tmp_path / "target.txt"
        target.write_text("keep")
        out = tmp_path / "link.onnx"
        out.symlink_to(target)
    else:
        out = tmp_path / "no-such-folder" / "map.onnx"
    assert main([str(model_dir), "--onnx", str(out), "--overwrite"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and len(err.strip().splitlines()) == 1
    if kind == "directory":
        assert (out / "keep.txt").read_text() == "keep"
    elif kind == "symlink":
        assert out.is_symlink() and (tmp_path / "target.txt").read_text() == "keep"


def test_a_folder_that_is_not_a_model_is_one_line_and_exit_2(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    out = tmp_path / "map.onnx"
    for model in (tmp_path / "empty", tmp_path / "absent"):
        assert main([str(model), "--onnx", str(out)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and len(err.strip().splitlines()) == 1, err
    assert not out.exists()


def test_the_file_has_the_mode_a_new_file_gets_or_the_one_it_replaces(model_dir, tmp_path):
    mask = os.umask(0o027)
    try:
        out = tmp_path / "map.onnx"
        assert main([str(model_dir), "--onnx", str(out)]) == 0
        assert out.stat().st_mode & 0o777 == 0o640
        out.chmod(0o604)
        assert main([str(model_dir), "--onnx", str(out), "--overwrite"]) == 0
        assert out.stat().st_mode & 0o777 == 0o604
    finally:
        os.umask(mask)


def test_an_empty_path_is_named_as_such(model_dir, capsys):
    assert main([str(model_dir), "--onnx", ""]) == 2
    assert "--onnx is empty" in capsys.readouterr().err
