"""Schemathesis against the live OpenAPI document, every check on: no 5xx, every status and
body as documented, valid data accepted, invalid data rejected.

The default run is bounded (``FUZZ_EXAMPLES`` per operation and mode: 10, ~170 cases, most
of their time spent generating them); ``make test-slow`` runs the same fuzz with 500
(test_fuzz_the_openapi_long) and against a real server with a key.
"""

from __future__ import annotations

import os

import httpx
import pytest
import schemathesis
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, assume, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import CHECKS, load_all_checks
from schemathesis.config import SchemathesisConfig
from schemathesis.config._checks import NEGATIVE_DATA_REJECTION_EXPECTED_STATUSES

from service.app import create_app
from tests.service.conftest import settings_for
from tests.service.servers import running_server

FUZZ_EXAMPLES = int(os.environ.get("NCAKNN_FUZZ_EXAMPLES", "10"))


@pytest.fixture(scope="module")
def live_app(model_artifact):
    app = create_app(settings_for(model_artifact[0], max_batch_rows=8, max_k=16))
    with TestClient(app):  # runs the lifespan: the model is loaded, the limits are live
        yield app


def fuzz_config() -> SchemathesisConfig:
    """Defaults, except that 413 counts as rejecting invalid data: the OpenAPI documents it
    for bodies with more than max_batch_rows rows (schemathesis's default list lacks it)."""
    statuses = [*NEGATIVE_DATA_REJECTION_EXPECTED_STATUSES, "413"]
    return SchemathesisConfig.from_dict(
        {"checks": {"negative_data_rejection": {"expected-statuses": statuses}}}
    )


def all_checks() -> list:
    load_all_checks()
    return CHECKS.get_all()


def run_schemathesis(app, examples: int) -> tuple[int, list[str]]:
    """(cases run, failures), for positive and negative data on every operation."""
    schema = schemathesis.openapi.from_asgi("/openapi.json", app, config=fuzz_config())
    checks = all_checks()
    failures: list[str] = []
    tested = [0]
    for operation in schema.get_all_operations():
        op = operation.ok()
        if op.path == "/v1/admin/reload":
            continue  # reloads the artifact: covered by the reload tests
        for mode in GenerationMode:
            if mode is GenerationMode.POSITIVE and op.path.endswith("/infer"):
                # JSON Schema cannot tie an input's data length to its shape [n, D], so a
                # schema-valid V2 request is almost never a valid one; the protocol's valid
                # requests are tested with tritonclient (test_v2_protocol.py). Negative
                # data (every malformed body) is fuzzed here.
                continue
            fuzz_operation(op, mode, examples, checks, failures, tested)
    return tested[0], failures


def is_float_k(body) -> bool:
    return isinstance(body, dict) and isinstance(body.get("k"), float)


def is_untied_sparse_row(body) -> bool:
    """A sparse row JSON Schema allows and our contract refuses (the corpus tests each): an
    index written as a float (5.0: "integer" to JSON Schema), a column twice (uniqueItems
    holds 5 and 5.0 apart), or a number of values other than of indices (JSON Schema cannot
    tie the two lengths, so most generated sparse rows are dropped here: positive sparse
    bodies are tested by test_sparse_rows.py and the corpus)."""
    rows = body.get("sparse_instances") if isinstance(body, dict) else None
    if not isinstance(rows, list):
        return False
    for row in rows:
        indices, values = row.get("indices", []), row.get("values", [])
        if len(indices) != len(values) or any(isinstance(j, float) for j in indices):
            return True
        if len(set(indices)) != len(indices):
            return True
    return False


def fuzz_operation(op, mode, examples, checks, failures, tested) -> None:
    where = f"{op.method.upper()} {op.path} ({mode.value})"

    @settings(
        max_examples=examples,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        database=None,
    )
    @given(case=op.as_strategy(generation_mode=mode))
    def fuzz(case):
        # JSON Schema cannot tell 5 from 5.0 (both are "integer"); our contract is stricter
        # and documented: k must be an integer literal. The corpus tests that 5.0 is 422.
        assume(not (mode is GenerationMode.POSITIVE and is_float_k(case.body)))
        assume(not (mode is GenerationMode.POSITIVE and is_untied_sparse_row(case.body)))
        tested[0] += 1
        try:
            case.call_and_validate(checks=checks)
        except Exception as exc:  # collect every failure, with the case that made it
            failures.append(f"{where}: {exc}"[:3000])

    try:
        fuzz()
    except Unsatisfiable:  # e.g. no negative data exists for an operation without inputs
        pass


def test_fuzz_the_openapi(live_app):
    tested, failures = run_schemathesis(live_app, FUZZ_EXAMPLES)
    print(f"schemathesis: {tested} cases, {len(failures)} failures")
    assert tested >= 100
    assert not failures, "\n\n".join(failures[:5])


@pytest.mark.slow
def test_fuzz_the_openapi_long(live_app):
    tested, failures = run_schemathesis(live_app, 500)
    print(f"schemathesis: {tested} cases, {len(failures)} failures")
    assert not failures, "\n\n".join(failures[:5])


KEY = "fuzz-key"


@pytest.fixture(scope="module")
def real_server(model_artifact):
    """A real ``python -m service`` with an API key, small limits and short body deadlines:
    the fuzzer's requests go through the connection guard and the key checks as a client's
    would."""
    with running_server(
        model_artifact[0],
        NCAKNN_API_KEY=KEY,
        NCAKNN_MAX_BATCH_ROWS=8,
        NCAKNN_MAX_K=16,
        NCAKNN_BODY_TIMEOUT_SECONDS=5,
    ) as (_, url, proc):
        yield url, proc


def fuzz_real_server(url: str, examples: int) -> tuple[int, list[str]]:
    """Every operation, positive and negative data, each case sent with the key (every
    check on) and without it (401 on every protected route, never a 5xx)."""
    schema = schemathesis.openapi.from_url(
        f"{url}/openapi.json", config=fuzz_config(), headers={"authorization": f"Bearer {KEY}"}
    )
    # ignored_auth re-sends a case without the credentials it knows of, and the key given
    # as a header is not one of them (it got 200 with the key); the call without a key below
    # checks the same thing
    checks = [check for check in all_checks() if check.__name__ != "ignored_auth"]
    failures: list[str] = []
    tested = [0]
    for operation in schema.get_all_operations():
        op = operation.ok()
        if op.path == "/v1/admin/reload":
            continue
        for mode in GenerationMode:
            if mode is GenerationMode.POSITIVE and op.path.endswith("/infer"):
                continue  # see run_schemathesis
            fuzz_with_and_without_key(op, mode, examples, checks, failures, tested)
    return tested[0], failures


def fuzz_with_and_without_key(op, mode, examples, checks, failures, tested) -> None:
    where = f"{op.method.upper()} {op.path} ({mode.value})"
    protected = op.path.startswith(("/v1/", "/v2/models")) or op.path == "/v2"

    @settings(
        max_examples=examples,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        database=None,
    )
    @given(case=op.as_strategy(generation_mode=mode))
    def fuzz(case):
        assume(not (mode is GenerationMode.POSITIVE and is_float_k(case.body)))
        assume(not (mode is GenerationMode.POSITIVE and is_untied_sparse_row(case.body)))
        tested[0] += 1
        try:
            case.call_and_validate(
                headers={"authorization": f"Bearer {KEY}"}, checks=checks, timeout=30
            )
            anonymous = case.call(headers={"authorization": ""}, timeout=30)
        except Exception as exc:  # collect every failure, with the case that made it
            failures.append(f"{where}: {exc}"[:3000])
            return
        if anonymous.status_code >= 500 or (protected and anonymous.status_code != 401):
            failures.append(f"{where} without a key: {anonymous.status_code}")

    try:
        fuzz()
    except Unsatisfiable:
        pass


@pytest.mark.slow  # a long real-server or training scenario: make test-slow
def test_fuzz_a_real_server_with_a_key(real_server):
    url, proc = real_server
    tested, failures = fuzz_real_server(url, max(8, FUZZ_EXAMPLES // 3))
    metrics = httpx.get(f"{url}/metrics", timeout=5).text
    server_errors = [
        line
        for line in metrics.splitlines()
        if line.startswith("ncaknn_requests_total") and 'status="5' in line
    ]
    print(f"schemathesis against a real server: {tested} cases x 2, {len(failures)} failures")
    assert tested >= 40
    assert not failures, "\n\n".join(failures[:5])
    assert server_errors == [], server_errors
    assert proc.poll() is None
