"""The request bodies one worker holds at once, bounded: a body's bytes are reserved as they
arrive, and a body that would pass the budget is refused (429) (``service.wire.read_body``
reserves; the routes hold the reservation while they read and parse; gRPC calls reserve
their largest message before it is read)."""

from __future__ import annotations

from service.errors import Overloaded
from service.ops import memory


class BodyBudget:
    """The bytes of request bodies one worker holds at once, received or being parsed, kept
    within ``limit`` (the setting max_body_bytes_in_flight): what arrives is reserved, and
    a body whose next bytes would pass the limit is refused (429). Used from the event loop
    only, which needs no lock."""

    def __init__(self, limit: int):
        self.limit = limit
        self.held = 0  # bytes reserved by the bodies in flight

    def hold(self) -> BodyHold:
        """A reservation for one request's body (a context manager: released at its end)."""
        return BodyHold(self)


class BodyHold:
    """What one request's body has reserved from its :class:`BodyBudget`."""

    __slots__ = ("budget", "bytes")

    def __init__(self, budget: BodyBudget):
        self.budget = budget
        self.bytes = 0

    def __enter__(self) -> BodyHold:
        return self

    def __exit__(self, *exc_info) -> None:
        self.release()

    def reserve(self, n: int) -> None:
        budget = self.budget
        if budget.held + n > budget.limit:
            raise Overloaded(
                f"the server holds {budget.held} bytes of request bodies, and this one needs "
                f"{n} more: the limit is {budget.limit} (max_body_bytes_in_flight); retry "
                "shortly"
            )
        budget.held += n
        self.bytes += n

    def release(self) -> None:
        """Give the reservation back; after a large body, free memory goes back to the OS."""
        self.budget.held -= self.bytes
        if self.bytes > memory.LARGE_REQUEST_BYTES:
            memory.trim_soon()
        self.bytes = 0
