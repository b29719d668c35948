"""benchmarks/real_digits.py's fit path: the test errors of the maps a fit stepped through,
each scored as the fitted map is (``model.transform``: z = ((x - mean_) / scale_) @ A.T)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
from real_digits import fit_path, knn_errors  # noqa: E402

from training import NCA  # noqa: E402


def two_classes(rng, n):
    """(X (n, 2), y (n,)): the classes 10 apart on feature 0 (spread 0.1), feature 1 noise
    of spread 50: told apart on feature 0 after standardisation, not on the raw rows."""
    y = np.repeat([0, 1], n // 2)
    X = np.column_stack([y * 10.0 + 100.0 + rng.normal(0, 0.1, n), rng.normal(0, 50, n)])
    return X, y


def test_each_map_is_scored_on_raw_rows_through_the_standardisation():
    rng = np.random.default_rng(0)
    X, y = two_classes(rng, 100)
    Xt, yt = two_classes(rng, 40)
    model = NCA(n_components=2)  # as fitted, with a standardisation of its own
    model.n_features_in_ = 2
    model._set_map(np.zeros((2, 2)), np.array([105.0, 0.0]), np.array([5.0, 50.0]))
    # the identity on standardised rows weighs both features alike: feature 0 (spread 0.1 /
    # 5) decides; on raw rows feature 1 (spread 50) would drown it. Then feature 0 alone,
    # then feature 1 alone (a map with rows the other way round)
    maps = [
        (1, np.eye(2).ravel()),
        (2, np.array([1.0, 0.0, 0.0, 0.0])),
        (3, np.array([0.0, 1.0, 0.0, 0.0])),
    ]
    rows = fit_path(model, maps, X, y, Xt, yt)
    assert [r["iteration"] for r in rows] == [1, 2, 3]
    assert rows[0]["err_1nn"] == rows[0]["err_5nn"] == 0.0
    assert rows[1]["err_1nn"] == rows[1]["err_5nn"] == 0.0
    raw = knn_errors(
        X, y, Xt, yt
    )  # the identity on raw rows: what a map scored unstandardised gives
    assert raw[1] > 0.05
    z1 = ((X - model.mean_) / model.scale_)[:, 1:]  # the third map by hand
    zt1 = ((Xt - model.mean_) / model.scale_)[:, 1:]
    by_hand = knn_errors(z1, y, zt1, yt)
    assert rows[2]["err_1nn"] == by_hand[1] and rows[2]["err_5nn"] == by_hand[5]
    assert rows[2]["err_1nn"] > 0.2
    assert rows[0]["norm"] == np.sqrt(2) and rows[1]["norm"] == rows[2]["norm"] == 1.0


def classes_in_six_features(rng, n):
    X = rng.normal(size=(n, 6)) * np.array([1, 5, 0.2, 3, 1, 9])
    y = (X[:, 0] + 0.3 * X[:, 2] > 0).astype(int) + 2 * (X[:, 4] > 0.5)
    return X, y


@pytest.mark.filterwarnings("ignore::sklearn.exceptions.ConvergenceWarning")  # max_iter=8
@pytest.mark.parametrize("judged", [False, True])
def test_the_row_of_the_kept_map_scores_as_the_fitted_model(judged):
    # judged=False: no held-out rows, the last map is returned; True: a validation split
    # judges the maps and the keep rule returns the one it scored best (standardize "auto")
    rng = np.random.default_rng(1)
    X, y = classes_in_six_features(rng, 240)
    Xt, yt = classes_in_six_features(rng, 80)
    options = {} if judged else {"select_stages": False, "standardize": "feature"}
    validation = {}
    if judged:
        X_val, y_val = classes_in_six_features(rng, 200)
        validation = {"X_val": X_val, "y_val": y_val}
    maps = []
    model = NCA(
        n_components=2,
        random_state=0,
        max_iter=8,
        callback=lambda flat, it: maps.append((int(it), np.array(flat, np.float64))),
        options=options,
    ).fit(X, y, **validation)
    rows = fit_path(model, maps, X, y, Xt, yt)
    assert len(rows) == len(maps) == model.n_iter_ and len(rows) >= 2
    assert [r["iteration"] for r in rows] == list(range(1, len(rows) + 1))
    if judged:  # the keep rule returned a map before the last: the test sees the rule act
        assert 0 < model.kept_iteration_ < len(rows)
    else:
        assert model.kept_iteration_ == len(rows)
    kept = [r for r in rows if r["iteration"] == model.kept_iteration_]
    assert len(kept) == 1
    A = dict(maps)[model.kept_iteration_].reshape(2, 6)
    np.testing.assert_allclose(A, model.components_, rtol=1e-6)
    fitted = knn_errors(model.transform(X), y, model.transform(Xt), yt)
    assert kept[0]["err_1nn"] == fitted[1] and kept[0]["err_5nn"] == fitted[5]
