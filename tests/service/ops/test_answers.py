"""The budget of answers in flight (``service.ops.answers``) and how the middleware applies it
in an app without the guarded connection (a test client: the reservation ends with the
send). The real server's release on drain, reset and close is tested in
``tests/service/server/test_answer_phase.py``."""

from __future__ import annotations

import numpy as np
import pytest
from fastapi.testclient import TestClient

from service.app import create_app
from service.errors import AnswerBudgetSpent, PayloadTooLarge, status_of
from service.ops.answers import RESERVE_FROM_BYTES, AnswerBudget, declared_size
from tests.service.conftest import npy, settings_for

ROWS = np.random.default_rng(0).uniform(0, 16, size=(256, 64)).astype(np.float32)
NPY = {"content-type": "application/x-npy", "accept": "application/x-npy"}
LARGE = 256 * 16 * 24  # /v1/neighbors?k=16 for 256 rows as npy: ids, labels, distances


def test_a_reservation_that_does_not_fit_is_refused_and_a_release_gives_it_back():
    budget = AnswerBudget(100)
    first = budget.reserve(60)
    with pytest.raises(AnswerBudgetSpent, match="max_answer_bytes_in_flight"):
        budget.reserve(41)
    with pytest.raises(PayloadTooLarge, match="more than the 100"):
        budget.reserve(101)  # larger than the whole budget: never fits
    second = budget.reserve(40)
    assert budget.held == 100
    first.release()
    first.release()  # a second release gives nothing back twice
    assert budget.held == 40
    second.release()
    assert budget.held == 0
    assert status_of(AnswerBudgetSpent("")) == 503


def test_the_declared_size_is_the_content_length():
    start = {"headers": [(b"content-type", b"x"), (b"Content-Length", b"1234")]}
    assert declared_size(start) == 1234
    assert declared_size({"headers": [(b"content-length", b"-1")]}) == 0
    assert declared_size({"headers": []}) == 0


@pytest.fixture(scope="module")
def tight(model_artifact):
    """An app whose answer budget (the smallest allowed) takes no large answer."""
    app = create_app(settings_for(model_artifact[0], max_answer_bytes_in_flight=1024))
    with TestClient(app) as client:
        yield client


@pytest.fixture
def held(model_artifact):
    """An app whose answer budget takes one large answer, all but 1 KiB of it held (as by
    answers other clients have not taken yet), given back at the end."""
    app = create_app(settings_for(model_artifact[0], max_answer_bytes_in_flight=LARGE + 1024))
    with TestClient(app) as client:
        hold = client.app.state.ncaknn.answers.reserve(LARGE)
        yield client
        hold.release()
        assert client.app.state.ncaknn.answers.held == 0


def test_a_large_answer_over_the_budget_is_a_503_with_the_one_error_body(held):
    r = held.post("/v1/neighbors?k=16", content=npy(ROWS), headers=NPY)
    assert r.status_code == 503, r.text
    assert r.json() == {"error": r.json()["error"], "error_type": "answer_budget_spent"}
    assert "max_answer_bytes_in_flight" in r.json()["error"]
    assert r.headers["retry-after"] == "1"
    assert held.app.state.ncaknn.answers.held == LARGE


def test_a_v2_answer_over_the_budget_is_a_503_with_the_protocols_error_body(held):
    rows = np.zeros((160, 64), np.float32)  # a JSON answer of about 79 KB
    body = {"inputs": [{"name": "input", "datatype": "FP32", "shape": list(rows.shape)}]}
    body["inputs"][0]["data"] = rows.ravel().tolist()
    r = held.post("/v2/models/nca-knn/infer", json=body)
    assert r.status_code == 503, r.text[:200]
    assert set(r.json()) == {"error"} and "max_answer_bytes_in_flight" in r.json()["error"]


def test_an_answer_larger_than_the_whole_budget_is_a_413_without_retry_after(tight):
    """No retry can send an answer larger than the whole budget (before: 503 with
    Retry-After: 1, which a client obeying it retries for ever)."""
    r = tight.post("/v1/neighbors?k=16", content=npy(ROWS), headers=NPY)
    assert r.status_code == 413, r.text
    assert r.json()["error_type"] == "payload_too_large" and "retry-after" not in r.headers
    assert "max_answer_bytes_in_flight" in r.json()["error"]
    rows = np.zeros((256, 64), np.float32)
    body = {"inputs": [{"name": "input", "datatype": "FP32", "shape": list(rows.shape)}]}
    body["inputs"][0]["data"] = rows.ravel().tolist()
    r = tight.post("/v2/models/nca-knn/infer", json=body)
    assert r.status_code == 413 and set(r.json()) == {"error"}, r.text[:200]
    assert tight.app.state.ncaknn.answers.held == 0


def test_small_answers_are_not_reserved_and_served(tight):
    r = tight.post("/v1/classify", json={"instances": ROWS[:2].tolist()})
    assert r.status_code == 200
    r = tight.post("/v1/embed", content=npy(ROWS), headers=NPY)  # 256 x 16 float32
    assert r.status_code == 200 and len(r.content) < RESERVE_FROM_BYTES
    assert tight.app.state.ncaknn.answers.held == 0


def test_an_answer_within_the_budget_is_served_and_released_after_its_send(model_artifact):
    settings = settings_for(model_artifact[0], max_answer_bytes_in_flight=LARGE + 1024)
    with TestClient(create_app(settings)) as client:
        answers = client.app.state.ncaknn.answers
        statuses = [
            client.post("/v1/neighbors?k=16", content=npy(ROWS), headers=NPY).status_code
            for _ in range(3)
        ]
        metrics = client.get("/metrics").text
    assert statuses == [200, 200, 200]
    assert answers.held == 0
    assert 'error_type="answer_budget_spent"' not in metrics
