"""Data whose features are all constant over the training rows is refused before the fit
(every distance between rows would be 0); one feature that varies is enough."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp

from training import NCA
from training.distributed import sharded_stats
from training.distributed.ranks import current_group

Y = np.arange(30) % 3


@pytest.mark.parametrize(
    "X",
    [
        np.full((30, 4), -2.0),
        np.zeros((30, 4), dtype=np.float32),
        sp.csr_matrix(np.full((30, 4), 3.0)),  # every entry stored
        sp.csr_matrix((30, 4)),  # no entry stored: all zeros
    ],
    ids=["dense", "float32-zeros", "csr-full", "csr-empty"],
)
def test_constant_features_are_refused(X):
    with pytest.raises(ValueError, match=r"every one of its 4 features has the same value in all"):
        NCA(n_components=2, max_iter=2).fit(X, Y)


def test_a_column_float32_cannot_resolve_is_refused_naming_it():
    """Values near 1.7e9 that differ by about 15 (timestamps a few seconds apart): the fit,
    standardising in float64, learned from them, but the service projects raw float32
    values, which are 128 apart there: the served map answered at chance (found by the
    hostile pass). So do 1 and 1 + 1e-12."""
    rng = np.random.default_rng(0)
    X = np.column_stack([1.7e9 + 30 * Y + rng.uniform(0, 10, len(Y)), rng.normal(size=len(Y))])
    with pytest.raises(
        ValueError, match=r"column 0 has values around 1\.7e\+09 .* resolves only 128"
    ):
        NCA(n_components=2, max_iter=2).fit(X, Y)
    X = np.ones((30, 3))
    X[::2, 1] += 1e-12
    with pytest.raises(ValueError, match=r"column 1 .* subtract its mean"):
        NCA(n_components=2, max_iter=2, options={"standardize": "none"}).fit(X, Y)


def test_values_below_float32s_range_are_said_to_be_lost_not_equal():
    """1e-300 and 2e-300 differ in the file, but both are 0 in float32."""
    X = np.full((30, 2), 1e-300)
    X[::2] = 2e-300
    with pytest.raises(ValueError, match=r"only below what float32.* can hold"):
        NCA(n_components=2, max_iter=2).fit(X, Y)


def test_columns_float32_resolves_are_fitted():
    """Timestamps over a year (std ~9e6 at 1.7e9: spacing 128) and float32 data as given."""
    rng = np.random.default_rng(1)
    X = np.column_stack([1.7e9 + rng.uniform(0, 3e7, 30), rng.normal(size=30)])
    NCA(n_components=2, max_iter=2).fit(X, Y)
    NCA(n_components=2, max_iter=2).fit(X.astype(np.float32), Y)


@pytest.mark.parametrize("sparse", [False, True])
def test_one_feature_that_varies_in_one_row_is_enough(sparse):
    X = np.ones((30, 4))
    X[7, 3] = 2.0
    X = sp.csr_matrix(X) if sparse else X
    assert sharded_stats.varying_features(X, current_group()) == 1
    NCA(n_components=2, max_iter=2).fit(X, Y)  # fitted, no error


def test_varying_features_counts_each_column_once():
    X = np.zeros((5, 6))
    X[1, 0], X[4, 2], X[2, 2], X[0, 5] = 1.0, -1.0, 3.0, np.float64(1e-300)
    assert sharded_stats.varying_features(X, current_group()) == 3
    assert sharded_stats.varying_features(sp.csr_matrix(X), current_group()) == 3
