"""Request tracing with OpenTelemetry: off unless the standard OTEL_* settings ask for it.

On when OTEL_EXPORTER_OTLP_ENDPOINT or OTEL_EXPORTER_OTLP_TRACES_ENDPOINT is set, or
OTEL_TRACES_EXPORTER names an exporter other than "none"; never when OTEL_SDK_DISABLED is
"true". It then needs the ``tracing`` extra (opentelemetry-sdk and the OTLP/HTTP exporter);
asking for tracing without them stops the server at start with a message saying so.

Each request gets one server span, a child of the caller's W3C ``traceparent`` when it sends
one (HTTP header or gRPC metadata), named by method and route. Its children, timed where
the work happened and recorded with explicit start and end times: ``parse`` (from the
request's start to the call of the inference path: decoding and validation), ``queue``
(waiting for the batcher or a worker thread), ``search`` (projection and index search, for
the whole merged batch the request rode in) and ``decide`` (the vote). The trace id comes
back in the ``x-request-id`` response header (gRPC: initial metadata) and in the request's
structured log line.

Off, the only cost is ``Tracing.enabled`` checks and the perf counters the inference path
reads anyway (benchmarks/results/tracing_cost.json measures both). Tested by
tests/service/ops/test_tracing.py with the SDK's in-memory exporter.
"""

from __future__ import annotations

import contextvars
import logging
import os
import threading
import time

REQUEST_ID_HEADER = "x-request-id"
SHUTDOWN_SECONDS = 2.0  # the longest a stop waits for the exporter to send what is buffered
log = logging.getLogger("service.requests")

# the server span of the request being handled (the inference path reads it)
current_span: contextvars.ContextVar = contextvars.ContextVar("ncaknn_request_span", default=None)


class TracingUnavailable(RuntimeError):
    """Tracing was asked for, but the tracing extra is not installed."""


def wanted(environ=os.environ) -> bool:
    """Whether the OTEL_* settings ask for traces."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporter = environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if exporter:
        return exporter != "none"
    return bool(
        environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        or environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    )


class NoTracing:
    """Tracing off: nothing is created, nothing is exported."""

    enabled = False

    def shutdown(self, timeout: float = 0.0) -> None:
        pass


class Tracing:
    """Tracing on, exporting through ``processor`` (default: a batch processor over the
    exporter the OTEL_* settings name)."""

    enabled = True

    def __init__(self, processor=None):
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        name = os.environ.get("OTEL_SERVICE_NAME", "nca-knn")
        # shut down by the app's lifespan, for a bounded time (shutdown), not at exit
        self.provider = TracerProvider(
            resource=Resource.create({"service.name": name}), shutdown_on_exit=False
        )
        self.provider.add_span_processor(processor or _default_processor())
        self.tracer = self.provider.get_tracer("nca-knn")
        self.propagator = TraceContextTextMapPropagator()

    def start_request(self, name: str, carrier: dict[str, str]):
        """A server span, the child of the carrier's traceparent when it has a valid one."""
        from opentelemetry.trace import SpanKind

        context = self.propagator.extract(carrier)
        return self.tracer.start_span(name, context=context, kind=SpanKind.SERVER)

    def child(self, parent, name: str, start_ns: int, end_ns: int, **attributes) -> None:
        """A finished child span of ``parent`` over [start_ns, end_ns] (epoch nanoseconds)."""
        from opentelemetry import trace

        span = self.tracer.start_span(
            name,
            context=trace.set_span_in_context(parent),
            start_time=start_ns,
            attributes=attributes or None,
        )
        span.end(end_time=max(end_ns, start_ns))

    def finish_request(self, span, route: str, status: int, seconds: float) -> None:
        """End the server span and, when it is sampled (OTEL_TRACES_SAMPLER), write the
        request's log line with its trace id."""
        if not span.is_recording():  # not sampled: nothing to name, export or log
            span.end()
            return
        span.update_name(route)
        span.set_attribute("http.route", route)
        span.set_attribute("http.response.status_code", status)
        if status >= 500:
            from opentelemetry.trace import Status, StatusCode

            span.set_status(Status(StatusCode.ERROR))
        span.end()
        context = span.get_span_context()
        log.info(
            "request",
            extra={
                "route": route,
                "status": status,
                "duration_ms": round(seconds * 1000, 3),
                "trace_id": trace_id_of(span),
                "span_id": format(context.span_id, "016x"),
            },
        )

    def shutdown(self, timeout: float = SHUTDOWN_SECONDS) -> None:
        """Export the spans still buffered, for at most ``timeout`` seconds: an exporter
        whose collector does not answer cannot hold the server's exit (the spans it had
        not sent are dropped, and a warning says so)."""
        done = threading.Thread(target=self.provider.shutdown, name="tracing-shutdown", daemon=True)
        done.start()
        done.join(timeout)
        if done.is_alive():
            log.warning(
                "spans not exported within the shutdown bound were dropped",
                extra={"timeout_seconds": timeout},
            )


def trace_id_of(span) -> str:
    return format(span.get_span_context().trace_id, "032x")


def _default_processor():
    """A batch processor over the OTLP/HTTP exporter, or the console one when
    OTEL_TRACES_EXPORTER=console."""
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

    if os.environ.get("OTEL_TRACES_EXPORTER", "").strip().lower() == "console":
        return BatchSpanProcessor(ConsoleSpanExporter())
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return BatchSpanProcessor(OTLPSpanExporter())


def check_available(environ=os.environ) -> bool:
    """Whether tracing is wanted; TracingUnavailable when it is and the extra is missing."""
    if not wanted(environ):
        return False
    try:
        import opentelemetry.exporter.otlp.proto.http
        import opentelemetry.sdk.trace  # noqa: F401
    except ImportError as exc:
        raise TracingUnavailable(
            "the OTEL_* settings ask for traces but the tracing extra is not installed "
            f"({exc.name} is missing): pip install 'nca-knn[tracing]', or unset "
            "OTEL_EXPORTER_OTLP_ENDPOINT and OTEL_TRACES_EXPORTER"
        ) from exc
    return True


def from_environment(environ=os.environ) -> Tracing | NoTracing:
    """Tracing as the OTEL_* settings say (check_available's error when it cannot be)."""
    return Tracing() if check_available(environ) else NoTracing()


def record_inference(tracing, called_ns: int, timings: dict | None) -> None:
    """The current request's parse / queue / search / decide spans, from the inference
    path's ``timings`` ({name: (start_ns, end_ns)}) and the time it was called."""
    span = current_span.get()
    if span is None or not tracing.enabled or not span.is_recording():
        return
    start = getattr(span, "start_time", None) or called_ns
    tracing.child(span, "parse", start, called_ns)
    for name, (begin, end) in (timings or {}).items():
        tracing.child(span, name, begin, end)


def now_ns() -> int:
    return time.time_ns()
