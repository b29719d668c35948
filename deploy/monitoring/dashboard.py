"""Writes deploy/monitoring/dashboard.json, the Grafana dashboard for nca-knn.

Every panel is a PromQL query over the metrics the service exports (service/ops/metrics.py);
tests/deploy/test_monitoring.py checks that the committed JSON is this script's output, that
every query parses and that it names only exported metrics. Import the JSON in Grafana
(Dashboards > New > Import) and pick the Prometheus data source that scrapes the pods.

Usage: python deploy/monitoring/dashboard.py   (rewrites dashboard.json)
"""

from __future__ import annotations

import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
OUT = HERE / "dashboard.json"
INFERENCE = 'route=~"/v1/classify.*|/v1/embed.*|/v1/neighbors.*|/v2/models/.*|grpc .*"'
CLASSIFY = 'route=~"/v1/classify.*|/v2/models/.*|grpc .*ModelInfer"'

# (title, unit, [(expr, legend)]), laid out two to a row. The one `fmt: skip` in the
# project: a panel per stanza reads as the dashboard does; formatted, each query splits.
PANELS = [
    ("Requests per second by route", "reqps", [
        ("sum by (route) (rate(ncaknn_requests_total[5m]))", "{{route}}"),
    ]),
    ("Errors and refusals (share of requests)", "percentunit", [
        ('sum(rate(ncaknn_requests_total{status=~"5.."}[5m])) / clamp_min(sum(rate(ncaknn_requests_total[5m])), 1e-9)', "5xx"),
        ('sum(rate(ncaknn_requests_total{status="429"}[5m])) / clamp_min(sum(rate(ncaknn_requests_total[5m])), 1e-9)', "429 (overloaded)"),
        ('sum(rate(ncaknn_requests_total{status=~"4..",status!="429"}[5m])) / clamp_min(sum(rate(ncaknn_requests_total[5m])), 1e-9)', "other 4xx"),
    ]),
    ("Inference latency", "s", [
        (f"histogram_quantile({q}, sum by (le) (rate(ncaknn_request_latency_seconds_bucket{{{INFERENCE}}}[5m])))", f"p{round(q * 100)}")
        for q in (0.5, 0.9, 0.99)
    ]),
    ("Latency p99 by route", "s", [
        ("histogram_quantile(0.99, sum by (le, route) (rate(ncaknn_request_latency_seconds_bucket[5m])))", "{{route}}"),
    ]),
    ("Batching: queue wait p99", "s", [
        ("histogram_quantile(0.99, sum by (le) (rate(ncaknn_queue_wait_seconds_bucket[5m])))", "queue wait p99"),
    ]),
    ("Batching: mean rows per merged search", "short", [
        ("sum(rate(ncaknn_batch_rows_sum[5m])) / clamp_min(sum(rate(ncaknn_batch_rows_count[5m])), 1e-9)", "mean rows per search"),
    ]),
    ("In flight and open connections", "short", [
        ("sum(ncaknn_in_flight_requests)", "requests in flight"),
        ("sum(ncaknn_open_connections)", "open connections"),
    ]),
    ("Errors by type", "reqps", [
        ("sum by (error_type) (rate(ncaknn_errors_total[5m]))", "{{error_type}}"),
    ]),
    ("Connections refused by reason", "reqps", [
        ("sum by (reason) (rate(ncaknn_connections_refused_total[5m]))", "{{reason}}"),
    ]),
    ("Outlier share of classified rows", "percentunit", [
        (f"sum(rate(ncaknn_outliers_total[15m])) / clamp_min(sum(rate(ncaknn_request_rows_sum{{{CLASSIFY}}}[15m])), 1e-9)", "outliers"),
    ]),
    ("Rows searched exactly instead of through the index", "short", [
        ("sum by (reason) (rate(ncaknn_search_fallback_rows_total[5m]))", "{{reason}}"),
    ]),
    ("Model age and load time", "s", [
        ("time() - max(ncaknn_model_created_timestamp_seconds)", "age of the served model"),
        ("max(ncaknn_model_load_duration_seconds)", "last load took"),
    ]),
    ("Model loads and reload failures", "short", [
        ("sum(increase(ncaknn_model_loads_total[1h]))", "loads (1 h)"),
        ("sum(increase(ncaknn_model_load_failures_total[1h]))", "failures (1 h)"),
    ]),
    ("Served model versions", "short", [
        ("sum by (model_version, index_type) (ncaknn_model_info)", "{{model_version}} ({{index_type}})"),
    ]),
]  # fmt: skip


def panel(number: int, title: str, unit: str, queries: list[tuple[str, str]]) -> dict:
    return {
        "id": number + 1,
        "type": "timeseries",
        "title": title,
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "gridPos": {"h": 8, "w": 12, "x": 12 * (number % 2), "y": 8 * (number // 2)},
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom"}},
        "targets": [
            {"refId": chr(ord("A") + i), "expr": expr, "legendFormat": legend}
            for i, (expr, legend) in enumerate(queries)
        ],
    }


def dashboard() -> dict:
    return {
        "title": "nca-knn",
        "uid": "nca-knn-service",
        "description": "kNN classification service: traffic, errors, latency, batching, model.",
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "tags": ["nca-knn"],
        "time": {"from": "now-6h", "to": "now"},
        "refresh": "30s",
        "templating": {
            "list": [
                {
                    "name": "datasource",
                    "label": "Prometheus",
                    "type": "datasource",
                    "query": "prometheus",
                }
            ]
        },
        "panels": [panel(i, *spec) for i, spec in enumerate(PANELS)],
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


if __name__ == "__main__":
    OUT.write_text(render())
    print(OUT)
