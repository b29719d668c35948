"""Candidate sets found by an IVF index (training.optim.candidates): the same sets as
the exact search when the index is searched exhaustively, at least the stated share of the
neighbour mass when it is not, the same rows whatever subset is asked for, deterministic,
and a fit on them that agrees with one on exact sets."""

from __future__ import annotations

import warnings

import pytest
import torch

from training import NCA
from training.data.synthetic import clustered_classes
from training.objectives.neighbourhood import nearest_candidates
from training.optim.candidates import (
    MIN_MASS_RATIO,
    CandidateSearch,
    held_mass,
    ivf_candidates,
)
from training.optim.problem import _log_neighbour_probabilities

pytest.importorskip("faiss")


@pytest.fixture(scope="module")
def embedded():
    """12,000 points of 6 classes in 8 dimensions: classes large enough for an IVF index of
    their own (FLAT_MAX_ROWS), overlapping enough for other-class neighbours to matter."""
    X, y = clustered_classes(12_000, n_features=8, n_classes=6, subspace_dim=8, overlap=0.7)
    return torch.as_tensor(X), torch.as_tensor(y)


def as_sets(candidates: torch.Tensor) -> torch.Tensor:
    return torch.sort(candidates, dim=1).values


def test_an_exhaustive_ivf_search_finds_the_exact_sets(embedded):
    z, labels = embedded
    exact = nearest_candidates(z, labels, 10)
    found = ivf_candidates(z, labels, 10, nprobe=10**6, seed=0)
    same = (as_sets(exact) == as_sets(found)).all(1).float().mean()
    assert float(same) > 0.999  # ties in float32 distances aside


def test_a_probed_search_holds_the_stated_share_of_the_neighbour_mass(embedded):
    z, labels = embedded
    rows = torch.arange(0, len(z), 23)
    log_p = _log_neighbour_probabilities(z, rows)
    exact = nearest_candidates(z, labels, 10, rows=rows)
    found = ivf_candidates(z, labels, 10, nprobe=16, seed=0)
    ratio = float(held_mass(log_p, found[rows]).mean() / held_mass(log_p, exact).mean())
    assert MIN_MASS_RATIO <= ratio <= 1.0 + 1e-6


def test_the_candidates_of_some_rows_are_those_rows_of_all(embedded):
    z, labels = embedded
    rows = torch.tensor([5, 0, 11_999, 700, 4242])
    every = ivf_candidates(z, labels, 7, nprobe=8, seed=3)
    some = ivf_candidates(z, labels, 7, nprobe=8, seed=3, rows=rows)
    assert torch.equal(some, every[rows])


def test_the_search_is_deterministic_for_a_seed(embedded):
    z, labels = embedded
    assert torch.equal(
        ivf_candidates(z, labels, 5, nprobe=4, seed=1),
        ivf_candidates(z, labels, 5, nprobe=4, seed=1),
    )


def test_sets_follow_the_layout_same_class_first_nearest_first(embedded):
    z, labels = embedded
    found = ivf_candidates(z, labels, 6, nprobe=32, seed=0)
    same, other = found[:, :6], found[:, 6:]
    rows = torch.arange(len(z))[:, None]
    assert bool((labels[same.clamp_min(0)] == labels[:, None])[same >= 0].all())
    assert bool((labels[other.clamp_min(0)] != labels[:, None])[other >= 0].all())
    assert not bool((found == rows).any())  # never its own candidate
    d = ((z[found.clamp_min(0)] - z[:, None, :]) ** 2).sum(-1)  # (N, 12)
    assert bool((d[:, :6].diff(dim=1) >= -1e-4).all())
    assert bool((d[:, 6:].diff(dim=1) >= -1e-4).all())


def test_the_search_raises_its_effort_when_the_mass_falls_short():
    search = CandidateSearch(kind="ivf", nprobe=8)
    search.tune(0.99)
    assert search.nprobe == 8
    search.tune(0.80)
    assert search.nprobe == 16


def test_auto_is_exact_below_the_size_limit_and_on_cuda_like_devices():
    small = torch.zeros((100, 2))
    assert not CandidateSearch().approximate(small)
    assert CandidateSearch(kind="ivf").approximate(small)
    assert not CandidateSearch(kind="exact").approximate(torch.zeros((10**5, 2)))


def test_a_fit_on_ivf_candidates_agrees_with_one_on_exact_candidates():
    """The same candidate fit on 4,000 points, its sets found exactly or by IVF: the 5-NN
    accuracy of 1,500 test rows within 2 points."""
    from sklearn.neighbors import KNeighborsClassifier

    kwargs = dict(n_features=16, n_classes=5, subspace_dim=6, overlap=0.5, noise=0.5)
    X, y = clustered_classes(4000, **kwargs)
    X_test, y_test = clustered_classes(1500, sample_seed=7, **kwargs)
    scores = {}
    for kind in ("exact", "ivf"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = NCA(
                n_components=4,
                random_state=0,
                n_candidates=8,
                max_iter=20,
                options=dict(candidate_search=kind, exact_finish=0),
            ).fit(X, y)
        knn = KNeighborsClassifier(5).fit(model.transform(X), y)
        scores[kind] = knn.score(model.transform(X_test), y_test)
    assert abs(scores["ivf"] - scores["exact"]) <= 0.02, scores
    assert min(scores.values()) > 0.5, scores  # well above chance (0.2)
