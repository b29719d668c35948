"""Schemathesis against the live OpenAPI document, every check on: no 5xx, every status and
body as documented, valid data accepted, invalid data rejected.

The default run is bounded (``FUZZ_EXAMPLES`` per operation); ``make test-slow`` runs more.
"""

from __future__ import annotations

import os

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

FUZZ_EXAMPLES = int(os.environ.get("NCAKNN_FUZZ_EXAMPLES", "25"))


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
