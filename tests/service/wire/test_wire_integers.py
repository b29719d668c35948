"""Property tests: every integer-valued input of every wire, given any string or any number
(signs, Unicode digits, underscores, thousands of digits, 10**30), is answered 2xx or 4xx
with the one error body, never 5xx; over gRPC, OK or a client-error status, never INTERNAL.

The inputs: the query's k (/v1/classify, /v1/neighbors); Content-Length; the JSON bodies' k
and outlier_quantile; the .npy header's shape; /v2's Inference-Header-Content-Length, its
parameters k and outlier_quantile, an input's shape and binary_data_size; gRPC's k and
outlier_quantile parameters and the input shape."""

from __future__ import annotations

import json

import grpc
import numpy as np
import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from service import wire
from service.app import create_app
from service.errors import InvalidInput
from service.oip.protocol import message
from tests.service.conftest import settings_for
from tests.service.servers import free_port, start_server, stop_server, wait_ready

D = 64
ROW = [0.5] * D
JSON_H = {"content-type": "application/json"}
EXAMPLES = settings(
    max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), database=None
)
# the strings that broke int() or str.isdigit() before, and their neighbours
NASTY_TEXT = [
    "9" * 4301,
    "0" * 5000 + "5",
    "9" * 19,
    "²",
    "٣",
    "1_000",
    " 5",
    "5 ",
    "+5",
    "-5",
    "5.0",
    "0x10",
    "1e3",
    "",
    "\x00",
    "5\n",
]
NASTY_NUMBERS = [  # as JSON text
    "1" + "0" * 30,
    str(2**63),
    str(2**64),
    "-" + str(2**64),
    "9" * 5000,
    "1e400",
    "-1e400",
    "1e-400",
    "0.99",
    "5",
    "0",
    "-1",
]

integer_text = st.one_of(
    st.sampled_from(NASTY_TEXT),
    st.from_regex(r"[0-9]{1,40}", fullmatch=True),
    st.text(max_size=30),
)
json_number = st.one_of(
    st.sampled_from(NASTY_NUMBERS),
    st.integers().map(str),
    st.integers(min_value=-(10**60), max_value=10**60).map(str),
    st.floats(allow_nan=False, allow_infinity=False).map(repr),
    st.from_regex(r"-?[0-9]{1,3000}(\.[0-9]{1,5})?([eE][-+]?[0-9]{1,4})?", fullmatch=True),
)


@pytest.fixture(scope="module")
def client(model_artifact):
    app = create_app(settings_for(model_artifact[0], max_batch_rows=16))
    with TestClient(app, raise_server_exceptions=False) as c:
        yield c


def assert_client_answer(response) -> None:
    assert response.status_code < 500, response.text[:300]
    if response.status_code >= 400:
        payload = response.json()
        assert set(payload) in ({"error", "error_type"}, {"error"}), payload
        assert payload["error"]


def test_parse_count_accepts_exactly_short_ascii_digit_strings():
    assert wire.parse_count("0", "x") == 0
    assert wire.parse_count("9" * 18, "x") == 10**18 - 1
    for text in NASTY_TEXT:
        if text.isascii() and text.isdigit() and len(text) <= 18:
            continue
        with pytest.raises(InvalidInput, match="x must be an integer"):
            wire.parse_count(text, "x")
    with pytest.raises(InvalidInput, match=">= 1, got 0"):
        wire.parse_count("0", "x", minimum=1)


def test_numbers_of_any_size_are_refused_by_value():
    with pytest.raises(InvalidInput, match="about 31 digits"):
        wire.check_int_range(10**30, "k", minimum=1, maximum=256)
    with pytest.raises(InvalidInput, match="finite"):
        wire.finite_number(-(2**2000), "q")
    assert wire.finite_number(2**64, "q") == float(2**64)
    assert wire.check_int_range(5, "k", minimum=1) == 5


@EXAMPLES
@given(k=integer_text, route=st.sampled_from(["/v1/classify", "/v1/neighbors"]))
@example(k="9" * 4301, route="/v1/classify")
@example(k="0" * 5000 + "5", route="/v1/neighbors")
@example(k="²", route="/v1/classify")
def test_query_k(client, k, route):
    response = client.post(route, params={"k": k}, json={"instances": [ROW]})
    assert_client_answer(response)


@EXAMPLES
@given(length=integer_text)
@example(length="9" * 4301)
@example(length="²")
def test_content_length(client, length):
    headers = {**JSON_H, "content-length": length.encode("utf-8")}
    response = client.post("/v1/embed", content=json.dumps({"instances": [ROW]}), headers=headers)
    assert_client_answer(response)


@EXAMPLES
@given(
    name=st.sampled_from(["k", "outlier_quantile"]),
    number=json_number,
    route=st.sampled_from(["/v1/classify", "/v1/neighbors"]),
)
def test_json_body_numbers(client, name, number, route):
    if route == "/v1/neighbors" and name == "outlier_quantile":
        name = "k"
    body = '{"instances": [' + json.dumps(ROW) + '], "' + name + '": ' + number + "}"
    response = client.post(route, content=body.encode(), headers=JSON_H)
    assert_client_answer(response)


@EXAMPLES
@given(rows=json_number, columns=st.one_of(st.just(str(D)), json_number))
def test_npy_header_shape(client, rows, columns):
    header = "{'descr': '<f4', 'fortran_order': False, 'shape': (" + rows + ", " + columns + "), }"
    text = header.encode("latin1")
    text += b" " * (64 - (10 + len(text) + 1) % 64) + b"\n"
    if len(text) > 65535:
        return
    body = b"\x93NUMPY\x01\x00" + len(text).to_bytes(2, "little") + text + b"\0" * (4 * D)
    response = client.post("/v1/embed", content=body, headers={"content-type": "application/x-npy"})
    assert_client_answer(response)


def v2_body(parameters: str = "", shape: str = f"[1, {D}]", size: str | None = None) -> bytes:
    data = (
        '"data": ' + json.dumps(ROW)
        if size is None
        else '"parameters": {"binary_data_size": ' + size + "}"
    )
    head = (
        '{"inputs": [{"name": "input", "datatype": "FP32", "shape": ' + shape + ", " + data + "}]"
    )
    if parameters:
        head += ', "parameters": {' + parameters + "}"
    return (head + "}").encode()


@EXAMPLES
@given(name=st.sampled_from(["k", "outlier_quantile"]), number=json_number)
@example(name="outlier_quantile", number=str(2**64))
@example(name="outlier_quantile", number="-" + str(2**64))
@example(name="k", number="1" + "0" * 30)
def test_v2_parameters(client, name, number):
    body = v2_body(parameters=f'"{name}": {number}')
    response = client.post("/v2/models/nca-knn/infer", content=body, headers=JSON_H)
    assert_client_answer(response)


@EXAMPLES
@given(first=json_number, second=st.one_of(st.just(str(D)), json_number))
def test_v2_shape(client, first, second):
    response = client.post(
        "/v2/models/nca-knn/infer", content=v2_body(shape=f"[{first}, {second}]"), headers=JSON_H
    )
    assert_client_answer(response)


@EXAMPLES
@given(size=json_number, length=st.one_of(st.none(), integer_text))
@example(size=str(4 * D), length="9" * 4301)
@example(size=str(4 * D), length="²")
def test_v2_binary_sizes_and_header_length(client, size, length):
    head = v2_body(size=size)
    body = head + np.zeros(D, np.float32).tobytes()
    headers = {**JSON_H}
    headers["inference-header-content-length"] = (
        str(len(head)) if length is None else length
    ).encode("utf-8")
    response = client.post("/v2/models/nca-knn/infer", content=body, headers=headers)
    assert_client_answer(response)


# ---------------------------------------------------------------------- gRPC


@pytest.fixture(scope="module")
def grpc_address(model_artifact):
    port, grpc_port = free_port(), free_port()
    proc = start_server(model_artifact[0], port, NCAKNN_GRPC_PORT=grpc_port)
    try:
        wait_ready(f"http://127.0.0.1:{port}", proc)
        yield f"127.0.0.1:{grpc_port}"
    finally:
        stop_server(proc)


GRPC_CLIENT_ERRORS = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.NOT_FOUND,
}
int64 = st.one_of(
    st.sampled_from([0, -1, 1, 2**63 - 1, -(2**63), 10**18]),
    st.integers(min_value=-(2**63), max_value=2**63 - 1),
)


def test_grpc_integers(grpc_address):
    request_type = message("inference.ModelInferRequest")
    with grpc.insecure_channel(grpc_address) as channel:
        stub = channel.unary_unary(
            "/inference.GRPCInferenceService/ModelInfer",
            request_serializer=request_type.SerializeToString,
            response_deserializer=None,
        )

        @EXAMPLES
        @given(
            k=st.one_of(st.none(), int64),
            quantile=st.one_of(st.none(), int64, st.floats()),
            rows=st.one_of(st.just(1), int64),
            columns=st.one_of(st.just(D), int64),
        )
        def check(k, quantile, rows, columns):
            r = request_type(model_name="nca-knn")
            if k is not None:
                r.parameters["k"].int64_param = k
            if isinstance(quantile, int):
                r.parameters["outlier_quantile"].int64_param = quantile
            elif isinstance(quantile, float):
                r.parameters["outlier_quantile"].double_param = quantile
            r.inputs.add(name="input", datatype="FP32", shape=[rows, columns])
            r.raw_input_contents.append(np.zeros(D, np.float32).tobytes())
            try:
                stub(r, timeout=30)
                code = grpc.StatusCode.OK
            except grpc.RpcError as exc:
                code = exc.code()
                assert exc.details()
            assert code in GRPC_CLIENT_ERRORS, (code, k, quantile, rows, columns)

        check()
