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


def test_a_soft_vote_at_a_temperature_is_the_soft_vote_of_the_scaled_map():
    """ "soft@t" weighs the k nearest by exp(-t d^2): the soft vote of the embeddings
    multiplied by sqrt(t) (here t = 1/4, a scale of 1/2, exact in float). Names round-trip
    through vote_name / parse_vote; majority and soft are at t = 1."""
    from training.evaluation.evaluate import (
        SERVED_VOTES,
        knn_accuracies_by_rule,
        knn_predictions,
        parse_vote,
        vote_name,
    )

    rng = np.random.default_rng(5)
    z_ref, y_ref = rng.normal(size=(80, 3)), rng.integers(0, 3, 80)
    z_q = rng.normal(size=(60, 3))
    ks = (1, 3, 5, 9, 15)
    # the soft rule's answers on the halved embeddings, as labels: the tempered vote on the
    # embeddings as they are gets every one of them right, at every k
    halved = knn_predictions(z_ref / 2, y_ref, z_q / 2, 3, ks, "soft")
    plain = knn_predictions(z_ref, y_ref, z_q, 3, ks, "soft")
    for k in ks:
        by_vote = knn_accuracies_by_rule(z_ref, y_ref, z_q, halved[k], 3, (k,), ("soft@0.25",))
        assert by_vote["soft@0.25"][k] == 1.0
    # the temperature changes the votes on this data
    assert any((halved[k] != plain[k]).any() for k in ks)
    assert SERVED_VOTES == ("majority", "soft", "soft@0.5", "soft@0.25")
    for name in SERVED_VOTES:
        assert vote_name(*parse_vote(name)) == name
    assert parse_vote("majority") == ("majority", 1.0) and parse_vote("soft@0.5") == ("soft", 0.5)
    with pytest.raises(ValueError, match="soft_prior"):
        knn_accuracies_by_rule(z_ref, y_ref, z_q, halved[1], 3, ks, ("soft_prior@0.5",))
