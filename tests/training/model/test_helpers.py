"""Unit tests of the training helpers: the init rule, the stratified split, the
standardiser, the choice of k and the optimiser's monitor."""

from __future__ import annotations

import itertools
import re
import warnings

import numpy as np
import pytest

from training import NCA
from training.data.datasets import stratified_split
from training.distributed.ranks import current_group
from training.distributed.sharded_stats import standardizer
from training.evaluation.evaluate import choose_k, choose_rule_and_k
from training.model.initialization import resolve_auto
from training.optim.candidates import audit_disagreement, audit_rows

# ------------------------------------------------------------------ resolve_auto


@pytest.mark.parametrize(
    "d, D, N, C, expected",
    [
        (2, 10, 100, 5, "lda"),  # d <= C - 1 and N > C
        (4, 10, 100, 5, "lda"),  # d = C - 1 exactly
        (5, 10, 100, 5, "pca"),  # d > C - 1, d < min(D, N)
        (3, 10, 5, 5, "pca"),  # LDA needs N > C
        (10, 10, 100, 5, "identity"),  # d = D: nothing to reduce
        (8, 20, 8, 3, "identity"),  # d = N
        (1, 1, 50, 2, "lda"),  # d = D = C - 1
        (1, 1, 2, 2, "identity"),  # N = C: no LDA; d = D: no PCA
    ],
)
def test_resolve_auto_follows_scikit_learns_rule(d, D, N, C, expected):
    assert resolve_auto(d, D, N, C) == expected


def test_auto_init_gives_a_full_rank_map_for_every_ordering_of_small_sizes():
    """Like scikit-learn's test_auto_init: every (N, D, C, d) with d <= D, including data of
    lower rank than d and LDA with fewer directions than d, through the fit's own path
    (``preparation.initialize``: PCA and LDA from ``sharded_stats``). With a tolerance no
    gradient misses the fit takes no step: its map is the initial map, scaled."""
    rng = np.random.default_rng(0)
    for N, D, C, d in itertools.product((3, 5, 7), (2, 4, 6), (2, 3, 5), (1, 2, 3, 4)):
        if d > D or C > N:
            continue
        X = rng.normal(size=(N, D))
        y = np.arange(N) % C
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = NCA(n_components=d, max_iter=1, tol=1e30, random_state=0).fit(X, y)
        assert model.init_used_ == resolve_auto(d, D, N, C), (N, D, C, d)
        A = model.components_
        assert A.shape == (d, D) and np.all(np.isfinite(A)), (N, D, C, d)
        assert np.linalg.matrix_rank(A) == d, (N, D, C, d, model.init_used_)


# ------------------------------------------------------------------ stratified_split


def test_stratified_split_is_a_partition_with_per_class_proportions():
    y = np.repeat(np.arange(4), [50, 20, 9, 3])
    train, val, test = stratified_split(y, (0.2, 0.1), seed=0)
    joined = np.concatenate([train, val, test])
    assert np.array_equal(np.sort(joined), np.arange(len(y)))  # disjoint, complete
    for part in (train, val, test):
        assert np.array_equal(part, np.sort(part))
    assert np.bincount(y[val], minlength=4).tolist() == [10, 4, 2, 1]
    assert np.bincount(y[test], minlength=4).tolist() == [5, 2, 1, 0]
    assert np.bincount(y[train], minlength=4).tolist() == [35, 14, 6, 2]  # >= 2 each


def test_stratified_split_gives_a_small_class_one_member_but_keeps_two_in_train():
    y = np.array([0] * 40 + [1] * 3 + [2] * 2)
    train, val = stratified_split(y, (0.1,), seed=1)
    assert np.bincount(y[val], minlength=3).tolist() == [4, 1, 0]
    assert np.bincount(y[train], minlength=3).tolist() == [36, 2, 2]


def test_stratified_split_is_deterministic_per_seed():
    y = np.repeat(np.arange(3), 30)
    a = stratified_split(y, (0.3,), seed=7)
    b = stratified_split(y, (0.3,), seed=7)
    c = stratified_split(y, (0.3,), seed=8)
    assert all(np.array_equal(p, q) for p, q in zip(a, b, strict=True))
    assert not np.array_equal(a[1], c[1])


# ------------------------------------------------------------------ standardizer


def fit_standardizer(X, name="feature"):
    """mean and scale (D,) of the fit's standardisation of every row of X, in one process."""
    return standardizer(name, X, len(X), current_group())


def test_fit_standardizer_gives_zero_mean_unit_variance_and_leaves_constants_alone():
    rng = np.random.default_rng(0)
    X = np.column_stack([rng.normal(3.0, 2.0, 500), np.full(500, 7.0), rng.uniform(0, 1, 500)])
    mean, scale = fit_standardizer(X)
    np.testing.assert_allclose(mean, X.mean(axis=0))
    assert scale[1] == 1.0  # a constant feature is centred, not divided by ~0
    np.testing.assert_allclose(scale[[0, 2]], X[:, [0, 2]].std(axis=0))
    Z = (X - mean) / scale
    np.testing.assert_allclose(Z.mean(axis=0), 0.0, atol=1e-12)
    np.testing.assert_allclose(Z[:, [0, 2]].std(axis=0), 1.0)
    assert np.all(Z[:, 1] == 0.0)


def test_fit_standardizer_treats_rounding_noise_as_constant():
    X = np.full((100, 1), 1e6) + np.tile([0.0, 1e-10], 50)[:, None]  # spread ~1e-16 relative
    assert fit_standardizer(X)[1][0] == 1.0


# ------------------------------------------------------------------ choose_k


@pytest.mark.parametrize(
    "accuracies, fallback, expected",
    [
        ({1: 0.90, 3: 0.95, 5: 0.95}, 5, 5),  # the training k when it is among the best
        ({1: 0.90, 3: 0.95, 5: 0.95}, 1, 3),  # else the smallest best
        ({1: 0.97, 3: 0.95}, 3, 1),
        ({}, 4, 4),  # no validation set
    ],
)
def test_choose_k(accuracies, fallback, expected):
    assert choose_k(accuracies, fallback=fallback) == expected


@pytest.mark.parametrize(
    "by_rule, fallback, expected",
    [
        ({"majority": {1: 0.90, 5: 0.92}, "soft": {1: 0.90, 9: 0.95}}, 1, ("soft", 9)),
        ({"majority": {1: 0.90, 5: 0.95}, "soft": {1: 0.90, 9: 0.95}}, 1, ("majority", 5)),
        ({"majority": {1: 0.95, 5: 0.95}, "soft": {5: 0.95}}, 5, ("majority", 5)),
        ({"soft": {1: 0.97, 3: 0.97}}, 3, ("soft", 3)),  # one rule given: its k
        ({"majority": {}, "soft": {}}, 4, ("majority", 4)),  # no validation rows
    ],
)
def test_choose_rule_and_k(by_rule, fallback, expected):
    """The best (rule, k) on validation; among equal rules the first (majority), and the k
    as choose_k chooses it."""
    assert choose_rule_and_k(by_rule, fallback=fallback) == expected


# ------------------------------------------------------------------ the verbose table

HEADER = "{:>10} {:>20} {:>10}".format("Iteration", "Objective Value", "Time(s)")
ROW = r"\[NCA\] +{} +-?\d\.\d{{6}}e[+-]\d\d +\d+\.\d\d"


def verbose_fit(capsys, **params) -> list[str]:
    """The lines a verbose 2-d fit on 300 blob rows (the last 100 its validation set) prints."""
    from tests.training.problems import blobs

    X, y = blobs(300)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        NCA(n_components=2, random_state=0, tol=0, verbose=1, **params).fit(
            X[:200], y[:200], X[200:], y[200:]
        )
    return capsys.readouterr().out.splitlines()


def test_verbose_prints_scikit_learns_table_with_the_validation_accuracy(capsys):
    lines = verbose_fit(capsys, max_iter=2)
    at = lines.index(f"[NCA] {HEADER}")
    assert lines[at - 1] == "[NCA]" and lines[at + 1] == f"[NCA] {'-' * len(HEADER)}"
    check = ROW.format(1) + r"  val_accuracy \d\.\d{4}  val_score \d\.\d{4}"
    assert re.fullmatch(check, lines[at + 2])
    assert re.fullmatch(ROW.format(2), lines[at + 3])  # not a check (every 5 iterations)
    assert re.fullmatch(r"\[NCA\] Training took +\d+\.\d\ds\.", lines[-1])


def test_a_later_stage_announces_itself_and_shares_the_table(capsys):
    lines = verbose_fit(capsys, max_iter=2, n_candidates=5, options=dict(exact_finish=2))
    assert sum(HEADER in line for line in lines) == 1
    opening = [i for i, line in enumerate(lines) if "Finishing on the exact objective" in line]
    assert len(opening) == 1
    assert lines[opening[0]].endswith("2 iterations over 200 of 200 query rows, l2=0.03")
    # the finish's first iteration (the fit's 3rd) is checked: a later stage earns its cost
    check = ROW.format(3) + r"  val_accuracy \d\.\d{4}  val_score \d\.\d{4}"
    assert re.fullmatch(check, lines[opening[0] + 1])


# ------------------------------------------------------------------ candidate-mode audit


def audited(iteration, candidate, exact):
    return {
        "iteration": iteration,
        "sample_candidate_objective": candidate,
        "sample_exact_objective": exact,
    }


def test_audit_disagreement_names_a_candidate_objective_that_rises_while_the_exact_falls():
    history = [audited(1, 0.50, 0.50), audited(5, 0.66, 0.60), audited(10, 0.71, 0.55)]
    message = audit_disagreement(history, n_rows=512)
    assert message is not None
    assert "rose from 0.5000 to 0.7100" in message and "fell from 0.6000 (iteration 5)" in message
    assert "512 sampled training points" in message and "n_candidates" in message


@pytest.mark.parametrize(
    "history",
    [
        [audited(1, 0.5, 0.5), audited(5, 0.6, 0.58), audited(10, 0.7, 0.69)],  # both rise
        [audited(1, 0.5, 0.5), audited(5, 0.6, 0.60), audited(10, 0.6, 0.595)],  # within 0.01
        [audited(1, 0.7, 0.7), audited(5, 0.6, 0.60), audited(10, 0.5, 0.5)],  # both fall
        [audited(1, 0.5, 0.5)],  # one audit: nothing to compare
        [{"iteration": 1, "objective": 0.5}],  # exact mode: no audit at all
    ],
)
def test_audit_disagreement_is_quiet_when_the_measures_agree(history):
    assert audit_disagreement(history) is None


@pytest.mark.parametrize(
    "objective, exact, warns",
    [
        ("nca", 0.45, True),  # 0.15 above: more than 0.1
        ("nca", 0.55, False),  # 0.05 above
        ("nca-log", 0.45, False),  # 0.15 nats: within 0.25
        ("nca-log", 0.30, True),  # 0.30 nats
    ],
)
def test_audit_disagreement_names_a_gap_that_stays_open_to_the_end(objective, exact, warns):
    """Both measures rise together, so there is no drift, but at the last audit the
    candidate objective (0.60) stands far above the exact one."""
    history = [audited(1, 0.40, 0.20), audited(5, 0.55, 0.28), audited(10, 0.60, exact)]
    message = audit_disagreement(history, n_rows=512, objective=objective)
    if not warns:
        assert message is None
        return
    assert f"is 0.6000, {0.60 - exact:.4f} above their exact objective {exact:.4f}" in message
    assert "too little of each point's neighbour mass" in message and "n_candidates" in message


def test_audit_disagreement_judges_the_gap_at_the_end_not_on_the_way():
    # far apart at first (fresh start), together at the end: quiet
    history = [audited(1, 0.70, 0.30), audited(5, 0.66, 0.60), audited(10, 0.70, 0.68)]
    assert audit_disagreement(history) is None
    # one audit is enough to see a gap
    assert audit_disagreement([audited(1, 0.70, 0.30)]) is not None


def test_audit_disagreement_falls_back_to_the_leave_one_out_accuracy():
    history = [
        {"iteration": i, "sample_candidate_objective": c, "sample_loo_accuracy": a}
        for i, c, a in ((1, 0.2, 0.50), (5, 0.3, 0.60), (10, 0.4, 0.45))
    ]
    assert "leave-one-out k-NN accuracy" in audit_disagreement(history)


def test_audit_rows_are_spread_and_distinct():
    assert audit_rows(10).tolist() == list(range(10))
    rows = audit_rows(100_000)
    assert len(rows) == 512 and rows[0] == 0 and rows[-1] == 99_999
    assert np.all(np.diff(rows) > 0)


def test_global_standardizer_centres_and_shares_one_scale():
    X = np.random.default_rng(0).normal(size=(500, 3)) * [1.0, 2.0, 0.0] + [5.0, -1.0, 7.0]
    mean, scale = fit_standardizer(X, "global")
    np.testing.assert_allclose(mean, X.mean(0))
    assert np.all(scale == scale[0])
    assert np.mean(((X - mean) / scale).var(0)) == pytest.approx(1.0)  # unit mean variance
    const = np.full((10, 2), 3.0)
    assert fit_standardizer(const, "global")[1].tolist() == [1.0, 1.0]


def pixels_with_quiet_border(n=1200, seed=0):
    """Images whose class lives in 16 bright pixels; 48 border pixels are near-constant
    noise (all one unit: per-feature scaling blows the noise up to the signal's weight)."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 4, n)
    prototypes = rng.uniform(0, 1, (4, 16))
    signal = prototypes[y] + rng.normal(0, 0.25, (n, 16))
    border = rng.normal(0, 0.01, (n, 48))
    return np.hstack([signal, border]), y


def test_auto_standardisation_picks_a_shared_scale_for_pixels_and_per_feature_for_units():
    from sklearn.datasets import load_wine

    from training.distributed.ranks import ProcessGroup
    from training.distributed.sharded_stats import choose_standardizer

    X, y = pixels_with_quiet_border()
    chosen, scores = choose_standardizer(X, y, 0, 4, ProcessGroup())
    assert chosen == "global" and scores["global"] > scores["feature"] + 0.05
    X, y = load_wine(return_X_y=True)  # features in different units (proline ~ 1000)
    chosen, scores = choose_standardizer(X, y, 0, 3, ProcessGroup())
    assert chosen == "feature" and scores["feature"] > scores["global"] + 0.05


def test_the_estimator_records_its_standardisation():
    X, y = pixels_with_quiet_border(400)
    auto = NCA(n_components=4, max_iter=5, random_state=0).fit(X, y)
    assert auto.standardization_ == "global" and set(auto.standardization_scores_) == {
        "feature",
        "global",
    }
    assert np.all(auto.scale_ == auto.scale_[0])
    fixed = NCA(n_components=4, max_iter=5, random_state=0, options=dict(standardize=False)).fit(
        X, y
    )
    assert fixed.standardization_ == "none" and fixed.standardization_scores_ is None
    np.testing.assert_array_equal(fixed.mean_, 0.0)
    np.testing.assert_array_equal(fixed.scale_, 1.0)
