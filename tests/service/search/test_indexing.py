"""Prebuilt, tuned indexes: the indexing command writes index.faiss into the artifact, the
service serves that very index with the tuned parameter, and the answers keep the agreement
the command measured."""

from __future__ import annotations

import json
from statistics import NormalDist

import faiss
import numpy as np
import pytest

import service.engine.model as engine_module
import service.search.tuning as indexing
from service.core.artifact import ArtifactError, read_artifact, rewrite_artifact, write_artifact
from service.core.knn import decide
from service.engine.model import load_model
from service.search.index import IndexParams, build_index, search
from tests.service.conftest import manifest, model_arrays, settings_for


def served_predictions(model, queries: np.ndarray) -> np.ndarray:
    art = model.artifact
    dist, idx = search(model, queries, art.default_k)
    return decide(model.labels[idx], dist, len(model.classes), art.decision_rule)[0]


@pytest.mark.parametrize("kind", ["ivf", "hnsw"])
def test_indexed_artifact_round_trip(model_dir, tmp_path, kind, monkeypatch):
    before = read_artifact(model_dir)
    assert before.validation_embeddings is not None  # the training job stores the split
    out = tmp_path / "indexed"
    record = indexing.index_artifact(
        model_dir, kind, target=0.995, confidence=0, out=out, log=lambda m: None
    )

    after = read_artifact(out)
    assert after.index_bytes is not None
    assert after.version != before.version  # a new artifact: pollers pick it up
    assert after.manifest["index"] == json.loads(json.dumps(record))
    for name in ("projection", "offset", "embeddings", "labels", "mean", "scale", "ids"):
        np.testing.assert_array_equal(getattr(after, name), getattr(before, name))
    np.testing.assert_array_equal(after.validation_embeddings, before.validation_embeddings)
    np.testing.assert_array_equal(after.validation_labels, before.validation_labels)
    assert after.manifest["extras"] == before.manifest["extras"]  # report and plots kept
    assert after.manifest["training"] == before.manifest["training"]

    # the service deserialises the prebuilt index: building one would fail here
    def no_build(embeddings, params):
        if params.kind != "flat":
            raise AssertionError("the service built an index the artifact carries")
        return build_index(embeddings, params)

    monkeypatch.setattr(engine_module, "build_index", no_build)
    model = load_model(out, settings_for(out))
    name = indexing.SEARCH_PARAMETER[kind][0]
    chosen = record["params"][name]
    assert model.index_type == kind
    assert model.index_params[name] == chosen
    if kind == "ivf":
        assert model.index.nprobe == chosen
    else:
        assert model.index.hnsw.efSearch == chosen

    # the served answers agree with exact search as the command measured
    exact = load_model(out, settings_for(out, index_type="flat"))
    queries = after.validation_embeddings
    agreement = np.mean(served_predictions(model, queries) == served_predictions(exact, queries))
    assert agreement == pytest.approx(record["tuning"]["chosen"]["label_agreement"])
    assert agreement >= 0.995


def test_explicit_settings_override_the_tuned_parameter(model_dir, tmp_path):
    out = tmp_path / "indexed"
    indexing.index_artifact(
        model_dir, "ivf", target=0.99, confidence=0, out=out, log=lambda m: None
    )
    assert load_model(out, settings_for(out, nprobe=3)).index.nprobe == 3
    flat = load_model(out, settings_for(out, index_type="flat"))
    assert flat.index_type == "flat" and isinstance(flat.index, faiss.IndexFlatL2)


def test_tuning_measures_settings_from_the_cheapest_and_picks_the_fastest_reaching_it(
    model_artifact,
):
    art = read_artifact(model_artifact[0])
    refs = np.ascontiguousarray(art.embeddings)
    labels = np.asarray(art.labels, np.int64)
    index = build_index(refs, IndexParams(kind="ivf"))
    chosen, trials, exact = indexing.tune(
        index,
        "ivf",
        refs,
        labels,
        len(art.classes),
        art.validation_embeddings,
        art.validation_labels,
        k=5,
        rule="majority",
        target=0.99,
        confidence=0,
    )
    one_stage = [t for t in trials if not t.recheck_margin]
    two_stage = [t for t in trials if t.recheck_margin]
    grid = list(indexing.SEARCH_PARAMETER["ivf"][1])
    assert [t.value for t in one_stage] == grid[: len(one_stage)]  # cheapest first
    reaching = [i for i, t in enumerate(one_stage) if t.agreement_bound >= 0.99]
    # it stops at the (SETTINGS_PAST_TARGET + 1)-th setting reaching the target, at full
    # agreement, or at the end of the grid; never later
    assert len(reaching) <= indexing.SETTINGS_PAST_TARGET + 1
    last = one_stage[-1]
    assert (
        (reaching[-1] == len(one_stage) - 1 and len(reaching) == indexing.SETTINGS_PAST_TARGET + 1)
        or last.label_agreement == 1.0
        or last.value == grid[-1]
        or grid[len(one_stage)] > index.nlist
    )
    # two-stage plans are scored from the one-stage runs; running them gives the same answers
    assert len(two_stage) <= indexing.PLANS_MEASURED
    for t in two_stage:
        assert t.label_agreement >= 0.99
        assert t.recheck_value > t.value and 1 <= t.recheck_margin <= 5
    reaching = [t for t in trials if t.label_agreement >= 0.99]
    assert chosen.microseconds_per_query == min(t.microseconds_per_query for t in reaching)
    # at nprobe = nlist an IVF is exhaustive: full agreement and recall
    index.nprobe = index.nlist
    full = indexing.answer_queries(
        index, refs, labels, len(art.classes), art.validation_embeddings, 5, "majority"
    )
    flat = indexing.answer_queries(
        build_index(refs, IndexParams(kind="flat")),
        refs,
        labels,
        len(art.classes),
        art.validation_embeddings,
        5,
        "majority",
    )
    np.testing.assert_array_equal(full.indices, flat.indices)
    assert exact.accuracy == pytest.approx(np.mean(flat.predicted == art.validation_labels), abs=0)


def test_recall_at_k_counts_shared_neighbours():
    exact = np.array([[1, 2, 3, 4], [5, 6, 7, 8]])
    approximate = np.array([[4, 3, 2, 1], [5, 6, 9, 10]])
    assert indexing.recall_at_k(approximate, exact) == pytest.approx((4 + 2) / 8)


def test_an_unreachable_target_leaves_the_artifact_alone(model_dir, monkeypatch, capsys):
    monkeypatch.setitem(indexing.SEARCH_PARAMETER, "ivf", ("nprobe", (1,)))
    before = manifest(model_dir)
    code = indexing.main(
        [
            str(model_dir),
            "--index",
            "ivf",
            "--agreement",
            "1.0",
            "--nlist",
            "30",
            "--confidence",
            "0",
        ]
    )
    assert code == 1
    err = capsys.readouterr().err
    assert (
        "no nprobe (one or two stages) reaches label agreement 1.0 (lower" in err
        and "nprobe=1" in err
    )
    assert manifest(model_dir) == before


def test_an_artifact_without_a_validation_split_is_refused(model_artifact, tmp_path, capsys):
    art = read_artifact(model_artifact[0])
    bare = write_artifact(tmp_path / "bare", **model_arrays(art))
    assert indexing.main([str(bare), "--index", "hnsw"]) == 1
    assert "no validation split to tune on" in capsys.readouterr().err


def test_the_command_indexes_in_place(model_dir, capsys):
    assert (
        indexing.main(
            [str(model_dir), "--index", "ivf", "--agreement", "0.99", "--confidence", "0"]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert "chose nprobe=" in printed and "agreement" in printed
    assert read_artifact(model_dir).manifest["index"]["kind"] == "ivf"
    assert load_model(model_dir, settings_for(model_dir)).index_type == "ivf"


def test_validation_arrays_go_together_and_are_checked(model_artifact, tmp_path):
    art = read_artifact(model_artifact[0])
    common = model_arrays(art)
    with pytest.raises(ArtifactError, match="go together"):
        write_artifact(tmp_path / "a", validation_embeddings=art.validation_embeddings, **common)
    with pytest.raises(ArtifactError, match=r"validation_embeddings\.npy: expected shape"):
        write_artifact(
            tmp_path / "b",
            validation_embeddings=art.validation_embeddings[:, :3],
            validation_labels=art.validation_labels,
            **common,
        )
    with pytest.raises(ArtifactError, match=r"validation_labels\.npy: label indices"):
        write_artifact(
            tmp_path / "c",
            validation_embeddings=art.validation_embeddings,
            validation_labels=np.full(len(art.validation_labels), 99, np.int32),
            **common,
        )


def test_a_prebuilt_index_of_other_references_is_refused(model_artifact, tmp_path):
    art = read_artifact(model_artifact[0])
    other = build_index(np.asarray(art.embeddings)[:100], IndexParams(kind="hnsw"))
    path = write_artifact(
        tmp_path / "m",
        **model_arrays(art),
        index_bytes=faiss.serialize_index(other).tobytes(),
    )
    with pytest.raises(ArtifactError, match="the index holds 100 vectors"):
        load_model(path, settings_for(path))


def test_the_service_serves_the_tuned_recheck_stage_unless_nprobe_is_set(model_dir, tmp_path):
    out = tmp_path / "indexed"
    record = indexing.index_artifact(
        model_dir, "ivf", target=0.99, confidence=0, out=out, log=lambda m: None
    )
    plan = {"nprobe": 1, "recheck_nprobe": record["params"]["nlist"], "recheck_margin": 9}
    record["params"].update(plan)
    art = read_artifact(out)
    rewrite_artifact(art, out, index_bytes=art.index_bytes, metadata={"index": record})

    model = load_model(out, settings_for(out))
    assert model.index.nprobe == 1
    assert (model.search_plan.recheck_nprobe, model.search_plan.recheck_margin) == (
        plan["recheck_nprobe"],
        9,
    )
    assert model.index_params["recheck_margin"] == 9
    # a margin above k rechecks every row with every list probed: exact answers
    exact = load_model(out, settings_for(out, index_type="flat"))
    queries = art.validation_embeddings
    np.testing.assert_array_equal(search(model, queries, 5)[1], search(exact, queries, 5)[1])
    # an explicit nprobe replaces the tuned plan, second stage included
    pinned = load_model(out, settings_for(out, nprobe=1))
    assert pinned.search_plan.recheck_parameters() is None
    assert "recheck_margin" not in pinned.index_params


def wilson_by_bisection(agreeing: int, n: int, z: float) -> float:
    """The p0 below p = agreeing / n at which the score statistic (p - p0) / sqrt(p0 (1 - p0)
    / n) equals z: Wilson's bound by its definition, found numerically."""
    p, lo, hi = agreeing / n, 0.0, agreeing / n
    for _ in range(200):
        mid = (lo + hi) / 2
        if (p - mid) / np.sqrt(mid * (1 - mid) / n) > z:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


@pytest.mark.parametrize(("agreeing", "n"), [(5000, 5000), (4996, 5000), (4990, 5000), (93, 100)])
@pytest.mark.parametrize("confidence", [0.9, 0.95, 0.99])
def test_agreement_lower_bound_is_wilsons(agreeing, n, confidence):
    z = NormalDist().inv_cdf(confidence)
    assert indexing.agreement_lower_bound(agreeing, n, confidence) == pytest.approx(
        wilson_by_bisection(agreeing, n, z), abs=1e-9
    )


def test_agreement_lower_bound_edges():
    bound = indexing.agreement_lower_bound
    assert bound(4990, 5000, 0) == 0.998  # confidence 0: the observed proportion
    assert bound(5000, 5000, 0.95) == pytest.approx(5000 / (5000 + NormalDist().inv_cdf(0.95) ** 2))
    assert bound(0, 10, 0.95) == 0.0
    # 0.998 from 5,000 queries at 95 %: 4 disagreements show it, 5 do not
    assert bound(4996, 5000, 0.95) >= 0.998 > bound(4995, 5000, 0.95)


def test_the_bound_falls_with_fewer_queries_and_more_confidence():
    bound = indexing.agreement_lower_bound
    assert bound(999, 1000, 0.95) < bound(9990, 10000, 0.95) < 0.999
    assert bound(9990, 10000, 0.99) < bound(9990, 10000, 0.95)


def test_a_validation_split_too_small_for_the_target_is_named(model_dir, capsys):
    before = manifest(model_dir)
    assert indexing.main([str(model_dir), "--index", "ivf", "--agreement", "0.998"]) == 1
    err = capsys.readouterr().err
    assert "validation queries cannot show label agreement 0.998 at confidence 0.95" in err
    assert "even full agreement bounds it at" in err
    assert manifest(model_dir) == before


def test_tuning_with_confidence_demands_more_than_the_observed_agreement(model_artifact):
    art = read_artifact(model_artifact[0])
    refs = np.ascontiguousarray(art.embeddings)
    labels = np.asarray(art.labels, np.int64)
    index = build_index(refs, IndexParams(kind="ivf"))
    common = dict(k=5, rule="majority", target=0.95)
    args = (index, "ivf", refs, labels, len(art.classes))
    val = (art.validation_embeddings, art.validation_labels)
    observed, _, _ = indexing.tune(*args, *val, confidence=0, **common)
    bounded, trials, _ = indexing.tune(*args, *val, confidence=0.95, **common)
    n = len(art.validation_labels)
    assert bounded.agreement_bound >= 0.95
    for t in trials:
        agreeing = round(t.label_agreement * n)
        assert t.agreement_bound == pytest.approx(indexing.agreement_lower_bound(agreeing, n, 0.95))
        assert t.agreement_bound < t.label_agreement
    # the bound only ever removes settings: whatever reaches the target by its bound reaches
    # it as observed, so the bounded choice is one the observed rule would accept too (which
    # of the accepted ones is fastest is a timing, not a property)
    plan = lambda t: (t.value, t.recheck_value, t.recheck_margin)  # noqa: E731
    by_bound = {plan(t) for t in trials if t.agreement_bound >= 0.95}
    by_observation = {plan(t) for t in trials if t.label_agreement >= 0.95}
    assert plan(bounded) in by_bound <= by_observation
    assert observed.label_agreement >= 0.95
