"""The soft-neighbour score that judges a fit's stages on rows held out of it
(``training.distributed.sharded_stats.soft_neighbour_score``): its value on toy problems
against NCA's p_i written out directly, its blindness to the map's scale, its truncation
to the nearest references, and which score judges which held-out rows."""

from __future__ import annotations

import numpy as np
import pytest

from training import NCA
from training.distributed.ranks import ProcessGroup
from training.distributed.sharded_stats import (
    SOFT_NEIGHBOURS,
    SOFT_TEMPERATURES,
    soft_neighbour_score,
)
from training.evaluation.evaluate import knn_accuracies

ONE = ProcessGroup()  # a single process: a group of one


def direct_score(z_ref, y_ref, z_q, y_q, m=None):
    """max over the temperature grid of the mean p_i, from the definition: the softmax of
    -t d_ij over the m nearest references (all by default), no shift, no vectorised gaps."""
    d2 = ((z_q[:, None, :].astype(np.float64) - z_ref[None, :, :]) ** 2).sum(-1)  # (Q, N)
    order = np.argsort(d2, axis=1, kind="stable")[:, : m or len(z_ref)]
    nearest_positive = np.where(d2 > 0, d2, np.inf).min(1)  # exact duplicates passed over
    t0 = 1.0 / np.exp(np.log(nearest_positive[np.isfinite(nearest_positive)]).mean())
    best = 0.0
    for factor in SOFT_TEMPERATURES:
        p = []
        for i in range(len(z_q)):
            w = np.exp(-t0 * factor * d2[i, order[i]])
            p.append(w[y_ref[order[i]] == y_q[i]].sum() / w.sum())
        best = max(best, float(np.mean(p)))
    return best


def test_a_toy_line_scores_nca_p_i_at_its_best_temperature():
    # class 1 at 0.9 is the nearest reference of the query at 0 (class 0); class 0's two
    # references lie just beyond: p rises from 0 at a high t towards 2/3 at a low one
    z_ref = np.array([[0.9], [1.0], [1.1], [4.0]], dtype=np.float32)
    y_ref = np.array([1, 0, 0, 1])
    z_q = np.array([[0.0], [4.2]], dtype=np.float32)
    y_q = np.array([0, 1])
    score = soft_neighbour_score(z_ref, y_ref, z_q, y_q, len(z_q), ONE)
    assert score == pytest.approx(direct_score(z_ref, y_ref, z_q, y_q), rel=1e-9)
    # the second query's nearest reference (4.0) is its class, the first's is not: at the
    # best temperature p_0 is well above 0 and p_1 well above 1/2
    assert 0.5 < score < 1.0


def test_the_score_is_blind_to_the_scale_of_the_map():
    rng = np.random.default_rng(0)
    z_ref = rng.normal(size=(500, 4)).astype(np.float32)
    y_ref = (z_ref[:, 0] + 0.5 * rng.normal(size=500) > 0).astype(int)
    z_q = rng.normal(size=(80, 4)).astype(np.float32)
    y_q = (z_q[:, 0] > 0).astype(int)
    score = soft_neighbour_score(z_ref, y_ref, z_q, y_q, len(z_q), ONE)
    assert score == pytest.approx(direct_score(z_ref, y_ref, z_q, y_q, SOFT_NEIGHBOURS), rel=1e-6)
    for c in (1e-3, 0.3, 7.0, 250.0):
        scaled = soft_neighbour_score(c * z_ref, y_ref, c * z_q, y_q, len(z_q), ONE)
        assert scaled == pytest.approx(score, rel=1e-6), c
    # labels that disagree with the geometry score lower; labels that follow it, higher
    assert soft_neighbour_score(z_ref, y_ref, z_q, 1 - y_q, len(z_q), ONE) < score
    assert soft_neighbour_score(z_ref, y_ref, z_q, y_q, len(z_q), ONE) > 0.5


def test_rows_with_exact_duplicates_among_the_references_keep_the_score_blind_to_scale():
    # a 3-d integer grid, 3 copies of each point as references and one more as the held-out
    # row: every nearest squared distance is 0, so t0 comes from each row's nearest positive
    # one (a fixed t0 made S(0.01 A) 0.53 against S(A) 0.67: a shrinking penalty read as harm)
    rng = np.random.default_rng(0)
    grid = np.stack(np.meshgrid(*[np.arange(3)] * 3, indexing="ij"), -1).reshape(-1, 3)
    z_ref = np.repeat(grid, 3, axis=0).astype(np.float32)  # (81, 3)
    y_ref = (z_ref.sum(1) + rng.normal(size=len(z_ref)) > 3).astype(int)
    z_q = grid.astype(np.float32)  # (27, 3)
    y_q = (z_q.sum(1) + rng.normal(size=len(z_q)) > 3).astype(int)
    score = soft_neighbour_score(z_ref, y_ref, z_q, y_q, len(z_q), ONE)
    assert score == pytest.approx(direct_score(z_ref, y_ref, z_q, y_q, SOFT_NEIGHBOURS), rel=1e-9)
    for c in (0.01, 0.3, 3.0, 100.0):
        scaled = soft_neighbour_score(c * z_ref, y_ref, c * z_q, y_q, len(z_q), ONE)
        assert scaled == pytest.approx(score, rel=1e-6), c
    # every reference a copy of its query's point: no positive distance anywhere, and p_i
    # is the share of the row's class among its copies, whatever t
    same_point = np.zeros((5, 2), dtype=np.float32)
    labels = np.array([0, 0, 0, 1, 1])
    one_row = soft_neighbour_score(same_point, labels, same_point[:1], np.array([0]), 1, ONE)
    assert one_row == pytest.approx(0.6)


def test_only_the_nearest_references_vote():
    # a query at the origin (class 0): SOFT_NEIGHBOURS references of class 1 on the unit
    # circle, then 100 of class 0 on a circle of radius 1.5. Over every reference p_0 > 0 at
    # every temperature; over the nearest SOFT_NEIGHBOURS it is 0
    def circle(n, radius):
        angle = np.linspace(0, 2 * np.pi, n, endpoint=False)
        return radius * np.stack([np.cos(angle), np.sin(angle)], 1)

    z_ref = np.vstack([circle(SOFT_NEIGHBOURS, 1.0), circle(100, 1.5)]).astype(np.float32)
    y_ref = np.array([1] * SOFT_NEIGHBOURS + [0] * 100)
    z_q, y_q = np.zeros((1, 2), dtype=np.float32), np.array([0])
    assert soft_neighbour_score(z_ref, y_ref, z_q, y_q, 1, ONE) == 0.0
    assert direct_score(z_ref, y_ref, z_q, y_q) > 0.1
    # ... and with one class-0 reference among the nearest, it is what the nearest give
    y_ref[0] = 0
    score = soft_neighbour_score(z_ref, y_ref, z_q, y_q, 1, ONE)
    assert score == pytest.approx(direct_score(z_ref, y_ref, z_q, y_q, SOFT_NEIGHBOURS), rel=1e-6)
    assert score == pytest.approx(1 / SOFT_NEIGHBOURS, rel=1e-5)  # equidistant: 1 of 64


def test_separated_classes_score_one_and_a_rank_without_rows_adds_nothing():
    z_ref = np.array([[0.0], [0.1], [10.0], [10.1]], dtype=np.float32)
    y_ref = np.array([0, 0, 1, 1])
    z_q = np.array([[0.05], [10.05]], dtype=np.float32)
    assert soft_neighbour_score(z_ref, y_ref, z_q, np.array([0, 1]), 2, ONE) == pytest.approx(1.0)
    # a rank holding none of the held-out rows: its sums are zero, the mean is the others'
    empty = soft_neighbour_score(z_ref, y_ref, z_q[:0], np.array([], int), 2, ONE)
    assert empty == 0.0


@pytest.mark.filterwarnings("ignore:.*did not converge")  # 3 iterations: enough to judge
def test_held_out_rows_are_judged_by_the_soft_score_a_validation_split_reports_accuracy():
    rng = np.random.default_rng(0)
    centres = rng.normal(scale=1.0, size=(3, 6))  # overlapping classes
    y = rng.integers(0, 3, size=9000)
    X = centres[y] + rng.normal(size=(9000, 6))
    judged = NCA(n_components=2, max_iter=3, random_state=0).fit(X, y)
    assert judged.stage_measure_.startswith("soft-neighbour score of ")
    assert judged.stage_measure_.endswith("training rows held out of the fit")
    start = judged.stages_[0]["start_score"]
    # a mean of probabilities, not a count of right answers out of the 900 rows held out
    assert 0.0 < start <= 1.0 and abs(start * 900 - round(start * 900)) > 1e-6
    validated = NCA(n_components=2, max_iter=3, random_state=0).fit(
        X[:2000], y[:2000], X_val=X[2000:2300], y_val=y[2000:2300]
    )
    assert validated.stage_measure_ == "soft-neighbour score of 300 validation rows"
    checks = [r for r in validated.history_ if "val_accuracy" in r]
    accuracies = [r["val_accuracy"] for r in checks]  # counts of right answers of 300 rows
    assert accuracies and all(abs(a * 300 - round(a * 300)) < 1e-9 for a in accuracies)
    scores = [r["val_score"] for r in checks]  # the judge: mean probabilities
    assert all(0.0 < s <= 1.0 and abs(s * 300 - round(s * 300)) > 1e-6 for s in scores)
    assert validated.stages_[0]["start_score"] not in accuracies
    # the accuracy reported is the kept map's 1-NN accuracy (the served k), within a row
    z_val, z_train = validated.transform(X[2000:2300]), validated.transform(X[:2000])
    served = knn_accuracies(z_train, y[:2000], z_val, y[2000:2300], 3, (1,))[1]
    assert validated.best_val_accuracy_ == pytest.approx(served, abs=1.01 / 300)
