"""The service's domain errors and the one table that maps them to HTTP statuses.

Every error reaches the client as ``{"error": "<what was wrong and what was expected>",
"error_type": "<name>"}`` with the status from :data:`STATUS`.
"""

from __future__ import annotations


class ServiceError(Exception):
    """Base of every error the service reports to a client."""

    error_type = "internal_error"

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class InvalidInput(ServiceError):
    error_type = "invalid_input"


class EmptyBatch(ServiceError):
    error_type = "empty_batch"


class PayloadTooLarge(ServiceError):
    error_type = "payload_too_large"


class Overloaded(ServiceError):
    error_type = "overloaded"


class NotReady(ServiceError):
    error_type = "not_ready"


class Unauthorized(ServiceError):
    error_type = "unauthorized"


class UnsupportedMediaType(ServiceError):
    error_type = "unsupported_media_type"


class NotAcceptable(ServiceError):
    error_type = "not_acceptable"


class ReloadFailed(ServiceError):
    error_type = "reload_failed"


class NotFound(ServiceError):
    error_type = "not_found"


class MethodNotAllowed(ServiceError):
    error_type = "method_not_allowed"


class MalformedRequest(ServiceError):
    """Not HTTP the server can parse (refused on the connection, before any route)."""

    error_type = "malformed_request"


class RequestTimeout(ServiceError):
    """The request line and headers, or the body, did not arrive in time
    (header_timeout_seconds, body_timeout_seconds)."""

    error_type = "request_timeout"


class HeaderFieldsTooLarge(ServiceError):
    """Headers over max_header_bytes or max_headers."""

    error_type = "header_fields_too_large"


class TooManyPipelined(ServiceError):
    """More pipelined requests wait on a connection than it may queue."""

    error_type = "too_many_pipelined"


class TooManyConnections(ServiceError):
    """The process holds max_connections open connections."""

    error_type = "too_many_connections"


class AnswerBudgetSpent(ServiceError):
    """The answers a worker holds for clients that have not taken them yet would pass
    max_answer_bytes_in_flight: this answer is refused instead (503, fast)."""

    error_type = "answer_budget_spent"


class ClientClosed(ServiceError):
    """The client went away before its request was read: nothing can be answered. Counted
    with nginx's status 499 (client closed request), never as a server error."""

    error_type = "client_closed"


STATUS: dict[type[ServiceError], int] = {
    EmptyBatch: 400,
    MalformedRequest: 400,
    RequestTimeout: 408,
    HeaderFieldsTooLarge: 431,
    TooManyConnections: 503,
    AnswerBudgetSpent: 503,
    TooManyPipelined: 429,
    Unauthorized: 401,
    NotFound: 404,
    MethodNotAllowed: 405,
    NotAcceptable: 406,
    ReloadFailed: 409,
    PayloadTooLarge: 413,
    UnsupportedMediaType: 415,
    InvalidInput: 422,
    Overloaded: 429,
    ClientClosed: 499,
    ServiceError: 500,
    NotReady: 503,
}


def status_of(error: ServiceError) -> int:
    for cls in type(error).__mro__:
        if cls in STATUS:
            return STATUS[cls]
    return 500  # pragma: no cover


def body_of(error: ServiceError) -> dict[str, str]:
    return {"error": error.message, "error_type": error.error_type}
