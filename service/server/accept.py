"""Accepting new connections in batches on the main port.

uvloop runs on libuv, which accepts one connection per turn of the event loop (since libuv
1.45: libuv/libuv#3696, "don't accept() connections in a loop"). Under a flood of requests a
turn takes 60-200 ms, so new connections wait seconds in the kernel's accept queue: a client
opening a fresh connection, or the connection cap's fast 503, reaches the application
seconds late.

:class:`AcceptBatch` takes the rest of the queue in the same turn: each time the server's
protocol gets a new connection (``GuardedHttpProtocol.connection_made``), up to
``BATCH`` more pending connections are accepted from the listening socket and handed to
the event loop (``loop.connect_accepted_socket``) with the same protocol, so they are read,
served or refused (over the cap) at the next turn. The listening socket is found once per
process: the listening TCP socket whose port is the one the connection arrived on (Linux:
``/proc/self/fd``; elsewhere nothing is batched). The batch works on a duplicate of its
descriptor, closed when the server shuts down (``close``), after which nothing more is
accepted here.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import socket
from collections.abc import Callable

log = logging.getLogger("service.server.accept")

BATCH = 32  # pending connections taken per new connection (workers share the queue)


def find_listener(port: int) -> socket.socket | None:
    """A duplicate of this process's listening TCP socket on ``port`` (non-blocking), or
    None when there is none or the platform has no ``/proc/self/fd``."""
    try:
        fds = [int(name) for name in os.listdir("/proc/self/fd")]
    except OSError:
        return None
    for fd in fds:
        try:
            if not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                continue
            candidate = socket.fromfd(fd, socket.AF_INET, socket.SOCK_STREAM)
        except OSError:
            continue
        try:
            listening = candidate.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
            family = candidate.getsockopt(socket.SOL_SOCKET, socket.SO_DOMAIN)
            if listening and family in (socket.AF_INET, socket.AF_INET6):
                found = socket.socket(family, socket.SOCK_STREAM, fileno=candidate.detach())
                if found.getsockname()[1] == port:
                    found.setblocking(False)
                    return found
                found.close()
                continue
        except OSError:
            pass
        candidate.close()
    return None


class AcceptBatch:
    """The batch accepter of one process (see the module docstring)."""

    def __init__(self) -> None:
        self.listener: socket.socket | None = None
        self.searched = False
        self.closed = False
        self.pending = 0  # accepted here, not yet handed to a protocol

    def arrived(self) -> None:
        """A connection reached its protocol (one accepted here, or by the event loop)."""
        self.pending = max(0, self.pending - 1)

    def accept(
        self,
        loop: asyncio.AbstractEventLoop,
        port: int,
        protocol_factory: Callable,
        room: int = BATCH,
    ) -> int:
        """Accept up to min(BATCH, ``room`` - those still pending) connections on ``port``'s
        listener and start serving them with ``protocol_factory``; the number accepted.
        ``room`` is what the connection cap and the lingering closes leave: connections are
        taken from the kernel's queue no faster than the server can hold them, so batching
        never runs the process out of file descriptors."""
        if self.closed:
            return 0
        if not self.searched:
            self.searched = True
            self.listener = find_listener(port)
        if self.listener is None:
            return 0
        accepted = 0
        for _ in range(min(BATCH, room - self.pending)):
            try:
                conn, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                break
            except OSError as exc:
                if exc.errno == errno.ECONNABORTED:
                    continue
                break  # out of file descriptors: the event loop's own accept copes
            conn.setblocking(False)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            task = loop.create_task(loop.connect_accepted_socket(protocol_factory, conn))
            task.add_done_callback(_report)
            self.pending += 1
            accepted += 1
        return accepted

    def close(self) -> None:
        """Accept nothing more (the server is shutting down)."""
        self.closed = True
        if self.listener is not None:
            self.listener.close()
            self.listener = None


def _report(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.warning("an accepted connection could not be served", exc_info=task.exception())


batch = AcceptBatch()  # one per process
