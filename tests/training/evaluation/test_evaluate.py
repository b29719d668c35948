"""Offline k-NN search (training.evaluation.evaluate.nearest_references): FAISS's flat first
pass gives exactly the service's exact_knn answer, duplicated references (ties within the
re-rank margin) included."""

from __future__ import annotations

import numpy as np
import pytest

from service.core.knn import exact_knn
from training.evaluation.evaluate import nearest_references


@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("k", [1, 5, 15])
def test_the_flat_search_gives_exact_knns_answer(ties, k):
    rng = np.random.default_rng(k)
    refs = rng.normal(size=(4000, 6)).astype(np.float32)
    queries = rng.normal(size=(200, 6)).astype(np.float32)
    if ties:  # references duplicated up to 4 times, queries on references: equal distances
        for copy in range(1, 4):
            refs[1000 * copy : 1000 * copy + 50] = refs[:50]
        queries[:40] = refs[10:50]
    expected = exact_knn(queries, refs, k)
    found = nearest_references(queries, refs, k, flat_search=True)
    np.testing.assert_array_equal(found[1], expected[1])
    np.testing.assert_array_equal(found[0], expected[0])


def test_fewer_references_than_k_plus_the_margin():
    rng = np.random.default_rng(0)
    refs, queries = rng.normal(size=(6, 3)), rng.normal(size=(4, 3))
    expected = exact_knn(queries, refs, 6)
    found = nearest_references(queries, refs, 6, flat_search=True)
    np.testing.assert_array_equal(found[1], expected[1])


def test_accuracies_by_rule_from_one_search_equal_each_rule_scored_alone():
    """The job scores majority and soft votes from one neighbour search; each rule's
    accuracies are those of knn_predictions with that rule (k above N dropped, no queries
    -> empty), and soft_prior, which needs a threshold, is refused."""
    from training.evaluation.evaluate import knn_accuracies_by_rule, knn_predictions

    rng = np.random.default_rng(3)
    z_ref, y_ref = rng.normal(size=(60, 3)), rng.integers(0, 3, 60)
    z_q, y_q = rng.normal(size=(40, 3)), rng.integers(0, 3, 40)
    ks = (1, 3, 5, 61)
    both = knn_accuracies_by_rule(z_ref, y_ref, z_q, y_q, 3, ks, ("majority", "soft"))
    for rule in ("majority", "soft"):
        alone = knn_predictions(z_ref, y_ref, z_q, 3, ks, rule)  # its own search per rule
        assert both[rule] == {k: float(np.mean(p == y_q)) for k, p in alone.items()}
        assert set(both[rule]) == {1, 3, 5}
    assert both["majority"] != both["soft"]  # the votes differ on this data
    empty = knn_accuracies_by_rule(z_ref, y_ref, z_q[:0], y_q[:0], 3, ks, ("majority", "soft"))
    assert empty == {"majority": {}, "soft": {}}
    with pytest.raises(ValueError, match="soft_prior"):
        knn_accuracies_by_rule(z_ref, y_ref, z_q, y_q, 3, ks, ("soft_prior",))
