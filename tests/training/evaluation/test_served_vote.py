"""The job's served vote (training.job.evaluate): with --decision-rule auto it chooses among
the majority vote and the soft vote at each temperature on validation, and serves the soft
vote at t as the service's soft rule on the map multiplied by sqrt(t), so that what the
report states is what the service answers.

The toy: two far-apart groups of three references in the plane, one validation (and test)
row in each. Row 1 (class A) has an A at squared distance 1 and two Bs at 3: the majority
of 3 says B, the soft vote at t says A when 1 > 2 e^{-2t}, t > 0.35. Row 2 (class B) has
an A at 1 and two Bs at 2: the soft vote says B when 2 e^{-t} > 1, t < 0.69. Only t = 0.5
of (1, 0.5, 0.25) serves both rows; the majority vote and 1-NN serve one each."""

from __future__ import annotations

import numpy as np
import pytest

from service.core.artifact import read_artifact
from service.core.knn import decide, exact_knn, project
from training.config import TrainConfig
from training.data.datasets import Split
from training.job import evaluate, save_artifact, served_vote_record
from training.model.initialization import initial_components

A, B = 0, 1
SHIFT = 8.0  # the inputs sit at the toy + SHIFT; the map's offset takes it off again
# (6, 2): an A at distance 1 from each row, two Bs at sqrt(3) from row 1 and sqrt(2) from row 2
REFERENCES = SHIFT + np.array(
    [[1, 0], [0, 3**0.5], [0, -(3**0.5)], [101, 0], [100, 2**0.5], [100, -(2**0.5)]]
)
REFERENCE_CLASSES = np.array([A, B, B, A, B, B])
ROWS = SHIFT + np.array([[0.0, 0.0], [100.0, 0.0]])  # (2, 2): validation and test rows
ROW_CLASSES = np.array([A, B])


class FittedMap:
    """What evaluate and save_artifact read of a fitted NCA: z = x - SHIFT (the identity
    and an offset), no learned prototypes."""

    projection_ = np.eye(2, dtype=np.float32)
    offset_ = np.full(2, -SHIFT, dtype=np.float32)
    mean_ = np.zeros(2)
    scale_ = np.ones(2)
    n_components = 2
    prototypes_ = None


def toy_split() -> Split:
    return Split(
        REFERENCES, REFERENCE_CLASSES, ROWS, ROW_CLASSES, ROWS, ROW_CLASSES, np.array(["A", "B"])
    )


def config_of(rule: str) -> TrainConfig:
    return TrainConfig(data="toy", decision_rule=rule, k_folds="0", plots=False)


def served(rule: str):
    return evaluate(FittedMap(), toy_split(), config_of(rule), log=lambda *_: None)


def test_auto_serves_the_soft_vote_at_the_temperature_best_on_validation():
    ev = served("auto")
    assert ev.vote == "soft@0.5" and ev.rule == "soft" and ev.default_k == 3
    assert set(ev.val_accuracy_by_rule) == {"majority", "soft", "soft@0.5", "soft@0.25"}
    assert ev.val_accuracy_by_rule["soft@0.5"][3] == 1.0
    assert max(ev.val_accuracy_by_rule["majority"].values()) == 0.5
    assert max(ev.val_accuracy_by_rule["soft"].values()) == 0.5
    # the served map carries the temperature: sqrt(0.5) x the fitted one, in float32
    scale = np.float32(np.sqrt(0.5))
    np.testing.assert_array_equal(ev.projection, FittedMap.projection_ * scale)
    np.testing.assert_array_equal(ev.offset, FittedMap.offset_ * scale)
    assert ev.projection.dtype == np.float32
    assert ev.map_scale == float(scale)  # the factor applied, as report.json records it
    # every split is in the served map, as the service projects it
    np.testing.assert_array_equal(ev.z_ref, project(REFERENCES, ev.projection, ev.offset))
    np.testing.assert_array_equal(ev.z_val, project(ROWS, ev.projection, ev.offset))
    # the service's soft rule on the served map answers what the report says
    z = project(ROWS, ev.projection, ev.offset)
    dist, idx = exact_knn(z, ev.z_ref, ev.default_k)
    answers = decide(ev.y_ref[idx], dist, 2, ev.rule)[0]
    np.testing.assert_array_equal(answers, ev.test_predictions)
    np.testing.assert_array_equal(answers, ROW_CLASSES)
    assert ev.test_accuracy[3] == 1.0


@pytest.mark.parametrize("rule", ["majority", "soft"])
def test_a_rule_given_is_served_on_the_fitted_map(rule):
    ev = served(rule)
    assert ev.vote == ev.rule == rule and ev.val_accuracy_by_rule is None
    np.testing.assert_array_equal(ev.projection, FittedMap.projection_)
    np.testing.assert_array_equal(ev.offset, FittedMap.offset_)
    assert ev.map_scale == 1.0
    assert max(ev.val_accuracy.values()) == 0.5  # neither serves both rows


def test_the_artifact_serves_what_the_report_says_and_a_warm_start_undoes_its_scale(tmp_path):
    """The artifact written from that evaluation holds the served map (the fitted one times
    float32 sqrt(0.5), offset included), its manifest the vote and the factor; the
    service's rule on it answers the report's predictions, and a warm start from it begins
    at the fitted map."""
    ev = served("auto")
    record = served_vote_record(ev)
    scale = float(np.float32(np.sqrt(0.5)))
    assert record["vote"] == "soft@0.5" and record["map_scale"] == scale
    assert record["decision_rule"] == "soft"
    assert record["votes_offered"] == ["majority", "soft", "soft@0.5", "soft@0.25"]
    report = {"training": {"history": []}, "metrics": record, "data": {}}
    out = tmp_path / "m"
    save_artifact(out, config_of("auto"), "toy", toy_split(), FittedMap(), ev, report)
    art = read_artifact(out)
    np.testing.assert_array_equal(art.projection, ev.projection)
    np.testing.assert_array_equal(art.offset, FittedMap.offset_ * np.float32(scale))
    assert art.decision_rule == "soft" and art.default_k == 3
    assert art.manifest["metrics"]["map_scale"] == scale
    z = project(ROWS, art.projection, art.offset)
    dist, idx = exact_knn(z, np.asarray(art.embeddings), art.default_k)
    answers = decide(np.asarray(art.labels)[idx], dist, 2, art.decision_rule)[0]
    np.testing.assert_array_equal(answers, ROW_CLASSES)
    A0, name = initial_components(
        str(out), ROWS, 2, random_state=np.random.default_rng(0), scale=np.ones(2)
    )
    assert name == "artifact"
    np.testing.assert_allclose(A0, FittedMap.projection_, rtol=1e-7)


def test_a_rule_given_records_its_vote_at_the_maps_own_scale():
    record = served_vote_record(served("soft"))
    assert record == {"vote": "soft", "map_scale": 1.0}
