"""The engine: offline/online consistency, the projection, load failures and swaps."""

from __future__ import annotations

import numpy as np
import pytest

from service.core.artifact import ArtifactError
from service.engine.infer import Engine, Query, infer_one, resolve
from service.engine.model import load_model
from service.errors import InvalidInput, NotReady
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


def test_failed_load_keeps_the_current_model(model_dir):
    loaded, failed = [], []
    engine = Engine(settings_for(model_dir), on_load=loaded.append, on_load_failure=failed.append)
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
    assert loaded == [first] and len(failed) == 1 and "checksum mismatch" in str(failed[0])
    assert not engine.changed_on_disk()  # the failed version is not retried by the poller


def test_changed_on_disk_sees_a_new_artifact(model_dir):
    engine = Engine(settings_for(model_dir))
    engine.load()
    assert not engine.changed_on_disk()
    version = republish_scaled(model_dir, 2.0)
    assert engine.changed_on_disk()
    new = engine.load()
    assert new.version == version and not engine.changed_on_disk()
