"""The Open Inference Protocol (KServe V2): REST with the binary tensor data extension and
gRPC, driven by tritonclient (the protocol's reference client) against a real server, and
hand-made REST bodies for what a client library would never send. Answers must equal
/v1/classify's bit for bit; bad input must get a protocol error, never a 500 or a crash."""

from __future__ import annotations

import json

# tritonclient is a dev dependency (pyproject.toml): a missing one fails the run, not skips it
import grpc
import httpx
import numpy as np
import pytest
import tritonclient.grpc as triton_grpc
import tritonclient.http as triton_http
from fastapi.testclient import TestClient
from tritonclient.utils import InferenceServerException

from service.app import create_app
from service.core.artifact import read_artifact, write_artifact
from tests.service.conftest import model_arrays, settings_for
from tests.service.servers import free_port, in_flight, running_server, start_server, wait_ready

KEY = "test-key"
AUTH = {"authorization": f"Bearer {KEY}"}


def auth() -> dict:
    """A fresh headers dict: tritonclient writes Inference-Header-Content-Length into the
    one it is given, which would then be stale for the next request."""
    return dict(AUTH)


MAX_ROWS = 64
OUTPUTS = [
    "label",
    "probabilities",
    "embedding",
    "neighbor_ids",
    "neighbor_distances",
    "nearest_distance",
    "outlier",
]


@pytest.fixture(scope="module")
def server(model_artifact):
    """A real server with an API key, REST and gRPC: (http url, grpc address, process)."""
    grpc_port = free_port()
    with running_server(
        model_artifact[0],
        NCAKNN_GRPC_PORT=grpc_port,
        NCAKNN_API_KEY=KEY,
        NCAKNN_MAX_BATCH_ROWS=MAX_ROWS,
    ) as (_, url, proc):
        yield url, f"127.0.0.1:{grpc_port}", proc


@pytest.fixture(scope="module")
def rows(model_artifact):
    return np.ascontiguousarray(model_artifact[2].X_test[:20], dtype=np.float32)


def clients(server):
    url, address, _ = server
    return [
        ("http", triton_http, triton_http.InferenceServerClient(url.removeprefix("http://"))),
        ("grpc", triton_grpc, triton_grpc.InferenceServerClient(address)),
    ]


def v1_classify(url: str, rows: np.ndarray, k: int, rule: str) -> list[dict]:
    body = {"instances": rows.tolist(), "k": k, "rule": rule, "return_neighbors": True}
    response = httpx.post(f"{url}/v1/classify", json=body, headers=auth(), timeout=30)
    assert response.status_code == 200, response.text
    return response.json()["predictions"]


def infer(module, client, x, outputs=None, binary=True, **parameters):
    tensor = module.InferInput("input", list(x.shape), module.np_to_triton_dtype(x.dtype))
    if module is triton_http:
        tensor.set_data_from_numpy(x, binary_data=binary)
        requested = [module.InferRequestedOutput(n, binary_data=binary) for n in outputs or []]
        return client.infer(
            "nca-knn", [tensor], outputs=requested or None, parameters=parameters, headers=auth()
        )
    tensor.set_data_from_numpy(x)
    requested = [module.InferRequestedOutput(n) for n in outputs or []]
    return client.infer(
        "nca-knn", [tensor], outputs=requested or None, parameters=parameters, headers=auth()
    )


# ------------------------------------------------------------------ metadata and health


def test_metadata_and_readiness_over_both_protocols(server, model_artifact):
    version = read_artifact(model_artifact[0]).version
    for wire, _, client in clients(server):
        assert client.is_server_live(headers=auth()) and client.is_server_ready(headers=auth())
        assert client.is_model_ready("nca-knn", headers=auth())
        assert client.is_model_ready("nca-knn", version, headers=auth())
        if wire == "http":  # 404, which tritonclient reads as not ready
            assert not client.is_model_ready("nca-knn", "not-a-version", headers=auth())
        else:  # NOT_FOUND, which tritonclient raises
            with pytest.raises(InferenceServerException, match="NOT_FOUND"):
                client.is_model_ready("nca-knn", "not-a-version", headers=auth())
        server_meta = client.get_server_metadata(headers=auth())
        model_meta = client.get_model_metadata("nca-knn", headers=auth())
        if wire == "grpc":
            server_meta = {"extensions": list(server_meta.extensions)}
            model_meta = {
                "versions": list(model_meta.versions),
                "inputs": [
                    {"name": t.name, "datatype": t.datatype, "shape": list(t.shape)}
                    for t in model_meta.inputs
                ],
                "outputs": [{"name": t.name, "datatype": t.datatype} for t in model_meta.outputs],
            }
        assert "binary_tensor_data" in server_meta["extensions"]
        assert model_meta["versions"] == [version]
        assert model_meta["inputs"] == [{"name": "input", "datatype": "FP32", "shape": [-1, 64]}]
        assert [o["name"] for o in model_meta["outputs"]] == OUTPUTS
        assert model_meta["outputs"][1]["datatype"] == "FP64"


def health_stub(channel, method: str):
    """(request type, callable) for grpc.health.v1.Health/<method> (Check: unary, Watch:
    a stream), with our own messages."""
    from service.oip.protocol import message

    request_type = message("grpc.health.v1.HealthCheckRequest")
    response_type = message("grpc.health.v1.HealthCheckResponse")
    make = channel.unary_unary if method == "Check" else channel.unary_stream
    stub = make(
        f"/grpc.health.v1.Health/{method}",
        request_serializer=request_type.SerializeToString,
        response_deserializer=response_type.FromString,
    )
    return request_type, stub


def test_grpc_health_checking_for_kubernetes_probes(server):
    with grpc.insecure_channel(server[1]) as channel:
        request_type, check = health_stub(channel, "Check")
        assert check(request_type()).status == 1  # SERVING, no key needed (probes)
        assert check(request_type(service="inference.GRPCInferenceService")).status == 1
        with pytest.raises(grpc.RpcError) as info:
            check(request_type(service="unknown"))
        assert info.value.code() == grpc.StatusCode.NOT_FOUND


# ------------------------------------------------------------------ answers


@pytest.mark.parametrize("rule", ["majority", "soft", "soft_prior"])
def test_answers_equal_v1_classify_bit_for_bit(server, rows, rule):
    url = server[0]
    expected = v1_classify(url, rows, 4, rule)
    embedded = httpx.post(
        f"{url}/v1/embed", json={"instances": rows.tolist()}, headers=auth(), timeout=30
    ).json()["embeddings"]
    classes = httpx.get(f"{url}/v1/model", headers=auth()).json()["classes"]
    for wire, module, client in clients(server):
        for binary in (True, False) if wire == "http" else (True,):
            result = infer(module, client, rows, binary=binary, k=4, rule=rule)
            where = f"{wire} binary={binary}"
            assert result.as_numpy("label").tolist() == [p["label"] for p in expected], where
            proba = result.as_numpy("probabilities")
            assert proba.dtype == np.float64
            assert proba.tolist() == [
                [p["probabilities"][str(c)] for c in classes] for p in expected
            ]
            ids = result.as_numpy("neighbor_ids").tolist()
            assert ids == [[n["id"] for n in p["neighbors"]] for p in expected], where
            dist = result.as_numpy("neighbor_distances").tolist()
            assert dist == [[n["distance"] for n in p["neighbors"]] for p in expected], where
            assert result.as_numpy("nearest_distance").tolist() == [
                p["nearest_distance"] for p in expected
            ]
            assert result.as_numpy("outlier").tolist() == [p["outlier"] for p in expected]
            embedding = result.as_numpy("embedding")
            assert embedding.dtype == np.float32
            assert embedding.tolist() == np.asarray(embedded, np.float32).tolist(), where


def test_requested_outputs_only_and_other_input_types(server, rows):
    for wire, module, client in clients(server):
        result = infer(module, client, rows, outputs=["neighbor_ids", "label"], k=2)
        answer = result.get_response()
        names = (
            [o["name"] for o in answer["outputs"]]
            if wire == "http"
            else [o.name for o in answer.outputs]
        )
        assert names == ["neighbor_ids", "label"]
        assert result.as_numpy("neighbor_ids").shape == (len(rows), 2)
        as_float32 = result.as_numpy("label").tolist()
        for dtype in (np.float64, np.int32, np.int64, np.uint8):
            converted = np.clip(np.round(rows), 0, 16).astype(dtype)
            expected = infer(module, client, converted.astype(np.float32), outputs=["label"])
            got = infer(module, client, converted, outputs=["label"])
            assert got.as_numpy("label").tolist() == expected.as_numpy("label").tolist(), dtype
        assert len(as_float32) == len(rows)
        only_embedding = infer(module, client, rows, outputs=["embedding"])
        assert only_embedding.as_numpy("embedding").shape == (len(rows), 16)


# ------------------------------------------------------------------ bad input, both wires


def expect_error(call, wire: str, http_status: int, fragment: str):
    with pytest.raises(InferenceServerException) as info:
        call()
    error = info.value
    if wire == "http":
        assert error.status() == str(http_status), (error.status(), error.message())
    else:
        from service.oip.grpc_server import GRPC_CODES

        assert error.status() == f"StatusCode.{GRPC_CODES[http_status].name}", error.status()
    assert fragment in error.message(), error.message()


@pytest.mark.parametrize("wire", ["http", "grpc"])
def test_bad_input_is_a_protocol_error_over_both_wires(server, rows, wire):
    module, client = {w: (m, c) for w, m, c in clients(server)}[wire]

    def send(x, name="input", datatype=None, model="nca-knn", version="", headers=None):
        tensor = module.InferInput(name, list(x.shape), datatype or "FP32")
        if datatype is None:
            tensor.set_data_from_numpy(x)
        else:
            tensor.set_raw(x.tobytes()) if hasattr(tensor, "set_raw") else raw_data(
                tensor, x.tobytes()
            )
        headers = auth() if headers is None else headers
        return lambda: client.infer(model, [tensor], model_version=version, headers=headers)

    def raw_data(tensor, data: bytes):
        if module is triton_http:
            tensor._raw_data = data
            tensor._parameters["binary_data_size"] = len(data)
        else:
            tensor._raw_content = data
        return tensor

    def raw(shape, data: bytes):
        tensor = raw_data(module.InferInput("input", shape, "FP32"), data)
        return lambda: client.infer("nca-knn", [tensor], headers=auth())

    def with_parameters(parameters):
        tensor = module.InferInput("input", [2, 64], "FP32")
        tensor.set_data_from_numpy(rows[:2])
        return lambda: client.infer("nca-knn", [tensor], parameters=parameters, headers=auth())

    expect_error(send(rows[:, :10]), wire, 422, "expected [n, 64]")
    expect_error(send(rows[0]), wire, 422, "expected [n, 64]")
    expect_error(send(rows, datatype="BYTES"), wire, 422, "datatype 'BYTES'")
    expect_error(send(rows, name="pixels"), wire, 422, "unknown input 'pixels'")
    expect_error(send(rows, model="other"), wire, 404, "unknown model 'other'")
    expect_error(send(rows, version="v0"), wire, 404, "unknown version 'v0'")
    expect_error(send(rows, headers={}), wire, 401, "API key")
    expect_error(send(np.zeros((MAX_ROWS + 1, 64), np.float32)), wire, 413, f"limit is {MAX_ROWS}")
    bad = rows.copy()
    bad[3, 5] = np.nan
    expect_error(send(bad), wire, 422, "NaN")
    expect_error(raw([2, 64], rows[:2].tobytes()[:-4]), wire, 422, "needs 128 values, got 127")
    expect_error(raw([2, 64], rows[:2].tobytes()[:-3]), wire, 422, "whole number")
    expect_error(lambda: client.infer("nca-knn", [], headers=auth()), wire, 422, "one input")
    two = [module.InferInput("input", [2, 64], "FP32") for _ in range(2)]
    for tensor in two:
        tensor.set_data_from_numpy(rows[:2])
    expect_error(lambda: client.infer("nca-knn", two, headers=auth()), wire, 422, "one input")
    expect_error(with_parameters({"k": 0}), wire, 422, "k must be an integer >= 1")
    expect_error(with_parameters({"rule": "vote"}), wire, 422, "rule must be one of")
    expect_error(with_parameters({"temperature": 1.0}), wire, 422, "unknown parameter")
    # after all of that, the server still answers
    assert httpx.get(f"{server[0]}/v2/health/ready", timeout=5).status_code == 200
    assert server[2].poll() is None


# ------------------------------------------------------------------ REST bodies by hand


def binary_body(header: dict, *chunks: bytes) -> tuple[bytes, dict]:
    head = json.dumps(header).encode()
    return head + b"".join(chunks), {"inference-header-content-length": str(len(head))}


@pytest.fixture(scope="module")
def rest(model_artifact):
    """One in-process app for the REST cases: they send requests and change nothing."""
    with TestClient(create_app(settings_for(model_artifact[0]))) as client:
        yield client


def tensor(shape, datatype="FP32", **extra):
    return {"name": "input", "shape": shape, "datatype": datatype, **extra}


def infer_body(parameters: str, rows: int = 1) -> bytes:
    """A valid JSON infer body of ``rows`` zero rows with the request parameters given as
    JSON text (numbers of any size)."""
    inputs = json.dumps([tensor([rows, 64], data=[0.0] * (64 * rows))])
    return f'{{"inputs": {inputs}, "parameters": {{{parameters}}}}}'.encode()


@pytest.mark.parametrize(
    "case, body, headers, status, fragment",
    [
        (
            "truncated binary",
            *binary_body(
                {"inputs": [tensor([1, 64], parameters={"binary_data_size": 256})]}, b"\0" * 200
            ),
            422,
            "declare 256 bytes",
        ),
        (
            "extra bytes",
            *binary_body(
                {"inputs": [tensor([1, 64], parameters={"binary_data_size": 256})]}, b"\0" * 300
            ),
            422,
            "carries 300",
        ),
        (
            "header length beyond body",
            b'{"inputs": []}',
            {"inference-header-content-length": "999"},
            422,
            "Inference-Header-Content-Length",
        ),
        (
            "header length not a number",
            b'{"inputs": []}',
            {"inference-header-content-length": "x"},
            422,
            "Inference-Header-Content-Length",
        ),
        (
            "binary_data_size negative",
            *binary_body({"inputs": [tensor([1, 64], parameters={"binary_data_size": -1})]}),
            422,
            "binary_data_size",
        ),
        (
            "data and binary",
            *binary_body(
                {"inputs": [tensor([1, 64], data=[0.0] * 64, parameters={"binary_data_size": 0})]}
            ),
            422,
            "both",
        ),
        ("no data", json.dumps({"inputs": [tensor([1, 64])]}).encode(), {}, 422, "neither data"),
        (
            "strings as data",
            json.dumps({"inputs": [tensor([1, 64], data=["1"] * 64)]}).encode(),
            {},
            422,
            "list of numbers",
        ),
        (
            "booleans as data",
            json.dumps({"inputs": [tensor([1, 64], data=[True] * 64)]}).encode(),
            {},
            422,
            "list of numbers",
        ),
        (
            "ragged nesting",
            json.dumps({"inputs": [tensor([2, 64], data=[[0.0] * 64, [0.0] * 63])]}).encode(),
            {},
            422,
            "[n][D] nested list",
        ),
        (
            "two inputs",
            json.dumps({"inputs": [tensor([1, 64], data=[0.0] * 64)] * 2}).encode(),
            {},
            422,
            "expected one input",
        ),
        ("no inputs", json.dumps({"inputs": []}).encode(), {}, 422, "expected one input"),
        (
            "unknown field",
            json.dumps({"inputs": [tensor([1, 64], data=[0.0] * 64)], "x": 1}).encode(),
            {},
            422,
            "Object contains unknown field",
        ),
        (
            "unknown output",
            json.dumps(
                {"inputs": [tensor([1, 64], data=[0.0] * 64)], "outputs": [{"name": "logits"}]}
            ).encode(),
            {},
            422,
            "unknown output 'logits'",
        ),
        (
            "output twice",
            json.dumps(
                {"inputs": [tensor([1, 64], data=[0.0] * 64)], "outputs": [{"name": "label"}] * 2}
            ).encode(),
            {},
            422,
            "more than once",
        ),
        (
            "output parameter",
            json.dumps(
                {
                    "inputs": [tensor([1, 64], data=[0.0] * 64)],
                    "outputs": [{"name": "label", "parameters": {"classification": 3}}],
                }
            ).encode(),
            {},
            422,
            "binary_data",
        ),
        (
            "k as float",
            json.dumps(
                {"inputs": [tensor([1, 64], data=[0.0] * 64)], "parameters": {"k": 2.0}}
            ).encode(),
            {},
            422,
            "k must be an integer",
        ),
        (
            "k as bool",
            json.dumps(
                {"inputs": [tensor([1, 64], data=[0.0] * 64)], "parameters": {"k": True}}
            ).encode(),
            {},
            422,
            "k must be an integer",
        ),
        (
            "empty batch",
            json.dumps({"inputs": [tensor([0, 64], data=[])]}).encode(),
            {},
            400,
            "no rows",
        ),
        (
            "shape with a float",
            json.dumps({"inputs": [tensor([1.5, 64], data=[0.0] * 64)]}).encode(),
            {},
            422,
            "Expected `int`",
        ),
        (
            "gzip",
            json.dumps({"inputs": []}).encode(),
            {"content-encoding": "gzip"},
            415,
            "Content-Encoding",
        ),
        ("text body", b"hello", {"content-type": "text/plain"}, 415, "Content-Type"),
        ("not json", b"{inputs", {}, 422, "not valid"),
        (
            "header length of 4301 digits",
            b'{"inputs": []}',
            {"inference-header-content-length": "9" * 4301},
            422,
            "1 to 18 ASCII digits",
        ),
        (
            "header length a Unicode digit",
            b'{"inputs": []}',
            {"inference-header-content-length": "²".encode()},
            422,
            "1 to 18 ASCII digits",
        ),
        *[
            (f"outlier_quantile {name}", infer_body(f'"outlier_quantile": {value}'), {}, 422, says)
            for name, value, says in (
                ("2**64", 2**64, "must lie in [0.5, 0.999]"),
                ("-(2**64)", -(2**64), "must lie in [0.5, 0.999]"),
                ("1e999", "1e999", "Number out of range"),
            )
        ],
        *[
            (
                f"k {name} before the answer size",
                infer_body(f'"k": {value}', rows=64),
                {},
                422,
                "over the limit max_k",
            )
            for name, value in (("10**30", 10**30), ("2**63", 2**63))
        ],
        (
            "invalid UTF-8 in a key",
            b'{"inputs": [], "\xff": 1}',
            {},
            422,
            "not valid UTF-8",
        ),
        (
            "invalid UTF-8 in a string",
            b'{"inputs": [{"name": "in\xffput", "shape": [1, 64], "datatype": "FP32", "data": []}]}',
            {},
            422,
            "not valid UTF-8",
        ),
    ],
)
def test_malformed_rest_bodies(rest, case, body, headers, status, fragment):
    response = rest.post("/v2/models/nca-knn/infer", content=body, headers=headers)
    assert response.status_code == status, (case, response.text)
    assert set(response.json()) == {"error"}
    assert fragment in response.json()["error"], (case, response.json())


def test_binary_answers_by_hand_and_nested_json_inputs(rest, rows):
    x = rows[:3]
    body, headers = binary_body(
        {
            "id": "req-7",
            "inputs": [tensor([3, 64], parameters={"binary_data_size": x.nbytes})],
            "outputs": [
                {"name": "probabilities", "parameters": {"binary_data": True}},
                {"name": "label"},
            ],
        },
        x.tobytes(),
    )
    response = rest.post("/v2/models/nca-knn/infer", content=body, headers=headers)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "application/octet-stream"
    length = int(response.headers["inference-header-content-length"])
    header = json.loads(response.content[:length])
    assert header["id"] == "req-7" and header["model_name"] == "nca-knn"
    proba_meta, label = header["outputs"]
    assert proba_meta["parameters"] == {"binary_data_size": 3 * 10 * 8}
    proba = np.frombuffer(response.content[length:], "<f8").reshape(3, 10)
    nested = {
        "inputs": [tensor([3, 64], data=x.tolist())],
        "outputs": [{"name": "probabilities"}, {"name": "label"}],
    }
    as_json = rest.post("/v2/models/nca-knn/infer", json=nested).json()
    assert response.headers["x-model-version"] and "inference-header-content-length" not in (
        rest.post("/v2/models/nca-knn/infer", json=nested).headers
    )
    assert as_json["outputs"][0]["data"] == proba.reshape(-1).tolist()
    assert label["data"] == as_json["outputs"][1]["data"]


def test_string_classes_answer_bytes_labels(tmp_path, model_artifact):
    art = read_artifact(model_artifact[0])
    arrays = model_arrays(art)
    arrays["classes"] = [f"digit-{c}" for c in art.classes]
    path = tmp_path / "named"
    write_artifact(path, **arrays)
    x = model_artifact[2].X_test[:4].astype(np.float32)
    with TestClient(create_app(settings_for(path))) as client:
        meta = client.get("/v2/models/nca-knn").json()
        assert meta["outputs"][0] == {"name": "label", "datatype": "BYTES", "shape": [-1]}
        v1 = client.post("/v1/classify", json={"instances": x.tolist()}).json()["predictions"]
        body, headers = binary_body(
            {
                "inputs": [tensor([4, 64], parameters={"binary_data_size": x.nbytes})],
                "parameters": {"binary_data_output": True},
                "outputs": [{"name": "label"}],
            },
            x.tobytes(),
        )
        response = client.post("/v2/models/nca-knn/infer", content=body, headers=headers)
        length = int(response.headers["inference-header-content-length"])
        raw, labels = response.content[length:], []
        while raw:
            size = int.from_bytes(raw[:4], "little")
            labels.append(raw[4 : 4 + size].decode())
            raw = raw[4 + size :]
        assert labels == [p["label"] for p in v1]


# ------------------------------------------------------------------ gRPC as a hostile client


GRPC_ALLOWED = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
}
DATATYPES = ["FP32", "FP64", "FP16", "INT8", "INT32", "INT64", "UINT8", "UINT64", "BOOL", "BYTES"]


def grpc_infer_stub(channel):
    return channel.unary_unary(
        "/inference.GRPCInferenceService/ModelInfer",
        request_serializer=None,  # bytes as they are: the fuzz sends raw messages too
        response_deserializer=None,
    )


def test_grpc_model_infer_fuzz_never_fails_inside(server):
    """Random ModelInferRequest messages (names, datatypes, shapes, typed and raw contents,
    parameters, outputs) and random bytes: every answer is OK or a client-error status with
    a message, never INTERNAL or UNKNOWN, and the server keeps serving."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from service.oip.protocol import message

    request_type = message("inference.ModelInferRequest")
    text = st.text(max_size=8)
    scalar = st.one_of(
        st.integers(-(2**40), 2**40),
        st.floats(allow_nan=True, allow_infinity=True),
        st.booleans(),
        text,
    )

    @st.composite
    def requests(draw):
        r = request_type(
            model_name=draw(st.sampled_from(["nca-knn", "nca-knn", "", "other"])),
            model_version=draw(st.sampled_from(["", "", "x"])),
            id=draw(text),
        )
        for name, value in draw(
            st.dictionaries(
                st.sampled_from(["k", "rule", "outlier_quantile", "zz"]), scalar, max_size=3
            )
        ).items():
            p = r.parameters[name]
            if isinstance(value, bool):
                p.bool_param = value
            elif isinstance(value, int):
                p.int64_param = value
            elif isinstance(value, float):
                p.double_param = value
            else:
                p.string_param = value
        n_rows = draw(st.integers(-1, 70))
        for _ in range(draw(st.integers(0, 2))):
            t = r.inputs.add(
                name=draw(st.sampled_from(["input", "input", "x"])),
                datatype=draw(st.sampled_from([*DATATYPES, "FP32", "FP32", "nope"])),
                shape=draw(
                    st.sampled_from([[n_rows, 64], [n_rows, 64], [n_rows], [1, 63], [2, 64, 1], []])
                ),
            )
            kind = draw(st.sampled_from(["fp32", "fp64", "int", "bytes", "none"]))
            count = draw(st.sampled_from([max(n_rows, 0) * 64, 64, 0, 7]))
            if kind == "fp32":
                t.contents.fp32_contents.extend(
                    draw(st.lists(st.floats(width=32), min_size=count, max_size=count))
                )
            elif kind == "fp64":
                t.contents.fp64_contents.extend([draw(st.floats())] * count)
            elif kind == "int":
                t.contents.int_contents.extend([draw(st.integers(-(2**31), 2**31 - 1))] * count)
            elif kind == "bytes":
                t.contents.bytes_contents.append(draw(st.binary(max_size=16)))
        for _ in range(draw(st.integers(0, 2))):
            r.raw_input_contents.append(draw(st.binary(max_size=600)))
        for _ in range(draw(st.integers(0, 3))):
            o = r.outputs.add(name=draw(st.sampled_from(["label", "embedding", "x", "outlier"])))
            if draw(st.booleans()):
                o.parameters["binary_data"].bool_param = True
        return r.SerializeToString()

    @st.composite
    def nearly_valid(draw):
        """A valid call (one FP32 input [n, 64], typed or raw), with at most one mutation."""
        n = draw(st.integers(1, 4))
        values = np.asarray(
            draw(st.lists(st.floats(-1e3, 1e3, width=32), min_size=n * 64, max_size=n * 64)),
            np.float32,
        )
        r = request_type(model_name="nca-knn")
        t = r.inputs.add(name="input", datatype="FP32", shape=[n, 64])
        if draw(st.booleans()):
            r.raw_input_contents.append(values.tobytes())
        else:
            t.contents.fp32_contents.extend(values.tolist())
        mutation = draw(st.sampled_from(["none", "none", "k", "rule", "output", "quantile"]))
        if mutation == "k":
            r.parameters["k"].int64_param = draw(st.integers(-2, 5000))
        elif mutation == "rule":
            r.parameters["rule"].string_param = draw(st.sampled_from(["soft", "soft_prior", "x"]))
        elif mutation == "output":
            r.outputs.add(name=draw(st.sampled_from(["label", "neighbor_ids", "bogus"])))
        elif mutation == "quantile":
            r.parameters["outlier_quantile"].double_param = draw(st.floats())
        return r.SerializeToString()

    with grpc.insecure_channel(server[1]) as channel:
        stub = grpc_infer_stub(channel)
        seen = set()

        @settings(
            max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), database=None
        )
        @given(body=st.one_of(nearly_valid(), requests(), st.binary(max_size=200)))
        def fuzz(body):
            try:
                stub(body, metadata=[("authorization", f"Bearer {KEY}")], timeout=30)
                code = grpc.StatusCode.OK
            except grpc.RpcError as exc:
                code = exc.code()
                assert exc.details(), code
            assert code in GRPC_ALLOWED, (code, body[:200])
            seen.add(code)

        fuzz()
    assert grpc.StatusCode.INVALID_ARGUMENT in seen and grpc.StatusCode.OK in seen
    assert server[2].poll() is None


def test_grpc_health_watch_streams_the_status(server):
    with grpc.insecure_channel(server[1]) as channel:
        request_type, watch = health_stub(channel, "Watch")
        stream = watch(request_type(), timeout=10)
        assert next(stream).status == 1  # SERVING
        stream.cancel()
        unknown = watch(request_type(service="nope"), timeout=10)
        assert next(unknown).status == 3  # SERVICE_UNKNOWN


@pytest.mark.slow  # a long real-server or training scenario: make test-slow
def test_sigterm_under_grpc_load_finishes_every_accepted_call(model_artifact):
    """Calls in flight when SIGTERM arrives are answered; the server then exits cleanly."""
    import signal
    import threading
    import time

    port, grpc_port = free_port(), free_port()
    # a 2 s batching window keeps calls in flight when SIGTERM arrives
    proc = start_server(
        model_artifact[0], port, NCAKNN_GRPC_PORT=grpc_port, NCAKNN_BATCH_MAX_WAIT_US=2_000_000
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, proc)
        client = triton_grpc.InferenceServerClient(f"127.0.0.1:{grpc_port}")
        x = np.zeros((1, 64), np.float32)
        results: list = []

        def call():
            tensor = triton_grpc.InferInput("input", [1, 64], "FP32")
            tensor.set_data_from_numpy(x)
            try:
                results.append(client.infer("nca-knn", [tensor]).as_numpy("label").shape)
            except InferenceServerException as exc:  # pragma: no cover - the failure tested
                results.append(str(exc))

        threads = [threading.Thread(target=call) for _ in range(8)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 10
        while in_flight(url) < 8:
            assert time.monotonic() < deadline, "calls did not all arrive"
            time.sleep(0.01)
        proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(30)
        assert results == [(1,)] * 8
        assert proc.wait(30) in (0, -signal.SIGTERM)
    finally:
        if proc.poll() is None:
            proc.kill()


def test_sigterm_ends_health_watch_streams_and_does_not_wait_for_them(model_artifact):
    """Open grpc.health.v1.Health/Watch streams (no key needed) are told NOT_SERVING when the
    server drains, then end: the process exits long before the grace period runs out."""
    import signal
    import threading
    import time

    grace = 20
    port, grpc_port = free_port(), free_port()
    proc = start_server(
        model_artifact[0],
        port,
        NCAKNN_GRPC_PORT=grpc_port,
        NCAKNN_API_KEY=KEY,
        NCAKNN_GRACEFUL_SHUTDOWN_SECONDS=grace,
        NCAKNN_DRAIN_DELAY_SECONDS=0.2,
    )
    try:
        wait_ready(f"http://127.0.0.1:{port}", proc)
        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            request_type, watch = health_stub(channel, "Watch")
            seen: list[list[int]] = [[] for _ in range(3)]
            streams = [watch(request_type(), timeout=60) for _ in range(3)]
            for stream, statuses in zip(streams, seen, strict=True):
                statuses.append(next(stream).status)

            def drain(stream, statuses):
                try:
                    for response in stream:
                        statuses.append(response.status)
                    statuses.append("ended")
                except grpc.RpcError as exc:
                    statuses.append(exc.code())

            readers = [
                threading.Thread(target=drain, args=pair)
                for pair in zip(streams, seen, strict=True)
            ]
            for t in readers:
                t.start()
            started = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            code = proc.wait(grace + 10)
            took = time.monotonic() - started
            for t in readers:
                t.join(10)
        print(f"exit {took:.2f} s after SIGTERM with 3 Watch streams open (grace {grace} s)")
        assert code in (0, -signal.SIGTERM)
        # SERVING, NOT_SERVING, then the stream ended: by the server, or (when the process was
        # faster than the last frame) by the connection closing
        assert all(statuses[:2] == [1, 2] and len(statuses) == 3 for statuses in seen), seen
        assert took < grace / 2
    finally:
        if proc.poll() is None:
            proc.kill()


def test_json_outputs_are_bounded_and_binary_ones_are_not(model_artifact, rows):
    """max_response_values counts the numbers of the JSON outputs only: 4 rows x (10
    probabilities + 16 embedding values) = 104 is over a limit of 100; in binary it passes."""
    x = rows[:4]
    body = {
        "inputs": [tensor([4, 64], data=x.ravel().tolist())],
        "outputs": [{"name": "probabilities"}, {"name": "embedding"}],
    }
    app = create_app(settings_for(model_artifact[0], max_response_values=100))
    with TestClient(app) as client:
        refused = client.post("/v2/models/nca-knn/infer", json=body)
        assert refused.status_code == 413 and "104 numbers" in refused.json()["error"]
        body["outputs"][1]["parameters"] = {"binary_data": True}  # 40 JSON numbers left
        assert client.post("/v2/models/nca-knn/infer", json=body).status_code == 200
