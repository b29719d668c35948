"""The Open Inference Protocol (KServe V2) on our engine: tensors in, tensors out.

No web or gRPC imports: ``service.oip.rest`` (REST, with the binary tensor data extension)
and ``service.oip.grpc_server`` (gRPC) both turn their wire format into an :class:`InferCall`
and the engine's answer into :class:`OutputTensor` objects through this module, so the two
protocols accept the same inputs, refuse the same mistakes with the same messages, and
answer the same numbers as ``/v1/classify``.

The model (name: the setting ``v2_model_name``, or its folder's name in a model repository;
version: the artifact's version):

* input ``input``: [n, D], FP32; FP64, FP16 and every INT / UINT type are accepted too and
  converted to float32 (the values must lie in the model's input range, as for /v1).
* outputs (all by default, or those requested):

  ====================  ========  =======  ==============================================
  name                  datatype  shape    what
  ====================  ========  =======  ==============================================
  label                 INT64     [n]      predicted class (BYTES when a class is not an
                                           integer)
  probabilities         FP64      [n, C]   class probabilities, GET /v1/model's class order
  embedding             FP32      [n, d]   the input projected into the learned space
  neighbor_ids          INT64     [n, k]   the k nearest references' ids, nearest first
  neighbor_distances    FP64      [n, k]   their squared distances in the learned space
  nearest_distance      FP64      [n]      squared distance to the nearest reference
  outlier               BOOL      [n]      nearest reference beyond the calibrated threshold
                                           (only for models with an outlier calibration)
  ====================  ========  =======  ==============================================

* parameters (request-level): ``k`` (integer), ``rule`` (majority, soft, soft_prior),
  ``outlier_quantile`` (number); the protocol's ``binary_data_output`` (REST).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from service.core.vocabulary import RULES
from service.engine.infer import Answer, Query, resolve
from service.engine.model import LoadedModel, class_array
from service.errors import EmptyBatch, InvalidInput, PayloadTooLarge
from service.state import AppState
from service.wire import check_int_range, finite_number, to_rows

INPUT_NAME = "input"
PLATFORM = "nca-knn"
# the protocol's datatypes and their numpy types (little-endian, row-major on the wire)
DTYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "UINT8": np.dtype("<u1"),
    "UINT16": np.dtype("<u2"),
    "UINT32": np.dtype("<u4"),
    "UINT64": np.dtype("<u8"),
    "INT8": np.dtype("<i1"),
    "INT16": np.dtype("<i2"),
    "INT32": np.dtype("<i4"),
    "INT64": np.dtype("<i8"),
    "FP16": np.dtype("<f2"),
    "FP32": np.dtype("<f4"),
    "FP64": np.dtype("<f8"),
}
INPUT_DATATYPES = tuple(name for name in DTYPES if name != "BOOL")  # converted to FP32
EXTENSIONS = ["binary_tensor_data", "model_repository"]  # the protocol extensions spoken here
PARAMETERS = ("k", "rule", "outlier_quantile")
# what the protocol's clients may send besides ours (REST: binary output; tritonclient's
# reserved ones are accepted only when they ask for nothing we would have to honour)
PROTOCOL_PARAMETERS = ("binary_data_output",)


@dataclass(frozen=True)
class OutputSpec:
    name: str
    datatype: str
    columns: str  # the second dimension ("" for [n])
    needs_search: bool


def output_specs(model: LoadedModel) -> list[OutputSpec]:
    """The model's outputs, in answer order."""
    classes = class_array(model.classes)
    specs = [
        OutputSpec("label", "INT64" if classes.dtype == np.int64 else "BYTES", "", True),
        OutputSpec("probabilities", "FP64", "C", True),
        OutputSpec("embedding", "FP32", "d", False),
        OutputSpec("neighbor_ids", "INT64", "k", True),
        OutputSpec("neighbor_distances", "FP64", "k", True),
        OutputSpec("nearest_distance", "FP64", "", True),
    ]
    if model.outlier_quantiles is not None:
        specs.append(OutputSpec("outlier", "BOOL", "", True))
    return specs


@dataclass
class RequestedOutput:
    name: str
    binary: bool | None = None  # REST: this output's binary_data parameter, when given


@dataclass
class InferCall:
    """A checked inference request, whatever the wire."""

    rows: np.ndarray  # (n, D) float32
    outputs: list[RequestedOutput]  # in the order requested (all: the model's order)
    k: int | None = None
    rule: str | None = None
    outlier_quantile: float | None = None
    id: str = ""
    parameters: dict[str, Any] = field(default_factory=dict)  # the protocol's, e.g. binary


@dataclass(frozen=True)
class OutputTensor:
    name: str
    datatype: str
    shape: list[int]
    array: np.ndarray  # C-contiguous, of DTYPES[datatype] (object array of bytes for BYTES)

    def raw(self) -> bytes:
        """The binary tensor data: row-major little-endian; BYTES elements as a 4-byte
        little-endian length then the bytes."""
        if self.datatype != "BYTES":
            return self.array.tobytes()
        return b"".join(len(b).to_bytes(4, "little") + b for b in self.array.reshape(-1))

    def values(self) -> list:
        """The flattened values for JSON (BYTES as strings)."""
        flat = self.array.reshape(-1)
        if self.datatype == "BYTES":
            return [b.decode("utf-8") for b in flat]
        return flat.tolist()


# ------------------------------------------------------------------ the model


def values_per_row(model: LoadedModel, name: str, k: int) -> int:
    """How many numbers output ``name`` holds per row."""
    (spec,) = (spec for spec in output_specs(model) if spec.name == name)
    sizes = {"": 1, "C": len(model.classes), "d": model.n_components, "k": k}
    return sizes[spec.columns]


def model_metadata(model: LoadedModel, served_name: str) -> dict:
    """The protocol's model metadata (-1: a dimension of any size)."""
    sizes = {"": None, "C": len(model.classes), "d": model.n_components, "k": -1}
    outputs = []
    for spec in output_specs(model):
        shape = [-1] if sizes[spec.columns] is None else [-1, sizes[spec.columns]]
        outputs.append({"name": spec.name, "datatype": spec.datatype, "shape": shape})
    return {
        "name": served_name,
        "versions": [model.version],
        "platform": PLATFORM,
        "inputs": [{"name": INPUT_NAME, "datatype": "FP32", "shape": [-1, model.n_features]}],
        "outputs": outputs,
    }


# ------------------------------------------------------------------ requests


def parameter_value(name: str, value: Any) -> Any:
    """Our request parameters, strictly: k an integer >= 1, rule one of RULES,
    outlier_quantile a number."""
    if name == "k":
        return check_int_range(value, "parameter k", minimum=1)
    if name == "rule":
        if not isinstance(value, str) or value not in RULES:
            raise InvalidInput(f"parameter rule must be one of {list(RULES)}, got {value!r}")
        return value
    return finite_number(value, "parameter outlier_quantile")


def split_parameters(parameters: dict[str, Any] | None) -> tuple[dict, dict]:
    """(ours: k, rule, outlier_quantile; the protocol's) from request-level parameters;
    anything else is refused, naming what is accepted."""
    ours, protocol = {}, {}
    for name, value in (parameters or {}).items():
        if name in PARAMETERS:
            ours[name] = parameter_value(name, value)
        elif name in PROTOCOL_PARAMETERS:
            if not isinstance(value, bool):
                raise InvalidInput(f"parameter {name} must be a boolean, got {value!r}")
            protocol[name] = value
        else:
            raise InvalidInput(
                f"unknown parameter {name!r}; this model takes {list(PARAMETERS)} "
                f"(and the protocol's {list(PROTOCOL_PARAMETERS)})"
            )
    return ours, protocol


def raw_values(name: str, datatype: str, raw: bytes, what: str) -> np.ndarray:
    """A tensor's elements from its raw little-endian bytes (``what``: how the wire calls
    them, for the message); InvalidInput for an unknown datatype or a partial element."""
    dtype = DTYPES.get(datatype)
    if dtype is None:
        raise InvalidInput(
            f"input {name!r} has datatype {datatype!r}; expected FP32 (or one of "
            f"{list(INPUT_DATATYPES)})"
        )
    if len(raw) % dtype.itemsize:
        raise InvalidInput(
            f"input {name!r}: {len(raw)} bytes of {what} is not a whole number of {datatype} "
            f"values ({dtype.itemsize} bytes each)"
        )
    return np.frombuffer(raw, dtype=dtype)


def input_rows(
    model: LoadedModel,
    name: str,
    datatype: str,
    shape: list[int],
    values: np.ndarray,
    max_rows: int,
) -> np.ndarray:
    """The one input tensor, checked, as float32 rows (n, D). ``values`` holds its
    elements (flat, any numeric dtype), decoded from JSON or raw bytes."""
    d = model.n_features
    if name != INPUT_NAME:
        raise InvalidInput(f"unknown input {name!r}; the model's input is {INPUT_NAME!r}")
    if datatype not in INPUT_DATATYPES:
        raise InvalidInput(
            f"input {name!r} has datatype {datatype!r}; expected FP32 (or one of "
            f"{list(INPUT_DATATYPES)}, converted to FP32)"
        )
    if len(shape) != 2 or any(isinstance(s, bool) or not isinstance(s, int) for s in shape):
        raise InvalidInput(f"input {name!r} has shape {shape}; expected [n, {d}]")
    n, columns = shape
    if columns != d or n < 0:
        raise InvalidInput(f"input {name!r} has shape {shape}; expected [n, {d}]")
    if n > max_rows:
        raise PayloadTooLarge(f"input {name!r} has {n} rows; the limit is {max_rows}")
    if n == 0:
        raise EmptyBatch(f"input {name!r} has no rows; send 1 or more")
    if values.size != n * d:
        raise InvalidInput(f"input {name!r}: shape {shape} needs {n * d} values, got {values.size}")
    return to_rows(
        values.reshape(n, d), n_features=d, max_rows=max_rows, abs_max=model.input_abs_max
    )


def requested_outputs(model: LoadedModel, requested: list[RequestedOutput] | None):
    """The outputs to answer: the requested ones (known, each once), else all."""
    known = [spec.name for spec in output_specs(model)]
    if not requested:
        return [RequestedOutput(name) for name in known]
    seen = set()
    for output in requested:
        if output.name not in known:
            raise InvalidInput(f"unknown output {output.name!r}; the model's outputs are {known}")
        if output.name in seen:
            raise InvalidInput(f"output {output.name!r} is requested more than once")
        seen.add(output.name)
    return requested


# ------------------------------------------------------------------ answers


def needs_search(model: LoadedModel, call: InferCall) -> bool:
    searching = {spec.name for spec in output_specs(model) if spec.needs_search}
    return any(output.name in searching for output in call.outputs)


def output_tensors(
    model: LoadedModel,
    call: InferCall,
    answer: Answer | None,
    embedding: np.ndarray | None,
) -> list[OutputTensor]:
    """The requested outputs from the engine's answer (and the embedding when asked)."""
    n = len(call.rows)
    tensors = []
    for output in call.outputs:
        name = output.name
        if name == "label":
            labels = class_array(model.classes)[answer.predicted]
            if labels.dtype != np.int64:
                labels = np.array([s.encode("utf-8") for s in labels], dtype=object)
                tensors.append(OutputTensor(name, "BYTES", [n], labels))
            else:
                tensors.append(OutputTensor(name, "INT64", [n], np.ascontiguousarray(labels)))
        elif name == "probabilities":
            proba = np.ascontiguousarray(answer.probabilities, dtype="<f8")
            tensors.append(OutputTensor(name, "FP64", list(proba.shape), proba))
        elif name == "embedding":
            z = np.ascontiguousarray(embedding, dtype="<f4")
            tensors.append(OutputTensor(name, "FP32", list(z.shape), z))
        elif name == "neighbor_ids":
            ids = np.ascontiguousarray(model.ids[answer.indices], dtype="<i8")
            tensors.append(OutputTensor(name, "INT64", list(ids.shape), ids))
        elif name == "neighbor_distances":
            dist = np.ascontiguousarray(answer.distances, dtype="<f8")
            tensors.append(OutputTensor(name, "FP64", list(dist.shape), dist))
        elif name == "nearest_distance":
            nearest = np.ascontiguousarray(answer.distances[:, 0], dtype="<f8")
            tensors.append(OutputTensor(name, "FP64", [n], nearest))
        elif name == "outlier":
            assert answer.outliers is not None, "an outlier output needs a calibrated model"
            flags = np.ascontiguousarray(answer.outliers)
            tensors.append(OutputTensor(name, "BOOL", [n], flags))
    return tensors


# ------------------------------------------------------------------ running a call


def query_of(model: LoadedModel, max_k: int, call: InferCall) -> Query:
    """The call's k, rule and outlier quantile resolved by the inference path's ``resolve``
    (the same checks and messages as /v1)."""
    return resolve(
        model, max_k, k=call.k, rule=call.rule, quantile=call.outlier_quantile, decides=True
    )


async def run_call(
    state: AppState, model: LoadedModel, call: InferCall, query: Query, route: str
) -> list[OutputTensor]:
    """An inference call on the engine, whatever the wire (REST or gRPC): one engine
    operation (``classify`` when an output needs the neighbours, with the embedding when it
    is asked for too; else ``embed``), then its output tensors."""
    wants_embedding = any(output.name == "embedding" for output in call.outputs)
    if needs_search(model, call):
        answer = await state.engine.classify(
            model, call.rows, query, route, with_embedding=wants_embedding
        )
        return output_tensors(model, call, answer, answer.embedding)
    embedding = await state.engine.embed(model, call.rows, route)
    return output_tensors(model, call, None, embedding)


def check_request_parameters(name: str, parameters: dict | None, allowed: set[str]) -> None:
    """The repository extension's load and unload parameters: refuse what this server
    cannot do (a config or files sent with a load: the model is what its folder holds)
    rather than ignore it. An unload takes ``unload_dependents``, a boolean (models here
    have no dependents)."""
    unknown = set(parameters or {}) - allowed
    if unknown:
        raise InvalidInput(
            f"model {name[:140]!r}: unsupported parameters {sorted(unknown)}; a load takes the "
            "model as its folder holds it (no config or file overrides)"
            + (f", and an unload takes {sorted(allowed)}" if allowed else "")
        )
    dependents = (parameters or {}).get("unload_dependents", False)
    if not isinstance(dependents, bool):
        raise InvalidInput(f"unload_dependents must be a boolean, got {dependents!r}")
