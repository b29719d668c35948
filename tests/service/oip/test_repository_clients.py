"""tritonclient's model repository calls, over HTTP and gRPC, against a real server that
serves a repository: the index, load and unload behind the admin key, and inference by
name on both wires."""

from __future__ import annotations

import numpy as np
import pytest
import tritonclient.grpc as triton_grpc
import tritonclient.http as triton_http
from tritonclient.utils import InferenceServerException

from tests.service.servers import free_port, running_server

API = {"authorization": "Bearer api-key"}
ADMIN = {"authorization": "Bearer admin-key"}


@pytest.fixture
def server(repository):
    grpc_port = free_port()
    with running_server(
        repository / "digits",  # --model is ignored when a repository is named
        NCAKNN_MODEL_REPOSITORY=repository,
        NCAKNN_GRPC_PORT=grpc_port,
        NCAKNN_API_KEY="api-key",
        NCAKNN_ADMIN_API_KEY="admin-key",
    ) as (_, url, _proc):
        yield url, grpc_port


def clients(url: str, grpc_port: int) -> list:
    return [
        ("http", triton_http, triton_http.InferenceServerClient(url.removeprefix("http://"))),
        ("grpc", triton_grpc, triton_grpc.InferenceServerClient(f"127.0.0.1:{grpc_port}")),
    ]


def states(wire, client) -> dict[str, str]:
    index = client.get_model_repository_index(headers=dict(ADMIN))
    if wire == "grpc":
        index = [{"name": m.name, "state": m.state} for m in index.models]
    return {entry["name"]: entry["state"] for entry in index}


def embed(module, client, name: str, x: np.ndarray) -> np.ndarray:
    tensor = module.InferInput("input", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x)
    outputs = [module.InferRequestedOutput("embedding")]
    answer = client.infer(name, [tensor], outputs=outputs, headers=dict(API))
    return answer.as_numpy("embedding")


def test_tritonclient_index_load_unload_and_infer_by_name(server, model_artifact):
    x = np.ascontiguousarray(model_artifact[2].X_test[:3], dtype=np.float32)
    for wire, module, client in clients(*server):
        assert states(wire, client) == {
            "broken": "UNAVAILABLE",
            "digits": "READY",
            "scaled": "READY",
            "versioned": "READY",
        }, wire
        plain = embed(module, client, "digits", x)
        assert embed(module, client, "scaled", x).shape == plain.shape
        assert client.is_model_ready("scaled", headers=dict(API))
        assert not client.is_model_ready("broken", headers=dict(API))

        client.unload_model("scaled", headers=dict(ADMIN))
        assert states(wire, client)["scaled"] == "UNAVAILABLE"
        assert not client.is_model_ready("scaled", headers=dict(API))
        with pytest.raises(InferenceServerException, match="not loaded"):
            embed(module, client, "scaled", x)
        client.load_model("scaled", headers=dict(ADMIN))
        assert states(wire, client)["scaled"] == "READY"
        np.testing.assert_array_equal(embed(module, client, "digits", x), plain)

        with pytest.raises(InferenceServerException, match="no model folder"):
            client.load_model("nope", headers=dict(ADMIN))
        with pytest.raises(InferenceServerException, match=r"embeddings\.npy") as refused:
            client.load_model("broken", headers=dict(ADMIN))
        if wire == "grpc":  # a refused load is a precondition, not a server error
            assert refused.value.status() == "StatusCode.FAILED_PRECONDITION"
        else:
            assert refused.value.status() == "409"
        with pytest.raises(InferenceServerException, match="config"):
            client.load_model("digits", headers=dict(ADMIN), config="{}")
        with pytest.raises(InferenceServerException):  # the API key is not the admin key
            client.unload_model("digits", headers=dict(API))
        assert states(wire, client)["digits"] == "READY"


def test_loads_and_unloads_race_requests_on_a_real_server(server, model_artifact):
    """Four clients ask two models while one of them is unloaded and loaded again and
    again: the other always answers 200, the raced one 200 or 503 naming the load call,
    never anything else."""
    import threading

    import httpx

    url, _ = server
    body = {"instances": model_artifact[2].X_test[:8].tolist()}
    stop, outcomes = threading.Event(), []

    def ask(name: str) -> None:
        with httpx.Client(base_url=url, headers=API, timeout=30) as client:
            while not stop.is_set():
                answer = client.post(f"/v1/models/{name}/classify", json=body)
                outcomes.append((name, answer.status_code, answer.text[:200]))

    threads = [threading.Thread(target=ask, args=(n,)) for n in ("digits", "scaled") * 2]
    for thread in threads:
        thread.start()
    try:
        with httpx.Client(base_url=url, headers=ADMIN, timeout=30) as admin:
            for _ in range(10):
                assert admin.post("/v2/repository/models/scaled/unload").status_code == 200
                assert admin.post("/v2/repository/models/scaled/load").status_code == 200
    finally:
        stop.set()
        for thread in threads:
            thread.join()
    assert {status for name, status, _ in outcomes if name == "digits"} == {200}
    raced = {(status, "load" in text) for name, status, text in outcomes if name == "scaled"}
    assert raced <= {(200, False), (503, True)} and (200, False) in raced


def test_two_workers_serve_the_same_models_after_a_load_or_unload(repository, model_artifact):
    """With two workers, the worker that unloads (or loads) a model records it and the
    other replays it within worker_sync_seconds: every fresh connection, whichever worker
    takes it, then sees the same models. A worker restarted afterwards replays the record."""
    import os
    import signal
    import time

    import httpx

    body = {"instances": model_artifact[2].X_test[:2].tolist()}

    def by_worker(url: str) -> dict[int, set[int]]:
        """{worker pid: the scaled model's statuses} over 32 fresh connections, each asking
        the worker's pid and the scaled model on one connection (so one worker)."""
        seen: dict[int, set[int]] = {}
        for _ in range(32):
            with httpx.Client(base_url=url, headers=API, timeout=30) as client:
                pid = client.get("/v1/models/digits").json()["worker_pid"]
                status = client.post("/v1/models/scaled/embed", json=body).status_code
                seen.setdefault(pid, set()).add(status)
        return seen

    def statuses(url: str) -> set[int]:
        """The scaled model's statuses, once both workers answered."""
        deadline = time.monotonic() + 20
        while len(seen := by_worker(url)) < 2:
            assert time.monotonic() < deadline, "one worker never took a connection"
        return set().union(*seen.values())

    def worker_pids(url: str) -> set[int]:
        return set(by_worker(url))

    def converge(url: str, expected: int) -> None:
        deadline = time.monotonic() + 20
        while statuses(url) != {expected}:
            assert time.monotonic() < deadline, f"the workers never all answered {expected}"
            time.sleep(0.2)

    with running_server(
        repository / "digits",
        NCAKNN_MODEL_REPOSITORY=repository,
        NCAKNN_WORKERS=2,
        NCAKNN_WORKER_SYNC_SECONDS=0.2,
        NCAKNN_API_KEY="api-key",
        NCAKNN_ADMIN_API_KEY="admin-key",
    ) as (_, url, _proc):
        assert statuses(url) == {200}
        with httpx.Client(base_url=url, headers=ADMIN, timeout=30) as admin:
            assert admin.post("/v2/repository/models/scaled/unload").status_code == 200
            converge(url, 503)
            assert admin.post("/v2/repository/models/scaled/load").status_code == 200
            converge(url, 200)
            assert admin.post("/v2/repository/models/scaled/unload").status_code == 200
            converge(url, 503)
        # a worker killed now is restarted, and the new one replays the unload at its start
        pids = worker_pids(url)
        assert len(pids) == 2
        os.kill(pids.pop(), signal.SIGKILL)
        deadline = time.monotonic() + 60
        while not (worker_pids(url) - pids):
            assert time.monotonic() < deadline, "no worker took the killed one's place"
            time.sleep(0.5)
        assert statuses(url) == {503}


def test_a_real_server_holds_the_budget_and_labels_metrics_by_model(repository, model_artifact):
    """On a real server: a budget of about one model serves the first and refuses the
    second (the index says why); the metrics carry each model's name, and an unload
    removes its series."""
    import httpx

    from service.config import Settings
    from service.engine.model import load_model
    from service.engine.repository import MIB, model_bytes

    sizes = [
        model_bytes(load_model(repository / name, Settings(log_json=False)))
        for name in ("digits", "scaled", "versioned/2")
    ]
    assert 2 * min(sizes) > 1.05 * max(sizes)
    budget = 1.05 * max(sizes) / MIB  # any one model, never two
    body = {"instances": model_artifact[2].X_test[:2].tolist()}
    with running_server(
        repository / "digits",
        NCAKNN_MODEL_REPOSITORY=repository,
        NCAKNN_REPOSITORY_MEMORY_MIB=budget,
        NCAKNN_API_KEY="api-key",
        NCAKNN_ADMIN_API_KEY="admin-key",
    ) as (_, url, _proc):
        with httpx.Client(base_url=url, timeout=30) as client:
            index = client.post("/v2/repository/index", headers=ADMIN).json()
            states = {entry["name"]: entry for entry in index}
            ready = [name for name, entry in states.items() if entry["state"] == "READY"]
            assert len(ready) == 1, states
            refused = [e for e in index if "memory budget" in e["reason"]]
            assert refused, states
            served = ready[0]
            assert (
                client.post(f"/v1/models/{served}/embed", json=body, headers=API).status_code == 200
            )
            metrics = client.get("/metrics").text
            assert f'ncaknn_repository_model_requests_total{{model="{served}"}} 1.0' in metrics
            assert (
                client.post(f"/v2/repository/models/{served}/unload", headers=ADMIN).status_code
                == 200
            )
            assert f'model="{served}"' not in client.get("/metrics").text
            other = refused[0]["name"]
            loaded = client.post(f"/v2/repository/models/{other}/load", headers=ADMIN)
            assert loaded.status_code == 200, loaded.text  # the unload made room
