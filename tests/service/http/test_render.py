"""Answers as structured .npy arrays (Accept: application/x-npy): the same numbers as the JSON
answer of the same request, for every class type, within the same limits."""

from __future__ import annotations

import io

import numpy as np
import pytest
from fastapi.testclient import TestClient

from service.app import create_app
from service.core.artifact import read_artifact, write_artifact
from service.engine.model import class_array
from tests.service.conftest import model_arrays, module_client, npy, settings_for

client = module_client()  # these tests only send requests

ANSWER_NPY = {"content-type": "application/x-npy", "accept": "application/x-npy"}


@pytest.fixture(scope="module")
def rows(model_artifact):
    return model_artifact[2].X_test[:25].astype(np.float32)


def load(response) -> np.ndarray:
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "application/x-npy"
    assert response.headers["x-model-version"]
    return np.load(io.BytesIO(response.content), allow_pickle=False)


@pytest.mark.parametrize("with_neighbors", [False, True])
@pytest.mark.parametrize("rule", ["majority", "soft"])
def test_classify_npy_answer_holds_the_json_answers_numbers(client, rows, rule, with_neighbors):
    query = f"/v1/classify?k=4&rule={rule}&return_neighbors={str(with_neighbors).lower()}"
    as_json = client.post(query, content=npy(rows), headers={"content-type": "application/x-npy"})
    records = load(client.post(query, content=npy(rows), headers=ANSWER_NPY))
    classes = client.get("/v1/model").json()["classes"]
    expected = as_json.json()["predictions"]
    assert records.shape == (len(rows),)
    assert records.dtype["label"] == np.int64 and records.dtype["probabilities"].shape == (10,)
    for record, item in zip(records, expected, strict=True):
        assert record["label"] == item["label"]
        assert record["probabilities"].tolist() == [item["probabilities"][str(c)] for c in classes]
        if with_neighbors:
            assert record["neighbor_ids"].tolist() == [n["id"] for n in item["neighbors"]]
            assert record["neighbor_labels"].tolist() == [n["label"] for n in item["neighbors"]]
            assert record["neighbor_distances"].tolist() == [
                n["distance"] for n in item["neighbors"]
            ]
        else:
            assert "neighbor_ids" not in records.dtype.names


def test_neighbors_npy_answer_holds_the_json_answers_numbers(client, rows):
    as_json = client.post("/v1/neighbors", json={"instances": rows.tolist(), "k": 6}).json()
    records = load(client.post("/v1/neighbors?k=6", content=npy(rows), headers=ANSWER_NPY))
    assert records.dtype.names == ("ids", "labels", "distances")
    for record, neighbours in zip(records, as_json["neighbors"], strict=True):
        assert record["ids"].tolist() == [n["id"] for n in neighbours]
        assert record["labels"].tolist() == [n["label"] for n in neighbours]
        assert record["distances"].tolist() == [n["distance"] for n in neighbours]


def test_a_json_body_can_ask_for_an_npy_answer(client, rows):
    body = {"instances": rows[:3].tolist(), "k": 3, "return_neighbors": True}
    records = load(client.post("/v1/classify", json=body, headers={"accept": "application/x-npy"}))
    assert records.shape == (3,) and records["neighbor_ids"].shape == (3, 3)


def test_json_stays_the_default_and_q_values_choose(client, rows):
    one = npy(rows[:1])
    plain = client.post("/v1/classify", content=one, headers={"content-type": "application/x-npy"})
    assert plain.headers["content-type"] == "application/json"
    prefer = "application/json;q=0.5, application/x-npy"
    chosen = client.post(
        "/v1/classify", content=one, headers={"content-type": "application/x-npy", "accept": prefer}
    )
    assert chosen.headers["content-type"] == "application/x-npy"


def test_string_classes_come_back_as_strings(model_artifact, tmp_path, rows):
    art = read_artifact(model_artifact[0])
    arrays = model_arrays(art)
    arrays["classes"] = [f"digit-{c}" for c in art.classes]
    write_artifact(tmp_path / "named", **arrays)
    with TestClient(create_app(settings_for(tmp_path / "named"))) as c:
        query = "/v1/classify?k=3&return_neighbors=true"
        expected = c.post(query, content=npy(rows), headers={"content-type": "application/x-npy"})
        records = load(c.post(query, content=npy(rows), headers=ANSWER_NPY))
    assert records.dtype["label"].kind == "U"
    labels = [item["label"] for item in expected.json()["predictions"]]
    assert records["label"].tolist() == labels
    assert records["neighbor_labels"][0].tolist() == [
        n["label"] for n in expected.json()["predictions"][0]["neighbors"]
    ]


def test_the_json_answer_size_limit_does_not_bind_npy_answers(model_artifact, rows):
    settings = settings_for(model_artifact[0], max_response_values=50)
    with TestClient(create_app(settings)) as c:
        too_big = c.post(
            "/v1/classify", content=npy(rows), headers={"content-type": "application/x-npy"}
        )
        assert too_big.status_code == 413 and "max_response_values" in too_big.json()["error"]
        assert len(load(c.post("/v1/classify", content=npy(rows), headers=ANSWER_NPY))) == 25


def test_large_npy_answers_are_the_same_encoded_off_the_event_loop(client, model_artifact):
    many = np.repeat(model_artifact[2].X_test[:40], 100, axis=0).astype(np.float32)  # 4,000
    query = "/v1/classify?k=5&return_neighbors=true"  # 4,000 x (10 + 15) > THREAD_ENCODE_VALUES
    records = load(client.post(query, content=npy(many), headers=ANSWER_NPY))
    small = load(client.post(query, content=npy(many[:40]), headers=ANSWER_NPY))
    np.testing.assert_array_equal(records[:40], small)
    np.testing.assert_array_equal(records[40:80], small)


@pytest.mark.parametrize(
    "classes, dtype",
    [
        ([0, 1, 2], np.int64),
        ([-5, 2**40], np.int64),
        (["a", "bb"], np.str_),
        ([1, "x"], np.str_),  # mixed: the string forms, as the JSON probabilities' keys
        ([2**70, 1], np.str_),  # beyond int64: strings, never a wrapped integer
    ],
)
def test_class_array_keeps_every_class_exactly(classes, dtype):
    array = class_array(classes)
    assert array.dtype.type is np.dtype(dtype).type
    assert array.tolist() == (classes if dtype is np.int64 else [str(c) for c in classes])


def test_openapi_documents_the_npy_answers(client):
    paths = client.get("/openapi.json").json()["paths"]
    for path, field in (
        ("/v1/classify", "probabilities"),
        ("/v1/neighbors", "distances"),
        ("/v1/embed", "float32"),
    ):
        content = paths[path]["post"]["responses"]["200"]["content"]
        assert set(content) == {"application/json", "application/x-npy"}
        assert field in content["application/x-npy"]["description"]
