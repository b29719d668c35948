"""Prometheus metrics, all named ``ncaknn_*``, in a registry per app."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "ncaknn_requests", "HTTP requests by route and status", ["route", "status"], registry=r
        )
        self.latency = Histogram(
            "ncaknn_request_latency_seconds",
            "request latency by route",
            ["route"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.request_rows = Histogram(
            "ncaknn_request_rows",
            "instances per request by route",
            ["route"],
            buckets=ROW_BUCKETS,
            registry=r,
        )
        self.batch_rows = Histogram(
            "ncaknn_batch_rows",
            "rows per merged search (dynamic batching)",
            buckets=ROW_BUCKETS,
            registry=r,
        )
        self.queue_wait = Histogram(
            "ncaknn_queue_wait_seconds",
            "time the oldest request of a batch waited",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.errors = Counter(
            "ncaknn_errors", "errors reported to clients by type", ["error_type"], registry=r
        )
        self.in_flight = Gauge("ncaknn_in_flight_requests", "requests computing now", registry=r)
        self.model_info = Gauge(
            "ncaknn_model_info",
            "the loaded model (value 1)",
            ["model_version", "index_type"],
            registry=r,
        )
        self.model_loaded_at = Gauge(
            "ncaknn_model_loaded_timestamp_seconds", "when the loaded model was loaded", registry=r
        )
        self.model_load_seconds = Gauge(
            "ncaknn_model_load_duration_seconds",
            "how long the last successful load took",
            registry=r,
        )
        self.model_loads = Counter("ncaknn_model_loads", "successful model loads", registry=r)
        self.model_load_failures = Counter(
            "ncaknn_model_load_failures",
            "failed model loads (the previous model kept serving)",
            registry=r,
        )

    def set_model(self, model) -> None:
        self.model_info.clear()
        self.model_info.labels(model_version=model.version, index_type=model.index_type).set(1)
        self.model_loaded_at.set(model.loaded_at)
        self.model_load_seconds.set(model.load_seconds)
        self.model_loads.inc()
