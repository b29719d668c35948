"""A stage that does not pay is undone (training.model.fitting's keep rule): a finish scored
below its start, the held-out rows it is judged on, small fits that are not judged, and a property
over seeded random problems: the default fit never ends below the better of its initial map
and its first stage's map on held-out rows."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from training import NCA
from training.data.synthetic import clustered_classes
from training.distributed import sharded_stats
from training.distributed.ranks import current_group
from training.evaluation.evaluate import knn_accuracies
from training.model import preparation
from training.model.initialization import initial_components
from training.model.options import with_options


def problem(n: int, seed: int, n_features: int = 24):
    law = dict(n_features=n_features, n_classes=5, subspace_dim=6, overlap=0.8, noise=0.6)
    X, y = clustered_classes(n, seed=seed, **law)
    X_test, y_test = clustered_classes(600, seed=seed, sample_seed=99, **law)
    return X.astype(np.float64), y, X_test.astype(np.float64), y_test


def initial_map(name: str, Xs: np.ndarray, y_idx: np.ndarray, d: int) -> np.ndarray:
    """The initial map (d, D), unscaled, a fit on standardised Xs starts from with ``init``
    ``name`` (its ``init_used_``): PCA and LDA as the fit computes them (``sharded_stats``),
    the other rules from ``initial_components``."""
    group = current_group()
    if name == "pca":
        return sharded_stats.pca_components(Xs, len(Xs), d, group)
    if name == "lda":
        return sharded_stats.lda_components(Xs, y_idx, len(Xs), int(y_idx.max()) + 1, d, group)
    rng = np.random.default_rng(0)
    return initial_components(name, Xs, d, random_state=rng, scale=None)[0]


def fit(X, y, **params):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return NCA(**with_options(dict(**{"n_components": 4, "random_state": 0, **params}))).fit(
            X, y
        )


@pytest.fixture
def holdout_from_small_sizes(monkeypatch):
    """Hold rows out to judge stages from 100 points (8,192 by default), so that small
    problems exercise the path of large ones."""
    monkeypatch.setattr(preparation, "HOLDOUT_MIN_SAMPLES", 100)


def separable_problem():
    """Five well-separated classes (one tight cluster each): any reasonable map classifies
    the held-out rows almost perfectly."""
    law = dict(n_features=12, n_classes=5, clusters_per_class=1, subspace_dim=4)
    X, y = clustered_classes(300, seed=1, overlap=0.1, noise=0.1, **law)
    return X.astype(np.float64), y


def finish_scored_at(score: float):
    """A held_out_score: 0.95 for every map but those the finish's iterations reach."""

    def held_out_score(A, stage, iteration):
        return score if stage == "exact finish" and iteration > 0 else 0.95

    return held_out_score


def test_a_finish_scored_below_its_start_is_undone_and_the_first_stage_kept():
    """A finish whose every iterate scores below its start is undone: the record says so,
    and the fit returns the map the finish started from, the first stage's, bit for bit.
    Without the judge (``select_stages=False``) the fit returns the finish's last map."""
    X, y = problem(400, seed=0)[:2]
    params = dict(n_candidates=6, exact_finish=5, max_iter=10, held_out_score=finish_scored_at(0.2))
    forced = fit(X, y, **params)
    record = forced.stages_[-1]
    assert record["stage"] == "exact finish" and record["kept"] == "start"
    assert record["start_score"] == 0.95 and record["end_score"] == 0.2
    assert forced.stage_measure_ == "held_out_score (FitOptions)"
    first = fit(X, y, **{**params, "exact_finish": 0})
    assert first.stages_[0]["iterations"] > 0  # the first stage moved the map
    np.testing.assert_array_equal(forced.components_, first.components_)
    maps = {}  # iteration -> the map it reached
    unguarded = fit(
        X,
        y,
        **params,
        select_stages=False,
        callback=lambda A, iteration: maps.__setitem__(iteration, A),
    )
    assert [r["kept"] for r in unguarded.stages_] == ["end (not judged)"] * 2
    assert unguarded.stages_[-1]["iterations"] > 0
    np.testing.assert_array_equal(unguarded.components_.ravel(), maps[unguarded.n_iter_])
    assert not np.array_equal(unguarded.components_, first.components_)


def test_with_a_validation_set_the_stages_are_judged_on_it():
    X, y = separable_problem()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = NCA(n_components=4, random_state=0, n_candidates=6, max_iter=10)
        model.fit(X[:200], y[:200], X[200:], y[200:])
    assert model.stage_measure_ == "soft-neighbour score of 100 validation rows"
    assert [r["stage"] for r in model.stages_] == ["candidate stage", "exact finish"]


def test_small_fits_without_validation_hold_nothing_out_and_are_not_judged():
    X, y, _, _ = problem(300, seed=3)
    model = fit(X, y)
    assert [r["kept"] for r in model.stages_] == ["end (not judged)"]
    assert model.stages_[0]["start_score"] is None and model.stage_measure_ is None
    assert [r["kept"] for r in fit(X, y, select_stages=False).stages_] == ["end (not judged)"]


def held_out_accuracy(model, A, X, y, X_test, y_test) -> float:
    """5-NN accuracy of test rows against the training rows under the map A (d, D) on the
    model's standardisation."""
    z = ((X - model.mean_) / model.scale_) @ A.T
    zt = ((X_test - model.mean_) / model.scale_) @ A.T
    accuracies = knn_accuracies(z.astype(np.float32), y, zt.astype(np.float32), y_test, 5, ks=(5,))
    return accuracies[5]


HELD_OUT_TOLERANCE = 0.03  # 600 test rows: a stage judged on the training rows left out


@pytest.mark.slow  # 12 fits
@settings(
    max_examples=6,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    database=None,
    derandomize=True,
)
@given(
    seed=st.integers(0, 10_000), n=st.sampled_from([300, 500]), n_features=st.sampled_from([12, 40])
)
def test_the_default_fit_never_ends_below_its_start_or_its_first_stage(
    holdout_from_small_sizes, seed, n, n_features
):
    """On held-out rows, the default structure of a large fit (candidate stage, then the
    exact finish) ends within HELD_OUT_TOLERANCE of the better of its initial map and its
    candidate stage's map, whatever the random problem."""
    X, y, X_test, y_test = problem(n, seed, n_features)
    full = fit(X, y, n_candidates=5)
    first = fit(X, y, n_candidates=5, exact_finish=0)
    Xs = (X - full.mean_) / full.scale_
    A0 = initial_map(full.init_used_, Xs, np.searchsorted(full.classes_, y), 4)
    scores = {
        "initial": held_out_accuracy(full, A0, X, y, X_test, y_test),
        "first stage": held_out_accuracy(first, first.components_, X, y, X_test, y_test),
        "final": held_out_accuracy(full, full.components_, X, y, X_test, y_test),
    }
    assert scores["final"] >= max(scores["initial"], scores["first stage"]) - HELD_OUT_TOLERANCE, (
        scores,
        full.stages_,
    )


def test_the_candidate_stage_reports_k_and_the_search_quality_of_each_refresh():
    """K chosen at each refresh and an approximate search's measured neighbour mass reach
    stages_ (they were kept on objects only tests read)."""
    from tests.training.problems import blobs

    X, y = blobs(600, seed=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exact = NCA(n_components=2, n_candidates=4, max_iter=8, random_state=0).fit(X, y)
        ivf = NCA(
            n_components=2,
            n_candidates=4,
            max_iter=8,
            random_state=0,
            options=dict(candidate_search="ivf"),
        ).fit(X, y)
    for model, measured in ((exact, False), (ivf, True)):
        first = model.stages_[0]
        assert first["refreshes"] >= 1
        assert len(first["refresh_sizes"]) == first["refreshes"]
        assert all(k in (4, 8, 16, 32, 64, 128) for k in first["refresh_sizes"])
        assert first["refresh_sizes"][-1] == model.n_candidates_
        ratios = first["search_mass_ratios"]
        assert len(ratios) == first["refreshes"]
        assert all((r is not None) == measured for r in ratios)
        assert all(0 < r <= 1.5 for r in ratios if r is not None)


def test_the_fit_records_which_kernels_evaluated_its_objectives(monkeypatch):
    from tests.training.problems import blobs

    X, y = blobs(300, seed=2)
    params = dict(n_components=2, max_iter=3, random_state=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exact = NCA(**with_options(dict(n_candidates=None, **params))).fit(X, y)
        staged = NCA(**with_options(dict(n_candidates=4, **params))).fit(X, y)
        knca = NCA(
            **with_options(dict(objective="knca-majority", k=3, n_candidates=4, **params))
        ).fit(X, y)
        monkeypatch.setenv("NCA_KNN_NATIVE", "0")
        off = NCA(**with_options(dict(n_candidates=4, **params))).fit(X, y)
    built = "c"  # built at install (setup.py); a fit never compiles
    assert exact.kernels_ == {"nca_exact": built}  # its row pass; its products in torch
    assert staged.kernels_ == {"nca_exact": built, "nca_candidates": built}
    assert knca.kernels_ == {"knca": built}
    assert off.kernels_ == {"nca_exact": "torch", "nca_candidates": "torch"}


def test_without_stage_selection_a_validation_set_stops_and_undoes_nothing():
    """select_stages=False: the stages run as the optimiser ends them, whatever the
    validation set scores (the stop rule judges for the keep rule only)."""
    X, y = separable_problem()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = NCA(
            n_components=4,
            random_state=0,
            n_candidates=6,
            max_iter=10,
            tol=0,
            options=dict(select_stages=False, exact_finish=3, validation_interval=1),
        ).fit(X[:200], y[:200], X[200:], y[200:])
    stops = [r["stop_reason"] for r in model.stages_]
    assert not {"hurt", "stalled"} & set(stops), stops  # the optimiser's reasons only
    assert [r["kept"] for r in model.stages_] == ["end (not judged)"] * 2
    assert model.kept_iteration_ == model.n_iter_
