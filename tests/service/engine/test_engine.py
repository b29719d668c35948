"""The engine: offline/online consistency, the projection, load failures and swaps."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from service.core.artifact import ArtifactError
from service.engine.batcher import Batcher
from service.engine.engine import Engine
from service.engine.events import EngineEvents
from service.engine.infer import Query, embed, infer_one, resolve
from service.engine.model import load_model
from service.errors import InvalidInput, NotReady, Overloaded
from tests.service.conftest import republish_scaled, settings_for


@pytest.mark.parametrize("kind", ["flat", "ivf", "hnsw", "ivfpq"])
def test_every_index_type_loads_and_answers(model_dir, kind):
    model = load_model(model_dir, settings_for(model_dir, index_type=kind, pq_m=4))
    assert model.index_type == kind and model.index.ntotal == model.n_references
    answer = infer_one(model, np.zeros((3, model.n_features), np.float32), Query(5, "soft"))
    assert answer.predicted.shape == (3,) and answer.indices.shape == (3, 5)


def test_checks_name_the_limit(model_dir):
    model = load_model(model_dir, settings_for(model_dir))
    with pytest.raises(InvalidInput, match=r"k=100000 must lie in \[1, \d+\]"):
        resolve(model, 10**6, k=100000)
    with pytest.raises(InvalidInput, match="k=300 is over the limit max_k=256"):
        resolve(model, 256, k=300)
    with pytest.raises(InvalidInput, match="rule must be one of"):
        resolve(model, 256, rule="vote")


class RecordedEvents(EngineEvents):
    """The engine's events, as a list of (name, values)."""

    def __init__(self):
        self.seen: list[tuple] = []

    def model_loaded(self, model):
        self.seen.append(("loaded", model))

    def model_load_failed(self, error):
        self.seen.append(("failed", error))

    def request_admitted(self, route, rows):
        self.seen.append(("admitted", route, rows))

    def request_done(self):
        self.seen.append(("done",))

    def outliers_flagged(self, count):
        self.seen.append(("outliers", count))

    def of(self, name: str) -> list[tuple]:
        return [event[1:] for event in self.seen if event[0] == name]


def test_failed_load_keeps_the_current_model(model_dir):
    events = RecordedEvents()
    engine = Engine(settings_for(model_dir), events=events)
    with pytest.raises(NotReady, match="no model is loaded yet"):
        engine.current()
    first = engine.load()
    raw = bytearray((model_dir / "embeddings.npy").read_bytes())
    raw[-3] ^= 0x55
    (model_dir / "embeddings.npy").write_bytes(bytes(raw))
    with pytest.raises(ArtifactError, match="checksum mismatch"):
        engine.load()
    assert engine.current() is first
    assert "checksum mismatch" in engine.last_error
    failed = events.of("failed")
    assert events.of("loaded") == [(first,)] and len(failed) == 1
    assert "checksum mismatch" in str(failed[0][0])
    assert not engine.changed_on_disk()  # the failed version is not retried by the poller


def test_changed_on_disk_sees_a_new_artifact(model_dir):
    engine = Engine(settings_for(model_dir))
    engine.load()
    assert not engine.changed_on_disk()
    version = republish_scaled(model_dir, 2.0)
    assert engine.changed_on_disk()
    new = engine.load()
    assert new.version == version and not engine.changed_on_disk()


# ------------------------------------------------ the operations every wire calls


def run(coroutine):
    return asyncio.run(coroutine)


@pytest.mark.parametrize("batching", [True, False])
def test_classify_answers_as_the_inference_path_and_counts_its_outliers(model_dir, batching):
    """Engine.classify = admission + the inference path + the outlier flags of the query's
    threshold, reported as events (the outlier count equals the flags' sum)."""
    events = RecordedEvents()
    engine = Engine(settings_for(model_dir), events=events)
    model = engine.load()
    rows = np.random.default_rng(0).normal(size=(6, model.n_features)).astype(np.float32)
    rows[0] *= 1e3  # far from every reference: an outlier
    query = resolve(model, 256, k=4)
    assert query.threshold is not None

    async def classified():
        if batching:
            engine.batcher = Batcher(max_rows=64, max_wait_us=0)
            engine.batcher.start()
        try:
            return await engine.classify(model, rows, query, "/test", with_embedding=True)
        finally:
            if engine.batcher is not None:
                await engine.batcher.stop()

    answer = run(classified())
    alone = infer_one(model, rows, query)
    np.testing.assert_array_equal(answer.indices, alone.indices)
    np.testing.assert_array_equal(answer.predicted, alone.predicted)
    np.testing.assert_array_equal(answer.outliers, alone.distances[:, 0] > query.threshold)
    np.testing.assert_array_equal(answer.embedding, embed(model, rows))
    assert answer.outliers[0] and engine.in_flight == 0
    assert events.of("admitted") == [("/test", 6)] and events.of("done") == [()]
    assert events.of("outliers") == [(int(answer.outliers.sum()),)]


def test_neighbors_and_embed_flag_nothing(model_dir):
    events = RecordedEvents()
    engine = Engine(settings_for(model_dir), events=events)
    model = engine.load()
    rows = np.zeros((3, model.n_features), np.float32)
    answer = run(engine.neighbors(model, rows, resolve(model, 256, k=2, decides=False), "/n"))
    z = run(engine.embed(model, rows, "/e"))
    assert answer.predicted is None and answer.outliers is None and answer.indices.shape == (3, 2)
    np.testing.assert_array_equal(z, embed(model, rows))
    assert events.of("admitted") == [("/n", 3), ("/e", 3)] and events.of("outliers") == []


def test_the_in_flight_gate_refuses_past_the_limit_and_reopens(model_dir):
    events = RecordedEvents()
    engine = Engine(settings_for(model_dir, max_in_flight=1), events=events)
    model = engine.load()
    rows = np.zeros((1, model.n_features), np.float32)
    with engine.admit("/held", 1):
        with pytest.raises(Overloaded, match="1 requests in flight, the limit is 1"):
            run(engine.embed(model, rows, "/e"))
    assert engine.in_flight == 0
    assert run(engine.embed(model, rows, "/e")).shape == (1, model.n_components)
    assert events.of("admitted") == [("/held", 1), ("/e", 1)]
    assert len(events.of("done")) == 2
