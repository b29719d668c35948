"""Calibrated "far away" (training.evaluation.calibration): quantiles, rates, the job's record, and
recalibration when the reference set changes."""

from __future__ import annotations

import json

import numpy as np
import pytest

from service.core.artifact import read_artifact
from tests.service.conftest import build_model_artifact, digits_like_split
from training.cli import main as cli_main
from training.evaluation.calibration import QUANTILES, calibrate, outlier_report
from training.references.versions import add_references


def gaussian(n, seed, d=4):
    return np.random.default_rng(seed).normal(size=(n, d)).astype(np.float32)


def test_quantiles_are_those_of_the_nearest_reference_distances():
    refs, val = gaussian(500, 0), gaussian(300, 1)
    calibration = calibrate(refs, val)
    brute = ((val[:, None, :].astype(np.float64) - refs[None]) ** 2).sum(-1).min(1)
    for q in QUANTILES:
        assert calibration["quantiles"][str(q)] == pytest.approx(np.quantile(brute, q), rel=1e-5)
    assert calibration["n"] == 300 and calibration["max"] == pytest.approx(brute.max(), rel=1e-5)
    assert calibrate(refs, np.empty((0, 4), np.float32)) is None


def test_in_distribution_points_are_flagged_at_about_the_chosen_rate_and_far_ones_always():
    refs, val, test = gaussian(2000, 0), gaussian(2000, 1), gaussian(8000, 2)
    calibration = calibrate(refs, val)
    y_refs, y_test = np.zeros(len(refs), np.int64), np.zeros(len(test), np.int64)

    def report(queries, quantile=0.99):
        return outlier_report(
            calibration, refs, y_refs, queries, y_test, 2, 5, "majority", quantile
        )

    near = report(test)
    assert 0.003 < near["rate"] < 0.03  # about 1 - 0.99
    assert report(test, quantile=0.9)["rate"] > near["rate"]
    assert report(test, quantile=0.93)["rate"] > near["rate"]  # between grid points
    far = report(test * 50.0 + 100.0)
    assert far["rate"] == 1.0 and far["accuracy_unflagged"] is None


def test_the_job_records_the_calibration_and_the_test_outliers(tmp_path):
    assert (
        cli_main(["--data", "digits", "--out", str(tmp_path / "m"), "--quiet", "--no-plots"]) == 0
    )
    manifest = json.loads((tmp_path / "m" / "manifest.json").read_text())
    calibration = manifest["outlier_calibration"]
    art = read_artifact(tmp_path / "m")
    assert calibration["n"] == len(art.validation_embeddings)
    values = [calibration["quantiles"][str(q)] for q in QUANTILES]
    assert values == sorted(values) and values[0] > 0
    report = manifest["metrics"]["outliers"]
    assert report["quantile"] == 0.99 and report["threshold"] == calibration["quantiles"]["0.99"]
    assert 0 <= report["rate"] < 0.05
    # far from the data the prior rule is less sure than the soft rule
    confidence = report["confidence_flagged"]
    if report["n_flagged"]:
        assert confidence["soft_prior"] <= confidence["soft"]


def test_changing_the_references_recalibrates(tmp_path):
    split = digits_like_split()
    build_model_artifact(tmp_path / "base", split)
    base = read_artifact(tmp_path / "base")
    assert base.validation_embeddings is not None
    # the validation points themselves become references: each is now at distance 0
    rows = split.X_val
    add_references(tmp_path / "base", rows, split.classes[split.y_val], out=tmp_path / "v2")
    calibration = read_artifact(tmp_path / "v2").manifest["outlier_calibration"]
    assert calibration["max"] == pytest.approx(0.0, abs=1e-6)
