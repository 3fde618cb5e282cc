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
