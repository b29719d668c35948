"""The batcher on its own: merged jobs answered exactly as alone, on the event loop or in the
search thread; a job whose rows overflow fails alone; neighbour-only jobs get no decision."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from service.engine.batcher import Batcher
from service.engine.infer import Query, infer_one
from service.engine.model import load_model
from service.errors import InvalidInput
from tests.service.conftest import brute_force_knn, settings_for


@pytest.fixture(scope="module")
def model(model_artifact):
    return load_model(model_artifact[0], settings_for(model_artifact[0]))


async def _run_jobs(batcher: Batcher, jobs):
    batcher.start()
    try:
        return await asyncio.gather(
            *(batcher.submit(m, rows, Query(k, rule)) for m, rows, k, rule in jobs),
            return_exceptions=True,
        )
    finally:
        await batcher.stop()


@pytest.mark.parametrize("inline_rows", [0, 256])
def test_merged_jobs_answer_as_alone(model, model_artifact, inline_rows):
    X = model_artifact[2].X_test[:40].astype(np.float32)
    # every term of z_0 = x . W_0 has the same sign: |z_0| = 3e38 ||W_0||_1 > float32's max
    huge = (3e38 * np.sign(model.projection[:1])).astype(np.float32)  # (1, D)
    assert 3e38 * np.abs(model.projection[0]).astype(np.float64).sum() > np.finfo(np.float32).max
    jobs = [
        (model, X[0:3], 5, "majority"),
        (model, X[3:4], 5, "soft"),
        (model, np.concatenate([X[4:5], huge]), 5, "majority"),  # fails alone
        (model, X[5:9], 5, None),  # neighbours only
        (model, X[9:12], 3, "soft"),  # another k: another group
        (model, X[12:40], 5, "soft"),
    ]
    merged = []
    batcher = Batcher(
        max_rows=512,
        max_wait_us=50_000,
        inline_rows=inline_rows,
        on_batch=lambda rows, waited: merged.append(rows),
    )
    answers = asyncio.run(_run_jobs(batcher, jobs))
    assert sorted(merged) == [3, 3 + 1 + 2 + 4 + 28]  # one merged search per k
    for (m, rows, k, rule), answer in zip(jobs, answers, strict=True):
        if rows is jobs[2][1]:
            assert isinstance(answer, InvalidInput)
            assert "instances[1]" in answer.message
            continue
        alone = infer_one(m, rows, Query(k, rule))
        brute_distances, brute_indices = brute_force_knn(m, rows, k)
        np.testing.assert_allclose(answer.distances, brute_distances, rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(answer.indices, brute_indices)
        np.testing.assert_array_equal(answer.distances, alone.distances)
        np.testing.assert_array_equal(answer.indices, alone.indices)
        if rule is None:
            assert answer.predicted is None and answer.probabilities is None
        else:
            np.testing.assert_array_equal(answer.predicted, alone.predicted)
            np.testing.assert_array_equal(answer.probabilities, alone.probabilities)
