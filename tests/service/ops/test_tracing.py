"""Request tracing (service/ops/tracing.py) against the OpenTelemetry SDK's in-memory
exporter: one server span per request, the child of the caller's traceparent, with parse /
queue / search / decide children, on /v1, /v2 REST and gRPC; the trace id in the
x-request-id header (gRPC: initial metadata) and in the request's log line; nothing at all
when tracing is off."""

from __future__ import annotations

import logging

import grpc
import pytest
from fastapi.testclient import TestClient

from service.app import create_app
from service.ops import tracing
from tests.service.conftest import settings_for
from tests.service.servers import free_port

pytest.importorskip("opentelemetry.sdk.trace")
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import (
    InMemorySpanExporter,
)

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"
CHILDREN = {"parse", "queue", "search", "decide"}


@pytest.fixture
def traced(model_artifact):
    """A factory: (TestClient, exporter) for an app with tracing on (spans kept in memory)."""
    opened = []

    def make(**overrides):
        exporter = InMemorySpanExporter()
        app = create_app(
            settings_for(model_artifact[0], **overrides),
            tracing=tracing.Tracing(processor=SimpleSpanProcessor(exporter)),
        )
        client = TestClient(app)
        client.__enter__()
        opened.append(client)
        return client, exporter

    yield make
    for client in opened:
        client.__exit__(None, None, None)


def spans_of(exporter, trace_id: str) -> dict[str, object]:
    spans = [
        s for s in exporter.get_finished_spans() if format(s.context.trace_id, "032x") == trace_id
    ]
    return {s.name: s for s in spans}


def check_tree(spans: dict, server_name: str, parent_id: str | None):
    server = spans[server_name]
    if parent_id is None:
        assert server.parent is None
    else:
        assert format(server.parent.span_id, "016x") == parent_id
    assert CHILDREN <= set(spans)
    for name in CHILDREN:
        child = spans[name]
        assert child.parent.span_id == server.context.span_id, name
        assert server.start_time <= child.start_time <= child.end_time <= server.end_time, name
    order = [spans[n].start_time for n in ("parse", "queue", "search", "decide")]
    assert order == sorted(order)
    return server


ROW = [[0.5] * 64]


@pytest.mark.parametrize("batching", [True, False])
def test_v1_classify_joins_the_callers_trace(traced, caplog, batching):
    client, exporter = traced(batching=batching)
    with caplog.at_level(logging.INFO, logger="service.requests"):
        response = client.post(
            "/v1/classify", json={"instances": ROW}, headers={"traceparent": TRACEPARENT}
        )
    assert response.status_code == 200
    assert response.headers["x-request-id"] == TRACE_ID
    server = check_tree(spans_of(exporter, TRACE_ID), "POST /v1/classify", PARENT_ID)
    assert server.attributes["http.response.status_code"] == 200
    lines = [r for r in caplog.records if r.name == "service.requests"]
    assert [r.trace_id for r in lines] == [TRACE_ID]
    assert lines[0].route == "POST /v1/classify" and lines[0].status == 200


def test_without_a_traceparent_a_request_starts_its_own_trace(traced):
    client, exporter = traced()
    for headers in ({}, {"traceparent": "00-nothex-00f067aa0ba902b7-01"}):
        response = client.post("/v1/classify", json={"instances": ROW}, headers=headers)
        trace_id = response.headers["x-request-id"]
        assert len(trace_id) == 32 and trace_id != TRACE_ID
        check_tree(spans_of(exporter, trace_id), "POST /v1/classify", None)


def test_v2_rest_infer_is_traced(traced):
    client, exporter = traced()
    body = {"inputs": [{"name": "input", "shape": [1, 64], "datatype": "FP32", "data": ROW[0]}]}
    response = client.post(
        "/v2/models/nca-knn/infer", json=body, headers={"traceparent": TRACEPARENT}
    )
    assert response.status_code == 200, response.text
    assert response.headers["x-request-id"] == TRACE_ID
    check_tree(spans_of(exporter, TRACE_ID), "POST /v2/models/{model_name}/infer", PARENT_ID)


def test_grpc_model_infer_is_traced(traced):
    from service.oip.protocol import message

    port = free_port()
    _, exporter = traced(grpc_port=port)
    request = message("inference.ModelInferRequest")(model_name="nca-knn")
    tensor = request.inputs.add(name="input", datatype="FP32", shape=[1, 64])
    tensor.contents.fp32_contents.extend(ROW[0])
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.unary_unary(
            "/inference.GRPCInferenceService/ModelInfer",
            request_serializer=lambda m: m.SerializeToString(),
            response_deserializer=message("inference.ModelInferResponse").FromString,
        )
        response, rpc = call.with_call(request, metadata=(("traceparent", TRACEPARENT),))
    assert response.model_name == "nca-knn"
    assert dict(rpc.initial_metadata())["x-request-id"] == TRACE_ID
    name = "grpc inference.GRPCInferenceService/ModelInfer"
    server = check_tree(spans_of(exporter, TRACE_ID), name, PARENT_ID)
    assert server.attributes["http.response.status_code"] == 200


def test_a_failed_request_is_an_error_span_with_its_status(traced):
    client, exporter = traced()
    response = client.post("/v1/classify", json={"instances": [[0.5] * 3]})  # 3 of 64 features
    assert response.status_code == 422
    spans = spans_of(exporter, response.headers["x-request-id"])
    assert spans["POST /v1/classify"].attributes["http.response.status_code"] == 422


def test_off_by_default_no_header_no_spans(client, caplog):
    assert not client.app.state.ncaknn.tracing.enabled
    with caplog.at_level(logging.INFO, logger="service.requests"):
        response = client.post(
            "/v1/classify", json={"instances": ROW}, headers={"traceparent": TRACEPARENT}
        )
    assert response.status_code == 200
    assert "x-request-id" not in response.headers
    assert not [r for r in caplog.records if r.name == "service.requests"]


@pytest.mark.parametrize(
    "environ, on",
    [
        ({}, False),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}, True),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4318/v1/traces"}, True),
        ({"OTEL_TRACES_EXPORTER": "otlp"}, True),
        ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}, False),
        ({"OTEL_SDK_DISABLED": "true", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}, False),
    ],
)
def test_the_standard_settings_turn_tracing_on(environ, on):
    assert tracing.wanted(environ) is on


def test_asking_for_traces_without_the_extra_is_a_clear_error(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "opentelemetry.sdk.trace", None)
    with pytest.raises(tracing.TracingUnavailable, match=r"nca-knn\[tracing\]"):
        tracing.check_available({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"})
    assert tracing.check_available({}) is False
