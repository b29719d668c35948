"""The synthetic generator (training.data.synthetic): shapes and types, one distribution for
every sample of a seed, samples that do not depend on how they are consumed, and the overlap
knob doing what it says."""

from __future__ import annotations

import numpy as np
import pytest
from sklearn.neighbors import KNeighborsClassifier

from training.data import synthetic
from training.data.synthetic import clustered_classes


def test_shapes_types_and_balanced_classes():
    X, y = clustered_classes(5000, n_features=32, n_classes=10)
    assert X.shape == (5000, 32) and X.dtype == np.float32
    assert y.shape == (5000,) and y.dtype == np.int64
    assert set(np.unique(y)) == set(range(10))
    assert np.bincount(y).min() > 400


def test_a_sample_does_not_depend_on_the_block_size(monkeypatch):
    X, y = clustered_classes(3000, n_features=8, n_classes=3, subspace_dim=4)
    monkeypatch.setattr(synthetic, "BLOCK_ROWS", 1000)
    X2, y2 = clustered_classes(3000, n_features=8, n_classes=3, subspace_dim=4)
    np.testing.assert_array_equal(y[:1000], y2[:1000])  # the first block is the same
    assert X.shape == X2.shape


def test_samples_of_one_seed_share_a_distribution_and_differ_in_rows():
    X, y = clustered_classes(3000, n_features=16, n_classes=4, subspace_dim=8)
    X_test, y_test = clustered_classes(
        1000, n_features=16, n_classes=4, subspace_dim=8, sample_seed=2
    )
    assert not np.array_equal(X[:1000], X_test)
    model = KNeighborsClassifier(5).fit(X, y)
    other = clustered_classes(1000, n_features=16, n_classes=4, subspace_dim=8, seed=9)
    # the test sample is drawn from the training sample's classes, another seed's is not
    assert model.score(X_test, y_test) > model.score(*other) + 0.3


def test_more_overlap_means_a_harder_problem():
    scores = []
    for overlap in (0.2, 1.5):
        X, y = clustered_classes(3000, n_features=16, n_classes=5, subspace_dim=8, overlap=overlap)
        X_test, y_test = clustered_classes(
            1000, n_features=16, n_classes=5, subspace_dim=8, overlap=overlap, sample_seed=3
        )
        scores.append(KNeighborsClassifier(5).fit(X, y).score(X_test, y_test))
    assert scores[0] > scores[1] + 0.2


def test_out_fills_a_given_array_and_bad_arguments_are_refused(tmp_path):
    out = np.lib.format.open_memmap(tmp_path / "x.npy", "w+", np.float32, (100, 8))
    X, _ = clustered_classes(100, n_features=8, n_classes=3, subspace_dim=4, out=out)
    assert X is out and np.abs(out).sum() > 0
    with pytest.raises(ValueError, match="subspace_dim=9"):
        clustered_classes(10, n_features=8, subspace_dim=9)
    with pytest.raises(ValueError, match="out has shape"):
        clustered_classes(10, n_features=8, subspace_dim=4, out=np.empty((5, 8), np.float32))
