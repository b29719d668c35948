"""Connection-level limits for the HTTP server: no client, with or without an API key, can
hold the server's time, memory or file descriptors by sending little, slowly, or nothing.

``GuardedHttpProtocol`` is uvicorn's httptools protocol with a bound on every phase of a
connection (``python -m service`` runs uvicorn with it; the settings are read from
``NCAKNN_*`` once per process):

* **accept: the connection cap** (``max_connections``, per process). A connection opened
  while that many are open is answered ``503`` at once, without parsing its request. New
  connections are accepted in batches (``service.server.accept``), so under a flood they reach
  the cap, and its 503, in one turn of the event loop instead of one per turn.
  ``check_open_files`` makes sure at start-up that the open-files limit (RLIMIT_NOFILE)
  leaves room for the cap and for the lingering closes below.
* **headers: a deadline and a size** (``header_timeout_seconds``, ``max_header_bytes``,
  ``max_headers``). From the moment a connection opens, or the first byte of a request on a
  kept-alive connection, the request line and all headers must arrive in time, else ``408``;
  they are counted as the bytes arrive, before the parser buffers them, and past either
  size limit the answer is ``431``.
* **body: a deadline, a minimum rate and a framing limit** (``body_timeout_seconds``,
  ``body_progress_seconds``). The whole body must arrive within the deadline of its headers,
  and grow by ``MIN_BODY_PROGRESS_BYTES`` (or be complete) in every window of
  ``body_progress_seconds``, else ``408``. At the connection cap a new connection takes the
  slot of the oldest body that has been below half that rate for ``EVICT_AFTER_SECONDS``
  (or a quarter of a window, when shorter; it is answered ``408``) instead of being refused,
  so clients trickling bodies, even coming back when cut off, cannot keep fresh clients
  out. Chunked framing (chunk sizes, extensions, trailers) may not exceed
  ``max_header_bytes`` plus the body bytes it carried, trailers count against
  ``max_headers``, and malformed framing, or a chunk larger than any body the server takes
  (``max_body_bytes``), is answered ``400``.
  While a body streams in uvicorn holds at most 64 KiB of it per connection (it stops
  reading until the application takes it); what the application holds is bounded by
  ``service.ops.bodies.BodyBudget``.
* **an early answer ends the connection.** When the application answers before the
  request's body has arrived (a missing API key, a body over its limit, a route that reads
  no body), no more of the body is read: the connection is closed after the answer, so a
  client that keeps dripping the body it declared holds neither a slot nor memory.
* **response: a minimum rate, measured on what the client took** (``send_timeout_seconds``).
  Once an answer stops draining (the transport's buffer passes its high-water mark, or an
  answer of MIN_SEND_PROGRESS_BYTES or more is complete while the kernel still holds that
  much of it), the client must take ``MIN_SEND_PROGRESS_BYTES`` (or all it was sent) for
  every window of ``send_timeout_seconds``, on average over the last ``SEND_WINDOWS``
  windows (fewer while fewer have passed: a client that took nothing in its first window is
  reset then; one that stops after a fast start, within SEND_WINDOWS windows). What it took
  is counted as the bytes written to it less what the connection still holds (the
  transport's buffer plus the kernel's send queue, ``TIOCOUTQ``: bytes it has not
  acknowledged), so an answer written meanwhile (the next request's) does not count against
  it. A client's kernel acknowledges what its application reads in steps (what its receive
  buffer held was acknowledged before; it reopens its window once enough room is free), so
  a client reading in bursts above the rate can show a window below it: the average over a
  few windows keeps it. Otherwise the connection is **reset** (``SO_LINGER`` 0, then abort:
  an RST, and the kernel drops its queue at once) and the answer dropped. An answer the
  server gives up on is always dropped by a reset, never by a close that would leave its
  bytes queued.
* **answers in flight** (``max_answer_bytes_in_flight``): the reservation an answer took in
  ``service.ops.answers`` is handed to its connection (``hold_answer``), which releases it
  once the bytes have left the process (below the high-water mark at the answer's end, at
  ``resume_writing``, or when the connection ends).
* **idle keep-alive** (``keep_alive_timeout_seconds``, uvicorn's own): a connection idle
  between requests is closed; one whose client is still taking its answer is not idle (the
  send rule watches it). A connection closed while the kernel still holds bytes for the
  client (``Connection: close``, HTTP/1.0, the client's half-close, a graceful shutdown)
  gets ``TCP_USER_TIMEOUT`` = SEND_WINDOWS ``send_timeout_seconds``: the kernel drops it
  once the client has acknowledged nothing for that long.

Every refusal carries the service's one error body (``{"error", "error_type"}``, statuses
from ``service.errors.STATUS``) and ``Connection: close``, and is counted by reason through
``set_observer`` (``ncaknn_connections_refused_total{reason}``; the reasons are fixed). When
the refusal answers a request whose application task is already running, the task sees the
client as gone and the request is counted with the refusal's status (the scope key
``ANSWERED_STATUS``).

A connection closed while its client may still be sending gets a **lingering close**: the
answer, then a FIN, then whatever the client still sends is read and dropped for
``LINGER_SECONDS``, so the client reads the answer instead of a reset. A lingering
connection no longer counts against ``max_connections``; at most ``MAX_LINGERING`` linger at
once (within the files reserved beside the cap), and beyond that a connection is closed at
once.
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import resource
import socket
import struct
import termios
from collections.abc import Callable
from dataclasses import dataclass
from http import HTTPStatus

import httptools
import msgspec
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from service.errors import (
    ClientClosed,
    HeaderFieldsTooLarge,
    MalformedRequest,
    RequestTimeout,
    ServiceError,
    TooManyConnections,
    TooManyPipelined,
    body_of,
    status_of,
)
from service.ops import memory
from service.ops.answers import AnswerHold
from service.server import accept

log = logging.getLogger("service.server.connections")

# file descriptors a worker needs besides its client connections: listening and gRPC
# sockets, the event loop, thread pool, log files, Prometheus multiprocess files, the model's
# files while it (re)loads, and the lingering closes (MAX_LINGERING)
RESERVED_FILES = 128
LINGER_SECONDS = 2.0  # after a refusal, how long to drop input before closing
# requests a connection may queue behind an answer not yet sent (HTTP/1.1 pipelining): each
# holds its headers (at most max_header_bytes); beyond, the connection is closed
MAX_PIPELINED = 8
# an answer the client is slow to take must shrink by this much every send_timeout_seconds,
# on average over the last SEND_WINDOWS windows
MIN_SEND_PROGRESS_BYTES = 65536
SEND_WINDOWS = 4
# a body that streams in must grow by this much every body_progress_seconds
MIN_BODY_PROGRESS_BYTES = 65536
# at the cap, a body below that rate for this long (at most a quarter of a window) gives its
# slot to a new connection
EVICT_AFTER_SECONDS = 0.5
CHUNK_LINE_TAIL = 32  # bytes of a body's last read kept for a chunk-size line split across reads
# over the cap the client has sent at most its request: a shorter linger serves more 503s
# from the MAX_LINGERING slots when a flood keeps the server at its cap
OVER_CAPACITY_LINGER_SECONDS = 0.5
MAX_LINGERING = 64  # lingering closes at once per process (half of RESERVED_FILES)
REFUSAL_REASONS = (
    "header_timeout",
    "headers_too_large",
    "too_many_headers",
    "over_capacity",
    "body_timeout",
    "malformed_request",
    "send_timeout",
    "too_many_pipelined",
)
# the scope key under which the connection records the status it answered in place of the
# application (the request's metrics read it)
ANSWERED_STATUS = "ncaknn.answered_status"
CLIENT_CLOSED_STATUS = status_of(ClientClosed(""))  # 499: the client left mid-request


@dataclass(frozen=True)
class ConnectionLimits:
    max_connections: int
    header_timeout_seconds: float
    max_header_bytes: int
    max_headers: int
    body_timeout_seconds: float
    body_progress_seconds: float
    max_body_bytes: int
    send_timeout_seconds: float

    @classmethod
    def from_settings(cls, settings) -> ConnectionLimits:
        return cls(
            max_connections=settings.max_connections,
            header_timeout_seconds=settings.header_timeout_seconds,
            max_header_bytes=settings.max_header_bytes,
            max_headers=settings.max_headers,
            body_timeout_seconds=settings.body_timeout_seconds,
            body_progress_seconds=settings.body_progress_seconds,
            max_body_bytes=settings.max_body_bytes,
            send_timeout_seconds=settings.send_timeout_seconds,
        )


class _Observer:
    """Where refusals and the open-connection count are reported (the app's metrics)."""

    def __init__(self) -> None:
        self.refused: Callable[[str], None] = lambda reason: None
        self.open_connections: Callable[[int], None] = lambda count: None


observer = _Observer()


def set_observer(refused: Callable[[str], None], open_connections: Callable[[int], None]) -> None:
    """Report refusals (by reason, one of REFUSAL_REASONS) and the number of open
    connections to these callbacks (the app does this with its metrics at creation)."""
    observer.refused = refused
    observer.open_connections = open_connections


def check_open_files(max_connections: int, listeners: int = 1) -> int:
    """Make sure this process may open ``listeners * max_connections + RESERVED_FILES`` files
    (HTTP, and gRPC when it is on, each take up to max_connections): raise the soft
    RLIMIT_NOFILE towards the hard one when needed (workers inherit it). Returns the soft
    limit now in force; ValueError naming both limits when the hard one is too low."""
    needed = listeners * max_connections + RESERVED_FILES
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < needed:
        if hard != resource.RLIM_INFINITY and hard < needed:
            raise ValueError(
                f"max_connections={max_connections} on {listeners} listener(s) needs {needed} "
                f"open files ({RESERVED_FILES} reserved for the server itself), but the "
                f"open-files limit (RLIMIT_NOFILE) is soft {soft}, hard {hard}: set "
                f"NCAKNN_MAX_CONNECTIONS to at most "
                f"{max(1, (hard - RESERVED_FILES) // listeners)} or raise the limit (ulimit -n)"
            )
        resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))
        soft = needed
    return soft


def answer_sink(send) -> GuardedHttpProtocol | None:
    """The guarded connection behind an ASGI ``send`` (uvicorn's request cycle, bound to its
    transport), or None (another server, a test client): where an answer's reservation is
    handed to be released when its bytes have left the process."""
    transport = getattr(getattr(send, "__self__", None), "transport", None)
    return transport.protocol if isinstance(transport, _Transport) else None


def hold_until_sent(send, hold: AnswerHold) -> None:
    """Hand an answer's reservation to the connection that sent it, which releases it once
    the answer's bytes have left the process; without one (a test client, where the send
    has returned with the bytes delivered), release it now."""
    sink = answer_sink(send)
    if sink is None:
        hold.release()
    else:
        sink.hold_answer(hold)


def refusal_bytes(error: ServiceError) -> bytes:
    """A complete HTTP/1.1 response carrying ``error`` with the one error body, closing."""
    body = msgspec.json.encode(body_of(error))
    status = status_of(error)
    return b"".join(
        [
            f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\n".encode("ascii"),
            b"content-type: application/json\r\n",
            f"content-length: {len(body)}\r\n".encode("ascii"),
            b"connection: close\r\n\r\n",
            body,
        ]
    )


class _HeaderLimit(Exception):
    """Raised inside a parser callback to stop parsing a request over a header limit."""


class _Lingering:
    """How many connections of this process are in a lingering close."""

    count = 0


# the connections of this process whose request body is streaming in (timed), oldest first:
# where a new connection at the cap looks for a slot to take (``evict_a_slow_body``)
_streaming_bodies: dict[GuardedHttpProtocol, None] = {}
LINGER_ZERO = struct.pack("ii", 1, 0)  # SO_LINGER {on, 0 s}: close() sends an RST


def kernel_send_queue(transport: asyncio.Transport) -> int:
    """The bytes of the connection's kernel send queue the client has not acknowledged
    (Linux: SIOCOUTQ, spelled TIOCOUTQ), 0 where the socket is gone or cannot say."""
    sock = transport.get_extra_info("socket")
    if sock is None:
        return 0
    try:
        queued = fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0")
    except (OSError, ValueError):
        return 0
    return struct.unpack("i", queued)[0]


def reset(transport: asyncio.Transport) -> None:
    """Drop the connection and whatever it still holds: SO_LINGER {on, 0} first, so that
    the socket's close sends an RST and the kernel frees its send queue at once (a plain
    close would queue a FIN behind the unsent bytes and keep them in FIN-WAIT-1)."""
    sock = transport.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, LINGER_ZERO)
        except (OSError, ValueError):
            pass  # already closed: nothing is queued
    transport.abort()


def bound_unacknowledged(transport: asyncio.Transport, seconds: float) -> None:
    """Have the kernel drop the connection when bytes it sent stay unacknowledged for
    ``seconds`` (TCP_USER_TIMEOUT; zero-window probes do not count as progress), where
    the platform has it."""
    option = getattr(socket, "TCP_USER_TIMEOUT", None)
    sock = transport.get_extra_info("socket")
    if option is None or sock is None:
        return
    try:
        sock.setsockopt(socket.IPPROTO_TCP, option, max(1, int(seconds * 1000)))
    except (OSError, ValueError):
        pass


def chunk_size_before(data: bytes) -> int | None:
    """The size a chunk-size line declares, read from ``data``, which ends with that line
    (and its CRLF); when the line began in an earlier read, the digits here are its last
    ones, whose value is a lower bound of the size. None when no size can be read."""
    if data.endswith(b"\r\n"):
        data = data[:-2]
    elif data.endswith(b"\n"):
        data = data[:-1]
    else:
        return None
    line = data[data.rfind(b"\n") + 1 :]
    digits = line.split(b";", 1)[0].strip(b" \t")
    if not digits or digits.strip(b"0123456789abcdefABCDEF"):
        return None
    return int(digits, 16)


class _Transport:
    """A connection's transport as uvicorn's protocol and request cycles see it: every call
    goes to the real transport, except ``close``, which becomes a lingering close while the
    client may still be sending the request's body (``GuardedHttpProtocol.close``)."""

    def __init__(self, inner: asyncio.Transport, protocol: GuardedHttpProtocol):
        self.inner = inner
        self.protocol = protocol
        # the calls of the request path, bound once (write counts what it is given)
        self.is_closing = inner.is_closing
        self.pause_reading = inner.pause_reading
        self.resume_reading = inner.resume_reading
        self.get_extra_info = inner.get_extra_info

    def write(self, data) -> None:
        self.protocol.written_bytes += len(data)
        self.inner.write(data)

    def writelines(self, chunks) -> None:
        for chunk in chunks:
            self.write(chunk)

    def close(self) -> None:
        self.protocol.close()

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


class GuardedHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the bounds of this module on every phase of a
    connection (see the module docstring)."""

    limits: ConnectionLimits | None = None  # read from the settings at the first connection

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if GuardedHttpProtocol.limits is None:
            from service.config import Settings

            GuardedHttpProtocol.limits = ConnectionLimits.from_settings(Settings())
        self.guard = GuardedHttpProtocol.limits
        self.header_timer: asyncio.TimerHandle | None = None
        # when the request being read must have its headers (a timer is armed only if a read
        # ends before they are complete: most requests arrive whole in one read)
        self.header_deadline: float | None = None
        self.body_timer: asyncio.TimerHandle | None = None
        # while a body streams in: when its clock started, its deadline, its bytes at the
        # last check of its rate
        self.body_started = 0.0
        self.body_deadline = 0.0
        self.body_checked_bytes = 0
        # the body bytes before the open chunk's data, while its size is still to be checked,
        # and the end of the last read of a body (where a chunk-size line may have begun)
        self.chunk_started: int | None = None
        self.read_tail = b""
        self.send_timer: asyncio.TimerHandle | None = None
        self.written_bytes = 0  # bytes of answers given to the transport, in all
        self.taking_answer = False  # the keep-alive timeout found an answer not yet taken
        # (bytes the client acknowledged, bytes written) at the start of each of the last
        # SEND_WINDOWS send windows, the newest last
        self.send_windows: list[tuple[int, int]] = []
        self.answer_holds: list[AnswerHold] = []  # answers sent, not yet out of the process
        self.lost = False  # connection_lost has run
        self.linger_timer: asyncio.TimerHandle | None = None
        # while a request's headers are incomplete: the bytes received for them (None once
        # they are complete; the body is not counted) and what the parser has reported
        self.raw_header_bytes: int | None = 0
        self.parsed_header_bytes = 0
        self.header_count = 0
        self.began_in_this_read = False
        # while a request's body is incomplete (its headers are complete): the body bytes
        # the parser delivered and the bytes of chunked framing around them
        self.in_body = False
        self.body_bytes = 0
        self.framing_bytes = 0
        self.refusal: tuple[ServiceError, str] | None = None  # set by a parser callback
        self.refused = False  # no more input is parsed: it is read and dropped
        self.lingering = False
        self.from_batch = False  # accepted by service.server.accept, not by the event loop
        # the request cycles whose answer may not be complete: the one the application is
        # answering and those pipelined behind it (uvicorn's self.cycle is only the newest)
        self.cycles: list = []

    # ------------------------------------------------------------------ connection

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(_Transport(transport, self))
        observer.open_connections(len(self.connections))
        if self.from_batch:
            accept.batch.arrived()
        # connections taken from the kernel's queue at most up to what the cap and the
        # lingering closes can hold: file descriptors stay within the reserve
        room = self.guard.max_connections + MAX_LINGERING - len(self.connections)
        if self.server is not None and room - _Lingering.count > 0:
            accept.batch.accept(
                self.loop, self.server[1], self.new_protocol, room - _Lingering.count
            )
        if len(self.connections) > self.guard.max_connections and not self.evict_a_slow_body():
            self.refuse(
                TooManyConnections(
                    f"the server holds its limit of {self.guard.max_connections} open "
                    "connections (max_connections); retry shortly or on another replica"
                ),
                "over_capacity",
                linger=OVER_CAPACITY_LINGER_SECONDS,
            )
            return
        self.arm_header_timer()

    def new_protocol(self) -> GuardedHttpProtocol:
        """A protocol for a connection accepted in a batch (service.server.accept)."""
        protocol = type(self)(
            config=self.config,
            server_state=self.server_state,
            app_state=self.app_state,
            _loop=self.loop,
        )
        protocol.from_batch = True
        return protocol

    def shutdown(self) -> None:
        accept.batch.close()  # the server stops accepting
        super().shutdown()

    def timeout_keep_alive_handler(self) -> None:
        """uvicorn's idle close, keep_alive_timeout_seconds after an answer was handed to
        the transport. A connection whose client is still taking its answer is not idle:
        the send rule watches it (armed here when the answer never filled the transport's
        buffer, so all of it went to the kernel's queue), and the idle clock starts again.
        Closing it would hand the answer to the kernel's rule instead (TCP_USER_TIMEOUT,
        ``close``), which drops a client reading in bursts well above the documented rate:
        a zero window between bursts does not count as progress there. Once the answer is
        found taken, the client gets one whole idle period from then, as it would have had
        from the answer's end (closed at once, its next request, sent as it took the last
        byte, would meet a closed connection)."""
        if not self.lost and not self.refused and not self.transport.is_closing():
            still_taking = bool(self.unsent())
            if still_taking and self.send_timer is None:
                self.arm_send_timer()
            if still_taking or self.taking_answer:
                self.taking_answer = still_taking
                self.timeout_keep_alive_task = self.loop.call_later(
                    self.timeout_keep_alive, self.timeout_keep_alive_handler
                )
                return
        super().timeout_keep_alive_handler()

    def connection_lost(self, exc) -> None:
        self.lost = True
        self.stop_body_clock()
        for timer in (self.header_timer, self.send_timer, self.linger_timer):
            if timer is not None:
                timer.cancel()
        self.header_timer = self.send_timer = self.linger_timer = None
        if self.lingering:
            self.lingering = False
            _Lingering.count -= 1
        if self.answer_holds:
            self.release_answers()  # whatever the transport still held is gone with it
        if not self.refused:
            # the client left before its answers: the requests are counted as client aborts
            for cycle in self.unanswered():
                cycle.scope.setdefault(ANSWERED_STATUS, CLIENT_CLOSED_STATUS)  # type: ignore[misc]
        self.disconnect_cycles()
        super().connection_lost(exc)
        observer.open_connections(len(self.connections))

    def data_received(self, data: bytes) -> None:
        if self.refused:
            return  # a refused connection's input is read and dropped until it closes
        self._unset_keepalive_if_required()
        self.began_in_this_read = False
        whole_read_in_body = self.in_body
        body_before = self.body_bytes
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()
            return
        except httptools.HttpParserError as exc:
            if self.refusal is not None:
                self.refuse(*self.refusal)
            else:
                what = "body framing" if self.in_body else "request"
                self.refuse(
                    MalformedRequest(f"invalid HTTP {what}: the parser refused it ({exc})"),
                    "malformed_request",
                )
            return
        if self.raw_header_bytes is not None:
            # headers still incomplete: a read that began the request holds its first
            # parsed_header_bytes (plus a partial header); every later read is all headers
            if self.began_in_this_read:
                self.raw_header_bytes = self.parsed_header_bytes
            else:
                self.raw_header_bytes += len(data)
            if self.raw_header_bytes > self.guard.max_header_bytes:
                self.refuse(self.headers_too_large(), "headers_too_large")
            elif self.header_timer is None and self.header_deadline is not None:
                # the request's headers did not come whole in this read: time them now
                remaining = max(0.0, self.header_deadline - self.loop.time())
                self.header_timer = self.loop.call_later(remaining, self.on_header_timeout)
        elif self.in_body:
            if self.chunk_started is not None and self.check_chunk_size(data):
                return
            if whole_read_in_body and not self.began_in_this_read:
                # every byte of this read belonged to one body's phase: what the body did
                # not get was chunked framing (a read that also began a pipelined request
                # holds that request's bytes too, and is not counted)
                self.framing_bytes += len(data) - (self.body_bytes - body_before)
                if self.framing_bytes > self.guard.max_header_bytes + self.body_bytes:
                    self.refuse(
                        MalformedRequest(
                            f"the chunked framing (chunk sizes, extensions, trailers) took "
                            f"{self.framing_bytes} bytes for {self.body_bytes} bytes of body; "
                            f"at most the body's size plus {self.guard.max_header_bytes} "
                            "(max_header_bytes) is accepted"
                        ),
                        "malformed_request",
                    )
                    return
            if self.body_timer is None:
                self.start_body_clock()
            self.read_tail = data[-CHUNK_LINE_TAIL:]

    def check_chunk_size(self, data: bytes) -> bool:
        """The chunk whose size line was parsed in this read and whose data is still
        coming: refuse it (400, True) when it is larger than any body the server takes.
        Its data is the tail of this read, so the size line ends just before it (and may
        have begun at the end of the last read)."""
        tail = self.body_bytes - self.chunk_started
        self.chunk_started = None
        size = chunk_size_before(self.read_tail + data[: len(data) - tail])
        if size is None or size <= self.guard.max_body_bytes:
            return False
        self.refuse(
            MalformedRequest(
                f"a chunk of {size} bytes is larger than any request body the server takes "
                f"({self.guard.max_body_bytes} bytes, max_body_bytes)"
            ),
            "malformed_request",
        )
        return True

    def send_400_response(self, msg: str) -> None:
        """A request the parser cannot read: the one error body, then close."""
        self.refuse(MalformedRequest(f"{msg} (the HTTP parser refused it)"), "malformed_request")

    # ------------------------------------------------------------------ parser callbacks

    def on_message_begin(self) -> None:
        if len(self.pipeline) >= MAX_PIPELINED:
            # requests queued behind an answer not yet sent hold their headers in memory
            self.refusal = (
                TooManyPipelined(
                    f"more than {MAX_PIPELINED} pipelined requests are waiting for their "
                    "answers on this connection; send the next request after an answer"
                ),
                "too_many_pipelined",
            )
            raise _HeaderLimit
        super().on_message_begin()
        self.raw_header_bytes = 0
        self.parsed_header_bytes = 0
        self.header_count = 0
        self.began_in_this_read = True
        if self.header_timer is None:  # timed from here; a timer only if this read ends early
            self.header_deadline = self.loop.time() + self.guard.header_timeout_seconds

    def on_url(self, url: bytes) -> None:
        super().on_url(url)
        self.count_parsed(len(url))

    def on_header(self, name: bytes, value: bytes) -> None:
        self.header_count += 1
        if self.header_count > self.guard.max_headers:
            self.refusal = (
                HeaderFieldsTooLarge(
                    f"the request has more than {self.guard.max_headers} header and trailer "
                    "fields (max_headers)"
                ),
                "too_many_headers",
            )
            raise _HeaderLimit
        if self.in_body:
            return  # a trailer field: counted as framing, not added to the request's headers
        self.parsed_header_bytes += len(name) + len(value) + 4  # "name: value\r\n"
        if self.parsed_header_bytes > self.guard.max_header_bytes:
            self.refusal = (self.headers_too_large(), "headers_too_large")
            raise _HeaderLimit
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self.cancel_header_timer()
        self.header_deadline = None
        self.raw_header_bytes = None
        super().on_headers_complete()
        if self.cycle is not None and self.cycle not in self.cycles:
            self.cycles = [*self.unanswered(), self.cycle]
        self.in_body = True  # until on_message_complete, which follows at once without a body
        self.body_bytes = 0
        self.framing_bytes = 0

    def on_body(self, body: bytes) -> None:
        self.body_bytes += len(body)
        super().on_body(body)

    def on_chunk_header(self) -> None:
        # a chunk's size line was parsed (chunked bodies only): its size is checked at the
        # end of this read unless the chunk completes within it
        self.chunk_started = self.body_bytes

    def on_chunk_complete(self) -> None:
        self.chunk_started = None

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self.in_body = False
        if self.body_timer is not None:
            self.stop_body_clock()

    def on_response_complete(self) -> None:
        if self.in_body and not self.pipeline:
            # answered before its body arrived (a refusal: no key, too large...): read no
            # more of it, so the client's declared body holds neither a slot nor memory
            self.server_state.total_requests += 1
            self.linger_close()
            return
        super().on_response_complete()
        self.cycles = self.unanswered()
        self.taking_answer = False  # the keep-alive timeout's count starts from this answer
        if self.send_timer is None and not self.refused and not self.transport.is_closing():
            if self.unsent() >= MIN_SEND_PROGRESS_BYTES:
                # an answer that went to the kernel's queue whole (the transport's buffer
                # never paused writing) is watched from here, as one that paused is
                self.arm_send_timer()
        if self.raw_header_bytes is None and not self.in_body:
            # waiting for the next request's headers (unless a pipelined request's have
            # come and its body is streaming in: its bytes are not headers)
            self.raw_header_bytes = 0

    def unanswered(self) -> list:
        """The request cycles of this connection whose answer is not complete."""
        return [cycle for cycle in self.cycles if not cycle.response_complete]

    def disconnect_cycles(self) -> None:
        """Mark every request of this connection without a complete answer (the one being
        answered and those pipelined behind it) as gone, so that what the application
        still sends for it is dropped: uvicorn marks only the newest request, and an
        answer to an older one would be written to a closed transport (uvloop raises)."""
        for cycle in self.unanswered():
            cycle.disconnected = True
            cycle.message_event.set()
        self.cycles = []

    # ------------------------------------------------------------------ writing

    def pause_writing(self) -> None:
        super().pause_writing()
        if self.send_timer is None and not self.refused:
            self.arm_send_timer()

    def resume_writing(self) -> None:
        super().resume_writing()
        if self.answer_holds:
            self.release_answers()  # the buffer has drained: the answers left the process

    def unsent(self) -> int:
        """What the client has not taken: the transport's buffer plus the kernel's send
        queue (bytes not yet acknowledged)."""
        transport = self.transport.inner
        return transport.get_write_buffer_size() + kernel_send_queue(transport)

    def acknowledged(self) -> int:
        """Bytes of answers the client has taken (its kernel acknowledged) on this
        connection, in all: written less what is still held. It only grows, whatever is
        written meanwhile."""
        return self.written_bytes - self.unsent()

    def arm_send_timer(self) -> None:
        window = (self.acknowledged(), self.written_bytes)
        self.send_windows = [*self.send_windows, window][-SEND_WINDOWS:]
        self.send_timer = self.loop.call_later(
            self.guard.send_timeout_seconds, self.on_send_timeout
        )

    def on_send_timeout(self) -> None:
        """A client slow to take its answer is given another send_timeout_seconds each time
        it took, over the last n = min(SEND_WINDOWS, windows so far) windows, at least
        n MIN_SEND_PROGRESS_BYTES (or all that was held n windows ago), counted on what the
        connection holds in the process and in the kernel; one that did not is reset."""
        self.send_timer = None
        unsent = self.unsent()
        if not unsent:
            self.send_windows = []  # all taken: a later stall starts a new count
            return
        taken_then, _ = self.send_windows[0]  # n windows ago
        n = len(self.send_windows)
        taken = self.written_bytes - unsent - taken_then
        owed = self.written_bytes - taken_then  # all it could have taken since
        if taken >= min(n * MIN_SEND_PROGRESS_BYTES, owed):
            self.arm_send_timer()  # it is reading: keep going
            return
        observer.refused("send_timeout")
        log.info(
            "an answer was not taken in time: connection reset",
            extra={"send_timeout_seconds": self.guard.send_timeout_seconds, "unsent": unsent},
        )
        self.refused = True
        reset(self.transport.inner)
        memory.trim_soon()  # the answer's memory goes back

    def hold_answer(self, hold: AnswerHold) -> None:
        """Keep an answer's reservation (``service.ops.answers``) until its bytes have left
        the process: at once when the transport's buffer is below its high-water mark (or
        the connection is gone), else when it drains or the connection ends."""
        if self.lost or not self.flow.write_paused:
            hold.release()
        else:
            self.answer_holds.append(hold)

    def release_answers(self) -> None:
        holds, self.answer_holds = self.answer_holds, []
        for hold in holds:
            hold.release()

    # ------------------------------------------------------------------ limits

    def count_parsed(self, n: int) -> None:
        self.parsed_header_bytes += n
        if self.parsed_header_bytes > self.guard.max_header_bytes:
            self.refusal = (self.headers_too_large(), "headers_too_large")
            raise _HeaderLimit

    def headers_too_large(self) -> ServiceError:
        return HeaderFieldsTooLarge(
            f"the request line and headers exceed {self.guard.max_header_bytes} bytes "
            "(max_header_bytes)"
        )

    def arm_header_timer(self) -> None:
        self.cancel_header_timer()
        self.header_timer = self.loop.call_later(
            self.guard.header_timeout_seconds, self.on_header_timeout
        )

    def cancel_header_timer(self) -> None:
        if self.header_timer is not None:
            self.header_timer.cancel()
            self.header_timer = None

    def on_header_timeout(self) -> None:
        self.header_timer = None
        if self.raw_header_bytes is None or self.refused:
            return
        self.refuse(
            RequestTimeout(
                f"the request line and headers did not arrive within "
                f"{self.guard.header_timeout_seconds:g} s (header_timeout_seconds)"
            ),
            "header_timeout",
        )

    def start_body_clock(self) -> None:
        """Time a body, from the end of the read that completed its headers when it did
        not come with them (most requests arrive whole in one read): its deadline, and its
        rate checked every body_progress_seconds."""
        now = self.loop.time()
        self.body_started = now
        self.body_deadline = now + self.guard.body_timeout_seconds
        self.body_checked_bytes = self.body_bytes
        _streaming_bodies[self] = None
        self.arm_body_timer(now)

    def arm_body_timer(self, now: float) -> None:
        wait = min(self.guard.body_progress_seconds, self.body_deadline - now)
        self.body_timer = self.loop.call_later(max(0.0, wait), self.on_body_timer)

    def stop_body_clock(self) -> None:
        if self.body_timer is not None:
            self.body_timer.cancel()
            self.body_timer = None
        _streaming_bodies.pop(self, None)

    def on_body_timer(self) -> None:
        """At the deadline: 408. At the end of a window: 408 unless the body grew by
        MIN_BODY_PROGRESS_BYTES meanwhile, or the application has not taken what came (the
        connection stopped reading: the client could not send)."""
        self.body_timer = None
        if not self.in_body or self.refused:
            self.stop_body_clock()
            return
        now = self.loop.time()
        if now >= self.body_deadline - 1e-3:
            self.refuse(
                RequestTimeout(
                    f"the request body did not arrive within "
                    f"{self.guard.body_timeout_seconds:g} s of its headers "
                    f"(body_timeout_seconds); {self.body_bytes} bytes arrived"
                ),
                "body_timeout",
            )
            return
        if (
            self.body_bytes - self.body_checked_bytes < MIN_BODY_PROGRESS_BYTES
            and not self.flow.read_paused
        ):
            self.refuse(self.body_too_slow(), "body_timeout")
            return
        self.body_checked_bytes = self.body_bytes
        self.arm_body_timer(now)

    def body_too_slow(self) -> ServiceError:
        return RequestTimeout(
            f"the request body came slower than {MIN_BODY_PROGRESS_BYTES} bytes per "
            f"{self.guard.body_progress_seconds:g} s (body_progress_seconds); "
            f"{self.body_bytes} bytes arrived"
        )

    def evict_a_slow_body(self) -> bool:
        """At the cap: answer 408 to the oldest body that has streamed in at less than half
        the minimum rate for EVICT_AFTER_SECONDS (or a quarter of a window, when that is
        shorter: it is bound to fail its window), so that this new connection takes its
        slot. False when there is none."""
        now = self.loop.time()
        window = self.guard.body_progress_seconds
        half_rate = MIN_BODY_PROGRESS_BYTES / window / 2
        grace = min(EVICT_AFTER_SECONDS, window / 4)
        victim = None
        for protocol in _streaming_bodies:  # oldest first
            elapsed = now - protocol.body_started
            if elapsed < grace:
                break  # every later one is younger
            if protocol.body_bytes < half_rate * elapsed and not protocol.flow.read_paused:
                victim = protocol
                break
        if victim is None:
            return False
        victim.refuse(victim.body_too_slow(), "body_timeout")
        return True

    # ------------------------------------------------------------------ ending

    def refuse(
        self, error: ServiceError, reason: str | None, linger: float = LINGER_SECONDS
    ) -> None:
        """Answer ``error`` with the one error body and stop reading. A refusal during a
        request's body answers that request: its application task sees the client as gone
        and its answer, if any, is dropped. A refusal while an earlier answer is pending (a
        pipelined request over a limit) leaves no room for an answer: the connection closes."""
        self.refused = True
        self.cancel_header_timer()
        self.stop_body_clock()
        self._unset_keepalive_if_required()
        if reason is not None:
            observer.refused(reason)
        if self.transport.is_closing():
            return
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            if not (self.in_body and not cycle.response_started and not self.pipeline):
                self.disconnect_cycles()
                self.transport.inner.close()
                return
            cycle.scope[ANSWERED_STATUS] = status_of(error)  # type: ignore[literal-required]
            cycle.disconnected = True
            cycle.message_event.set()
        self.transport.write(refusal_bytes(error))
        self.linger_close(linger)

    def close(self) -> None:
        """Close the connection: a lingering close while the client may still be sending
        the request's body or more requests after a refusal, else at once. Bytes the client
        has not taken yet are still sent, under the kernel's rule (the process no longer
        watches them): ``bound_unsent``."""
        if self.in_body or self.refused:
            self.linger_close()
            return
        transport = self.transport.inner
        if not self.lost and not transport.is_closing():
            self.bound_unsent()
        transport.close()

    def bound_unsent(self) -> None:
        """Before the transport closes with bytes the client has not taken: have the kernel
        drop the connection once the client acknowledges nothing for SEND_WINDOWS send
        windows (TCP_USER_TIMEOUT), the longest the send rule lets a client take nothing."""
        if self.unsent():
            seconds = SEND_WINDOWS * self.guard.send_timeout_seconds
            bound_unacknowledged(self.transport.inner, seconds)

    def eof_received(self) -> None:
        """The client half-closed: the transport closes itself (uvicorn's answer), with what
        the client has not taken under the kernel's rule, as at ``close``."""
        if not self.lost and not self.transport.is_closing():
            self.bound_unsent()
        return super().eof_received()

    def linger_close(self, seconds: float = LINGER_SECONDS) -> None:
        """Send what is buffered and a FIN, then read and drop the client's input for up to
        ``seconds`` before closing. The connection leaves the count of open ones at once;
        beyond MAX_LINGERING lingering connections it is closed at once."""
        self.refused = True
        if self.lingering:
            return
        self.connections.discard(self)
        observer.open_connections(len(self.connections))
        transport = self.transport.inner
        if transport.is_closing():
            return
        if _Lingering.count >= MAX_LINGERING or not transport.can_write_eof():
            transport.close()
            return
        self.lingering = True
        _Lingering.count += 1
        transport.write_eof()
        transport.resume_reading()
        self.linger_timer = self.loop.call_later(seconds, self.end_linger)

    def end_linger(self) -> None:
        self.linger_timer = None
        transport = self.transport.inner
        if transport.get_write_buffer_size() or kernel_send_queue(transport):
            reset(transport)  # the client did not take the answer: drop it
        else:
            transport.close()
