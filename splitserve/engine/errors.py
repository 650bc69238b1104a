"""The errors a caller can act on, raised by the code that knows what happened.

Each names the status a client should see (`status`, a gRPC status code's name; this module
imports neither torch nor grpc, so any layer may raise these). One interceptor in the service
runtime maps them to status codes; any other exception is an internal error, answered INTERNAL
and logged with its traceback. `clip` and `quoted` keep what a message echoes of a request
bounded.
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


MAX_MESSAGE_BYTES = 1000
"""Longest status message a client is sent (UTF-8 bytes): input echoed in a message must never
make it outgrow the client's metadata limit (gRPC clients refuse trailers over 16 KiB)."""


def clip(text: str, max_bytes: int = MAX_MESSAGE_BYTES) -> str:
    """`text` cut to at most `max_bytes` UTF-8 bytes, ending in "…" when it was cut."""
    raw = text.encode("utf-8", "replace")
    if len(raw) <= max_bytes:
        return text
    ellipsis = "…"
    keep = raw[: max(0, max_bytes - len(ellipsis.encode()))]
    return keep.decode("utf-8", "ignore") + ellipsis


def quoted(value: object, max_chars: int = 64) -> str:
    """`repr` of a value taken from a request (an id, a stop string), its start only: control
    characters come out escaped (no `\\r\\n` can forge a log line) and the length is bounded."""
    text = str(value)
    if len(text) <= max_chars:
        return repr(text)
    return f"{text[:max_chars]!r}… ({len(text)} characters)"


class EngineStopped(Unavailable):
    """The engine is not running (stopped, or it failed) (UNAVAILABLE)."""
