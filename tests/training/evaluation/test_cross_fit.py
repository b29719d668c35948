"""The served k chosen on cross-fitted votes (training/evaluation/cross_fit.py): folds that
are stratified and seeded, a curve equal to out-of-fold kNN written out by hand, fits that
never see the rows they vote for, and the job's --k-folds (its checks, its record in the
report, the page's curve and warnings)."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
import scipy.sparse as sp

from training.config import TrainConfig
from training.distributed.ranks import ProcessGroup
from training.errors import ConfigError
from training.evaluation.cross_fit import (
    CROSS_FIT_FOLDS,
    check_k_folds,
    cross_fitted_accuracies,
    fold_of,
    folds_for,
)
from training.evaluation.report_page import render_page, warnings_of

FITTED: list[np.ndarray] = []  # the rows each IdentityMap was fitted on, in order


class IdentityMap:
    """A stand-in estimator: the identity map (A = I, offset 0); records the rows it saw."""

    def fit(self, X, y):
        FITTED.append(X.toarray() if sp.issparse(X) else X.copy())
        return self

    def transform(self, X):
        return np.asarray(X.toarray() if sp.issparse(X) else X, dtype=np.float32)


def two_classes(n: int = 60, seed: int = 0):
    rng = np.random.default_rng(seed)
    y = (np.arange(n) % 3 == 0).astype(np.int64)  # 20 of class 1, 40 of class 0
    X = rng.normal(size=(n, 3)) + 1.2 * y[:, None]
    return X, y


def test_folds_are_stratified_seeded_and_cover_every_row():
    y = np.repeat([0, 1, 2], [23, 7, 3])
    fold = fold_of(y, 5, seed=4)
    assert fold.shape == y.shape and set(fold) <= set(range(5))
    for c, size in ((0, 23), (1, 7), (2, 3)):
        counts = np.bincount(fold[y == c], minlength=5)
        assert counts.min() == size // 5 and counts.max() == -(-size // 5), (c, counts)
    np.testing.assert_array_equal(fold, fold_of(y, 5, seed=4))
    assert not np.array_equal(fold, fold_of(y, 5, seed=5))


@pytest.mark.parametrize("sparse", [False, True])
def test_the_curve_is_out_of_fold_knn_written_out(sparse):
    """Two classes, odd k (no tied votes), the identity map: every row's majority among its
    k nearest rows of the other folds, by hand."""
    X, y = two_classes()
    folds, seed, ks = 4, 1, (1, 3, 5)
    FITTED.clear()
    curve = cross_fitted_accuracies(
        IdentityMap, sp.csr_matrix(X) if sparse else X, y, 2, ks, ("majority",), folds, seed
    )
    fold = fold_of(y, folds, seed)
    z = X.astype(np.float32).astype(np.float64)  # the search runs on float32 embeddings
    right = dict.fromkeys(ks, 0)
    for i in range(len(y)):
        others = np.flatnonzero(fold != fold[i])
        order = others[np.argsort(((z[others] - z[i]) ** 2).sum(1), kind="stable")]
        for k in ks:
            right[k] += int((np.mean(y[order[:k]]) > 0.5) == y[i])
    assert curve == {"majority": {k: right[k] / len(y) for k in ks}}
    # each fit saw exactly the other folds' rows, never the rows it voted for
    assert len(FITTED) == folds
    for f, seen in enumerate(FITTED):
        np.testing.assert_array_equal(seen, X[fold != f])


def test_a_k_some_fold_cannot_answer_is_left_out():
    """12 rows in 4 folds: 9 references a fold, so k = 11 and 13 are not scored."""
    X, y = two_classes(12)
    curve = cross_fitted_accuracies(IdentityMap, X, y, 2, (1, 9, 11, 13), ("majority",), 4, 0)
    assert list(curve["majority"]) == [1, 9]


def test_auto_cross_fits_only_small_validation_splits_of_small_sets():
    assert folds_for("auto", 444, 4435) == CROSS_FIT_FOLDS  # UCI Satellite
    assert folds_for("auto", 0, 500) == CROSS_FIT_FOLDS
    assert folds_for("auto", 1600, 16000) == 0  # UCI letters: its split is large enough
    assert folds_for("auto", 500, 1_000_000) == 0  # a fit of a million rows is not seconds
    assert folds_for(0, 10, 100) == 0 and folds_for(3, 5000, 10**6) == 3


@pytest.mark.parametrize(
    "value, group, prototypes, pooled, expected",
    [
        ("1", ProcessGroup(), None, None, "must be auto, 0"),
        ("-2", ProcessGroup(), None, None, "must be auto, 0"),
        ("five", ProcessGroup(), None, None, "must be auto, 0"),
        ("5", ProcessGroup(0, 2, "gloo"), None, None, "a data-parallel run"),
        ("5", ProcessGroup(), 20.0, None, "with --prototypes"),
        ("13", ProcessGroup(), None, 12, "the largest class has 12 .* at most 12 folds"),
        ("\u0663", ProcessGroup(), None, None, "must be auto, 0"),  # an Arabic-Indic 3
        ("+3", ProcessGroup(), None, None, "must be auto, 0"),
        ("1_0", ProcessGroup(), None, None, "must be auto, 0"),
        ("5.0", ProcessGroup(), None, None, "must be auto, 0"),
    ],
)
def test_k_folds_the_run_cannot_use_are_refused(value, group, prototypes, pooled, expected):
    with pytest.raises(ConfigError, match=expected):
        check_k_folds(
            value, distributed=group.is_distributed, prototypes=prototypes, largest=pooled
        )


def test_k_folds_accepted():
    assert check_k_folds(" AUTO ") == "auto"
    assert check_k_folds("0", distributed=True, prototypes=20.0) == 0
    assert check_k_folds("12", largest=12) == 12


def test_the_job_records_which_curve_chose_k_and_the_page_draws_it(tmp_path):
    """sklearn's digits through the job: its validation split (179 rows) is small, so auto
    cross-fits 5 folds over the training and validation rows; the served (rule, k) is that
    curve's best; --k-folds 0 chooses on the validation split and says on how many rows."""
    from training.evaluation.evaluate import choose_rule_and_k
    from training.job import run

    fast = dict(data="digits", n_components=8, max_iter=10, plots=False, quiet=True)
    report = run(TrainConfig(out=str(tmp_path / "auto"), **fast), log=lambda *_: None)
    metrics = report["metrics"]
    choice = metrics["k_choice"]
    n_pooled = report["data"]["n_train"] + report["data"]["n_val"]
    assert choice["method"] == "cross-fitted"
    assert choice["folds"] == CROSS_FIT_FOLDS and choice["rows"] == n_pooled
    curves = choice["accuracy"]
    assert (metrics["decision_rule"], metrics["default_k"]) == choose_rule_and_k(curves, 1)
    for by_k in curves.values():  # every value a count of right votes over the rows
        assert all(abs(a * n_pooled - round(a * n_pooled)) < 1e-9 for a in by_k.values())
    saved = json.loads((tmp_path / "auto" / "report.json").read_text())
    page = render_page(saved, {"classes": list(range(10))}, {})
    assert "5 folds cross-fitted" in page

    report = run(TrainConfig(out=str(tmp_path / "val"), k_folds="0", **fast), log=lambda *_: None)
    n_val = report["data"]["n_val"]
    assert report["metrics"]["k_choice"] == {"method": "validation", "rows": n_val}
    assert not [w for w in warnings_of(report) if "validation rows" in w]


def test_the_page_warns_when_few_or_no_validation_rows_chose_k():
    few = warnings_of({"metrics": {"k_choice": {"method": "validation", "rows": 3}}})
    assert len(few) == 1 and "chosen on 3 validation rows" in few[0] and "--k-folds" in few[0]
    none = warnings_of({"metrics": {"k_choice": {"method": "validation", "rows": 0}}})
    assert len(none) == 1 and "No validation rows" in none[0]
    crossed = {"method": "cross-fitted", "folds": 5, "rows": 30, "accuracy": {}}
    assert warnings_of({"metrics": {"k_choice": crossed}}) == []


def test_the_cross_fitted_curve_holds_only_ks_the_served_references_can_answer(tmp_path):
    """12 training rows and 42 validation rows: a fold's references (43 rows) could answer
    k = 15, the 12 references served cannot; the curve stops at k = 11."""
    from training.job import run

    rng = np.random.default_rng(0)
    data = tmp_path / "d.npz"
    np.savez(data, X=rng.normal(size=(60, 3)), y=np.arange(60) % 2)
    config = TrainConfig(
        data=str(data), out=str(tmp_path / "m"), val_size=0.7, test_size=0.1, quiet=True
    )
    report = run(replace(config, plots=False), log=lambda *_: None)
    assert report["data"]["n_train"] == 12
    choice = report["metrics"]["k_choice"]
    assert choice["method"] == "cross-fitted" and choice["rows"] == 54
    assert max(map(int, choice["accuracy"]["majority"])) == 11


def test_a_fold_whose_rows_the_fit_refuses_falls_back_to_the_validation_choice(tmp_path):
    """One row of 60 differs from the rest: the main fit's rows hold it, a fold's fit does
    not (its features are all constant). The job stopped after its fit had succeeded; it
    now chooses on the validation split and says why (found by the hostile pass)."""
    from training.job import run

    X = np.zeros((60, 3))
    X[0, 1] = 1.0
    data = tmp_path / "d.npz"
    np.savez(data, X=X, y=np.arange(60) % 2, X_test=np.zeros((4, 3)), y_test=np.arange(4) % 2)
    said = []
    config = TrainConfig(data=str(data), out=str(tmp_path / "m"), val_size=0.1, quiet=True)
    report = run(replace(config, plots=False, n_components=2), log=said.append)
    choice = report["metrics"]["k_choice"]
    assert choice["method"] == "validation" and choice["rows"] == report["data"]["n_val"]
    assert "refused its rows" in choice["cross_fit_failed"]
    assert any(line.startswith("warning: no cross-fitted k (the fit of fold") for line in said)
    assert any("could not be cross-fitted" in w for w in warnings_of(report))


def test_the_advice_for_few_validation_rows_is_what_the_run_can_take():
    """With --prototypes the cross-fit is refused: the warning does not suggest it."""
    few = {"k_choice": {"method": "validation", "rows": 3}}
    plain = warnings_of({"metrics": few, "training": {"config": {"prototypes": None}}})
    assert "--k-folds 5" in plain[0]
    with_prototypes = warnings_of({"metrics": few, "training": {"config": {"prototypes": 20.0}}})
    assert "--val-size" in with_prototypes[0] and "--k-folds" not in with_prototypes[0]
