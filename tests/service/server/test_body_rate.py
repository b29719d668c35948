"""The body phase's minimum rate against a real ``python -m service``, without an API key: a
body must grow by MIN_BODY_PROGRESS_BYTES in every body_progress_seconds, and at the
connection cap a new connection takes the slot of a body below that rate, so clients
trickling bodies (and coming back when cut off) cannot keep fresh clients out. Also the
chunk sizes no body could fill, answered 400 at once however the size line is split."""

from __future__ import annotations

import json
import select
import socket
import threading
import time

import pytest

from service.server.connections import MIN_BODY_PROGRESS_BYTES, chunk_size_before
from tests.service.servers import (
    connect,
    error_type,
    read_response,
    refused_count,
    running_server,
    wait_for,
)

MAX_CONNECTIONS = 16
WINDOW = 1.0  # body_progress_seconds
BODY_TIMEOUT = 10.0
D = 64


@pytest.fixture(scope="module")
def server(model_artifact):
    with running_server(
        model_artifact[0],
        NCAKNN_MAX_CONNECTIONS=MAX_CONNECTIONS,
        NCAKNN_BODY_PROGRESS_SECONDS=WINDOW,
        NCAKNN_BODY_TIMEOUT_SECONDS=BODY_TIMEOUT,
    ) as running:
        yield running


def classify_request(rows: int) -> tuple[bytes, bytes]:
    """(head, body) of a POST /v1/classify with ``rows`` rows (about 260 bytes a row)."""
    body = json.dumps({"instances": [[0.5] * D] * rows}).encode()
    head = (
        "POST /v1/classify HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    ).encode()
    return head, body


def send_paced(
    port: int, rate: float, rows: int, connected: threading.Event | None = None
) -> tuple[int, bytes, float]:
    """Send a classify body at ``rate`` bytes a second (in 4 KiB pieces), until it is sent
    or an answer comes; (status, answer body, seconds from the head to the answer).
    ``connected`` is set once the head is sent."""
    head, body = classify_request(rows)
    sock = connect(port)
    started = time.monotonic()
    sock.sendall(head)
    if connected is not None:
        connected.set()
    sent = 0
    try:
        while sent < len(body) and not select.select([sock], [], [], 0)[0]:
            due = rate * (time.monotonic() - started) - sent
            if due < 4096 and len(body) - sent > 4096:
                time.sleep(0.01)
                continue
            piece = body[sent : sent + max(4096, int(due))]
            sock.sendall(piece)
            sent += len(piece)
    except OSError:
        pass  # refused while sending: the answer is buffered
    status, _, answer = read_response(sock, timeout=BODY_TIMEOUT + 5)
    sock.close()
    return status, answer, time.monotonic() - started


def fresh_classify(port: int) -> tuple[int, float]:
    """A one-row classification from a client that retries at once when the cap answers
    503 (as that answer asks), for up to 5 s: (final status, seconds it took)."""
    head, body = classify_request(1)
    started = time.monotonic()
    while True:
        with connect(port) as sock:
            sock.sendall(head + body)
            status = read_response(sock, timeout=5)[0]
        if status != 503 or time.monotonic() - started > 5:
            return status, time.monotonic() - started


def test_a_body_below_the_minimum_rate_is_cut_at_its_window_and_one_above_it_is_served(server):
    """Two bodies of about 160 KB: one sent at 1.25 times the minimum rate is answered 200;
    one at 0.75 times it gets 408 at the end of its first window, naming the rule."""
    port, url, _ = server
    before = refused_count(url, "body_timeout")
    results = {}

    def run(name: str, factor: float) -> None:
        results[name] = send_paced(port, factor * MIN_BODY_PROGRESS_BYTES / WINDOW, rows=600)

    threads = [threading.Thread(target=run, args=a) for a in (("above", 1.25), ("below", 0.75))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    (above, _, above_s), (below, body, below_s) = results["above"], results["below"]
    print(
        f"above the minimum rate: {above} after {above_s:.2f} s; below: {below} after {below_s:.2f} s"
    )
    assert above == 200
    assert below == 408 and error_type(body) == "request_timeout"
    assert b"body_progress_seconds" in body
    assert WINDOW - 0.1 <= below_s <= WINDOW + 1
    assert refused_count(url, "body_timeout") == before + 1


class Tricklers:
    """``n`` clients that each send a head declaring a 1 MB body and then one byte every
    0.2 s, and come back at once when the server cuts them off (counted)."""

    def __init__(self, port: int, n: int):
        self.port = port
        self.stop = threading.Event()
        self.cut = 0
        self.threads = [threading.Thread(target=self.run, daemon=True) for _ in range(n)]

    def run(self) -> None:
        head = (
            b"POST /v1/classify HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\n"
            b"content-length: 1000000\r\n\r\n{"
        )
        while not self.stop.is_set():
            try:
                sock = socket.create_connection(("127.0.0.1", self.port), timeout=5)
                sock.sendall(head)
                sock.settimeout(0.2)
                while not self.stop.is_set():
                    try:
                        if sock.recv(4096):
                            self.cut += 1
                            time.sleep(0.01)  # back at once (a pause for this test's threads)
                            break
                    except TimeoutError:
                        sock.send(b" ")
            except OSError:
                time.sleep(0.02)
                continue
            finally:
                sock.close()

    def __enter__(self) -> Tricklers:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(10)


def test_tricklers_at_the_cap_do_not_keep_fresh_clients_out(server):
    """A body sent at 1.25 times the minimum rate, then MAX_CONNECTIONS clients that trickle
    bodies and come back as soon as they are cut off: every fresh client (retrying on the
    cap's fast 503) is answered 200 within 1 s, taking the slot of a trickler below the
    minimum rate, and the body at 1.25 times the rate is served, never evicted."""
    port = server[0]
    uploader: dict[str, tuple] = {}
    rate, connected = 1.25 * MIN_BODY_PROGRESS_BYTES / WINDOW, threading.Event()
    thread = threading.Thread(
        target=lambda: uploader.update(r=send_paced(port, rate, 700, connected))
    )
    thread.start()
    connected.wait(5)
    with Tricklers(port, MAX_CONNECTIONS) as tricklers:
        wait_for(lambda: tricklers.cut, timeout=5, what="tricklers cut at the cap")
        fresh = [fresh_classify(port) for _ in range(10)]
        thread.join()
        cut = tricklers.cut
    print(
        f"fresh clients while {MAX_CONNECTIONS} tricklers renew at the cap: "
        f"{[(s, round(t, 3)) for s, t in fresh]}; the body above the rate: "
        f"{uploader['r'][0]}; tricklers cut {cut}"
    )
    assert all(status == 200 and seconds < 1 for status, seconds in fresh)
    assert uploader["r"][0] == 200
    assert cut >= 10


@pytest.mark.parametrize(
    "pieces",
    [
        [b"FFFFFFFF", b"FFFFFFFF\r\nhel"],
        [b"4", b"000001\r\nhel"],
        [b"5\r\nhello\r\n4", b"000001;x=y\r\n"],
    ],
    ids=["2^64-1 split", "max_body_bytes + 1 split after its first digit", "a second chunk split"],
)
def test_a_chunk_size_split_across_reads_is_refused_at_once(server, pieces):
    """A chunk larger than max_body_bytes (64 MiB) whose size line arrives in two reads:
    400 malformed_request as soon as the line is complete, not at the body deadline."""
    port, _, _ = server
    head = (
        b"POST /v1/classify HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\n"
        b"transfer-encoding: chunked\r\n\r\n"
    )
    with connect(port) as sock:
        sock.sendall(head + pieces[0])
        time.sleep(0.2)  # the first piece is read on its own
        started = time.monotonic()
        sock.sendall(pieces[1])
        status, _, body = read_response(sock, timeout=BODY_TIMEOUT + 5)
        answered = time.monotonic() - started
    assert (status, error_type(body)) == (400, "malformed_request")
    assert b"max_body_bytes" in body
    assert answered < 1


def test_a_chunk_size_line_is_read_from_the_bytes_before_its_data():
    """What the server reads for the chunk whose data is still coming: the size on the line
    that ends the bytes before it (extensions dropped), or, when that line began in an
    earlier read, its last digits (a lower bound); None for no line or no number."""
    assert chunk_size_before(b"...\r\n\r\nFFFFFFFFFFFFFFFF\r\n") == 2**64 - 1
    assert chunk_size_before(b"hello\r\n4000001 ;name=value\r\n") == 0x4000001
    assert chunk_size_before(b"01\n") == 1
    assert chunk_size_before(b"FF\r\n") == 0xFF  # the line's first digits in an earlier read
    assert chunk_size_before(b"x-trailer: v\r\n") is None
    assert chunk_size_before(b"FFFF") is None  # the line is not complete
    assert chunk_size_before(b"\r\n") is None
