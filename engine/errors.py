"""The errors a caller can act on, raised by the code that knows what happened.

Each names the status a client should see (`status`, a gRPC status code's name; this module
imports neither torch nor grpc, so any layer may raise these). One interceptor in the service
runtime maps them to status codes; any other exception is an internal error, answered INTERNAL
and logged with its traceback.
"""

from __future__ import annotations


class SplitserveError(Exception):
    """Base of the errors that carry a status."""

    status: str = "UNKNOWN"


class InvalidRequest(SplitserveError, ValueError):
    """The caller's input is wrong; the message names what (INVALID_ARGUMENT)."""

    status = "INVALID_ARGUMENT"


class NotFound(SplitserveError, LookupError):
    """No such request, reservation or worker (NOT_FOUND)."""

    status = "NOT_FOUND"


class FailedPrecondition(SplitserveError):
    """The state moved on: a stale fence, a superseded record, KV not yet complete
    (FAILED_PRECONDITION)."""

    status = "FAILED_PRECONDITION"


class Overloaded(SplitserveError):
    """Full right now; the same request may succeed later (RESOURCE_EXHAUSTED)."""

    status = "RESOURCE_EXHAUSTED"


class Unavailable(SplitserveError):
    """A dependency or this service can't serve now: loading, draining, stopped, unreachable
    (UNAVAILABLE)."""

    status = "UNAVAILABLE"


class Cancelled(SplitserveError):
    """The caller went away or aborted the request (CANCELLED)."""

    status = "CANCELLED"


class DeadlineExceeded(SplitserveError):
    """The request's deadline passed (DEADLINE_EXCEEDED)."""

    status = "DEADLINE_EXCEEDED"


class AlreadyExists(SplitserveError):
    """A request id that is already in use (ALREADY_EXISTS)."""

    status = "ALREADY_EXISTS"
