"""The scikit-learn estimator: conventions, validation, strategies, warm start."""

from __future__ import annotations

import inspect
import warnings

import numpy as np
import pytest
import torch
from sklearn.datasets import load_digits, load_iris
from sklearn.exceptions import ConvergenceWarning
from sklearn.neighbors import KNeighborsClassifier, NeighborhoodComponentsAnalysis
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler
from sklearn.utils.estimator_checks import check_estimator

from service.core.artifact import write_artifact
from service.core.knn import project
from training import NCA
from training.model.initialization import initial_components
from training.model.options import OPTION_NAMES, FitOptions, with_options


def test_passes_scikit_learn_check_estimator():
    # every check applies and passes (check_array_api_input skips itself: no array API here)
    check_estimator(NCA(max_iter=20))


def test_pipeline_with_kneighbors_classifier():
    X, y = load_iris(return_X_y=True)
    model = make_pipeline(NCA(n_components=2, random_state=0), KNeighborsClassifier(3))
    model.fit(X[::2], y[::2])
    assert model.score(X[1::2], y[1::2]) > 0.9


def test_fitted_attributes_and_transform_formula():
    X, y = load_iris(return_X_y=True)
    nca = NCA(n_components=3, random_state=0, options=dict(standardize="feature")).fit(X, y)
    assert nca.components_.shape == (3, 4)
    assert nca.projection_.shape == (3, 4) and nca.offset_.shape == (3,)
    np.testing.assert_allclose(nca.mean_, X.mean(0))
    np.testing.assert_allclose(nca.scale_, X.std(0))
    expected = ((X - nca.mean_) / nca.scale_) @ nca.components_.T
    np.testing.assert_allclose(nca.transform(X), expected, rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(nca.transform(X), project(X, nca.projection_, nca.offset_))
    assert nca.get_feature_names_out().tolist() == ["nca0", "nca1", "nca2"]
    assert nca.converged_ and nca.n_iter_ >= 1 and nca.history_


def test_matches_scikit_learn_on_the_same_problem():
    X, y = load_digits(return_X_y=True)
    Xs = StandardScaler().fit_transform(X[:600])
    # l2=0: scikit-learn's objective has no penalty; init_scale=1.0: its initial map as built
    ours = NCA(
        n_components=8,
        init="pca",
        l2=0.0,
        random_state=0,
        max_iter=50,
        options=dict(init_scale=1.0, standardize=False),
    ).fit(Xs, y[:600])
    theirs = NeighborhoodComponentsAnalysis(n_components=8, init="pca", random_state=0, max_iter=50)
    theirs.fit(Xs, y[:600])
    # same init, same objective, same optimiser (scipy L-BFGS-B): same objective reached
    import torch

    from training.objectives.nca import NCAObjective
    from training.objectives.neighbourhood import objective_sum

    def f(A):
        Z = torch.tensor(Xs @ A.T)
        return float(objective_sum(Z, torch.tensor(y[:600]), NCAObjective(False)))

    assert f(ours.components_) == pytest.approx(f(theirs.components_), rel=2e-3)


@pytest.mark.parametrize(
    "params, pattern",
    [
        (dict(n_components=5), r"`n_components` \(5\) cannot be greater than the given data "),
        (dict(n_components=0), r"n_components=0 must be an integer >= 1"),
        (dict(objective="lmnn"), r"objective='lmnn' must be one of"),
        (dict(objective=["nca"]), r"objective=\['nca'\] must be one of"),
        (
            dict(validation_fraction=[0.1]),
            r"validation_fraction=\[0.1\] must be a finite real number in \(0, 1\)",
        ),
        (
            dict(validation_fraction=1.0),
            r"validation_fraction=1.0 must be a finite real number in \(0, 1\)",
        ),
        (dict(callback="print"), r"callback='print' must be None or a callable\(transformation"),
        (dict(progress=3), r"progress=3 must be None or a callable\(StageProgress\)"),
        (
            dict(held_out_score=0.9),
            r"held_out_score=0.9 must be None or a callable\(A, stage, iteration\)",
        ),
        (
            dict(held_out_score=lambda A, stage, iteration: float("nan")),
            r"held_out_score returned nan for the map of the exact fit's iteration 0; "
            r"expected a finite number",
        ),
        (
            dict(held_out_score=lambda A, stage, iteration: "best"),
            r"held_out_score returned 'best' for the map of the exact fit's iteration 0",
        ),
        (dict(random_state=-1), r"random_state=-1 must be None, an integer >= 0"),
        (dict(random_state={"seed": 1}), r"random_state=\{'seed': 1\} must be None, an integer"),
        (dict(transformation="square"), r"transformation='square' must be one of"),
        (dict(transformation="diagonal", n_components=2), r"needs n_components = n_features = 4"),
        (dict(solver="sgd"), r"solver='sgd' must be one of"),
        (dict(max_iter=0), r"max_iter=0 must be an integer >= 1"),
        (dict(tol=-1.0), r"tol=-1.0 must be a finite real number >= 0"),
        (dict(l2=-0.1), r"l2=-0.1 must be 'auto' or a finite real number in \[0, 1e\+06\]"),
        (dict(l2="strong"), r"l2='strong' must be 'auto' or a finite real number in \[0"),
        (dict(l2=True), r"l2=True must be 'auto' or a finite real number in \[0"),
        (dict(l2=float("inf")), r"l2=inf must be 'auto' or a finite real number in \[0"),
        (dict(l2=float("nan")), r"l2=nan must be 'auto' or a finite real number in \[0"),
        (dict(l2=1e300), r"l2=1e\+300 must be 'auto' or a finite real number in \[0, 1e\+06\]"),
        (dict(tol=float("inf")), r"tol=inf must be a finite real number >= 0"),
        (dict(learning_rate=float("inf")), r"learning_rate=inf must be a finite real number in"),
        (
            dict(learning_rate=1e30),
            r"learning_rate=1e\+30 must be a finite real number in \(0, 1000\]",
        ),
        (dict(n_candidates=0), r"n_candidates=0 must be 'auto', None or an integer >= 1"),
        (dict(standardize="yes"), r"standardize='yes' must be one of \('auto', 'feature'"),
        (
            dict(refresh_tol=0.0),
            r"refresh_tol=0.0 must be None or a finite real number in \(0, 1\)",
        ),
        (
            dict(refresh_tol=1.5),
            r"refresh_tol=1.5 must be None or a finite real number in \(0, 1\)",
        ),
        (
            dict(candidate_mass="most"),
            r"candidate_mass='most' must be None or a finite real number in \(0, 1\]",
        ),
        (
            dict(candidate_mass=1.2),
            r"candidate_mass=1.2 must be None or a finite real number in \(0, 1\]",
        ),
        (dict(init="nonsense"), r"init='nonsense' must be one of"),
        (
            dict(init=np.zeros((2, 3)), n_components=2),
            r"input dimensionality \(3\) of the given linear transformation `init` must match "
            r"the dimensionality of the given inputs `X` \(4\)",
        ),
        (
            dict(init=np.eye(4)[:3], n_components=2),
            r"`n_components` \(2\) does not match the output dimensionality of the given "
            r"linear transformation `init` \(3\)",
        ),
        (dict(device="tpu"), r"device='tpu'"),
        (dict(objective="nca", k=3), r"k must be 1"),
    ],
)
def test_bad_parameters_are_named_in_the_error(params, pattern):
    X, y = load_iris(return_X_y=True)
    with pytest.raises(ValueError, match=pattern):
        NCA(**with_options(dict(**params))).fit(X, y)


@pytest.mark.parametrize(
    "options, pattern",
    [
        ({"refresh_rate": 3}, r"options has no setting 'refresh_rate'; the settings are "),
        ({"l2": 0.1}, r"options has no setting 'l2'"),  # a constructor parameter
        ("fast", r"options='fast' must be None, a training.model.options.FitOptions or a dict"),
        ([("solver", "adam")], r"must be None, a training.model.options.FitOptions or a dict"),
        (FitOptions(solver="sgd"), r"solver='sgd' must be one of"),  # the same table
        ({"validation_fraction": 1.0}, r"validation_fraction=1.0 must be a finite real"),
    ],
)
def test_bad_options_are_named_in_the_error(options, pattern):
    X, y = load_iris(return_X_y=True)
    with pytest.raises(ValueError, match=pattern):
        NCA(options=options).fit(X, y)


def test_options_as_a_dict_or_a_fitoptions_give_the_same_map():
    X, y = load_iris(return_X_y=True)
    settings = dict(standardize="global", init_scale=1.0, exact_finish=0)
    from_dict = NCA(n_components=2, max_iter=10, random_state=0, options=settings).fit(X, y)
    from_options = NCA(
        n_components=2, max_iter=10, random_state=0, options=FitOptions(**settings)
    ).fit(X, y)
    default = NCA(n_components=2, max_iter=10, random_state=0).fit(X, y)
    np.testing.assert_array_equal(from_dict.components_, from_options.components_)
    assert from_dict.standardization_ == "global" and from_dict.init_scale_ == 1.0
    assert not np.array_equal(default.components_, from_dict.components_)


def test_the_constructor_keeps_to_fifteen_parameters_with_scikit_learns_names():
    """Issue 56: a small public surface; every other setting is a FitOptions field."""
    names = list(inspect.signature(NCA.__init__).parameters)[1:]
    assert len(names) <= 15, names
    sklearn_names = set(inspect.signature(NeighborhoodComponentsAnalysis.__init__).parameters)
    assert sklearn_names - {"self"} <= set(names)
    assert not set(names) & set(OPTION_NAMES)  # one place for each setting


def test_l2_auto_is_the_cross_validated_penalty_exactly_and_zero_on_candidates():
    from training.model.plan import DEFAULT_L2
    from training.objectives.nca import NCAObjective
    from training.objectives.neighbourhood import objective_sum

    X, y = load_iris(return_X_y=True)
    params = dict(n_components=2, max_iter=30, random_state=0)
    exact = NCA(**with_options(dict(**params))).fit(X, y)
    assert exact.l2 == "auto" and exact.n_candidates_ is None and exact.l2_ == DEFAULT_L2
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        on_candidates = NCA(**with_options(dict(n_candidates=8, **params, exact_finish=0))).fit(
            X, y
        )
        finished = NCA(**with_options(dict(n_candidates=8, **params))).fit(X, y)
    assert on_candidates.l2_ == 0.0
    assert finished.l2_ == DEFAULT_L2  # the exact finish carries the exact objective's
    # "auto" on the exact path is the same fit as the number it stands for
    explicit = NCA(**with_options(dict(l2=DEFAULT_L2, **params))).fit(X, y)
    np.testing.assert_array_equal(exact.components_, explicit.components_)
    # and the penalty is in the loss: the unpenalised fit reaches a higher f with a larger A
    free = NCA(**with_options(dict(l2=0.0, **params))).fit(X, y)
    assert free.l2_ == 0.0
    assert np.linalg.norm(free.components_) > np.linalg.norm(exact.components_)

    def f(model):
        z = torch.tensor(((X - model.mean_) / model.scale_) @ model.components_.T)
        return float(objective_sum(z, torch.tensor(y), NCAObjective()))

    assert f(free) > f(exact)


def test_diagonal_transform_learns_to_ignore_a_noise_feature():
    rng = np.random.default_rng(0)
    y = np.repeat([0, 1, 2], 60)
    signal = y + rng.normal(0, 0.2, 180)
    X = np.column_stack([signal, rng.normal(0, 1.0, 180), rng.normal(0, 1.0, 180)])
    nca = NCA(init="identity", random_state=0, options=dict(transformation="diagonal")).fit(X, y)
    assert nca.components_.shape == (3, 3)
    assert np.count_nonzero(nca.components_ - np.diag(np.diag(nca.components_))) == 0
    weights = np.abs(np.diag(nca.components_))
    assert weights[0] > 5 * weights[1:].max()


def test_log_objective_trains_too():
    X, y = load_iris(return_X_y=True)
    nca = NCA(n_components=2, objective="nca-log", random_state=0).fit(X, y)
    assert nca.objective_value_ < 0  # a mean log-probability
    assert KNeighborsClassifier(1).fit(nca.transform(X), y).score(nca.transform(X), y) > 0.9


def test_adam_and_candidates_paths_reach_a_good_solution():
    X, y = load_digits(return_X_y=True)
    kw = dict(n_components=8, random_state=0)
    exact = NCA(**with_options(dict(**kw))).fit(X[:800], y[:800])
    adam = NCA(
        **with_options(dict(max_iter=30, **kw, solver="adam", batch_size=128, learning_rate=0.01))
    ).fit(X[:800], y[:800])
    cand = NCA(**with_options(dict(n_candidates=16, **kw, refresh_every=5))).fit(X[:800], y[:800])
    assert cand.n_candidates_ == 16 and adam.solver_ == "adam"
    scores = {}
    for name, m in (("exact", exact), ("adam", adam), ("cand", cand)):
        clf = KNeighborsClassifier(1).fit(m.transform(X[:800]), y[:800])
        scores[name] = clf.score(m.transform(X[800:]), y[800:])
    assert scores["exact"] > 0.9
    assert scores["adam"] > scores["exact"] - 0.03
    assert scores["cand"] > scores["exact"] - 0.03


def test_auto_picks_candidates_for_large_n(monkeypatch):
    import training.model.plan as est

    monkeypatch.setattr(est, "AUTO_EXACT_MAX_SAMPLES", 100)
    X, y = load_iris(return_X_y=True)
    assert NCA(n_components=2, max_iter=5).fit(X, y).n_candidates_ == est.AUTO_N_CANDIDATES
    assert NCA(n_components=2, max_iter=5).fit(X[:90], y[:90]).n_candidates_ is None


def early_stopping_nca(n_iter_no_change: int, **params) -> NCA:
    """d = 4 with a validation check every iteration, stopped only by early stopping (the
    tests script the validation accuracy; the stage judge, tested in test_stages.py, would
    score the maps for real)."""
    return NCA(
        **with_options(
            dict(
                n_components=4,
                max_iter=300,
                tol=0,
                random_state=0,
                **params,
                early_stopping=True,
                validation_interval=1,
                n_iter_no_change=n_iter_no_change,
                select_stages=False,
            )
        )
    )


PEAK_AT_2 = {1: 0.5, 2: 0.7}  # validation score by iteration, 0.6 after


def peak_at_2(A, stage, iteration):
    """A held_out_score: PEAK_AT_2's score for the map of each iteration."""
    return PEAK_AT_2.get(iteration, 0.6)


def test_early_stopping_keeps_best_validation_model():
    """The validation score peaks at iteration 2 (scripted): with a patience of 2 checks
    the fit stops at iteration 4, by early stopping, with the accuracy of the best map."""
    X, y = load_digits(return_X_y=True)
    nca = early_stopping_nca(2, held_out_score=peak_at_2).fit(X[:600], y[:600])
    assert nca.stop_reason_ == "stalled" and nca.n_iter_ == 4
    checked = [h["val_score"] for h in nca.history_ if "val_score" in h]
    assert checked == [0.5, 0.7, 0.6, 0.6]
    assert nca.kept_iteration_ == 2
    kept = next(h for h in nca.history_ if h["iteration"] == 2)
    assert nca.best_val_accuracy_ == kept["val_accuracy"]


def test_non_convergence_is_a_warning():
    X, y = load_digits(return_X_y=True)
    with pytest.warns(ConvergenceWarning, match=r"\[NCA\] NCA did not converge in max_iter=2"):
        nca = NCA(n_components=4, max_iter=2, random_state=0).fit(X[:300], y[:300])
    assert not nca.converged_ and nca.stop_reason_ == "max_iter"


def test_deterministic_for_a_seed():
    X, y = load_digits(return_X_y=True)
    a = NCA(n_components=4, init="random", random_state=3, max_iter=10).fit(X[:300], y[:300])
    b = NCA(n_components=4, init="random", random_state=3, max_iter=10).fit(X[:300], y[:300])
    np.testing.assert_array_equal(a.components_, b.components_)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("n_candidates", [None, 8])
def test_fit_leaves_the_callers_arrays_untouched(dtype, n_candidates):
    """Standardisation, the held-out rows and the candidate stages work on copies: the
    caller's X and y are bit for bit what they were (exact and candidate paths)."""
    X, y = load_digits(return_X_y=True)
    X, y = X[:400].astype(dtype), y[:400].copy()
    X_before, y_before = X.copy(), y.copy()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        NCA(n_components=4, max_iter=3, n_candidates=n_candidates, random_state=0).fit(X, y)
    np.testing.assert_array_equal(X, X_before)
    np.testing.assert_array_equal(y, y_before)


@pytest.mark.parametrize("map_scale", [None, 0.5, float(np.float32(np.sqrt(0.5)))])
def test_warm_start_from_an_artifact_continues_the_same_map(tmp_path, map_scale):
    """An artifact's map carried over is the fitted map: a job that serves its soft vote
    at a temperature t stores the map times sqrt(t) (its manifest's metrics.map_scale,
    training.job.evaluate), which the warm start divides out."""
    X, y = load_iris(return_X_y=True)
    first = NCA(n_components=2, random_state=0).fit(X, y)
    factor = np.float32(1.0 if map_scale is None else map_scale)
    path = write_artifact(
        tmp_path / "m",
        projection=first.projection_ * factor,
        offset=first.offset_ * factor,
        embeddings=first.transform(X) * factor,
        labels=y.astype(np.int32),
        classes=[0, 1, 2],
        mean=first.mean_,
        scale=first.scale_,
        default_k=1,
        metadata={} if map_scale is None else {"metrics": {"map_scale": map_scale}},
    )
    # the artifact's map on raw inputs, carried to the current standardisation, is A itself
    Xs = (X - first.mean_) / first.scale_
    A0, name = initial_components(
        str(path), Xs, 2, random_state=np.random.default_rng(0), scale=first.scale_
    )
    assert name == "artifact"
    np.testing.assert_allclose(A0, first.components_, rtol=1e-5, atol=1e-6)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        warm = NCA(n_components=2, init=str(path), max_iter=1, random_state=0).fit(X, y)
    assert warm.init_used_ == "artifact"
    # it starts where the first fit ended (which may already be stationary: no iteration)
    assert warm.objective_value_ >= first.objective_value_ - 1e-3
    assert all(r["objective"] >= first.objective_value_ - 1e-3 for r in warm.history_)


def map_only_artifact(path, projection: np.ndarray, metadata: dict | None = None):
    """An artifact that a warm start reads the map of: ``projection`` (2, D) float32, four
    references at the origin of one class."""
    n_features = projection.shape[1]
    return write_artifact(
        path,
        projection=projection,
        offset=np.zeros(2, np.float32),
        embeddings=np.zeros((4, 2), np.float32),
        labels=np.zeros(4, np.int32),
        classes=[0],
        mean=np.zeros(n_features),
        scale=np.ones(n_features),
        default_k=1,
        metadata=metadata or {},
    )


@pytest.mark.parametrize("bad", [0, -0.5, "0.5", True, None, [1]])  # JSON: no NaN or inf
def test_warm_start_refuses_an_artifact_whose_map_scale_is_not_a_positive_number(tmp_path, bad):
    X, y = load_iris(return_X_y=True)
    projection = np.eye(2, 4, dtype=np.float32)
    path = map_only_artifact(tmp_path / "m", projection, {"metrics": {"map_scale": bad}})
    with pytest.raises(ValueError, match=r"metrics\.map_scale is .*expected a positive finite"):
        NCA(n_components=2, init=str(path)).fit(X, y)


def test_warm_start_refuses_an_artifact_with_other_features(tmp_path):
    X, y = load_iris(return_X_y=True)
    rng = np.random.default_rng(0)
    path = map_only_artifact(tmp_path / "m", rng.normal(size=(2, 3)).astype(np.float32))
    with pytest.raises(ValueError, match="the artifact expects 3 features, the data has 4"):
        NCA(n_components=2, init=str(path)).fit(X, y)


def test_knca_estimator_in_a_pipeline():
    X, y = load_iris(return_X_y=True)
    model = make_pipeline(
        NCA(n_components=2, objective="knca-majority", k=5, random_state=0, max_iter=30),
        KNeighborsClassifier(5),
    )
    model.fit(X[::2], y[::2])
    assert model.score(X[1::2], y[1::2]) > 0.9


def test_early_stopping_returns_the_best_components_and_their_objective():
    X, y = load_digits(return_X_y=True)
    seen = {}
    nca = early_stopping_nca(
        3,
        callback=lambda transformation, n_iter: seen.__setitem__(n_iter, transformation.copy()),
        held_out_score=peak_at_2,
    ).fit(X[:600], y[:600])
    assert nca.stop_reason_ == "stalled"
    checks = [h for h in nca.history_ if "val_score" in h]
    best = max(checks, key=lambda h: h["val_score"])  # max keeps the first of equals
    last = nca.history_[-1]["iteration"]
    assert best["iteration"] < last, "the test needs a best iterate before the last"
    np.testing.assert_array_equal(nca.components_.ravel(), seen[best["iteration"]])
    assert not np.array_equal(nca.components_.ravel(), seen[last])
    # the recorded objective is the returned map's, not the last iterate's
    assert nca.objective_value_ == pytest.approx(best["objective"], rel=1e-5)
    assert nca.objective_value_ != pytest.approx(nca.history_[-1]["objective"], rel=1e-9)


def test_callback_gets_the_raveled_transformation_and_the_iteration():
    X, y = load_iris(return_X_y=True)
    calls = []
    NCA(
        n_components=2,
        max_iter=5,
        tol=0,
        random_state=0,
        callback=lambda t, i: calls.append((t.shape, i)),
    ).fit(X, y)
    assert calls and all(shape == (2 * 4,) for shape, _ in calls)
    assert [i for _, i in calls] == list(range(1, len(calls) + 1))


def test_a_single_class_leaves_the_initial_transformation():
    # scikit-learn's test_one_class
    X, y = load_iris(return_X_y=True)
    X, y = X[y == 0], y[y == 0]
    nca = NCA(
        n_components=X.shape[1], init="identity", max_iter=30, options=dict(standardize=False)
    ).fit(X, y)
    np.testing.assert_allclose(nca.transform(X), X, rtol=1e-6)
    assert nca.n_iter_ == 0 and nca.converged_ and nca.stop_reason_ == "single_class"
    assert nca.objective_value_ == pytest.approx(1.0)  # p_i = 1 for every point


def test_warm_start_continues_from_the_previous_components():
    X, y = load_iris(return_X_y=True)
    nca = NCA(n_components=2, warm_start=True, max_iter=3, tol=0, random_state=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        nca.fit(X, y)
        first = nca.components_.copy()
        nca.set_params(max_iter=1).fit(X, y)
    assert nca.init_used_ == "array"
    cold = NCA(n_components=2, init=first, max_iter=1, tol=0, random_state=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        cold.fit(X, y)
    np.testing.assert_allclose(nca.components_, cold.components_)
    with pytest.raises(ValueError, match=r"The new inputs dimensionality \(3\) does not match"):
        nca.fit(X[:, :3], y)


@pytest.mark.parametrize("init", ["auto", "lda", "pca"])
@pytest.mark.parametrize(
    ("n_samples", "n_features", "n_classes", "rank"),
    [(7, 5, 5, None), (200, 5, 5, 2), (5, 10, 5, None), (30, 6, 3, 1), (12, 3, 6, None)],
)
def test_initialisation_gives_d_rows_for_every_shape(init, n_samples, n_features, n_classes, rank):
    """scikit-learn's test_auto_init orderings of N, D, C and d, plus rank-deficient data:
    LDA and PCA can find fewer directions than d; the rest are completed."""
    rng = np.random.default_rng(0)
    X = rng.normal(size=(n_samples, rank or n_features)) @ (
        rng.normal(size=(rank, n_features)) if rank else np.eye(n_features)
    )
    y = np.arange(n_samples) % n_classes
    for d in range(1, n_features + 1):
        nca = NCA(n_components=d, init=init, max_iter=2, random_state=0)
        if init == "lda" and d > min(n_features, n_classes - 1):
            with pytest.raises(ValueError, match="init='lda' gives at most"):
                nca.fit(X, y)
            continue
        if init == "lda" and n_samples <= n_classes:
            with pytest.raises(ValueError, match="init='lda' needs more samples than classes"):
                nca.fit(X, y)
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            nca.fit(X, y)
        assert nca.components_.shape == (d, n_features)
        assert np.all(np.isfinite(nca.components_))


def test_a_non_finite_gradient_stops_the_fit_with_an_error_not_a_nan_map(monkeypatch):
    """L-BFGS fed a NaN gradient returns NaN parameters; the fit must say so instead (a
    kNCA overflow once produced a NaN map this way, reported as stop reason 'precision')."""
    from sklearn.exceptions import NotFittedError

    from training.optim.problem import Problem

    real = Problem.loss_and_grad
    calls = {"n": 0}

    def poisoned(self, theta):
        loss, grad, score = real(self, theta)
        calls["n"] += 1
        if calls["n"] == 3:
            grad = grad.copy()
            grad[:2] = np.nan
        return loss, grad, score

    monkeypatch.setattr(Problem, "loss_and_grad", poisoned)
    X, y = load_iris(return_X_y=True)
    model = NCA(n_components=2, max_iter=20, random_state=0)
    with pytest.raises(FloatingPointError, match=r"\(2 of 8 entries not finite\) at evaluation 3"):
        model.fit(X, y)
    with pytest.raises(NotFittedError):
        model.transform(X)


def test_a_non_finite_map_from_any_solver_is_refused(monkeypatch):
    """Whatever the optimiser returns, a map with NaN entries is not a fit."""
    from dataclasses import replace

    from sklearn.exceptions import NotFittedError

    from training.optim.adam import AdamEpochs

    real = AdamEpochs.step

    def nan_step(self, theta, at, max_evaluations=None):
        step = real(self, theta, at, max_evaluations)
        return replace(step, x=np.full_like(step.x, np.nan))

    monkeypatch.setattr(AdamEpochs, "step", nan_step)
    X, y = load_iris(return_X_y=True)
    model = NCA(n_components=2, max_iter=2, random_state=0, options=dict(solver="adam"))
    with pytest.raises(FloatingPointError, match=r"A has 8 non-finite entries after 2 iterations"):
        model.fit(X, y)
    with pytest.raises(NotFittedError):
        model.transform(X)


def test_the_plan_records_what_every_auto_resolved_to(monkeypatch):
    """plan_: exact below the size limit (penalty on, no finish); candidate sets above it,
    with no penalty on them and the finish carrying it; Adam gets no finish."""
    import training.model.plan as plan

    X, y = load_iris(return_X_y=True)
    exact = NCA(n_components=2, max_iter=3).fit(X, y).plan_
    assert (exact.n_candidates, exact.finish_iter, exact.l2) == (None, 0, plan.DEFAULT_L2)
    monkeypatch.setattr(plan, "AUTO_EXACT_MAX_SAMPLES", 100)
    candidates = NCA(n_components=2, max_iter=3).fit(X, y).plan_
    assert candidates.n_candidates == plan.AUTO_N_CANDIDATES and candidates.solver == "lbfgs"
    assert (candidates.l2, candidates.finish_l2) == (0.0, plan.DEFAULT_L2)
    assert candidates.finish_iter == plan.AUTO_EXACT_FINISH_ITER
    adam = NCA(n_components=2, max_iter=2, options=dict(solver="adam")).fit(X, y).plan_
    assert adam.finish_iter == 0 and adam.solver == "adam"
    assert NCA(n_components=2, max_iter=2, l2=0.5).fit(X, y).plan_.describe()["l2"] == 0.5


def test_to_onnx_runs_in_onnx_runtime_as_transform_does(tmp_path):
    """NCA.to_onnx: ONNX Runtime's z equals transform's (float32 inputs and float64 inputs
    cast as transform casts them), and the file written is the same model."""
    import onnx
    import onnxruntime as ort
    from sklearn.exceptions import NotFittedError

    X, y = load_iris(return_X_y=True)
    nca = NCA(n_components=2, max_iter=10, random_state=0).fit(X, y)
    model = nca.to_onnx(tmp_path / "iris.onnx")
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    z = session.run(["z"], {"x": X.astype(np.float32)})[0]
    np.testing.assert_allclose(z, nca.transform(X), rtol=1e-6, atol=1e-6)
    props = {p.key: p.value for p in model.metadata_props}
    assert props["classes"] == "[0, 1, 2]" and props["n_components"] == "2"
    assert onnx.load(str(tmp_path / "iris.onnx")) == model
    with pytest.raises(NotFittedError):
        NCA().to_onnx()


def test_to_onnx_writes_as_the_command_does(tmp_path):
    """NCA.to_onnx(path): whole or not at all, never through a link, an existing file only
    with overwrite."""
    import onnx

    X, y = load_iris(return_X_y=True)
    nca = NCA(n_components=2, max_iter=5, random_state=0).fit(X, y)
    victim = tmp_path / "victim.txt"
    victim.write_text("keep")
    link = tmp_path / "link.onnx"
    link.symlink_to(victim)
    with pytest.raises(ValueError, match="is not a regular file"):
        nca.to_onnx(link, overwrite=True)
    assert victim.read_text() == "keep"
    out = tmp_path / "iris.onnx"
    nca.to_onnx(out)
    with pytest.raises(ValueError, match="pass --overwrite"):
        nca.to_onnx(out)
    with pytest.raises(ValueError, match="does not exist"):
        nca.to_onnx(tmp_path / "absent" / "iris.onnx")
    props = {p.key: p.value for p in onnx.load(str(out)).metadata_props}
    assert set(props) == {
        "classes",
        "n_features_in",
        "n_components",
        "objective",
        "nca_knn_version",
    }
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iris.onnx", "link.onnx", "victim.txt"]
