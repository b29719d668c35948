"""A candidate stage on sampled query rows (``Problem(query_rows=...)``, the plan's
``candidate_rows``): candidate sets kept for those rows only read exactly like the rows of
the full table, the loss and gradient equal those of full tables averaged over the same
rows, a row without a kept set is an error, and the estimator samples rows above
``CANDIDATE_QUERY_MAX_ROWS`` only, deterministically."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from sklearn.neighbors import KNeighborsClassifier

from training import NCA
from training.data.synthetic import clustered_classes
from training.model import plan as fit_plan
from training.model.options import fit_settings, with_options
from training.numerics import evenly_spaced_rows
from training.objectives.neighbourhood import RowTable, nearest_candidates
from training.objectives.registry import make_objective
from training.optim.candidates import CandidateSearch
from training.optim.problem import Problem


@pytest.fixture(scope="module")
def data():
    X, y = clustered_classes(900, n_features=10, n_classes=4, subspace_dim=6, overlap=0.8)
    return torch.as_tensor(X), torch.as_tensor(y)


def test_a_row_table_reads_like_the_full_table_on_its_rows(data):
    X, y = data
    full = nearest_candidates(X, y, 5)  # (N, 10)
    rows = torch.tensor([7, 3, 850, 0, 411])
    table = RowTable(full[rows], rows, len(y))
    assert table.shape == full.shape
    asked = torch.tensor([0, 850, 7, 7])
    assert torch.equal(table[asked], full[asked])
    with pytest.raises(IndexError, match=r"no candidate set is kept for rows \[4\]"):
        table[torch.tensor([3, 4])]


@pytest.mark.parametrize("objective", ["nca", "nca-log", "knca-majority"])
def test_the_loss_on_kept_rows_equals_the_full_tables_on_the_same_rows(data, objective):
    X, y = data
    rows = torch.as_tensor(evenly_spaced_rows(len(y), 200))
    common = dict(
        transform="linear",
        n_components=3,
        n_candidates=6,
        search=CandidateSearch(kind="exact"),
    )
    made = make_objective(objective, 3 if objective.startswith("knca") else 1, n_classes=4)
    kept = Problem(X, y, made, query_rows=rows, **common)
    full = Problem(X, y, made, **common)
    full.query_rows = rows
    theta = np.random.default_rng(0).normal(size=3 * X.shape[1]) * 0.3
    kept.refresh_candidates(theta)
    full.refresh_candidates(theta)
    assert isinstance(kept.candidates, RowTable) and kept.candidates.table.shape == (200, 12)
    loss_kept, grad_kept, _ = kept.loss_and_grad(theta)
    loss_full, grad_full, _ = full.loss_and_grad(theta)
    assert loss_kept == pytest.approx(loss_full, rel=1e-6)
    np.testing.assert_allclose(grad_kept, grad_full, rtol=1e-5, atol=1e-7)
    # the audits read the kept rows only
    sample = kept.sample_rows(50)
    assert set(sample.tolist()) <= set(rows.tolist())
    assert kept.outside_mass(theta, sample) == pytest.approx(full.outside_mass(theta, sample))


@pytest.mark.parametrize(
    "n_samples, params, expected",
    [
        (fit_plan.CANDIDATE_QUERY_MAX_ROWS, {}, None),  # at the limit: every row
        (fit_plan.CANDIDATE_QUERY_MAX_ROWS + 1, {}, fit_plan.CANDIDATE_QUERY_MAX_ROWS),
        (10**6, {"solver": "adam"}, None),  # Adam's batches draw from every row
        (10**6, {"n_candidates": None}, None),  # exact: no candidate stage
        (10**6, {"distributed": True}, None),  # torchrun: each rank's shard (the plan said
        # 131,072 sampled rows, which report.json showed, where none were sampled)
    ],
)
def test_the_plan_samples_query_rows_only_above_the_limit(n_samples, params, expected):
    params = dict(params)
    distributed = params.pop("distributed", False)
    settings = vars(fit_settings(NCA(**with_options(params)).get_params()))
    assert fit_plan.resolve_plan(settings, n_samples, distributed).candidate_rows == expected


def test_a_fit_on_sampled_rows_is_deterministic_and_learns(monkeypatch):
    """With the limit lowered to 600 of 2,000 rows, the candidate stage reads 600 rows'
    sets; two fits agree bit for bit, and the map beats its random start."""
    monkeypatch.setattr(fit_plan, "CANDIDATE_QUERY_MAX_ROWS", 600)
    law = dict(n_features=12, n_classes=4, subspace_dim=4, overlap=0.5, noise=1.0)
    X, y = clustered_classes(2000, **law)
    Xt, yt = clustered_classes(1000, sample_seed=2, **law)

    def fit():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return NCA(
                n_components=3,
                n_candidates=8,
                init="random",
                max_iter=30,
                random_state=0,
                options=dict(exact_finish=0, select_stages=False),
            ).fit(X, y)

    a, b = fit(), fit()
    assert a.plan_.candidate_rows == 600
    np.testing.assert_array_equal(a.components_, b.components_)

    def accuracy(Z, Zt):
        return KNeighborsClassifier(5).fit(Z, y).score(Zt, yt)

    projection = np.random.default_rng(0).normal(size=(12, 3))
    assert (
        accuracy(a.transform(X), a.transform(Xt)) > accuracy(X @ projection, Xt @ projection) + 0.05
    )
