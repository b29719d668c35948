"""The learned map as an ONNX graph: what ``/v1/embed`` computes, for any ONNX runtime.

The graph has one input ``x`` (batch, D) float32 and one output ``z`` (batch, d) float32:

    z = float32( float64(x) @ W.T + b ),   W = A / scale (d, D),  b = -(mean / scale) @ A.T

the standardisation folded into the projection exactly as the artifact stores it
(``projection.npy``, ``offset.npy``) and as :func:`service.core.knn.project` applies it:
inputs taken as float32, the product accumulated in float64 and rounded once. So ONNX
Runtime's answer is the service's to float32 rounding (tested within 1e-6 relative).
Nodes: Cast (to double), Gemm (transB = 1, with W and b as float64 initializers), Cast (to
float). The graph's metadata carries the model's description: classes (JSON), D, d, the model
version, the objective, the package version.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from service import __version__
from service.core.artifact import read_artifact

OPSET = 13  # Gemm, Cast: every ONNX runtime of the last five years has it
PRODUCER = "nca-knn"


def map_graph(
    projection: np.ndarray, offset: np.ndarray, metadata: Mapping[str, str] | None = None
) -> onnx.ModelProto:
    """The ONNX model of z = x @ W.T + b for W (d, D), b (d,), with ``metadata`` as its
    metadata_props (strings). ValueError for shapes that do not make a map."""
    W = np.asarray(projection, dtype=np.float32)
    b = np.asarray(offset, dtype=np.float32)
    if W.ndim != 2 or b.shape != (W.shape[0],) or min(W.shape) < 1:
        raise ValueError(
            f"a map needs projection (d, D) and offset (d,), got {W.shape} and {b.shape}"
        )
    if not (np.isfinite(W).all() and np.isfinite(b).all()):
        raise ValueError("the map has non-finite entries: nothing to export")
    d, D = W.shape
    weights = numpy_helper.from_array(W.astype(np.float64), name="projection")  # (d, D)
    bias = numpy_helper.from_array(b.astype(np.float64), name="offset")  # (d,)
    nodes = [
        helper.make_node("Cast", ["x"], ["x64"], to=TensorProto.DOUBLE, name="inputs_as_double"),
        helper.make_node(
            "Gemm", ["x64", "projection", "offset"], ["z64"], transB=1, name="project"
        ),
        helper.make_node("Cast", ["z64"], ["z"], to=TensorProto.FLOAT, name="round_to_float"),
    ]
    graph = helper.make_graph(
        nodes,
        "nca_knn_map",
        inputs=[helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", D])],
        outputs=[helper.make_tensor_value_info("z", TensorProto.FLOAT, ["batch", d])],
        initializer=[weights, bias],
    )
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", OPSET)],
        producer_name=PRODUCER,
        producer_version=__version__,
        doc_string="z = x @ projection.T + offset: the learned NCA map of an nca-knn model",
    )
    model.ir_version = 8  # readable by onnxruntime >= 1.10
    helper.set_model_props(model, {str(k): str(v) for k, v in (metadata or {}).items()})
    onnx.checker.check_model(model, full_check=True)
    return model


def estimator_metadata(classes, n_features_in: int, n_components: int, objective: str) -> dict:
    """The graph's metadata for a fitted estimator (no artifact, so no model version)."""
    return {
        "classes": json.dumps(list(classes)),
        "n_features_in": str(n_features_in),
        "n_components": str(n_components),
        "objective": str(objective),
        "nca_knn_version": __version__,
    }


def artifact_metadata(manifest: Mapping) -> dict[str, str]:
    """The manifest's description of the model, as the graph's metadata (strings)."""
    training = manifest.get("training") or {}
    return {
        "classes": json.dumps(list(manifest["classes"])),
        "n_features_in": str(manifest["n_features_in"]),
        "n_components": str(manifest["n_components"]),
        "model_version": str(manifest.get("model_version", "")),
        "objective": str(training.get("objective", "")),
        "nca_knn_version": __version__,
    }


def export_artifact(model_dir: str | os.PathLike, out: str | os.PathLike, overwrite=False) -> Path:
    """Write the map of the artifact at ``model_dir`` to ``out`` as ONNX (:func:`write_model`);
    returns the path. The artifact's own errors (``ArtifactError``) pass through."""
    check_writable_file(out, overwrite)  # before reading the model: said at once
    artifact = read_artifact(model_dir)
    model = map_graph(artifact.projection, artifact.offset, artifact_metadata(artifact.manifest))
    return write_model(model, out, overwrite)


def check_writable_file(out: str | os.PathLike, overwrite: bool, option: str = "--onnx") -> Path:
    """``out`` as a Path when a model may be written there: a non-empty path whose folder
    exists, and which is absent, or (with ``overwrite``) a regular file. ValueError naming
    what is there otherwise: a directory, a symbolic link, a device or a FIFO is never
    replaced."""
    if not str(out):
        raise ValueError(f"{option} is empty: give the path of the .onnx file to write")
    out = Path(out)
    if out.is_symlink() or (out.exists() and not out.is_file()):
        raise ValueError(f"{option} {out} exists and is not a regular file: nothing written")
    if out.exists() and not overwrite:
        raise ValueError(f"{option} {out} exists: pass --overwrite to replace it")
    if not out.parent.is_dir():
        raise ValueError(f"{option} {out}: the folder {out.parent} does not exist")
    return out


def write_model(model: onnx.ModelProto, out: str | os.PathLike, overwrite=False) -> Path:
    """Write ``model`` to ``out`` whole or not at all: under a temporary name beside it,
    flushed, given the mode a new file gets (0666 less the umask; a replaced file's own
    mode), then renamed. Where ``out`` may not be written (:func:`check_writable_file`),
    ValueError and nothing written."""
    out = check_writable_file(out, overwrite)
    mode = out.stat().st_mode & 0o777 if out.exists() else 0o666 & ~_umask()
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(model.SerializeToString())
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def _umask() -> int:
    """This process's umask (read by setting it and setting it back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask
