"""The answers one worker holds at once, bounded: the bytes of HTTP answers (``/v1`` and
``/v2`` REST alike) that clients have not taken yet are kept within a budget, and an answer
that would pass it is replaced by a fast 503 (``AnswerBudgetSpent``).

``service.app.ServiceMiddleware`` reserves an answer when its size is known (its first body
message) and hands the reservation to the connection that sends it
(``service.server.connections``), which releases it once the bytes have left the process:
at the answer's end when the transport's buffer is below its high-water mark, else when
the buffer drains (``resume_writing``) or the connection ends (a reset, a client gone).
Without that connection (a test client), the reservation ends right after the send.
Answers smaller than ``RESERVE_FROM_BYTES`` are not reserved: the hot path pays one
comparison. Used from the event loop only, which needs no lock."""

from __future__ import annotations

from service.errors import AnswerBudgetSpent, PayloadTooLarge
from service.ops import memory

# answers this small are not reserved: each fits the transport's high-water mark (64 KiB),
# so at most max_connections of them are held besides the budget (64 MiB at the default)
RESERVE_FROM_BYTES = 64 * 1024


def declared_size(start: dict) -> int:
    """The Content-Length of an ASGI ``http.response.start`` (0 without one: a streamed
    answer of unknown size is not reserved)."""
    for name, value in start.get("headers", ()):
        if name.lower() == b"content-length":
            return int(value) if value.isdigit() else 0
    return 0


class AnswerBudget:
    """The bytes of answers one worker has not yet handed to the kernel, kept within
    ``limit`` (the setting max_answer_bytes_in_flight)."""

    def __init__(self, limit: int):
        self.limit = limit
        self.held = 0  # bytes reserved by the answers in flight

    def reserve(self, n: int) -> AnswerHold:
        """A reservation of ``n`` bytes for one answer; AnswerBudgetSpent (503) when it
        does not fit what the answers in flight hold, PayloadTooLarge (413) when it is
        larger than the whole budget (it could never be sent: a retry would not help)."""
        if n > self.limit:
            raise PayloadTooLarge(
                f"this answer is {n} bytes, more than the {self.limit} that all answers in "
                "flight may hold (max_answer_bytes_in_flight): ask for fewer rows or a "
                "smaller k"
            )
        if self.held + n > self.limit:
            raise AnswerBudgetSpent(
                f"the server holds {self.held} bytes of answers that clients have not taken "
                f"yet, and this answer needs {n} more: the limit is {self.limit} "
                "(max_answer_bytes_in_flight); retry shortly or on another replica"
            )
        self.held += n
        return AnswerHold(self, n)


class AnswerHold:
    """What one answer has reserved from its :class:`AnswerBudget`; released once."""

    __slots__ = ("budget", "bytes")

    def __init__(self, budget: AnswerBudget, n: int):
        self.budget = budget
        self.bytes = n

    def release(self) -> None:
        """Give the reservation back (a second call does nothing); after a large answer,
        free memory goes back to the OS."""
        if not self.bytes:
            return
        self.budget.held -= self.bytes
        if self.bytes > memory.LARGE_REQUEST_BYTES:
            memory.trim_soon()
        self.bytes = 0
