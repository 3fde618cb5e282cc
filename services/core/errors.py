"""Domain errors, raised by service logic that never imports grpc.

The gRPC boundary (`waygate.core.grpcserver`) maps each class to one status
code, keeping the message for the caller. Any other exception becomes INTERNAL
with a pointer to the server log, never a bare UNKNOWN.
"""

from __future__ import annotations


class WaygateError(Exception):
    """Base class: a failure whose message is fit to show the caller."""

    #: Name of the grpc.StatusCode member this error maps to.
    status = "INTERNAL"


class InvalidArgument(WaygateError):
    status = "INVALID_ARGUMENT"


class NotFound(WaygateError):
    status = "NOT_FOUND"


class AlreadyExists(WaygateError):
    status = "ALREADY_EXISTS"


class FailedPrecondition(WaygateError):
    status = "FAILED_PRECONDITION"


class Unavailable(WaygateError):
    status = "UNAVAILABLE"


class Unauthenticated(WaygateError):
    status = "UNAUTHENTICATED"


class PermissionDenied(WaygateError):
    status = "PERMISSION_DENIED"


class ResourceExhausted(WaygateError):
    status = "RESOURCE_EXHAUSTED"


class DeadlineExceeded(WaygateError):
    status = "DEADLINE_EXCEEDED"


#: How much of a caller-supplied value a log line or an error message repeats.
EXCERPT_LIMIT = 64


def excerpt(value: str | bytes, limit: int = EXCERPT_LIMIT) -> str:
    """A caller-supplied value made safe to repeat in a log line or an error message.

    Hostile callers send megabytes under a name field and control characters
    that forge log lines; what we repeat is a quoted prefix of at most `limit`
    characters (escapes included), with the full length when it was cut.
    """
    text = value.decode("utf-8", "replace") if isinstance(value, bytes) else value
    head = repr(text[:limit])
    if len(head) > limit + 2:
        head = head[: limit + 1] + head[0]
    if len(text) > limit:
        return f"{head}... ({len(text)} characters)"
    return head
