"""report.html (training/evaluation/report_page.py): written by the job beside report.json,
rewritten by ``python -m training report MODEL_DIR``, self-contained, with the figures a
reader needs and the warnings at the top."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from service.core.artifact import read_artifact
from training import NCA
from training.cli import main
from training.evaluation.report_page import kept_iteration, render_page, warnings_of


@pytest.fixture(scope="module")
def digits_model(tmp_path_factory):
    out = tmp_path_factory.mktemp("report") / "digits"
    code = main(
        [
            "--data",
            "digits",
            "--n-components",
            "8",
            "--out",
            str(out),
            "--max-iter",
            "30",
            "--quiet",
        ]
    )
    assert code == 0
    return out


def test_the_job_writes_a_self_contained_page_with_the_key_figures(digits_model):
    page = (digits_model / "report.html").read_text()
    manifest = read_artifact(digits_model).manifest
    report = json.loads((digits_model / "report.json").read_text())
    k = manifest["default_k"]
    assert manifest["model_version"] in page
    assert f"{manifest['metrics']['test_accuracy'][str(k)]:.4g}" in page
    for name in ("euclidean", "whitening", "pca", "lda", "rca", "NCA (ours)"):
        assert name in page
    assert f"<td>{report['data']['n_train']}</td>" in page
    assert 'class="confusion"' in page and page.count("<tr>") > 10
    assert page.count("data:image/png;base64,") == 1  # the embedding plot, inline
    assert "first two principal axes" in page  # d = 8: the 2-D view says what it is
    # the curve the served k was chosen on, beside the test curve
    assert "NCA (ours), validation" in page and "NCA (ours), test" in page
    assert "Validation and test accuracy against k" in page
    assert "mean score (unpenalised)" in page and "score - l2 ||A||²" in page
    # nothing fetched: no scripts, no stylesheets, no external sources or links
    assert "<script" not in page and "<link" not in page
    assert not re.findall(r'(?:src|href)="(?!data:)', page)
    assert set(re.findall(r"https?://[^\s\"'<>]+", page)) <= {"http://www.w3.org/2000/svg"}


def test_the_report_command_rewrites_the_same_page(digits_model, capsys):
    written = (digits_model / "report.html").read_text()
    (digits_model / "report.html").unlink()
    assert main(["report", str(digits_model)]) == 0
    assert capsys.readouterr().out.strip().endswith("report.html")
    assert (digits_model / "report.html").read_text() == written
    assert not list(digits_model.glob("*.partial"))
    assert "report.html" not in read_artifact(digits_model).manifest["extras"]  # a view


def test_the_report_command_refuses_what_is_not_an_artifact(tmp_path, capsys):
    assert main(["report", str(tmp_path / "missing")]) == 2
    assert "error:" in capsys.readouterr().err
    assert not (tmp_path / "missing").exists()


def test_the_history_records_the_penalty_beside_the_unpenalised_score():
    rng = np.random.default_rng(0)
    X = rng.normal(size=(120, 5))
    y = (X[:, 0] > 0).astype(int)
    model = NCA(n_components=2, random_state=0, max_iter=8, l2=0.05, n_candidates=None).fit(X, y)
    last = model.history_[-1]
    A = model.components_
    assert last["penalty"] == pytest.approx(0.05 * float((A * A).sum()), rel=1e-9)
    assert model.objective_value_ == pytest.approx(last["objective"], rel=1e-6)


def history(*values, early_stopping=True, best=None):
    records = [
        {"iteration": i + 1, "objective": 0.5, "val_accuracy": v} for i, v in enumerate(values)
    ]
    return {
        "history": records,
        "best_val_accuracy": best if best is not None else max(values),
        "config": {"early_stopping": early_stopping},
        "converged": True,
    }


def test_kept_iteration_is_the_first_best_with_early_stopping_else_the_last():
    assert kept_iteration(history(0.9, 0.95, 0.95, 0.93)) == 2
    assert kept_iteration(history(0.9, 0.95, 0.93, early_stopping=False)) == 3
    assert kept_iteration({"history": []}) is None
    # a report that records it: as recorded (0: the initial map)
    assert kept_iteration({**history(0.9, 0.95), "kept_iteration": 0}) == 0
    assert kept_iteration({**history(0.9, 0.95, 0.94), "kept_iteration": 3}) == 3


def test_warnings_name_an_untrained_map_an_audit_and_non_convergence():
    untrained = {**history(0.99, 0.98, 0.97), "kept_iteration": 0, "n_iter": 3}
    first = warnings_of({"training": untrained})
    assert len(first) == 1 and "kept map is the initial one" in first[0]
    assert "none of the fit's 3 iterations" in first[0]
    # one iteration's map, at the ceiling of a small validation set, is a trained map
    assert warnings_of({"training": {**history(0.99, 0.98, 0.97), "kept_iteration": 1}}) == []
    assert warnings_of({"training": history(0.9, 0.95)}) == []
    training = {**history(0.9, 0.95), "converged": False, "stop_reason": "max_iter", "n_iter": 2}
    training["candidate_warning"] = "the candidate-set objective rose"
    found = warnings_of({"training": training})
    assert any("did not converge" in w for w in found)
    assert any("candidate-set objective rose" in w for w in found)


def test_non_convergence_is_said_once_when_the_estimator_said_it():
    """The job records the estimator's ConvergenceWarning in ``training.warnings``; the page
    and the console then show that line alone, not a second, shorter one beside it."""
    said = "[NCA] NCA did not converge in max_iter=2 iterations (stop reason: max_iter); ..."
    training = {**history(0.9, 0.95), "converged": False, "stop_reason": "max_iter", "n_iter": 2}
    found = warnings_of({"training": {**training, "warnings": [said]}})
    assert found == [said]
    budget = "[NCA] the fit's budget max_seconds=5 ran out: the best judged map so far ..."
    training["stop_reason"] = "max_seconds"
    assert warnings_of({"training": {**training, "warnings": [budget]}}) == [budget]
    # a report without the estimator's line (an older one) still says it
    found = warnings_of({"training": training})
    assert len(found) == 1 and "The fit did not converge (stop reason: max_seconds" in found[0]


def test_warnings_stand_before_every_section():
    training = {**history(0.99, 0.98), "kept_iteration": 0}
    report = {"training": training, "data": {"name": "toy"}, "metrics": {}}
    page = render_page(report, {"classes": [0, 1]}, {})
    assert page.index('class="warning"') < page.index("<h2>")
    assert "No warnings" in render_page({"training": history(0.9, 0.95)}, {}, {})


def test_the_job_prints_the_pages_warnings_and_where_the_page_is(tmp_path, capsys, monkeypatch):
    import training.job

    monkeypatch.setattr(
        training.job, "warnings_of", lambda report: ["the kept map is iteration 1's"]
    )
    out = tmp_path / "m"
    assert (
        main(["--data", "iris", "--n-components", "2", "--out", str(out), "--max-iter", "5"]) == 0
    )
    err = capsys.readouterr().err
    assert "warning: the kept map is iteration 1's" in err
    assert f"report: {out / 'report.html'}" in err


def test_a_data_parallel_runs_skipped_baselines_render_as_a_row():
    """torchrun records {"skipped": why} instead of baselines (no rank holds every raw row)."""
    metrics = {
        "default_k": 1,
        "test_accuracy": {"1": 0.9},
        "baselines": {"skipped": "no rank holds the rows"},
    }
    page = render_page({"training": history(0.9, 0.95), "metrics": metrics}, {}, {})
    assert "baselines skipped" in page and "no rank holds the rows" in page


def test_a_page_that_cannot_be_written_is_a_warning_not_a_failed_run(tmp_path, capsys, monkeypatch):
    import training.job

    def broken(model_dir):
        raise ValueError("a report the page does not understand")

    monkeypatch.setattr(training.job, "write_report_page", broken)
    out = tmp_path / "m"
    assert (
        main(["--data", "iris", "--n-components", "2", "--out", str(out), "--max-iter", "5"]) == 0
    )
    assert read_artifact(out).n_components == 2
    assert (
        "warning: report.html not written (ValueError: a report the page" in capsys.readouterr().err
    )


def test_the_report_measures_how_far_validation_and_test_rows_sit_from_the_references(
    digits_model,
):
    """On the digits' random split, validation and test rows are alike: ratio near 1, no
    warning."""
    distance = json.loads((digits_model / "report.json").read_text())["metrics"][
        "nearest_reference_distance"
    ]
    assert 0.8 < distance["ratio"] < 1.25 and distance["near_copies"] is False
    assert distance["validation_median"] > 0 and distance["test_median"] > 0


@pytest.mark.parametrize("n_refs", [500, 20_000])  # torch's first pass, and FAISS's
def test_nearest_reference_distances_are_the_brute_force_medians(n_refs):
    from scipy.spatial.distance import cdist

    from training.evaluation.evaluate import FLAT_SEARCH_MIN_REFS
    from training.job import nearest_reference_distances

    assert 500 < FLAT_SEARCH_MIN_REFS <= 20_000  # the two sizes take the two first passes

    rng = np.random.default_rng(1)
    z_ref = rng.normal(size=(n_refs, 6)).astype(np.float32)
    z_val = rng.normal(size=(301, 6)).astype(np.float32)
    z_test = (1.5 * rng.normal(size=(200, 6))).astype(np.float32)

    def brute_force_median(z):
        d2 = cdist(z.astype(np.float64), z_ref.astype(np.float64), "sqeuclidean")  # (n, M)
        return float(np.median(np.sqrt(d2.min(1))))

    found = nearest_reference_distances(z_ref, z_val, z_test)
    assert found["validation_median"] == pytest.approx(brute_force_median(z_val), rel=1e-12)
    assert found["test_median"] == pytest.approx(brute_force_median(z_test), rel=1e-12)
    assert found["ratio"] == pytest.approx(found["validation_median"] / found["test_median"])


def test_validation_rows_with_near_copies_among_the_references_are_flagged():
    """Validation rows that are references moved by 1e-3 sit ~1000x nearer the references
    than fresh test rows: the ratio says so and the page warns that the served k may be too
    small; rows drawn alike are not flagged."""
    from training.job import nearest_reference_distances

    rng = np.random.default_rng(0)
    z_ref = rng.normal(size=(500, 4))
    copies = z_ref[:100] + rng.normal(scale=1e-3, size=(100, 4))
    fresh = rng.normal(size=(100, 4))
    flagged = nearest_reference_distances(z_ref, copies, fresh)
    assert flagged["ratio"] < 0.01 and flagged["near_copies"] is True
    alike = nearest_reference_distances(z_ref, rng.normal(size=(100, 4)), fresh)
    assert 0.8 < alike["ratio"] < 1.25 and alike["near_copies"] is False
    assert nearest_reference_distances(z_ref, z_ref[:0], fresh) is None
    on_references = nearest_reference_distances(z_ref, fresh, z_ref[:50])  # test rows are refs
    assert on_references["ratio"] is None and on_references["near_copies"] is False
    found = warnings_of({"metrics": {"nearest_reference_distance": flagged}})
    assert len(found) == 1 and "near-copies of validation rows" in found[0]
    assert warnings_of({"metrics": {"nearest_reference_distance": alike}}) == []


def test_the_page_names_the_vote_served_with_its_temperature():
    """A soft vote at t = 0.5 is served as the service's soft rule on a scaled map: the
    page names the vote ("soft@0.5"), not the rule alone, at the default k's marker and the
    confusion matrix; without a vote in the metrics (a rule given), the rule."""
    metrics = {"default_k": 3, "test_accuracy": {"3": 0.9}, "vote": "soft@0.5"}
    predictions = {"k": 3, "rule": "soft", "class_index": [0, 1], "true_class_index": [0, 1]}
    report = {"training": history(0.9), "metrics": metrics, "test_predictions": predictions}
    page = render_page(report, {"classes": [0, 1]}, {})
    assert "default k = 3, soft@0.5" in page
    assert "Confusion matrix (test, k = 3, soft@0.5)" in page
    del metrics["vote"]
    page = render_page(report, {"classes": [0, 1]}, {})
    assert "Confusion matrix (test, k = 3, soft)" in page and "soft@" not in page
