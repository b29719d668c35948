"""benchmarks/real_digits.py's fit path: the test errors of the maps a fit stepped through,
each scored as the fitted map is (``model.transform``: z = ((x - mean_) / scale_) @ A.T)."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
from real_digits import fit_path, knn_errors  # noqa: E402

from training import NCA  # noqa: E402


def test_each_map_is_scored_on_raw_rows_through_the_standardisation():
    # two classes told apart by feature 0 alone; feature 1 is large noise. A map that
    # reads feature 0 after standardisation classifies every test row; one that reads
    # feature 1 errs on about half of them, so a map scored on the wrong rows (raw rows
    # without the standardisation, or the wrong column) gives other errors
    rng = np.random.default_rng(0)
    y = np.repeat([0, 1], 50)
    X = np.column_stack([y * 10.0 + 100.0 + rng.normal(0, 0.1, 100), rng.normal(0, 50, 100)])
    yt = np.repeat([0, 1], 20)
    Xt = np.column_stack([yt * 10.0 + 100.0 + rng.normal(0, 0.1, 40), rng.normal(0, 50, 40)])
    model = SimpleNamespace(
        mean_=np.array([105.0, 0.0]),
        scale_=np.array([5.0, 50.0]),
        components_=np.zeros((1, 2)),
    )
    maps = [(1, np.array([1.0, 0.0])), (2, np.array([0.0, 1.0]))]  # feature 0, then feature 1
    rows = fit_path(model, maps, X, y, Xt, yt)
    assert [r["iteration"] for r in rows] == [1, 2]
    assert rows[0]["err_1nn"] == rows[0]["err_5nn"] == 0.0
    z1 = ((X - model.mean_) / model.scale_)[:, 1:]  # the second map by hand
    zt1 = ((Xt - model.mean_) / model.scale_)[:, 1:]
    by_hand = knn_errors(z1, y, zt1, yt)
    assert rows[1]["err_1nn"] == by_hand[1] and rows[1]["err_5nn"] == by_hand[5]
    assert rows[1]["err_1nn"] > 0.2
    assert rows[0]["norm"] == rows[1]["norm"] == 1.0


@pytest.mark.filterwarnings("ignore::sklearn.exceptions.ConvergenceWarning")  # max_iter=8
def test_the_last_map_of_a_fit_scores_as_the_fitted_model():
    # an exact fit (few rows) that keeps its last map: the path's last row is the
    # fitted model's own errors through transform
    rng = np.random.default_rng(1)
    X = rng.normal(size=(240, 6)) * np.array([1, 5, 0.2, 3, 1, 9])
    y = (X[:, 0] + 0.3 * X[:, 2] > 0).astype(int) + 2 * (X[:, 4] > 0.5)
    Xt = rng.normal(size=(80, 6)) * np.array([1, 5, 0.2, 3, 1, 9])
    yt = (Xt[:, 0] + 0.3 * Xt[:, 2] > 0).astype(int) + 2 * (Xt[:, 4] > 0.5)
    maps = []
    model = NCA(
        n_components=2,
        random_state=0,
        max_iter=8,
        callback=lambda flat, it: maps.append((int(it), np.array(flat, np.float64))),
        options={"select_stages": False, "standardize": "feature"},
    ).fit(X, y)
    rows = fit_path(model, maps, X, y, Xt, yt)
    assert len(rows) == len(maps) == model.n_iter_ and len(rows) >= 2
    np.testing.assert_allclose(maps[-1][1].reshape(2, 6), model.components_, rtol=1e-6)
    fitted = knn_errors(model.transform(X), y, model.transform(Xt), yt)
    assert rows[-1]["err_1nn"] == fitted[1] and rows[-1]["err_5nn"] == fitted[5]
    assert rows[-1]["norm"] == np.linalg.norm(model.components_.astype(np.float64))
