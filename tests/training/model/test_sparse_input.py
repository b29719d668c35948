"""Sparse inputs (training.model.sparse_input): a CSR or CSC X is fitted and transformed
without ever being densified, to the same numbers as its dense copy; what a sparse X cannot
take is refused in one line naming the setting."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import scipy.sparse as sp
from sklearn.datasets import load_digits
from sklearn.decomposition import TruncatedSVD

from training import NCA

A0 = np.random.default_rng(0).standard_normal((8, 64)) * 0.1  # (d, D) a fixed start


@pytest.fixture(scope="module")
def digits():
    X, y = load_digits(return_X_y=True)
    return X, y


def fit(X, y, **params):
    options = {"init_scale": 1.0, "select_stages": False, **params.pop("options", {})}
    settings = dict(n_components=8, random_state=0, init=A0, **params)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return NCA(**settings, options=options).fit(X, y)


@pytest.mark.parametrize("n_candidates", [None, 8])
@pytest.mark.parametrize("to_sparse", [sp.csr_matrix, sp.csc_matrix, sp.coo_matrix])
def test_a_sparse_fit_takes_the_steps_of_its_dense_copy(digits, n_candidates, to_sparse):
    """From the same start, the first L-BFGS steps on a sparse X and on its dense copy
    (unstandardised, as sparse inputs are) reach the same map: Z = X A^T and its gradient
    are the same numbers up to float32 summation order."""
    X, y = digits
    options = {"exact_finish": 0}  # the candidate stage's two steps alone
    dense = fit(
        X, y, max_iter=2, n_candidates=n_candidates, options=options | {"standardize": "none"}
    )
    sparse = fit(to_sparse(X), y, max_iter=2, n_candidates=n_candidates, options=options)
    np.testing.assert_allclose(sparse.components_, dense.components_, atol=1e-4)  # of ~0.2
    assert sparse.objective_value_ == pytest.approx(dense.objective_value_, rel=1e-5)
    assert sparse.standardization_ == "none"
    np.testing.assert_array_equal(sparse.mean_, 0.0)
    np.testing.assert_array_equal(sparse.scale_, 1.0)


def test_transform_of_sparse_rows_equals_that_of_their_dense_copy(digits):
    X, y = digits
    model = fit(X, y, max_iter=5)
    for to_sparse in (sp.csr_matrix, sp.csc_matrix, sp.csr_array):
        np.testing.assert_array_equal(model.transform(to_sparse(X)), model.transform(X))
    assert model.transform(sp.csr_matrix(X)).dtype == np.float32


def test_a_sparse_fit_learns_and_never_densifies(digits, monkeypatch):
    """The default fit (an uncentred PCA start, candidate sets, the exact finish) on sparse
    rows, with every way scipy densifies a matrix made to fail."""

    def refuse(self, *args, **kwargs):
        raise AssertionError("the fit densified X")

    for name in ("toarray", "todense"):
        monkeypatch.setattr(sp._base._spbase, name, refuse)  # scipy's base of every format
    X, y = digits
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = NCA(n_components=8, n_candidates=8, random_state=0).fit(
            sp.csr_matrix(X[:1200]), y[:1200]
        )
    assert model.init_used_ == "pca"
    monkeypatch.undo()

    def accuracy(z_train, z_test):
        nearest = ((z_test[:, None] - z_train[None]) ** 2).sum(-1).argmin(1)
        return (y[:1200][nearest] == y[1200:]).mean()

    learned = accuracy(model.transform(X[:1200]), model.transform(X[1200:]))
    start = TruncatedSVD(8, random_state=0).fit(X[:1200])  # the uncentred PCA it starts from
    assert learned > accuracy(start.transform(X[:1200]), start.transform(X[1200:])) + 0.02


@pytest.mark.parametrize(
    "params, message",
    [
        (dict(options={"standardize": "feature"}), r"standardize='feature' centres every"),
        (dict(options={"standardize": "global"}), r"standardize='global' centres every"),
        (dict(options={"transformation": "diagonal"}), r"transformation='diagonal' is not"),
        (dict(init="lda"), r"init='lda' needs the D x D within-class scatter"),
        (dict(options={"prototypes": 10}), r"prototypes=10 learns prototypes from dense rows"),
    ],
)
def test_what_a_sparse_x_cannot_take_is_refused_naming_the_setting(digits, params, message):
    X, y = digits
    settings = dict(n_components=8, max_iter=2, **params)
    if settings.get("options", {}).get("transformation") == "diagonal":
        settings["n_components"] = 64
    with pytest.raises(ValueError, match=message):
        NCA(**settings).fit(sp.csr_matrix(X), y)


@pytest.mark.parametrize("bad", [np.nan, np.inf, 1e39])
def test_a_sparse_x_storing_a_value_float32_cannot_hold_is_refused(digits, bad):
    X, y = digits
    Xs = sp.csr_matrix(X)
    Xs.data[7] = bad
    with pytest.raises(ValueError, match=r"NaN|infinit|float32"):
        NCA(n_components=8, max_iter=2).fit(Xs, y)


def test_sparse_validation_rows_beside_a_dense_x_are_standardised_as_it_is(digits):
    """A dense X is standardised; its validation rows given sparse must be too: the fit
    equals the one with the same rows given dense."""
    X, y = digits
    settings = dict(n_components=4, max_iter=10, random_state=0)
    options = {"early_stopping": True, "standardize": "feature"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dense = NCA(**settings, options=options).fit(X[:400], y[:400], X[400:600], y[400:600])
        mixed = NCA(**settings, options=options).fit(
            X[:400], y[:400], sp.csr_matrix(X[400:600]), y[400:600]
        )
    assert mixed.best_val_accuracy_ == dense.best_val_accuracy_
    np.testing.assert_array_equal(mixed.components_, dense.components_)


def test_a_full_rank_map_of_a_wide_sparse_x_is_refused_before_any_work():
    """n_components=None means d = D: for 20 rows of 200,000 features that is a 298 GiB
    map; refused with the size and the fix, not a MemoryError."""
    X = sp.random(20, 200_000, density=1e-4, format="csr", random_state=0)
    y = np.arange(20) % 2
    with pytest.raises(ValueError, match=r"n_components=None means d = D = 200000 .* give"):
        NCA().fit(X, y)
