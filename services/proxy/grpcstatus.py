"""gRPC statuses for the answers the proxy gives itself on a gRPC request.

A gRPC client reads the outcome of a call from the `grpc-status` and
`grpc-message` trailers, not from the HTTP status or an HTML body: a local
answer (no route, no endpoint, the upstream's certificate expired, a
timeout) on a request whose content-type is application/grpc... is sent as
a trailers-only response (HTTP 200, one HEADERS frame ending the stream,
gRPC's PROTOCOL-HTTP2 "Trailers-Only") carrying the same reason text the HTTP
error page and X-Waygate-Error carry.

Which code: the proxy's timeouts (408, 504) are DEADLINE_EXCEEDED (4); what
the proxy cannot reach or route (502, 503) UNAVAILABLE (14); 401/403 are
UNAUTHENTICATED (16) / PERMISSION_DENIED (7); a request the proxy refuses
as malformed is INTERNAL (13), as gRPC's own HTTP-to-status table says for 400.
"""

from __future__ import annotations

from typing import Final

OK: Final = 0
DEADLINE_EXCEEDED: Final = 4
PERMISSION_DENIED: Final = 7
UNIMPLEMENTED: Final = 12
INTERNAL: Final = 13
UNAVAILABLE: Final = 14
UNAUTHENTICATED: Final = 16

_CODES: Final = {
    401: UNAUTHENTICATED,
    403: PERMISSION_DENIED,
    # A Gateway listener's miss: no route for this service/method (gRPC's table).
    404: UNIMPLEMENTED,
    408: DEADLINE_EXCEEDED,
    502: UNAVAILABLE,
    503: UNAVAILABLE,
    504: DEADLINE_EXCEEDED,
}


def code_for(http_status: int) -> int:
    """The gRPC status of a local answer with this HTTP status."""
    return _CODES.get(http_status, INTERNAL if http_status < 500 else UNAVAILABLE)


def percent_encode(message: str) -> bytes:
    """grpc-message encoding: bytes outside printable ASCII, and '%', as %XX (UTF-8)."""
    out = bytearray()
    for byte in message.encode("utf-8"):
        if 0x20 <= byte <= 0x7E and byte != 0x25:
            out.append(byte)
        else:
            out += b"%%%02X" % byte
    return bytes(out)


def trailers_only(http_status: int, reason: str) -> list[tuple[bytes, bytes]]:
    """The header fields of a trailers-only answer (to go with :status 200)."""
    return [
        (b"content-type", b"application/grpc"),
        (b"grpc-status", b"%d" % code_for(http_status)),
        (b"grpc-message", percent_encode(reason)),
        (b"x-waygate-error", reason.encode("ascii", "replace")),
    ]


def parse_timeout(value: bytes) -> float | None:
    """grpc-timeout ("1S", "250m", at most 8 digits and a unit) in seconds; None if malformed."""
    if not 2 <= len(value) <= 9 or not value[:-1].isdigit():
        return None
    unit = _UNITS.get(value[-1:])
    if unit is None:
        return None
    return int(value[:-1]) * unit


_UNITS: Final = {
    b"H": 3600.0,
    b"M": 60.0,
    b"S": 1.0,
    b"m": 1e-3,
    b"u": 1e-6,
    b"n": 1e-9,
}
