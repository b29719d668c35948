"""The audit a candidate-mode fit runs on itself: the exact objective and leave-one-out
k-NN accuracy of a fixed sample, against the candidate objective the optimiser sees."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from service.core.knn import decide
from tests.training.problems import blobs, candidate_gaps, fit_history, hard_noisy
from training import NCA
from training.objectives.neighbourhood import objective_sum
from training.objectives.registry import make_objective
from training.optim.problem import Problem, Refreshed


@pytest.mark.parametrize("objective, k", [("nca", 1), ("knca-all", 3)])
def test_audit_figures_equal_direct_computations(objective, k):
    X, y = blobs(300)
    Xt = torch.as_tensor(X, dtype=torch.float32)
    yt = torch.as_tensor(y)
    problem = Problem(
        Xt,
        yt,
        make_objective(objective, k, n_classes=4),
        transform="linear",
        n_components=3,
        n_candidates=5,
    )
    theta = np.random.default_rng(1).normal(size=(3, 6))
    problem.refresh_candidates(theta)
    rows = torch.arange(0, 300, 7)
    got = problem.audit(theta, rows)

    z = Xt @ torch.as_tensor(theta, dtype=torch.float32).T
    candidate = objective_sum(
        z, yt, problem.objective, rows=rows, candidates=problem.candidates, method="autograd"
    )
    assert got["sample_candidate_objective"] == pytest.approx(float(candidate) / len(rows), 1e-5)
    if objective == "nca":
        exact = objective_sum(z, yt, problem.objective, rows=rows, method="autograd")
        assert got["sample_exact_objective"] == pytest.approx(float(exact) / len(rows), 1e-5)
    else:
        assert "sample_exact_objective" not in got  # kNCA's exact objective is not cheap
    # leave-one-out k-NN accuracy by brute force in float64
    zz = X @ theta.T
    d2 = ((zz[rows.numpy(), None, :] - zz[None, :, :]) ** 2).sum(-1)  # (B, N)
    d2[np.arange(len(rows)), rows.numpy()] = np.inf
    idx = np.argsort(d2, axis=1, kind="stable")[:, :k]
    predicted, _ = decide(y[idx], np.take_along_axis(d2, idx, 1), 4, "majority")
    assert got["sample_loo_accuracy"] == pytest.approx(np.mean(predicted == y[rows.numpy()]))


def test_candidate_fits_record_the_audit_and_exact_fits_do_not():
    X, y = blobs(600)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        candidate = NCA(n_components=3, n_candidates=8, max_iter=12, random_state=0).fit(X, y)
        exact = NCA(n_components=3, n_candidates=None, max_iter=12, random_state=0).fit(X, y)
    audited = [r for r in candidate.history_ if "sample_exact_objective" in r]
    # the audit runs in the candidate stage, not in the exact finish after it
    n_candidate_stage = candidate.n_iter_ - candidate.exact_finish_iter_
    assert candidate.exact_finish_iter_ > 0
    assert [r["iteration"] for r in audited] == [
        i for i in range(1, n_candidate_stage + 1) if i == 1 or i % 5 == 0
    ]
    assert all(0 <= r["sample_loo_accuracy"] <= 1 for r in audited)
    assert candidate.candidate_warning_ is None  # easy blobs: the two measures agree
    assert not any("sample_exact_objective" in r for r in exact.history_)
    assert exact.candidate_warning_ is None


def candidate_problem(n=300, n_candidates=5, objective="nca", k=1, seed=0):
    X, y = blobs(n, seed)
    return (
        X,
        y,
        Problem(
            torch.as_tensor(X),  # float64: exact comparisons with numpy
            torch.as_tensor(y),
            make_objective(objective, k, n_classes=4),
            transform="linear",
            n_components=3,
            n_candidates=n_candidates,
        ),
    )


def test_outside_mass_equals_the_softmax_mass_off_the_candidates():
    X, _, problem = candidate_problem()
    theta = np.random.default_rng(1).normal(size=(3, 6))
    problem.refresh_candidates(theta)
    moved = theta + np.random.default_rng(2).normal(0, 0.5, theta.shape)  # stale candidates
    rows = torch.tensor([0, 17, 150, 299])
    z = X @ moved.T
    expected = []
    for i in rows.tolist():
        logits = -((z - z[i]) ** 2).sum(1)
        logits[i] = -np.inf
        p = np.exp(logits - logits.max())
        p /= p.sum()
        cand = problem.candidates[i].numpy()
        expected.append(1.0 - p[cand[cand >= 0]].sum())
    assert problem.outside_mass(moved, rows) == pytest.approx(np.mean(expected), abs=1e-12)
    # every point a candidate: nothing is outside
    _, _, everyone = candidate_problem(n_candidates=299)
    everyone.refresh_candidates(moved)
    assert everyone.outside_mass(moved, rows) == pytest.approx(0.0, abs=1e-12)


class ScriptedProblem:
    """A stand-in for Problem whose outside mass follows a script (one value per call)."""

    n_candidates = 4

    def __init__(self, masses):
        self.masses = list(masses)
        self.refreshed_at = []

    def refresh_candidates(self, theta, n_candidates=None):
        if n_candidates is not None:
            self.n_candidates = n_candidates
        self.refreshed_at.append(float(theta[0]))
        return Refreshed(changed=1.0, replaced=1.0, search_mass_ratio=None)  # exact search

    def outside_mass(self, theta, rows):
        return self.masses.pop(0)


def test_candidate_watch_refreshes_when_the_inside_mass_falls_past_the_tolerance():
    from training.optim.candidates import CandidateWatch

    # outside masses: refresh (inside 0.90), three iterations, inside 0.89, 0.86, 0.84; the
    # third lost 6.7% of 0.90 > 5%; refresh (inside 0.70: a low level that stays is not a
    # fall), one iteration at inside 0.67 (4.3% lost)
    problem = ScriptedProblem([0.10, 0.11, 0.14, 0.16, 0.30, 0.33])
    watch = CandidateWatch(problem, rows=None, refresh_every=100, refresh_tol=0.05)
    watch.refresh(np.array([0.0]))
    decisions = [watch.after_iteration(np.array([float(i)])) for i in (1, 2, 3)]
    assert [due for due, _ in decisions] == [False, False, True]
    assert [f["candidate_outside_mass"] for _, f in decisions] == [0.11, 0.14, 0.16]
    watch.refresh(np.array([3.0]))
    assert watch.after_iteration(np.array([4.0]))[0] is False
    assert problem.refreshed_at == [0.0, 3.0] and watch.n_refreshes == 2


def test_candidate_watch_refreshes_on_the_count_alone_without_a_tolerance():
    from training.optim.candidates import CandidateWatch

    watch = CandidateWatch(ScriptedProblem([]), rows=None, refresh_every=3, refresh_tol=None)
    watch.refresh(np.array([0.0]))  # asks for no mass: the script is empty
    assert [watch.after_iteration(np.array([0.0])) for _ in range(3)] == [
        (False, {"n_candidates": 4}),
        (False, {"n_candidates": 4}),
        (True, {"n_candidates": 4}),
    ]


class LadderProblem(ScriptedProblem):
    """Fresh candidate sets of K = 4, 8, 16, 32 per kind hold the scripted masses."""

    def __init__(self, fresh_masses):
        super().__init__([0.0] * 10)
        self.fresh_masses = fresh_masses
        self.asked = []

    def fresh_inside_mass(self, theta, rows, ks):
        self.asked.append(list(ks))
        return self.fresh_masses


@pytest.mark.parametrize(
    "fresh_masses, chosen",
    [
        ([0.95, 0.97, 0.99, 1.0], 4),  # enough at the requested K
        ([0.40, 0.70, 0.91, 0.97], 16),  # the smallest K that holds 90%
        ([0.10, 0.20, 0.40, 0.60], 32),  # none does: the largest allowed
    ],
)
def test_candidate_watch_chooses_the_smallest_k_that_holds_the_target_mass(fresh_masses, chosen):
    from training.optim.candidates import CandidateWatch

    problem = LadderProblem(fresh_masses)
    watch = CandidateWatch(problem, None, refresh_every=5, refresh_tol=0.05, target_mass=0.9)
    watch.refresh(np.array([0.0]))
    assert problem.asked == [[4, 8, 16, 32]]  # n_candidates x 1, 2, 4, 8
    assert problem.n_candidates == chosen and watch.sizes == [chosen]


class ApproximateSearchProblem(LadderProblem):
    """Fresh exact sets hold 0.95 of the mass; the approximate search installs sets that
    hold 90% of that (0.855), and the map does not move: its outside mass stays 0.145."""

    def __init__(self):
        super().__init__([0.95, 0.97, 0.99, 1.0])
        self.masses = [0.145] * 10

    def refresh_candidates(self, theta, n_candidates=None):
        super().refresh_candidates(theta, n_candidates)
        return Refreshed(changed=1.0, replaced=1.0, search_mass_ratio=0.9)


def test_the_drift_rule_measures_the_installed_sets_not_the_exact_ones_k_was_chosen_on():
    """K is chosen on what exact sets would hold; the drift rule compares the mass the
    installed sets hold with what they held right after the refresh. With an approximate
    search holding 90% of the exact mass, a map that does not move is no fall: no refresh
    is due (a baseline of the exact 0.95 called every iteration a 10% fall)."""
    from training.optim.candidates import CandidateWatch

    problem = ApproximateSearchProblem()
    watch = CandidateWatch(problem, None, refresh_every=50, refresh_tol=0.05, target_mass=0.9)
    watch.refresh(np.array([0.0]))
    assert watch.baseline == pytest.approx(0.855)
    assert [watch.after_iteration(np.array([0.0]))[0] for _ in range(5)] == [False] * 5
    assert watch.n_refreshes == 1


def test_refreshing_on_the_signal_keeps_the_candidate_objective_honest():
    """On hard data a fixed refresh count lets the map pull non-candidates into
    neighbourhoods (the candidate objective runs far above the exact one on the audit
    sample); refreshing when the inside mass falls keeps the two together."""
    X, y = hard_noisy()
    fixed = fit_history(X, y, refresh_tol=None, candidate_mass=None)
    watched = fit_history(X, y, candidate_mass=None)
    assert max(candidate_gaps(fixed)) > 0.3
    assert max(candidate_gaps(watched)) < 0.1
    masses = [r["candidate_outside_mass"] for r in watched.history_]
    assert len(masses) == watched.n_iter_ and all(0 <= m <= 1 for m in masses)


def test_choosing_k_from_the_data_closes_the_gap_of_too_few_candidates():
    """Few informative dimensions and noisy labels keep neighbourhoods wide: 8 candidates
    per kind hold little of the neighbour mass even when fresh, and the candidate objective
    stays far from the exact one however often they are refreshed. Growing K closes it."""
    X, y = hard_noisy(n_features=20, n_informative=4)
    fixed_k = fit_history(X, y, candidate_mass=None)
    chosen_k = fit_history(X, y)
    assert candidate_gaps(fixed_k)[-1] > 0.2
    assert fixed_k.candidate_warning_ is not None  # the audit says so
    assert max(candidate_gaps(chosen_k)[2:]) < 0.1
    assert chosen_k.candidate_warning_ is None
    assert max(r["n_candidates"] for r in chosen_k.history_) > 8


def test_a_penalty_on_candidate_sets_is_what_l2_auto_avoids_and_the_audit_reports():
    """Why l2="auto" is 0 on candidate sets: the exact default penalty (DEFAULT_L2) keeps A
    small, the neighbourhoods stay wide, and even K grown from the data holds too little of
    the neighbour mass; the candidate objective then runs far above the exact one on the
    audit sample. The same fit with "auto" (0 here) stays faithful."""
    from training.model.plan import DEFAULT_L2

    X, y = hard_noisy(n_features=20, n_informative=4)
    penalised = fit_history(X, y, l2=DEFAULT_L2)
    assert penalised.l2_ == DEFAULT_L2
    assert max(candidate_gaps(penalised)[2:]) > 0.2
    assert penalised.candidate_warning_ is not None  # the audit says so
    auto = fit_history(X, y)
    assert auto.l2_ == 0.0
    assert max(candidate_gaps(auto)[2:]) < 0.1
    assert auto.candidate_warning_ is None


def nca_problem(X, y, n_candidates):
    """NCA on the rows X (N, 6) in float32, a map to 3 dimensions."""
    Xt = torch.as_tensor(X, dtype=torch.float32)
    return Problem(
        Xt,
        torch.as_tensor(y),
        make_objective("nca"),
        transform="linear",
        n_components=3,
        n_candidates=n_candidates,
    )


@pytest.mark.parametrize("n_candidates", [None, 5])
def test_figures_after_an_evaluation_read_its_embedding_and_no_other(n_candidates):
    """The watch's and the audit's figures at the map the last evaluation computed reuse its
    embedding; at any other map they embed afresh (a stale embedding is never read)."""
    X, y = blobs(300)
    problem = nca_problem(X, y, n_candidates)
    Xt = problem.X
    rng = np.random.default_rng(2)
    theta, other = rng.normal(size=(2, 3, 6))
    if n_candidates:
        problem.refresh_candidates(theta)
    problem.loss_and_grad(theta.ravel())
    reused = problem.embedded(theta.ravel())
    assert reused is problem.embedded(theta)  # the evaluation's tensor itself
    fresh = Xt @ torch.as_tensor(theta, dtype=torch.float32).T
    torch.testing.assert_close(reused, fresh, rtol=0, atol=0)
    assert not reused.requires_grad
    moved = problem.embedded(other)  # another map: embedded anew
    torch.testing.assert_close(moved, Xt @ torch.as_tensor(other, dtype=torch.float32).T)
    assert moved is not problem.embedded(other)
    rows = torch.arange(0, 300, 7)
    if n_candidates:  # the figures at the evaluated map equal those computed from scratch
        expected = nca_problem(X, y, n_candidates)
        expected.refresh_candidates(theta)
        assert problem.outside_mass(theta, rows) == expected.outside_mass(theta, rows)
        assert problem.audit(theta, rows) == expected.audit(theta, rows)


def test_after_an_adam_epoch_the_figures_embed_the_map_it_reached():
    """Adam changes its parameters in place after each batch's evaluation: the embedding kept
    from the epoch's last evaluation is of the map before its last update, and is not read
    at the map the epoch returns."""
    from training.optim.adam import AdamEpochs

    X, y = blobs(200)
    problem = nca_problem(X, y, 5)
    Xt = problem.X
    theta = np.random.default_rng(3).normal(size=3 * 6)
    problem.refresh_candidates(theta)
    solver = AdamEpochs(problem, 0.1, 50, np.random.default_rng(0), 1e-9)
    step = solver.step(theta, solver.start(theta))
    expected = Xt @ torch.as_tensor(step.x.reshape(3, 6), dtype=torch.float32).T
    torch.testing.assert_close(problem.embedded(step.x), expected)
