"""ops/logs.py: one JSON object per line with the fields an operator filters on."""

from __future__ import annotations

import io
import json
import logging

import pytest

from service.ops.logs import JsonFormatter, configure_logging


def record(message: str, *args, exc_info=None, **extra) -> logging.LogRecord:
    rec = logging.LogRecord("service.test", logging.WARNING, __file__, 1, message, args, exc_info)
    for key, value in extra.items():
        setattr(rec, key, value)
    rec.created = 1_700_000_000.25
    rec.msecs = 250.0
    return rec


def test_a_log_line_is_one_json_object_with_time_level_logger_message_and_extras():
    line = JsonFormatter().format(record("loaded %s", "v1", model_version="abc", seconds=0.5))
    assert "\n" not in line
    assert json.loads(line) == {
        "time": "2023-11-14T22:13:20.250Z",
        "level": "warning",
        "logger": "service.test",
        "message": "loaded v1",
        "model_version": "abc",
        "seconds": 0.5,
    }


def test_an_exception_is_kept_in_the_line_and_odd_extras_are_strings():
    try:
        raise ValueError("broken artifact")
    except ValueError:
        import sys

        exc_info = sys.exc_info()
    line = JsonFormatter().format(record("failed", exc_info=exc_info, path=object()))
    payload = json.loads(line)
    assert "ValueError: broken artifact" in payload["exception"]
    assert payload["path"].startswith("<object object")


@pytest.mark.parametrize("json_lines", [True, False])
def test_configure_logging_writes_service_logs_to_one_handler(monkeypatch, json_lines):
    stream = io.StringIO()
    monkeypatch.setattr("sys.stderr", stream)
    configure_logging("info", json_lines)
    logger = logging.getLogger("service.engine")
    logger.debug("hidden")
    logger.info("model loaded", extra={"model_version": "v2"})
    lines = stream.getvalue().splitlines()
    assert len(lines) == 1
    if json_lines:
        assert json.loads(lines[0])["model_version"] == "v2"
    else:
        assert lines[0].endswith("INFO service.engine model loaded")
    configure_logging("warning", False)  # leave the logger quiet for the other tests


def test_requests_are_counted_by_route_and_status_and_timed_by_route():
    from service.ops.metrics import Metrics

    metrics = Metrics()
    for route, status, seconds in (
        ("/v1/classify", 200, 0.002),
        ("/v1/classify", 200, 0.004),
        ("/v1/classify", 422, 0.001),
        ("/readyz", 200, 0.0001),
    ):
        count, latency = metrics.request_series[route, status]
        count.inc()
        latency.observe(seconds)
    assert (
        metrics.request_series["/v1/classify", 200] is metrics.request_series["/v1/classify", 200]
    )

    def sample(name, **labels):
        return metrics.registry.get_sample_value(name, labels)

    assert sample("ncaknn_requests_total", route="/v1/classify", status="200") == 2
    assert sample("ncaknn_requests_total", route="/v1/classify", status="422") == 1
    assert sample("ncaknn_requests_total", route="/readyz", status="200") == 1
    assert sample("ncaknn_request_latency_seconds_count", route="/v1/classify") == 3
    assert sample("ncaknn_request_latency_seconds_sum", route="/v1/classify") == pytest.approx(
        0.007
    )
