"""report.html: one self-contained page per training run (inline CSS, SVG and PNG; no
scripts, nothing fetched), rendered from the artifact's manifest, report.json and plots.

``render_page(report, manifest, images)`` builds it; ``write_report_page(model_dir)`` reads
those files from an artifact directory and writes ``report.html`` there (a temporary file,
then a rename). The training job calls the latter after writing the artifact, and so does
``python -m training report MODEL_DIR``: one path for both. The page is a view, not part of
the model: the manifest does not list it, so rewriting it never changes the model or its
version. Tested by tests/training/evaluation/test_report_page.py.
"""

from __future__ import annotations

import base64
import html
import json
import os
from pathlib import Path

from service.core.artifact import read_artifact
from service.core.artifact.read import read_extras
from training.errors import writing
from training.evaluation.charts import Chart, Marker, Series, confusion_table, line_chart

PAGE_FILE = "report.html"
# fewer validation rows than this: one row moves the curve over k by more than a point
FEW_VALIDATION_ROWS = 100
IMAGES = ("embedding_test.png", "objective.png")
DATA_FIELDS = ("name", "source", "n_train", "n_val", "n_test", "n_features", "fingerprint_sha256")
STYLE = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 2em auto; max-width: 980px; color: #222; }
h1 { font-size: 1.6em; margin-bottom: 0.2em; } h2 { border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; margin: 0.5em 0; } td, th { border: 1px solid #ddd;
padding: 3px 8px; text-align: right; } th { background: #f6f6f6; }
.warning { background: #fff4e5; border-left: 4px solid #e67e00; padding: 0.6em 1em; }
.ok { background: #eef7ee; border-left: 4px solid #2e8b57; padding: 0.6em 1em; }
.kv td:first-child, .kv th:first-child { text-align: left; } svg { max-width: 100%; }
img { max-width: 100%; } code { background: #f3f3f3; padding: 0 3px; }
"""


def kept_iteration(training: dict) -> int | None:
    """The iteration whose map the fit returned (0: the initial map), as the fit recorded it
    (``kept_iteration``); in a report written before it did: with early stopping, the first
    validated iteration at the best validation accuracy, else the last iteration. None when
    nothing was recorded."""
    history = training.get("history") or []
    if not history:
        return None
    if training.get("kept_iteration") is not None:
        return int(training["kept_iteration"])
    best = training.get("best_val_accuracy")
    if training.get("config", {}).get("early_stopping") and best is not None:
        for record in history:
            if record.get("val_accuracy") == best:
                return int(record["iteration"])
    return int(history[-1]["iteration"])


def warnings_of(report: dict) -> list[str]:
    """What a reader must see first, in words."""
    training = report.get("training", {})
    found = []
    kept = kept_iteration(training)
    if kept == 0:  # no iteration of any stage scored above the initial map on held-out rows
        found.append(
            f"The kept map is the initial one: none of the fit's {training.get('n_iter')} "
            "iterations scored better on the held-out rows, so the fit returned an untrained "
            "map. The penalty (l2) or the objective may pull the map away from what kNN needs "
            "on this data; compare the baselines below."
        )
    if training.get("candidate_warning"):
        found.append(f"Candidate audit: {training['candidate_warning']}")
    recorded = [str(w) for w in training.get("warnings", [])]
    # the estimator's own ConvergenceWarning (max_iter, or the budget) says it in more words:
    # one line, not two
    said = any("did not converge" in w or "budget max_seconds" in w for w in recorded)
    if training and not training.get("converged", True) and not said:
        found.append(
            f"The fit did not converge (stop reason: {training.get('stop_reason')}, "
            f"{training.get('n_iter')} iterations)."
        )
    found.extend(w for w in recorded if w not in " ".join(found))
    choice = (report.get("metrics") or {}).get("k_choice") or {}
    if choice.get("cross_fit_failed"):
        found.append(
            f"The served k could not be cross-fitted ({choice['cross_fit_failed']}); it was "
            f"chosen on the {choice.get('rows')} validation rows."
        )
    if choice.get("method") == "validation" and choice.get("rows", 0) < FEW_VALIDATION_ROWS:
        # cross-fitting is advice only where the run could make it (not with prototypes)
        config = (report.get("training") or {}).get("config") or {}
        remedy = "Hold out more rows (--val-size)"
        if config.get("prototypes") is None:
            remedy += ", or cross-fit the choice (--k-folds 5)"
        found.append(
            f"The served k was chosen on {choice.get('rows')} validation rows, where one row "
            "moves the curve over k by more than a point: the k served may not be the best "
            f"for unseen rows. {remedy}."
            if choice.get("rows")
            else f"No validation rows: the served k is the training k, not chosen on any rows. "
            f"{remedy.replace('more', 'some')}."
        )
    distance = (report.get("metrics") or {}).get("nearest_reference_distance") or {}
    if distance.get("near_copies"):
        found.append(
            f"Validation rows sit nearer the references than test rows (median distance to "
            f"the nearest reference {distance['validation_median']:.4g} against "
            f"{distance['test_median']:.4g}, ratio {distance['ratio']:.2f}): the training rows "
            "hold near-copies of validation rows that unseen rows lack, so a k chosen on rows "
            "of the training data (validation or cross-fitted) may be smaller than what "
            "serves unseen rows best. Split the data "
            "by its source (a group, a time, a region) and pass the test rows as X_test."
        )
    return found


def _table(rows: list[tuple[str, object]]) -> str:
    body = "".join(
        f"<tr><th>{html.escape(str(k))}</th><td>{html.escape(_fmt(v))}</td></tr>" for k, v in rows
    )
    return f'<table class="kv">{body}</table>'


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, dict | list):
        return json.dumps(value, sort_keys=True)
    return "—" if value is None else str(value)


def _objective_chart(training: dict) -> str:
    history = training.get("history", [])
    objective = [(r["iteration"], r["objective"]) for r in history]
    series = [Series("mean score (unpenalised)", objective)]
    penalised = None
    if any(r.get("penalty") for r in history):  # its own chart: the penalty can dwarf the score
        points = [(r["iteration"], r["objective"] - r.get("penalty", 0.0)) for r in history]
        penalised = Series("penalised objective (score - l2 ||A||²), what L-BFGS maximises", points)
    markers = []
    kept = kept_iteration(training)
    if kept is not None:
        markers.append(Marker(kept, f"kept: {kept}"))
    finish = [r["iteration"] for r in history if r.get("stage") == "exact finish"]
    if finish:
        markers.append(Marker(finish[0] - 0.5, "exact finish"))
    chart = Chart("objective per iteration", "iteration", "objective", series, markers)
    validation = [(r["iteration"], r["val_accuracy"]) for r in history if "val_accuracy" in r]
    accuracy = ""
    if validation:
        accuracy = line_chart(
            Chart(
                "validation kNN accuracy per iteration",
                "iteration",
                "validation accuracy",
                [Series("validation accuracy", validation, markers=True)],
                markers,
            )
        )
    if penalised is not None:
        accuracy = (
            line_chart(Chart("penalised objective", "iteration", "objective", [penalised], markers))
            + accuracy
        )
    return line_chart(chart) + accuracy


def _accuracy_chart(metrics: dict) -> str:
    def points(by_k: dict) -> list[tuple[float, float]]:
        return sorted((float(k), float(v)) for k, v in (by_k or {}).items())

    series = [Series("NCA (ours), test", points(metrics.get("test_accuracy")), markers=True)]
    if metrics.get("val_accuracy"):
        validation = points(metrics["val_accuracy"])
        series.append(Series("NCA (ours), validation", validation, markers=True))
    choice = metrics.get("k_choice") or {}
    if choice.get("method") == "cross-fitted":  # the curve the served k was chosen on
        curves = choice.get("accuracy") or {}  # {vote: {k: accuracy}}, one vote unless auto
        served = metrics.get("vote") or metrics.get("decision_rule")  # "soft@0.5": the vote
        curve = curves.get(served or next(iter(curves), ""), {})
        label = f"NCA (ours), {choice.get('folds')} folds cross-fitted"
        series.append(Series(label, points(curve), markers=True))
    for name, record in _baselines(metrics):
        if "test_accuracy" in record:
            series.append(Series(name, points(record["test_accuracy"]), dashed=True, markers=True))
    default_k = metrics.get("default_k")
    vote = f", {metrics['vote']}" if metrics.get("vote") else ""  # "soft@0.5": t = 0.5
    markers = [Marker(float(default_k), f"default k = {default_k}{vote}")] if default_k else []
    return line_chart(Chart("accuracy against k", "k", "accuracy", series, markers))


def _baselines(metrics: dict) -> list[tuple[str, dict]]:
    """The baselines that were scored; a data-parallel run records only why they were not
    ({"skipped": reason}), which _baseline_table shows as a row of its own."""
    found = metrics.get("baselines") or {}
    return [(name, record) for name, record in sorted(found.items()) if isinstance(record, dict)]


def _baseline_table(metrics: dict) -> str:
    k = str(metrics.get("default_k"))
    rows = [(f"NCA (ours), test accuracy at k = {k}", (metrics.get("test_accuracy") or {}).get(k))]
    for name, record in _baselines(metrics):
        value = (record.get("test_accuracy") or {}).get(k, record.get("error"))
        rows.append((f"{name}, test accuracy at k = {k}", value))
    found = metrics.get("baselines") or {}
    rows += [
        (f"baselines {name}", value)
        for name, value in sorted(found.items())
        if not isinstance(value, dict)
    ]
    return _table(rows)


def _image(images: dict[str, bytes], name: str, alt: str) -> str:
    if name not in images:
        return f"<p>No {html.escape(name)} in this artifact.</p>"
    data = base64.b64encode(images[name]).decode("ascii")
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{data}">'


def render_page(report: dict, manifest: dict, images: dict[str, bytes]) -> str:
    """The whole page as a string (see the module docstring)."""
    data, training = report.get("data", {}), report.get("training", {})
    metrics = report.get("metrics", {})
    title = f"nca-knn model report: {data.get('name', 'model')}"
    found = warnings_of(report)
    banner = (
        "".join(f'<p class="warning">{html.escape(w)}</p>' for w in found)
        or '<p class="ok">No warnings: the fit converged and kept its last or best validated map.</p>'
    )
    sections = [
        f"<h1>{html.escape(title)}</h1>",
        f"<p>model version <code>{html.escape(str(manifest.get('model_version', 'not yet written')))}</code>"
        f" · written {html.escape(str(manifest.get('created_at', '—')))}</p>",
        banner,
        "<h2>Data and split</h2>",
        _table([(k, data.get(k)) for k in DATA_FIELDS]),
        "<h2>Fit plan and what the fit did</h2>",
        _fit_table(training),
        "<h2>Stages: what each one cost and bought</h2>",
        _stage_table(training),
        "<h2>Objective and validation accuracy</h2>",
        _objective_chart(training),
        "<h2>Validation and test accuracy against k</h2>",
        _accuracy_chart(metrics),
        _baseline_table(metrics),
        *_predictions(report, manifest),
        "<h2>Test embeddings in two dimensions</h2>",
        _embedding_note(manifest, training),
        _image(images, "embedding_test.png", "2-D view of the test embeddings"),
        "<h2>Outlier calibration</h2>",
        _table(_outlier_rows(manifest, metrics)),
        "<h2>Reference set</h2>",
        _table(_reference_rows(manifest)),
    ]
    body = "\n".join(sections)
    return (
        f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
        f"<style>{STYLE}</style></head><body>{body}</body></html>"
    )


def _outlier_rows(manifest: dict, metrics: dict) -> list[tuple[str, object]]:
    calibration = sorted((manifest.get("outlier_calibration") or {}).items())
    on_test = sorted((metrics.get("outliers") or {}).items())
    return [(f"calibration: {k}", v) for k, v in calibration] + [
        (f"test set: {k}", v) for k, v in on_test
    ]


def _fit_table(training: dict) -> str:
    plan = training.get("plan", {})
    rows = [
        ("objective", training.get("objective")),
        ("solver", plan.get("solver", training.get("solver"))),
        ("candidates per kind (none: exact)", plan.get("n_candidates")),
        ("penalty l2 (first stage / exact finish)", f"{plan.get('l2')} / {plan.get('finish_l2')}"),
        ("exact finish iterations", training.get("exact_finish_iter")),
        ("iterations", training.get("n_iter")),
        ("stop reason", training.get("stop_reason")),
        ("kept iteration", kept_iteration(training)),
        ("fit seconds", training.get("fit_seconds")),
        ("budget (max_seconds)", training.get("max_seconds")),
        ("peak memory (MiB)", training.get("peak_memory_mib")),
        ("initialisation", training.get("init")),
        ("standardisation", training.get("standardization")),
        ("device", training.get("device")),
    ]
    return _table(rows)


STAGE_COLUMNS = (
    ("stage", "stage"),
    ("seconds", "seconds"),
    ("iterations", "iterations"),
    ("evaluations", "evaluations"),
    ("refreshes", "refreshes"),
    ("held-out checks", "checks"),
    ("their seconds", "check_seconds"),
    ("start scale", "start_scale"),
    ("held-out score at start", "start_score"),
    ("at end", "end_score"),
    ("kept", "kept"),
    ("stopped by", "stop_reason"),
)


def _stage_table(training: dict) -> str:
    """One row per stage of the fit (``NCA.stages_``): its seconds and work, the scale its
    start was multiplied by, the held-out score it started and ended with, which map was
    kept and why it stopped."""
    stages = training.get("stages") or []
    if not stages:
        return "<p>No stages recorded in this report.</p>"
    head = "".join(f"<th>{html.escape(title)}</th>" for title, _ in STAGE_COLUMNS)
    rows = "".join(
        "<tr>"
        + "".join(f"<td>{html.escape(_fmt(stage.get(key)))}</td>" for _, key in STAGE_COLUMNS)
        + "</tr>"
        for stage in stages
    )
    measure = training.get("stage_measure") or "not judged: no held-out rows"
    budget = training.get("max_seconds")
    spent = (
        f" The budget of {budget:g} s ran out: the fit returned the best judged map it had."
        if training.get("budget_exhausted")
        else ""
    )
    note = f"<p>Held-out score: {html.escape(str(measure))}.{html.escape(spent)}</p>"
    return f'<table class="stages"><tr>{head}</tr>{rows}</table>{note}'


def _predictions(report: dict, manifest: dict) -> list[str]:
    predictions = report.get("test_predictions")
    classes = manifest.get("classes")
    if not predictions or not classes:
        return []
    # the vote served: the rule, or "soft@t" for the soft vote at a temperature t
    vote = (report.get("metrics") or {}).get("vote") or predictions.get("rule")
    return [
        f"<h2>Confusion matrix (test, k = {predictions.get('k')}, {html.escape(str(vote))})</h2>",
        confusion_table(predictions["true_class_index"], predictions["class_index"], classes),
    ]


def _embedding_note(manifest: dict, training: dict) -> str:
    d = (training.get("config") or {}).get("n_components")
    if d == 2:
        return "<p>The embedding itself (d = 2).</p>"
    return (
        f"<p>The learned embedding has d = {html.escape(str(d))}: shown are its first two "
        "principal axes (a PCA of the test embeddings), not the embedding itself.</p>"
    )


def _reference_rows(manifest: dict) -> list[tuple[str, object]]:
    record = manifest.get("reference_set") or {"kind": "training_rows"}
    rows = [(f"reference set: {k}", v) for k, v in sorted(record.items())]
    rows.append(("references served", manifest.get("n_references")))
    rows.append(("lineage", manifest.get("lineage")))
    return rows


def write_report_page(model_dir: str | os.PathLike) -> Path:
    """Render report.html from the artifact in ``model_dir`` and write it there atomically
    (a temporary file renamed into place); a write the file system refuses raises
    ``WriteError`` naming the page and the cause, and leaves no temporary file behind."""
    root = Path(model_dir)
    artifact = read_artifact(root)
    extras = read_extras(artifact)
    if "report.json" not in extras:
        raise ValueError(f"{root} has no report.json among its extra files: nothing to render")
    report = json.loads(extras["report.json"])
    manifest = artifact.manifest
    page = render_page(report, manifest, {k: v for k, v in extras.items() if k in IMAGES})
    target = root / PAGE_FILE
    partial = root / f".{PAGE_FILE}.{os.getpid()}.partial"
    with writing("the report page", target):  # a full disk: WriteError, and no partial file
        try:
            partial.write_text(page, encoding="utf-8")
            os.replace(partial, target)
        except BaseException:
            partial.unlink(missing_ok=True)
            raise
    return target
