"""Parsing from many threads at once against a real ``python -m service``: ``.npy`` bodies
small (parsed on the event loop) and large (parsed in worker threads) posted to /v1/embed
by several threads while another reloads the model (its arrays parsed in a thread) without
pause. Every request gets its answer: no 5xx, no failed reload (the ``.npy`` reader holds
no state shared by threads: ``service/core/npy.py``)."""

from __future__ import annotations

import threading
import time
from collections import Counter

import httpx
import numpy as np
import pytest

from tests.service.conftest import npy
from tests.service.servers import running_server, server_log

D = 64
THREADS = 5


def storm(url: str, seconds: float) -> tuple[Counter, Counter, list[str]]:
    """(embed statuses, reload statuses, the first failures' bodies) after ``seconds`` of
    THREADS threads posting .npy bodies of 2 and 1,100 rows and one thread reloading."""
    rng = np.random.default_rng(0)
    bodies = [npy(rng.normal(size=(rows, D)).astype(np.float32)) for rows in (2, 1100, 2)]
    embeds: Counter = Counter()
    reloads: Counter = Counter()
    failures: list[str] = []
    stop = time.monotonic() + seconds

    def post_embeds(first: int) -> None:
        with httpx.Client(timeout=60) as client:
            i = first
            while time.monotonic() < stop:
                body = bodies[i % len(bodies)]
                i += 1
                r = client.post(
                    f"{url}/v1/embed",
                    content=body,
                    headers={"content-type": "application/x-npy"},
                )
                embeds[r.status_code] += 1
                if r.status_code != 200 and len(failures) < 5:
                    failures.append(f"embed {r.status_code}: {r.text[:300]}")

    def post_reloads() -> None:
        with httpx.Client(timeout=60) as client:
            while time.monotonic() < stop:
                r = client.post(f"{url}/v1/admin/reload")
                reloads[r.status_code] += 1
                if r.status_code != 200 and len(failures) < 5:
                    failures.append(f"reload {r.status_code}: {r.text[:300]}")

    threads = [threading.Thread(target=post_embeds, args=(i,)) for i in range(THREADS)]
    threads.append(threading.Thread(target=post_reloads))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(seconds + 120)
    return embeds, reloads, failures


def check_storm(model_artifact, seconds: float) -> None:
    with running_server(model_artifact[0]) as (_, url, proc):
        embeds, reloads, failures = storm(url, seconds)
        log = server_log(proc)
    print(
        f"{seconds:g} s: embed {dict(embeds)}, reload {dict(reloads)}; "
        f"'recursion depth mismatch' in the log: {log.count('recursion depth mismatch')}"
    )
    assert failures == [], failures
    assert set(embeds) == {200} and set(reloads) == {200}
    assert embeds[200] > 20 and reloads[200] > 2
    assert "SystemError" not in log


def test_npy_bodies_and_reloads_in_parallel_never_fail(model_artifact):
    check_storm(model_artifact, 3.0)


@pytest.mark.slow  # a long real-server scenario: make test-slow
def test_npy_bodies_and_reloads_in_parallel_never_fail_for_45_seconds(model_artifact):
    check_storm(model_artifact, 45.0)
