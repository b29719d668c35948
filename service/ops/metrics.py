"""Prometheus metrics, all named ``ncaknn_*``, in a registry per app.

With several workers (``PROMETHEUS_MULTIPROC_DIR`` set by ``python -m service``), values live
in prometheus-client's per-process files and /metrics aggregates every worker: counters and
histograms are summed, ``in_flight`` is summed over live workers, and the model gauges carry
a ``pid`` label per worker, so a roll-out shows each worker's version: ``ncaknn_model_info``
holds one series per worker, its current model (``service.ops.model_info``).
"""

from __future__ import annotations

import os

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    multiprocess,
)

from service.engine.events import EngineEvents
from service.ops.model_info import ModelInfo
from service.server.connections import REFUSAL_REASONS

LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


def multiprocess_mode() -> bool:
    return bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))


class RequestSeries(dict):
    """(route, status) -> (that route and status's request counter, that route's latency
    histogram), each pair made on first use and then looked up: label children are cached
    because every request counts itself here::

        count, latency = metrics.request_series[route, status]
        count.inc()
        latency.observe(seconds)
    """

    def __init__(self, requests: Counter, latency: Histogram) -> None:
        super().__init__()
        self.requests = requests
        self.latency = latency

    def __missing__(self, key: tuple[str, int]) -> tuple:
        route, status = key
        series = self[key] = (self.requests.labels(route, str(status)), self.latency.labels(route))
        return series


class Metrics(EngineEvents):
    """The service's Prometheus series; the engine's events (``EngineEvents``) land here."""

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
        self.request_series = RequestSeries(self.requests, self.latency)
        self.request_rows = Histogram(
            "ncaknn_request_rows",
            "instances per request by route",
            ["route"],
            buckets=ROW_BUCKETS,
            registry=r,
        )
        self._define_serving_metrics(r)
        self._define_model_metrics(r)
        self._define_connection_metrics(r)
        self._define_repository_metrics(r)

    def _define_serving_metrics(self, r: CollectorRegistry) -> None:
        """Batches, queueing, errors by type, requests in flight."""
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
        self.in_flight = Gauge(
            "ncaknn_in_flight_requests",
            "requests computing now",
            registry=r,
            multiprocess_mode="livesum",
        )

    def _define_model_metrics(self, r: CollectorRegistry) -> None:
        """The loaded model, its loads, the search fallback and outliers."""
        self.model_info = ModelInfo(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))
        r.register(self.model_info)
        self.model_loaded_at = Gauge(
            "ncaknn_model_loaded_timestamp_seconds",
            "when the loaded model was loaded",
            registry=r,
            multiprocess_mode="liveall",
        )
        self.model_created_at = Gauge(
            "ncaknn_model_created_timestamp_seconds",
            "when the loaded model's artifact was written (its manifest's created_at); "
            "time() minus this is the model's age",
            registry=r,
            multiprocess_mode="liveall",
        )
        self.model_load_seconds = Gauge(
            "ncaknn_model_load_duration_seconds",
            "how long the last successful load took",
            registry=r,
            multiprocess_mode="liveall",
        )
        self.search_fallback_rows = Counter(
            "ncaknn_search_fallback_rows",
            "query rows searched exactly instead of through the index, by reason (far: too "
            "far from the data for float32; underfilled: the index found fewer than k)",
            ["reason"],
            registry=r,
        )
        self.outliers = Counter(
            "ncaknn_outliers",
            "classified rows whose nearest reference is beyond the calibrated outlier "
            "threshold (the request's outlier_quantile, else the setting's)",
            registry=r,
        )
        self.model_loads = Counter("ncaknn_model_loads", "successful model loads", registry=r)
        self.model_load_failures = Counter(
            "ncaknn_model_load_failures",
            "failed model loads (the previous model kept serving)",
            registry=r,
        )

    def _define_repository_metrics(self, r: CollectorRegistry) -> None:
        """Per model of a repository, labelled by its name: the label's values are the
        repository's loaded models (an unloaded model's series are removed; with several
        workers, whose files keep every series, its memory goes to 0 and its counters stay
        until the restart), so they stay bounded by the repository, never by what clients
        send."""
        self.model_requests = Counter(
            "ncaknn_repository_model_requests",
            "inference requests admitted per repository model",
            ["model"],
            registry=r,
        )
        self.model_rows = Counter(
            "ncaknn_repository_model_rows",
            "instances admitted per repository model",
            ["model"],
            registry=r,
        )
        self.model_memory = Gauge(
            "ncaknn_repository_model_memory_bytes",
            "memory a repository model holds (its arrays and index), while it serves",
            ["model"],
            registry=r,
            multiprocess_mode="liveall",
        )

    def _define_connection_metrics(self, r: CollectorRegistry) -> None:
        """Connections refused before any route, by reason; open connections."""
        self.connections_refused = Counter(
            "ncaknn_connections_refused",
            "HTTP connections refused by the connection guard, by reason: header_timeout and "
            "body_timeout (408), headers_too_large or too_many_headers (431), "
            "malformed_request (400), over_capacity (503), send_timeout (an answer not taken "
            "in time: reset)",
            ["reason"],
            registry=r,
        )
        for reason in REFUSAL_REASONS:
            self.connections_refused.labels(reason)
        self.open_connections = Gauge(
            "ncaknn_open_connections",
            "open HTTP connections (limit: max_connections per worker)",
            registry=r,
            multiprocess_mode="livesum",
        )

    def exposition(self) -> tuple[bytes, str]:
        """(the text exposition, its content type), of every worker in multiprocess mode."""
        if multiprocess_mode():
            registry = CollectorRegistry()
            multiprocess.MultiProcessCollector(registry)
            registry.register(self.model_info)
            return generate_latest(registry), CONTENT_TYPE_LATEST
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def connection_refused(self, reason: str) -> None:
        if reason in REFUSAL_REASONS:  # labels from the fixed set only
            self.connections_refused.labels(reason).inc()

    # ------------------------------------------------ the engine's events (EngineEvents)

    def search_fell_back(self, far_rows: int, underfilled_rows: int) -> None:
        if far_rows:
            self.search_fallback_rows.labels("far").inc(far_rows)
        if underfilled_rows:
            self.search_fallback_rows.labels("underfilled").inc(underfilled_rows)

    def model_load_failed(self, error: Exception) -> None:
        self.model_load_failures.inc()

    def request_admitted(self, route: str, rows: int) -> None:
        self.in_flight.inc()
        self.request_rows.labels(route).observe(rows)

    def request_done(self) -> None:
        self.in_flight.dec()

    def outliers_flagged(self, count: int) -> None:
        self.outliers.inc(count)

    def batch_searched(self, rows: int, waited_seconds: float) -> None:
        self.batch_rows.observe(rows)
        self.queue_wait.observe(waited_seconds)

    def model_request(self, name: str, rows: int) -> None:
        self.model_requests.labels(name).inc()
        self.model_rows.labels(name).inc(rows)

    def repository_model_ready(self, name: str, nbytes: int) -> None:
        self.model_memory.labels(name).set(nbytes)

    def repository_model_removed(self, name: str) -> None:
        if multiprocess_mode():  # the workers' files keep every series: what can be said
            self.model_memory.labels(name).set(0)  # is that this worker holds nothing
            return
        for family in (self.model_requests, self.model_rows, self.model_memory):
            try:
                family.remove(name)
            except KeyError:  # no series of that name yet
                pass

    def model_loaded(self, model) -> None:
        if model.name:  # a repository's model: its series are the labelled ones above
            self.model_loads.inc()
            return
        self.model_info.set(model.version, model.index_type)  # the only series of this worker
        self.model_loaded_at.set(model.loaded_at)
        created = created_timestamp(model.artifact.manifest.get("created_at"))
        if created is not None:
            self.model_created_at.set(created)
        self.model_load_seconds.set(model.load_seconds)
        self.model_loads.inc()


def created_timestamp(created_at) -> float | None:
    """A manifest's created_at (ISO 8601 with a zone) as Unix seconds; None when absent or
    not a time (an artifact written by hand)."""
    import datetime

    try:
        moment = datetime.datetime.fromisoformat(str(created_at))
    except ValueError:
        return None
    if moment.tzinfo is None:
        return None
    return moment.timestamp()
