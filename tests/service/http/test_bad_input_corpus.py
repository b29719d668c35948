"""A table of malformed inputs, each sent to every inference route it applies to: the status,
the error_type and a fragment of the message naming the problem. None may be a 5xx."""

from __future__ import annotations

import io
import json
import zipfile

import numpy as np
import pytest
from fastapi.testclient import TestClient

from service.app import create_app
from tests.service.conftest import settings_for

D = 64
ROUTES = ("/v1/classify", "/v1/embed", "/v1/neighbors")
SEARCH_ROUTES = ("/v1/classify", "/v1/neighbors")
JSON_H = {"content-type": "application/json"}
NPY_H = {"content-type": "application/x-npy"}
ROW = [0.5] * D
SPARSE_ROW = {"indices": [9, 2, 40], "values": [0.5, 1.0, 3.0]}


def js(value) -> bytes:
    return json.dumps(value).encode()


def npy(array, **kw) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array, **kw)
    return buffer.getvalue()


def npy_with_header(header: str, data: bytes = b"") -> bytes:
    text = header.encode("latin1")
    pad = 64 - (10 + len(text) + 1) % 64
    text += b" " * pad + b"\n"
    return b"\x93NUMPY\x01\x00" + len(text).to_bytes(2, "little") + text + data


def zip_bytes() -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as z:
        z.writestr("a.npy", npy(np.zeros((1, D), np.float32)))
    return buffer.getvalue()


GOOD_NPY = npy(np.zeros((1, D), np.float32))
# (name, routes, headers, body, query, status, error_type, fragment)
CASES = [
    # ---- JSON structure
    ("not json", ROUTES, JSON_H, b"{instances", "", 422, "invalid_input", "not valid JSON"),
    ("empty body", ROUTES, JSON_H, b"", "", 422, "invalid_input", "not valid JSON"),
    ("json array", ROUTES, JSON_H, js([ROW]), "", 422, "invalid_input", "Expected `object`"),
    ("json null", ROUTES, JSON_H, b"null", "", 422, "invalid_input", "Expected `object`"),
    ("missing instances", ROUTES, JSON_H, js({}), "", 422, "invalid_input", "instances"),
    (
        "unknown field",
        ROUTES,
        JSON_H,
        js({"instances": [ROW], "x": 1}),
        "",
        422,
        "invalid_input",
        "unknown field `x`",
    ),
    (
        "instances string",
        ROUTES,
        JSON_H,
        js({"instances": "abc"}),
        "",
        422,
        "invalid_input",
        "Expected `array`",
    ),
    (
        "instances flat",
        ROUTES,
        JSON_H,
        js({"instances": ROW}),
        "",
        422,
        "invalid_input",
        "Expected `array`",
    ),
    (
        "instances 3-D",
        ROUTES,
        JSON_H,
        js({"instances": [[ROW]]}),
        "",
        422,
        "invalid_input",
        "Expected `float`",
    ),
    ("empty batch", ROUTES, JSON_H, js({"instances": []}), "", 400, "empty_batch", "empty"),
    ("empty row", ROUTES, JSON_H, js({"instances": [[]]}), "", 422, "invalid_input", "64 features"),
    (
        "short row",
        ROUTES,
        JSON_H,
        js({"instances": [[1.0] * 63]}),
        "",
        422,
        "invalid_input",
        "got 63",
    ),
    (
        "long row",
        ROUTES,
        JSON_H,
        js({"instances": [[1.0] * 65]}),
        "",
        422,
        "invalid_input",
        "got 65",
    ),
    (
        "ragged",
        ROUTES,
        JSON_H,
        js({"instances": [ROW, ROW[:-1]]}),
        "",
        422,
        "invalid_input",
        "ragged",
    ),
    (
        "string value",
        ROUTES,
        JSON_H,
        js({"instances": [["1.5", *ROW[1:]]]}),
        "",
        422,
        "invalid_input",
        "got `str`",
    ),
    (
        "bool value",
        ROUTES,
        JSON_H,
        js({"instances": [[True, *ROW[1:]]]}),
        "",
        422,
        "invalid_input",
        "got `bool`",
    ),
    (
        "null value",
        ROUTES,
        JSON_H,
        js({"instances": [[None, *ROW[1:]]]}),
        "",
        422,
        "invalid_input",
        "got `null`",
    ),
    (
        "object value",
        ROUTES,
        JSON_H,
        js({"instances": [[{}, *ROW[1:]]]}),
        "",
        422,
        "invalid_input",
        "got `object`",
    ),
    (
        "NaN literal",
        ROUTES,
        JSON_H,
        b'{"instances": [[NaN' + b", 0" * (D - 1) + b"]]}",
        "",
        422,
        "invalid_input",
        "not valid JSON",
    ),
    (
        "Infinity literal",
        ROUTES,
        JSON_H,
        b'{"instances": [[Infinity' + b", 0" * (D - 1) + b"]]}",
        "",
        422,
        "invalid_input",
        "not valid JSON",
    ),
    (
        "1e400",
        ROUTES,
        JSON_H,
        b'{"instances": [[1e400' + b", 0" * (D - 1) + b"]]}",
        "",
        422,
        "invalid_input",
        "out of range",
    ),
    (
        "1e39 beyond float32",
        ROUTES,
        JSON_H,
        js({"instances": [[1e39, *ROW[1:]]]}),
        "",
        422,
        "invalid_input",
        "input range",
    ),
    (
        "-1e38 beyond the model's range",
        ROUTES,
        JSON_H,
        js({"instances": [[-3e38] * D]}),
        "",
        422,
        "invalid_input",
        "input range",
    ),
    (
        "trailing garbage",
        ROUTES,
        JSON_H,
        js({"instances": [ROW]}) + b"xyz",
        "",
        422,
        "invalid_input",
        "not valid JSON",
    ),
    (
        "utf-16 body",
        ROUTES,
        JSON_H,
        json.dumps({"instances": [ROW]}).encode("utf-16"),
        "",
        422,
        "invalid_input",
        "not valid JSON",
    ),
    (
        "too many values (commas)",
        ROUTES,
        JSON_H,
        b'{"instances": [[' + b"0," * 300_000 + b"0]]}",
        "",
        413,
        "payload_too_large",
        "more values",
    ),
    # ---- options in the JSON body
    (
        "k zero",
        SEARCH_ROUTES,
        JSON_H,
        js({"instances": [ROW], "k": 0}),
        "",
        422,
        "invalid_input",
        "k",
    ),
    (
        "k negative",
        SEARCH_ROUTES,
        JSON_H,
        js({"instances": [ROW], "k": -3}),
        "",
        422,
        "invalid_input",
        "k",
    ),
    (
        "k float",
        SEARCH_ROUTES,
        JSON_H,
        js({"instances": [ROW], "k": 5.0}),
        "",
        422,
        "invalid_input",
        "got `float`",
    ),
    (
        "k string",
        SEARCH_ROUTES,
        JSON_H,
        js({"instances": [ROW], "k": "5"}),
        "",
        422,
        "invalid_input",
        "got `str`",
    ),
    (
        "k bool",
        SEARCH_ROUTES,
        JSON_H,
        js({"instances": [ROW], "k": True}),
        "",
        422,
        "invalid_input",
        "got `bool`",
    ),
    (
        "k over max_k",
        SEARCH_ROUTES,
        JSON_H,
        js({"instances": [ROW], "k": 257}),
        "",
        422,
        "invalid_input",
        "max_k=256",
    ),
    (
        "query k over max_k while the body's k wins (found by the fuzzer)",
        SEARCH_ROUTES,
        JSON_H,
        js({"instances": [ROW], "k": 3}),
        "k=9999999999999999",
        422,
        "invalid_input",
        "query parameter k=9999999999999999 is over the limit max_k=256",
    ),
    (
        "k huge",
        SEARCH_ROUTES,
        JSON_H,
        js({"instances": [ROW], "k": 10**30}),
        "",
        422,
        "invalid_input",
        "k=",
    ),
    (
        "k on embed",
        ("/v1/embed",),
        JSON_H,
        js({"instances": [ROW], "k": 5}),
        "",
        422,
        "invalid_input",
        "unknown field `k`",
    ),
    (
        "rule unknown",
        ("/v1/classify",),
        JSON_H,
        js({"instances": [ROW], "rule": "vote"}),
        "",
        422,
        "invalid_input",
        "rule",
    ),
    (
        "rule number",
        ("/v1/classify",),
        JSON_H,
        js({"instances": [ROW], "rule": 1}),
        "",
        422,
        "invalid_input",
        "rule",
    ),
    (
        "return_neighbors string",
        ("/v1/classify",),
        JSON_H,
        js({"instances": [ROW], "return_neighbors": "yes"}),
        "",
        422,
        "invalid_input",
        "got `str`",
    ),
    (
        "return_neighbors int",
        ("/v1/classify",),
        JSON_H,
        js({"instances": [ROW], "return_neighbors": 1}),
        "",
        422,
        "invalid_input",
        "got `int`",
    ),
    (
        "rule on neighbors",
        ("/v1/neighbors",),
        JSON_H,
        js({"instances": [ROW], "rule": "soft"}),
        "",
        422,
        "invalid_input",
        "unknown field `rule`",
    ),
    # ---- query options
    (
        "query k text",
        SEARCH_ROUTES,
        NPY_H,
        GOOD_NPY,
        "k=five",
        422,
        "invalid_input",
        "k must be an integer",
    ),
    (
        "query k float",
        SEARCH_ROUTES,
        NPY_H,
        GOOD_NPY,
        "k=5.0",
        422,
        "invalid_input",
        "k must be an integer",
    ),
    (
        "query k zero",
        SEARCH_ROUTES,
        NPY_H,
        GOOD_NPY,
        "k=0",
        422,
        "invalid_input",
        "k must be an integer",
    ),
    (
        "query k twice",
        SEARCH_ROUTES,
        NPY_H,
        GOOD_NPY,
        "k=1&k=2",
        422,
        "invalid_input",
        "more than once",
    ),
    (
        "query k unicode digits",
        SEARCH_ROUTES,
        NPY_H,
        GOOD_NPY,
        "k=%D9%A3",
        422,
        "invalid_input",
        "k must be an integer",
    ),
    (
        "query unknown",
        ROUTES,
        NPY_H,
        GOOD_NPY,
        "K=5",
        422,
        "invalid_input",
        "unknown query parameter 'K'",
    ),
    (
        "query rule",
        ("/v1/classify",),
        NPY_H,
        GOOD_NPY,
        "rule=vote",
        422,
        "invalid_input",
        "rule must be one of",
    ),
    (
        "query neighbors yes",
        ("/v1/classify",),
        NPY_H,
        GOOD_NPY,
        "return_neighbors=yes",
        422,
        "invalid_input",
        "true or false",
    ),
    (
        "query k on embed",
        ("/v1/embed",),
        NPY_H,
        GOOD_NPY,
        "k=3",
        422,
        "invalid_input",
        "unknown query parameter",
    ),
    # ---- npy
    ("npy garbage", ROUTES, NPY_H, b"hello world, not npy", "", 422, "invalid_input", "magic"),
    ("npy empty", ROUTES, NPY_H, b"", "", 422, "invalid_input", "magic"),
    ("npy zip", ROUTES, NPY_H, zip_bytes(), "", 422, "invalid_input", "magic"),
    ("npy bool", ROUTES, NPY_H, npy(np.zeros((1, D), bool)), "", 422, "invalid_input", "dtype"),
    (
        "npy complex",
        ROUTES,
        NPY_H,
        npy(np.zeros((1, D), complex)),
        "",
        422,
        "invalid_input",
        "dtype",
    ),
    ("npy string", ROUTES, NPY_H, npy(np.zeros((1, D), "U3")), "", 422, "invalid_input", "dtype"),
    (
        "npy object",
        ROUTES,
        NPY_H,
        npy(np.array([[{}] * D], object), allow_pickle=True),
        "",
        422,
        "invalid_input",
        "dtype",
    ),
    (
        "npy float128",
        ROUTES,
        NPY_H,
        npy(np.zeros((1, D), np.longdouble)),
        "",
        422,
        "invalid_input",
        "dtype",
    ),
    (
        "npy structured",
        ROUTES,
        NPY_H,
        npy(np.zeros((1, D), [("a", "f4")])),
        "",
        422,
        "invalid_input",
        "dtype",
    ),
    ("npy 1-D", ROUTES, NPY_H, npy(np.zeros(D, np.float32)), "", 422, "invalid_input", "2-D"),
    (
        "npy 3-D",
        ROUTES,
        NPY_H,
        npy(np.zeros((1, 1, D), np.float32)),
        "",
        422,
        "invalid_input",
        "2-D",
    ),
    (
        "npy zero rows",
        ROUTES,
        NPY_H,
        npy(np.zeros((0, D), np.float32)),
        "",
        400,
        "empty_batch",
        "empty",
    ),
    (
        "npy wrong D",
        ROUTES,
        NPY_H,
        npy(np.zeros((2, D + 1), np.float32)),
        "",
        422,
        "invalid_input",
        "got 65",
    ),
    (
        "npy NaN",
        ROUTES,
        NPY_H,
        npy(np.full((1, D), np.nan, np.float32)),
        "",
        422,
        "invalid_input",
        "NaN",
    ),
    (
        "npy Inf",
        ROUTES,
        NPY_H,
        npy(np.full((1, D), np.inf)),
        "",
        422,
        "invalid_input",
        "NaN or Inf",
    ),
    (
        "npy float64 beyond float32",
        ROUTES,
        NPY_H,
        npy(np.full((1, D), 1e300)),
        "",
        422,
        "invalid_input",
        "input range",
    ),
    (
        "npy header claims 1e12 rows",
        ROUTES,
        NPY_H,
        npy_with_header("{'descr': '<f4', 'fortran_order': False, 'shape': (1000000000000, 64), }"),
        "",
        413,
        "payload_too_large",
        "1000000000000 instances",
    ),
    (
        "npy truncated data",
        ROUTES,
        NPY_H,
        npy(np.zeros((3, D), np.float32))[:-10],
        "",
        422,
        "invalid_input",
        "truncated",
    ),
    (
        "npy trailing rows",
        ROUTES,
        NPY_H,
        npy_with_header(
            "{'descr': '<f4', 'fortran_order': False, 'shape': (1, 64), }", b"\0" * (4 * D * 3)
        ),
        "",
        422,
        "invalid_input",
        "extra bytes",
    ),
    (
        "npy header not a dict",
        ROUTES,
        NPY_H,
        npy_with_header("[1, 2, 3]"),
        "",
        422,
        "invalid_input",
        "descr, fortran_order and shape",
    ),
    (
        "npy header code",
        ROUTES,
        NPY_H,
        npy_with_header("__import__('os').system('true')"),
        "",
        422,
        "invalid_input",
        "not a readable dictionary",
    ),
    (
        "npy negative shape",
        ROUTES,
        NPY_H,
        npy_with_header("{'descr': '<f4', 'fortran_order': False, 'shape': (-1, 64), }"),
        "",
        422,
        "invalid_input",
        "not a tuple of sizes",
    ),
    (
        "npy bad descr",
        ROUTES,
        NPY_H,
        npy_with_header("{'descr': 'zz', 'fortran_order': False, 'shape': (1, 64), }"),
        "",
        422,
        "invalid_input",
        "dtype",
    ),
    (
        "npy version 9",
        ROUTES,
        NPY_H,
        b"\x93NUMPY\x09\x00" + b"\0" * 100,
        "",
        422,
        "invalid_input",
        "version 9",
    ),
    (
        "npy header longer than body",
        ROUTES,
        NPY_H,
        b"\x93NUMPY\x01\x00\xff\xff{",
        "",
        422,
        "invalid_input",
        "header declares",
    ),
    # ---- media types
    (
        "text/plain",
        ROUTES,
        {"content-type": "text/plain"},
        b"x",
        "",
        415,
        "unsupported_media_type",
        "text/plain",
    ),
    (
        "form",
        ROUTES,
        {"content-type": "application/x-www-form-urlencoded"},
        b"a=1",
        "",
        415,
        "unsupported_media_type",
        "not accepted",
    ),
    (
        "accept html",
        ROUTES,
        {**JSON_H, "accept": "text/html"},
        js({"instances": [ROW]}),
        "",
        406,
        "not_acceptable",
        "text/html",
    ),
    (
        "accept json q=0",
        SEARCH_ROUTES,
        {**JSON_H, "accept": "application/json;q=0"},
        js({"instances": [ROW]}),
        "",
        406,
        "not_acceptable",
        "q=0",
    ),
    # ---- sizes
    (
        "too many rows",
        ROUTES,
        JSON_H,
        js({"instances": [ROW] * 4097}),
        "",
        413,
        "payload_too_large",
        "4097 instances",
    ),
    (
        "npy too many rows",
        ROUTES,
        NPY_H,
        npy(np.zeros((4097, D), np.float32)),
        "",
        413,
        "payload_too_large",
        "4097 instances",
    ),
    (
        "content-length over the limit",
        ROUTES,
        {**JSON_H, "content-length": str(10**12)},
        b"{}",
        "",
        413,
        "payload_too_large",
        "request body of",
    ),
    # ---- integers and text straight off the wire
    (
        "query k of 4301 digits",
        SEARCH_ROUTES,
        JSON_H,
        js({"instances": [ROW]}),
        "k=" + "9" * 4301,
        422,
        "invalid_input",
        "k must be an integer >= 1 written with 1 to 18 ASCII digits",
    ),
    (
        "query k of 5000 zeros then 5",
        SEARCH_ROUTES,
        JSON_H,
        js({"instances": [ROW]}),
        "k=" + "0" * 5000 + "5",
        422,
        "invalid_input",
        "1 to 18 ASCII digits",
    ),
    (
        "query k a Unicode digit",
        SEARCH_ROUTES,
        JSON_H,
        js({"instances": [ROW]}),
        "k=%C2%B2",
        422,
        "invalid_input",
        "1 to 18 ASCII digits",
    ),
    (
        "query k with underscores",
        SEARCH_ROUTES,
        JSON_H,
        js({"instances": [ROW]}),
        "k=1_0",
        422,
        "invalid_input",
        "1 to 18 ASCII digits",
    ),
    (
        "content-length of 4301 digits",
        ROUTES,
        {**JSON_H, "content-length": "9" * 4301},
        js({"instances": [ROW]}),
        "",
        422,
        "invalid_input",
        "Content-Length must be an integer",
    ),
    (
        "invalid UTF-8 in a key",
        ROUTES,
        JSON_H,
        b'{"instances": [[0.5]], "\xff\xfe": 1}',
        "",
        422,
        "invalid_input",
        "not valid UTF-8: byte 0xff",
    ),
    (
        "invalid UTF-8 in a string",
        ("/v1/classify",),
        JSON_H,
        b'{"instances": [[0.5]], "rule": "maj\xc3\x28"}',
        "",
        422,
        "invalid_input",
        "not valid UTF-8",
    ),
    (
        "body k of 31 digits",
        SEARCH_ROUTES,
        JSON_H,
        js({"instances": [ROW], "k": 10**30}),
        "",
        422,
        "invalid_input",
        "over the limit",
    ),
    (
        "answer too large",
        ("/v1/classify",),
        JSON_H,
        js({"instances": [ROW] * 4096, "k": 256, "return_neighbors": True}),
        "",
        413,
        "payload_too_large",
        "max_response_values",
    ),
    (
        "neighbors answer too large",
        ("/v1/neighbors",),
        JSON_H,
        js({"instances": [ROW] * 4096, "k": 256}),
        "",
        413,
        "payload_too_large",
        "max_response_values",
    ),
    # ---- rows by their non-zeros (sparse_instances)
    *[
        (f"sparse: {name}", ROUTES, JSON_H, js(body), "", status, error_type, fragment)
        for name, body, status, error_type, fragment in [
            ("neither form", {}, 422, "invalid_input", "gives neither"),
            (
                "both forms",
                {"instances": [ROW], "sparse_instances": [SPARSE_ROW]},
                422,
                "invalid_input",
                "gives both",
            ),
            ("empty batch", {"sparse_instances": []}, 400, "empty_batch", "sparse_instances is"),
            (
                "a row as a list",
                {"sparse_instances": [[1, 2]]},
                422,
                "invalid_input",
                "Expected `object`",
            ),
            (
                "values missing",
                {"sparse_instances": [{"indices": [1]}]},
                422,
                "invalid_input",
                "missing required field `values`",
            ),
            (
                "an unknown field in a row",
                {"sparse_instances": [{**SPARSE_ROW, "shape": [1, 64]}]},
                422,
                "invalid_input",
                "unknown field `shape`",
            ),
            (
                "more values than indices",
                {"sparse_instances": [SPARSE_ROW, {"indices": [1], "values": [1.0, 2.0]}]},
                422,
                "invalid_input",
                "sparse_instances[1] has 1 indices and 2 values",
            ),
            (
                "an index past the features",
                {"sparse_instances": [{"indices": [3, 64], "values": [1.0, 1.0]}]},
                422,
                "invalid_input",
                "sparse_instances[0].indices[1] = 64 is not a column",
            ),
            (  # the row and position are counted past an empty row
                "an index past the features in a later row",
                {
                    "sparse_instances": [
                        SPARSE_ROW,
                        {"indices": [], "values": []},
                        {"indices": [4, 70], "values": [1.0, 1.0]},
                    ]
                },
                422,
                "invalid_input",
                "sparse_instances[2].indices[1] = 70 is not a column",
            ),
            (
                "a value out of range in a later row",
                {
                    "sparse_instances": [
                        {"indices": [], "values": []},
                        SPARSE_ROW,
                        {"indices": [4, 9, 11], "values": [1.0, 2.0, -1e300]},
                    ]
                },
                422,
                "invalid_input",
                "sparse_instances[2].values[2] = -1e+300 is outside",
            ),
            (
                "a negative index",
                {"sparse_instances": [{"indices": [-1], "values": [1.0]}]},
                422,
                "invalid_input",
                "indices[0] = -1 is not a column",
            ),
            (
                "an index beyond int64",
                {"sparse_instances": [{"indices": [2**70], "values": [1.0]}]},
                422,
                "invalid_input",
                "is not a column",
            ),
            (
                "a float index",
                {"sparse_instances": [{"indices": [1.0], "values": [1.0]}]},
                422,
                "invalid_input",
                "Expected `int`, got `float`",
            ),
            (
                "an index as text",
                {"sparse_instances": [{"indices": ["1"], "values": [1.0]}]},
                422,
                "invalid_input",
                "Expected `int`, got `str`",
            ),
            (
                "a column twice",
                {"sparse_instances": [SPARSE_ROW, {"indices": [5, 2, 5], "values": [1, 2, 3]}]},
                422,
                "invalid_input",
                "sparse_instances[1].indices gives column 5 twice",
            ),
            (
                "a value as text",
                {"sparse_instances": [{"indices": [1], "values": ["x"]}]},
                422,
                "invalid_input",
                "Expected `float`, got `str`",
            ),
            (
                "a value beyond the input range",
                {"sparse_instances": [{"indices": [0, 7], "values": [1.0, 1e300]}]},
                422,
                "invalid_input",
                "sparse_instances[0].values[1] = 1e+300 is outside this model's input range",
            ),
            (
                "too many rows",
                {"sparse_instances": [SPARSE_ROW] * 4097},
                413,
                "payload_too_large",
                "4097 sparse_instances in one request",
            ),
        ]
    ],
]

PARAMS = [
    pytest.param(route, headers, body, query, status, error_type, fragment, id=f"{name} {route}")
    for name, routes, headers, body, query, status, error_type, fragment in CASES
    for route in routes
]


@pytest.fixture(scope="module")
def corpus_client(model_artifact):
    with TestClient(
        create_app(settings_for(model_artifact[0])), raise_server_exceptions=False
    ) as c:
        yield c


def test_the_corpus_is_large():
    assert len(CASES) >= 60 and len(PARAMS) >= 150


@pytest.mark.parametrize("route, headers, body, query, status, error_type, fragment", PARAMS)
def test_bad_input(corpus_client, route, headers, body, query, status, error_type, fragment):
    url = f"{route}?{query}" if query else route
    response = corpus_client.post(url, content=body, headers=headers)
    assert response.status_code == status, response.text
    payload = response.json()
    assert set(payload) == {"error", "error_type"}, payload
    assert payload["error_type"] == error_type
    assert fragment in payload["error"], payload["error"]


def test_the_same_rows_valid_are_answered(corpus_client):
    """The corpus's base row and npy body are valid: the refusals above are about the defect."""
    for route in ROUTES:
        assert (
            corpus_client.post(route, content=js({"instances": [ROW]}), headers=JSON_H).status_code
            == 200
        )
        assert corpus_client.post(route, content=GOOD_NPY, headers=NPY_H).status_code == 200
