"""Connection-level limits for the HTTP server: no client can hold the server's memory or
file descriptors by opening connections and sending little or nothing.

``GuardedHttpProtocol`` is uvicorn's httptools protocol with four limits added (``python -m
service`` runs uvicorn with it; the settings are read from ``NCAKNN_*`` once per process):

* **header timeout** (``header_timeout_seconds``): from the moment a connection opens, or
  the first byte of a request on a kept-alive connection, the request line and all headers
  must arrive within this time; otherwise ``408`` and the connection is closed. A client
  that sends nothing, or trickles header bytes, is cut off after at most this long.
* **idle keep-alive timeout** (``keep_alive_timeout_seconds``, uvicorn's own): a connection
  idle between requests is closed.
* **header size and count** (``max_header_bytes``, ``max_headers``): the request line plus
  headers are counted as the bytes arrive, before the parser buffers them; past either
  limit ``431`` and the connection is closed. Memory held per connection is at most the
  limit plus one socket read.
* **connection cap** (``max_connections``, per process): a connection opened while that
  many are open is answered ``503`` at once and closed, without parsing its request, so a
  fresh client is always served or refused quickly. ``check_open_files`` makes sure at
  start-up that the open-files limit (RLIMIT_NOFILE) leaves room for the cap.

Every refusal carries the service's one error body (``{"error", "error_type"}``, statuses
from ``service.errors.STATUS``) and ``Connection: close``, and is counted by reason through
``set_observer`` (``ncaknn_connections_refused_total{reason}``; the reasons are fixed).
"""

from __future__ import annotations

import asyncio
import logging
import resource
from collections.abc import Callable
from dataclasses import dataclass
from http import HTTPStatus

import httptools
import msgspec
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from service.errors import (
    HeaderFieldsTooLarge,
    MalformedRequest,
    RequestTimeout,
    ServiceError,
    TooManyConnections,
    body_of,
    status_of,
)

log = logging.getLogger("service.ops.connections")

# file descriptors a worker needs besides its client connections: listening and gRPC
# sockets, the event loop, thread pool, log files, Prometheus multiprocess files, the model's
# files while it (re)loads
RESERVED_FILES = 128
LINGER_SECONDS = 2.0  # after a refusal, how long to drop input before closing
REFUSAL_REASONS = ("header_timeout", "headers_too_large", "too_many_headers", "over_capacity")


@dataclass(frozen=True)
class ConnectionLimits:
    max_connections: int
    header_timeout_seconds: float
    max_header_bytes: int
    max_headers: int

    @classmethod
    def from_settings(cls, settings) -> ConnectionLimits:
        return cls(
            max_connections=settings.max_connections,
            header_timeout_seconds=settings.header_timeout_seconds,
            max_header_bytes=settings.max_header_bytes,
            max_headers=settings.max_headers,
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


class GuardedHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the header timeout, header limits and connection
    cap of this module (see the module docstring)."""

    limits: ConnectionLimits | None = None  # read from the settings at the first connection

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if GuardedHttpProtocol.limits is None:
            from service.config import Settings

            GuardedHttpProtocol.limits = ConnectionLimits.from_settings(Settings())
        self.guard = GuardedHttpProtocol.limits
        self.header_timer: asyncio.TimerHandle | None = None
        self.linger_timer: asyncio.TimerHandle | None = None
        # while a request's headers are incomplete: the bytes received for them (None once
        # they are complete; the body is not counted) and what the parser has reported
        self.raw_header_bytes: int | None = 0
        self.parsed_header_bytes = 0
        self.header_count = 0
        self.began_in_this_read = False
        self.refusal: tuple[ServiceError, str] | None = None  # set by a parser callback
        self.refused = False

    # ------------------------------------------------------------------ connection

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        observer.open_connections(len(self.connections))
        if len(self.connections) > self.guard.max_connections:
            self.refuse(
                TooManyConnections(
                    f"the server holds its limit of {self.guard.max_connections} open "
                    "connections (max_connections); retry shortly or on another replica"
                ),
                "over_capacity",
            )
            return
        self.arm_header_timer()

    def connection_lost(self, exc) -> None:
        self.cancel_header_timer()
        if self.linger_timer is not None:
            self.linger_timer.cancel()
        super().connection_lost(exc)
        observer.open_connections(len(self.connections))

    def data_received(self, data: bytes) -> None:
        if self.refused:
            return  # a refused connection's input is read and dropped until it closes
        self._unset_keepalive_if_required()
        self.began_in_this_read = False
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()
            return
        except httptools.HttpParserError:
            if self.refusal is not None:
                self.refuse(*self.refusal)
            else:
                log.warning("invalid HTTP request received")
                self.send_400_response("Invalid HTTP request received.")
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

    def send_400_response(self, msg: str) -> None:
        """A request the parser cannot read: the one error body, then close."""
        self.refuse(MalformedRequest(f"{msg} (the HTTP parser refused it)"), None)

    # ------------------------------------------------------------------ parser callbacks

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self.raw_header_bytes = 0
        self.parsed_header_bytes = 0
        self.header_count = 0
        self.began_in_this_read = True
        if self.header_timer is None:
            self.arm_header_timer()

    def on_url(self, url: bytes) -> None:
        super().on_url(url)
        self.count_parsed(len(url))

    def on_header(self, name: bytes, value: bytes) -> None:
        self.header_count += 1
        if self.header_count > self.guard.max_headers:
            self.refusal = (
                HeaderFieldsTooLarge(
                    f"the request has more than {self.guard.max_headers} headers (max_headers)"
                ),
                "too_many_headers",
            )
            raise _HeaderLimit
        self.count_parsed(len(name) + len(value) + 4)  # "name: value\r\n"
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self.cancel_header_timer()
        self.raw_header_bytes = None
        super().on_headers_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.raw_header_bytes is None:
            self.raw_header_bytes = 0  # waiting for the next request's headers

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

    def refuse(self, error: ServiceError, reason: str | None) -> None:
        """Answer ``error`` with the one error body and stop reading: send it, half-close
        (FIN), drop whatever the client still sends, and close after LINGER_SECONDS (or
        when the client closes), so the client reads the answer instead of a reset."""
        self.refused = True
        self.cancel_header_timer()
        self._unset_keepalive_if_required()
        if reason is not None:
            observer.refused(reason)
        if self.transport.is_closing():
            return
        if self.cycle is not None and not self.cycle.response_complete:
            self.transport.close()  # a pipelined request over a limit: no room for an answer
            return
        self.transport.write(refusal_bytes(error))
        if self.transport.can_write_eof():
            self.transport.write_eof()
            self.linger_timer = self.loop.call_later(LINGER_SECONDS, self.transport.close)
        else:
            self.transport.close()
