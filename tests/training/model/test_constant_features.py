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


def test_values_that_float32_cannot_tell_apart_are_constant_to_the_fit():
    """1 and 1 + 1e-12 are one float32 value: the fit (in float32) sees no difference."""
    X = np.ones((30, 3))
    X[::2, 1] += 1e-12
    with pytest.raises(ValueError, match="expected at least one feature that varies"):
        NCA(n_components=2, max_iter=2, options={"standardize": "none"}).fit(X, Y)


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
