"""The gRPC wire against a real server: credentials checked before a message is read, the
message limit sized by the model, ambiguous credentials refused, calls the client abandons
counted as such, and a port no other process can take over."""

from __future__ import annotations

import contextlib
import errno
import socket
import threading
import time

import grpc
import httpx
import numpy as np
import pytest

from service.oip.grpc_server import MESSAGE_FRAMING_BYTES
from service.oip.protocol import message
from tests.service.servers import (
    free_port,
    rss_mib,
    running_server,
    start_server,
    stop_server,
    wait_for,
    wait_ready,
)

KEY = "grpc-key"
MAX_ROWS = 256
D = 64
INFER = "/inference.GRPCInferenceService/ModelInfer"
LIMIT = MAX_ROWS * D * 8 + MESSAGE_FRAMING_BYTES  # the model-sized message limit
Request = message("inference.ModelInferRequest")
Response = message("inference.ModelInferResponse")


@contextlib.contextmanager
def keyed_server(model_artifact, **env):
    """A real server with a key and MAX_ROWS rows per call: (url, gRPC port, process)."""
    grpc_port = free_port()
    with running_server(
        model_artifact[0],
        NCAKNN_GRPC_PORT=grpc_port,
        NCAKNN_API_KEY=KEY,
        NCAKNN_MAX_BATCH_ROWS=MAX_ROWS,
        **env,
    ) as (_, url, proc):
        yield url, grpc_port, proc


@pytest.fixture(scope="module")
def server(model_artifact):
    with keyed_server(model_artifact) as running:
        yield running


def infer_request(rows: int, raw_bytes: int | None = None) -> bytes:
    """A serialised ModelInferRequest of ``rows`` FP32 rows (or ``raw_bytes`` of raw data)."""
    request = Request(model_name="nca-knn")
    request.inputs.add(name="input", datatype="FP32", shape=[rows, D])
    size = rows * D * 4 if raw_bytes is None else raw_bytes
    request.raw_input_contents.append(np.full(size // 4, 0.5, np.float32).tobytes())
    return request.SerializeToString()


def call(grpc_port: int, payload: bytes, metadata=(), timeout: float = 30) -> grpc.StatusCode:
    with grpc.insecure_channel(
        f"127.0.0.1:{grpc_port}", options=[("grpc.max_send_message_length", -1)]
    ) as channel:
        stub = channel.unary_unary(INFER)
        try:
            stub(payload, metadata=metadata, timeout=timeout)
        except grpc.RpcError as exc:
            return exc.code()
        return grpc.StatusCode.OK


def grpc_requests(url: str, status: int) -> float:
    text = httpx.get(f"{url}/metrics", timeout=5, headers={"authorization": f"Bearer {KEY}"})
    for line in text.text.splitlines():
        if line.startswith("ncaknn_requests_total") and f"{INFER[1:]}" in line:
            if f'status="{status}"' in line:
                return float(line.split()[-1])
    return 0.0


def test_a_full_batch_passes_and_a_larger_message_is_refused_by_its_size(server):
    _, grpc_port, _ = server
    auth = (("authorization", f"Bearer {KEY}"),)
    assert call(grpc_port, infer_request(MAX_ROWS), auth) == grpc.StatusCode.OK
    too_large = infer_request(1, raw_bytes=LIMIT + 4)
    assert len(too_large) > LIMIT
    assert call(grpc_port, too_large, auth) == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_unauthenticated_large_calls_cost_no_memory(server):
    """Eight concurrent calls without a key, each a message just under the limit, and eight
    of 63 MiB: all refused (UNAUTHENTICATED, or RESOURCE_EXHAUSTED for the oversized ones),
    with the server's RSS peaking at most 32 MiB above where it was."""
    url, grpc_port, proc = server
    before = rss_mib(proc.pid)
    peak = [before]
    done = threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], rss_mib(proc.pid))
            time.sleep(0.01)

    sampler = threading.Thread(target=sample)
    sampler.start()
    codes: list[grpc.StatusCode] = []
    payloads = [infer_request(MAX_ROWS)] * 8 + [infer_request(1, raw_bytes=63 * 2**20)] * 8

    def one(payload):
        codes.append(call(grpc_port, payload))

    try:
        threads = [threading.Thread(target=one, args=(p,)) for p in payloads]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        done.set()
        sampler.join()
    print(
        f"16 unauthenticated calls: {sorted({c.name for c in codes})}; RSS {before:.0f} -> peak "
        f"{peak[0]:.0f} MiB"
    )
    assert len(codes) == 16
    assert set(codes) <= {grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.RESOURCE_EXHAUSTED}
    assert codes.count(grpc.StatusCode.UNAUTHENTICATED) >= 8
    assert peak[0] - before <= 32
    assert grpc_requests(url, 401) >= 8


def test_two_authorization_values_are_refused(server):
    _, grpc_port, _ = server
    auth = (("authorization", f"Bearer {KEY}"), ("authorization", f"Bearer {KEY}"))
    assert call(grpc_port, infer_request(1), auth) == grpc.StatusCode.UNAUTHENTICATED


def test_a_call_the_client_abandons_is_not_counted_as_served(server):
    """Calls whose deadline passes while they run (1 ms) are counted as 499, not 200 (a call
    answered just as its deadline passes may count as 499 at the server's clock). A call the
    client cancels before its handler starts is never seen by the server, so up to 20 are
    counted, and at least one as 499."""
    url, grpc_port, _ = server
    auth = (("authorization", f"Bearer {KEY}"),)
    before = (grpc_requests(url, 200), grpc_requests(url, 499))
    codes = [call(grpc_port, infer_request(MAX_ROWS), auth, timeout=0.001) for _ in range(20)]
    wait_for(  # the calls the server saw may still be computing
        lambda: grpc_requests(url, 499) > before[1], timeout=30, what="an abandoned call counted"
    )
    after = (grpc_requests(url, 200), grpc_requests(url, 499))
    served = sum(code == grpc.StatusCode.OK for code in codes)
    print(f"20 calls with a 1 ms deadline: {served} served; counts {before} -> {after}")
    abandoned = after[1] - before[1]
    assert after[0] - before[0] <= served
    assert 1 <= abandoned and (after[0] - before[0]) + abandoned <= 20
    assert set(codes) <= {grpc.StatusCode.OK, grpc.StatusCode.DEADLINE_EXCEEDED}


def test_no_other_process_can_take_the_grpc_port(server):
    """One worker binds the gRPC port without SO_REUSEPORT: a socket asking for it is
    refused (with several workers the port is shared, by design, among them)."""
    _, grpc_port, _ = server
    intruder = socket.socket()
    intruder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        with pytest.raises(OSError) as caught:
            intruder.bind(("127.0.0.1", grpc_port))
        assert caught.value.errno == errno.EADDRINUSE
    finally:
        intruder.close()


@pytest.fixture(scope="module")
def tight_server(model_artifact):
    """A key, a 2 s body deadline and a body budget of 2 MiB: ten of this model's largest
    messages (MAX_ROWS x 64 x 8 bytes + 64 KiB = 192 KiB each)."""
    budget = 10 * LIMIT + 1024
    env = dict(NCAKNN_BODY_TIMEOUT_SECONDS=2, NCAKNN_MAX_BODY_BYTES_IN_FLIGHT=budget)
    with keyed_server(model_artifact, **env) as (_, grpc_port, _):
        yield grpc_port


def stalled_call(grpc_port: int, results: list, release: threading.Event) -> None:
    """A call whose message never comes (a client stream that yields nothing until
    ``release``): the server holds its reservation until the body deadline."""

    def nothing():
        release.wait(10)
        return
        yield  # a generator that yields nothing

    with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
        stub = channel.stream_unary(INFER)
        started = time.perf_counter()
        try:
            stub(nothing(), metadata=(("authorization", f"Bearer {KEY}"),), timeout=20)
            results.append(("OK", time.perf_counter() - started))
        except grpc.RpcError as exc:
            results.append((exc.code().name, time.perf_counter() - started))


def test_a_message_that_never_comes_meets_the_body_deadline(tight_server):
    results: list = []
    release = threading.Event()
    try:
        stalled_call(tight_server, results, release)
    finally:
        release.set()
    ((code, seconds),) = results
    print(f"a call whose message never came: {code} after {seconds:.2f} s")
    assert code == "DEADLINE_EXCEEDED" and 1.9 <= seconds <= 4


def test_calls_in_flight_are_bounded_by_the_body_budget(tight_server):
    """Twelve calls hold their reservations (their messages never come): the budget takes
    ten; a normal call meanwhile is refused UNAVAILABLE at once, and served once the
    stalled ones met their deadline."""
    results: list = []
    release = threading.Event()
    holders = [
        threading.Thread(target=stalled_call, args=(tight_server, results, release))
        for _ in range(12)
    ]
    for t in holders:
        t.start()
    auth = (("authorization", f"Bearer {KEY}"),)
    during = wait_for(  # once the holders' reservations fill the budget, within their deadline
        lambda: (code := call(tight_server, infer_request(1), auth)) != grpc.StatusCode.OK and code,
        timeout=1.5,
        what="the budget full",
    )
    for t in holders:
        t.join()
    after = call(tight_server, infer_request(1), auth)
    codes = sorted(code for code, _ in results)
    print(f"12 stalled calls: {codes}; a call meanwhile: {during.name}, after: {after.name}")
    assert during == grpc.StatusCode.UNAVAILABLE
    assert codes.count("UNAVAILABLE") >= 2 and codes.count("DEADLINE_EXCEEDED") <= 10
    assert after == grpc.StatusCode.OK


@pytest.mark.slow  # a long real-server or training scenario: make test-slow
def test_a_stop_finishes_both_wires_within_one_grace_period(model_artifact):
    """SIGTERM while a keyed HTTP client trickles its body and a gRPC call's message never
    comes: the process exits within the drain delay (1 s) + one grace period (3 s) + 2 s
    (the wires stop side by side, not one after the other)."""
    import signal

    from tests.service.servers import connect

    port, grpc_port = free_port(), free_port()
    proc = start_server(
        model_artifact[0],
        port,
        NCAKNN_GRPC_PORT=grpc_port,
        NCAKNN_API_KEY=KEY,
        NCAKNN_DRAIN_DELAY_SECONDS=1,
        NCAKNN_GRACEFUL_SHUTDOWN_SECONDS=3,
    )
    results: list = []
    release = threading.Event()
    try:
        wait_ready(f"http://127.0.0.1:{port}", proc)
        trickler = connect(port)
        trickler.sendall(
            b"POST /v1/classify HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\n"
            + f"authorization: Bearer {KEY}\r\ncontent-length: 100000\r\n\r\n{{".encode()
        )
        stalled = threading.Thread(target=stalled_call, args=(grpc_port, results, release))
        stalled.start()
        time.sleep(0.5)
        started = time.perf_counter()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(30)
        took = time.perf_counter() - started
    finally:
        release.set()
        stop_server(proc)
    stalled.join()
    trickler.close()
    print(f"stop with a trickling HTTP body and a stalled gRPC message: {took:.2f} s")
    assert code in (0, -signal.SIGTERM)
    assert took <= 1 + 3 + 2
