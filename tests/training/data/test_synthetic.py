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


MOVING = dict(n_features=40, n_classes=5, clusters_per_class=6, subspace_dim=8, noise=0.0)


def style_index(rows: np.ndarray, tol: float) -> np.ndarray:
    """(n,) the index of each row among the distinct rows (equal within ``tol``; float32
    sums differ in their last bits), in order of first appearance."""
    found: list[np.ndarray] = []
    index = np.empty(len(rows), np.int64)
    for i, row in enumerate(rows):
        match = next((j for j, f in enumerate(found) if np.abs(f - row).max() < tol), None)
        if match is None:
            found.append(row)
            match = len(found) - 1
        index[i] = match
    return index


def test_styles_add_one_of_m_vectors_orthogonal_to_the_class_subspace_and_nothing_else():
    plain, y = clustered_classes(3000, **MOVING)
    styled, y2 = clustered_classes(
        3000, **MOVING, nuisance_dim=4, nuisance_clusters=7, nuisance_scale=2.0
    )
    np.testing.assert_array_equal(y, y2)  # the same rows, classes and clusters
    added = styled.astype(np.float64) - plain
    styles = style_index(added, tol=1e-3)
    assert styles.max() + 1 == 7  # one of the 7 styles per row
    assert np.linalg.matrix_rank(added, tol=1e-3) == 4  # spanning nuisance_dim directions
    # orthogonal to the class subspace: the span of the noise-free rows
    class_basis = np.linalg.svd(plain, full_matrices=False)[2][: MOVING["subspace_dim"]]
    np.testing.assert_allclose(added @ class_basis.T, 0.0, atol=1e-4)
    # independent of the class: every class gets every style
    assert all(len(np.unique(styles[y == c])) == 7 for c in range(5))


def test_without_styles_a_sample_is_the_one_drawn_before_they_existed():
    """nuisance_dim = 0 draws nothing more, and styles of scale 0 change no row."""
    plain, _ = clustered_classes(2000, **MOVING)
    unstyled, _ = clustered_classes(2000, **MOVING, nuisance_dim=4, nuisance_scale=0.0)
    np.testing.assert_array_equal(plain, unstyled)
    first_row = clustered_classes(1, n_features=4, n_classes=2, subspace_dim=2)[0][0]
    # the sample of the generator before styles (commit 8d8faaa)
    np.testing.assert_allclose(first_row, [-0.302496, -0.049172, -0.300682, -0.286258], atol=1e-5)


@pytest.mark.parametrize(
    "extra, message",
    [
        (
            {"nuisance_dim": 33},
            r"nuisance_dim=33 must lie in \[0, n_features - subspace_dim = 32\]",
        ),
        ({"nuisance_dim": -1}, "nuisance_dim=-1 must lie in"),
        ({"nuisance_dim": 2, "nuisance_clusters": 0}, "nuisance_clusters=0 and"),
        ({"nuisance_dim": 2, "nuisance_scale": -1.0}, "nuisance_scale=-1.0 must be"),
    ],
)
def test_bad_style_arguments_are_refused(extra, message):
    with pytest.raises(ValueError, match=message):
        clustered_classes(10, **MOVING, **extra)
