"""The model card at GET /: one HTML page about the served model, for people.

What it shows: the model version, lineage, classes, reference set, index and its tuned
search setting; the training report's key figures (test accuracy at the default k against
every baseline, the fit plan) and its plots, inline; this worker's live figures from its
Prometheus registry (requests, errors, latency percentiles); links to /docs and /v1/model.
Self-contained: inline CSS and PNG, no scripts, nothing fetched.

The model's part is rendered once per model version and cached (the plots are read from
the artifact, each checked against its sha256); the live part is read from the registry on
each request. The route (service/app.py) serves it with the same access rule as /docs, and
renders it in a worker thread, never on the event loop. Tested by
tests/service/http/test_model_card.py.
"""

from __future__ import annotations

import base64
import html
import json
import threading

from prometheus_client import CollectorRegistry

CARD_IMAGES = ("objective.png", "embedding_test.png")
STYLE = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 2em auto; max-width: 960px; color: #222; }
table { border-collapse: collapse; margin: 0.4em 0 1em; } td, th { border: 1px solid #ddd;
padding: 3px 8px; text-align: left; } th { background: #f6f6f6; width: 16em; }
h2 { border-bottom: 1px solid #ddd; } img { max-width: 48%; } code { background: #f3f3f3; }
"""


def _rows(rows: list[tuple[str, object]]) -> str:
    body = "".join(
        f"<tr><th>{html.escape(k)}</th><td>{html.escape(_text(v))}</td></tr>" for k, v in rows
    )
    return f"<table>{body}</table>"


def _text(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, dict | list):
        return json.dumps(value, sort_keys=True, default=str)
    return "—" if value is None else str(value)


def model_section(model, images: dict[str, bytes]) -> str:
    """The part of the card that depends only on the loaded model."""
    manifest = model.artifact.manifest
    metrics = manifest.get("metrics", {})
    training = manifest.get("training", {})
    k = str(model.default_k)
    accuracy = [("NCA (ours)", (metrics.get("test_accuracy") or {}).get(k))]
    for name, record in sorted((metrics.get("baselines") or {}).items()):
        if isinstance(record, dict):  # a data-parallel run records {"skipped": reason}
            accuracy.append((name, (record.get("test_accuracy") or {}).get(k, record.get("error"))))
        else:
            accuracy.append((f"baselines {name}", record))
    plan = training.get("plan") or {}
    pictures = "".join(
        f'<img alt="{name}" src="data:image/png;base64,{base64.b64encode(images[name]).decode()}">'
        for name in CARD_IMAGES
        if name in images
    )
    return "".join(
        [
            "<h2>Model</h2>",
            _rows(
                [
                    ("version", model.version),
                    ("classes", model.class_names),
                    ("input features", model.n_features),
                    ("embedding dimensions", model.n_components),
                    ("references", model.n_references),
                    ("reference set", manifest.get("reference_set") or {"kind": "training_rows"}),
                    ("index and search setting", model.index_params),
                    ("default k, decision rule", f"{model.default_k}, {model.decision_rule}"),
                    ("lineage", manifest.get("lineage", [])),
                    ("written", manifest.get("created_at")),
                ]
            ),
            f"<h2>Test accuracy at k = {html.escape(k)} (training report)</h2>",
            _rows(accuracy),
            "<h2>How it was trained</h2>",
            _rows(
                [
                    ("data", (manifest.get("data") or {}).get("name")),
                    ("objective, solver", f"{training.get('objective')}, {plan.get('solver')}"),
                    ("iterations", training.get("n_iter")),
                    ("stop reason", training.get("stop_reason")),
                    ("fit seconds", training.get("fit_seconds")),
                ]
            ),
            pictures,
        ]
    )


def samples_by_name(registry: CollectorRegistry) -> dict[str, list]:
    """Every sample of the registry, collected once, by sample name."""
    found: dict[str, list] = {}
    for metric in registry.collect():
        for sample in metric.samples:
            found.setdefault(sample.name, []).append(sample)
    return found


def latency_percentiles(
    registry: CollectorRegistry, quantiles=(0.5, 0.9, 0.99), samples=None
) -> dict:
    """Request latency quantiles (seconds) over every route, from the histogram's buckets:
    the upper bound of the bucket where the cumulative count crosses q (as Prometheus's
    histogram_quantile does, without its interpolation). {} before the first request.
    ``samples``: samples_by_name(registry), when the caller has collected them already."""
    samples = samples_by_name(registry) if samples is None else samples
    buckets: dict[float, float] = {}
    for sample in samples.get("ncaknn_request_latency_seconds_bucket", []):
        bound = float(sample.labels["le"])
        buckets[bound] = buckets.get(bound, 0.0) + sample.value
    total = buckets.get(float("inf"), 0.0)
    if not total:
        return {}
    bounds = sorted(buckets)
    return {q: next(b for b in bounds if buckets[b] >= q * total) for q in quantiles}


def live_section(registry: CollectorRegistry) -> str:
    """This worker's request figures, read from its registry now (collected once)."""
    samples = samples_by_name(registry)
    requests = samples.get("ncaknn_requests_total", [])
    total = sum(s.value for s in requests)
    failed = sum(s.value for s in requests if s.labels["status"].startswith("5"))
    refused = sum(s.value for s in requests if s.labels["status"] == "429")
    errors = {s.labels["error_type"]: s.value for s in samples.get("ncaknn_errors_total", [])}
    rows = [
        ("requests", int(total)),
        ("server errors (5xx)", int(failed)),
        ("overload refusals (429)", int(refused)),
        ("errors by type", {k: int(v) for k, v in sorted(errors.items()) if v}),
    ]
    rows += [
        (f"latency p{round(q * 100)}", "—" if v == float("inf") else f"{v * 1000:g} ms")
        for q, v in latency_percentiles(registry, samples=samples).items()
    ]
    return "<h2>Live (this worker, since it started)</h2>" + _rows(rows)


class ModelCard:
    """Renders the card; the model's part is cached per model version."""

    def __init__(self, read_images=None):
        self.read_images = read_images  # model -> {name: PNG bytes}; None: artifact_images
        self._lock = threading.Lock()
        self._cached: tuple[str, str] | None = None  # (version, model section)

    def render(self, model, registry: CollectorRegistry, reload_error: str | None) -> str:
        with self._lock:
            if self._cached is None or self._cached[0] != model.version:
                read = self.read_images or artifact_images
                self._cached = (model.version, model_section(model, read(model)))
            section = self._cached[1]
        warning = ""
        if reload_error:
            warning = f"<p><strong>The last reload failed:</strong> {html.escape(reload_error)}</p>"
        return (
            '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
            f"<title>nca-knn model card</title><style>{STYLE}</style></head><body>"
            "<h1>nca-knn model card</h1>"
            '<p><a href="/docs">API documentation</a> · <a href="/v1/model">GET /v1/model</a> · '
            '<a href="/metrics">metrics</a></p>'
            f"{warning}{section}{live_section(registry)}</body></html>"
        )


def render_repository(entries: list[dict[str, str]], registry: CollectorRegistry) -> str:
    """The card of a model repository: every model, its version, state and reason, each
    ready one linking to its own description (GET /v1/models/{name})."""
    rows = []
    for entry in entries:
        name = html.escape(entry["name"])
        link = f'<a href="/v1/models/{name}">{name}</a>' if entry["state"] == "READY" else name
        cells = [link, html.escape(entry["version"]), entry["state"], html.escape(entry["reason"])]
        rows.append("<tr>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    table = (
        "<table><tr><th>model</th><th>version</th><th>state</th><th>reason</th></tr>"
        + "".join(rows)
        + "</table>"
    )
    return (
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
        f"<title>nca-knn models</title><style>{STYLE}</style></head><body>"
        f"<h1>nca-knn: {len(entries)} models</h1>"
        '<p><a href="/docs">API documentation</a> · <a href="/v1/models">GET /v1/models</a> · '
        '<a href="/metrics">metrics</a></p>'
        f"{table}{live_section(registry)}</body></html>"
    )


def artifact_images(model) -> dict[str, bytes]:
    """The card's plots from the model's artifact, checked against their sha256; none when
    the artifact has no extras or they cannot be read."""
    from service.core.artifact import ArtifactError
    from service.core.artifact.read import read_extras

    listed = model.artifact.manifest.get("extras", {})
    if not any(name in listed for name in CARD_IMAGES):
        return {}
    try:
        extras = read_extras(model.artifact)
    except (ArtifactError, OSError):
        return {}
    return {name: extras[name] for name in CARD_IMAGES if name in extras}
