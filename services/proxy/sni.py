"""Sans-IO: the server name (SNI) of a TLS ClientHello, without decrypting anything.

`read_server_name(data)` looks at the bytes a client sent so far and answers
`(status, name)`:

- NEED_MORE: the ClientHello is not complete yet (it may span several TLS
  records, and records may arrive split across reads): call again with more.
- FOUND: the ClientHello is complete; `name` is its server name, lower-cased,
  or "" when it carries no SNI extension.
- NOT_TLS: the bytes are not a TLS handshake starting with a ClientHello,
  or the ClientHello is malformed.
- TOO_LARGE: the ClientHello would exceed `MAX_HELLO` bytes (a bound: a real
  one, even with post-quantum key shares, is under 4 KiB).

Nothing is consumed: callers peek (MSG_PEEK) and hand the untouched bytes on.
"""

from __future__ import annotations

from typing import Final

NEED_MORE: Final = 0
FOUND: Final = 1
NOT_TLS: Final = 2
TOO_LARGE: Final = 3

MAX_HELLO: Final = 16 * 1024
_HANDSHAKE: Final = 22
_CLIENT_HELLO: Final = 1
_SERVER_NAME: Final = 0
_HOST_NAME: Final = 0


def _handshake_bytes(data: bytes) -> tuple[int, bytes]:
    """The handshake-layer bytes carried by the complete records at the start of `data`."""
    out = bytearray()
    at = 0
    while len(data) - at >= 5:
        if data[at] != _HANDSHAKE or data[at + 1] != 3:
            return NOT_TLS, b""
        length = int.from_bytes(data[at + 3 : at + 5], "big")
        if length == 0 or length > 16384 + 2048:
            return NOT_TLS, b""
        if len(data) - at - 5 < length:
            break
        out += data[at + 5 : at + 5 + length]
        at += 5 + length
    if at == 0 and len(data) >= 1 and data[0] != _HANDSHAKE:
        return NOT_TLS, b""
    return NEED_MORE, bytes(out)


def read_server_name(data: bytes) -> tuple[int, str]:
    if len(data) > MAX_HELLO + 5 * 8:
        data = data[: MAX_HELLO + 5 * 8]
    status, handshake = _handshake_bytes(data)
    if status != NEED_MORE:
        return status, ""
    if len(handshake) < 4:
        return (TOO_LARGE, "") if len(data) >= MAX_HELLO else (NEED_MORE, "")
    if handshake[0] != _CLIENT_HELLO:
        return NOT_TLS, ""
    length = int.from_bytes(handshake[1:4], "big")
    if length > MAX_HELLO:
        return TOO_LARGE, ""
    if len(handshake) < 4 + length:
        return NEED_MORE, ""
    try:
        return FOUND, _server_name(handshake[4 : 4 + length])
    except (IndexError, ValueError):
        return NOT_TLS, ""


def _server_name(hello: bytes) -> str:
    at = 2 + 32  # legacy_version, random
    at += 1 + hello[at]  # session id
    at += 2 + int.from_bytes(hello[at : at + 2], "big")  # cipher suites
    at += 1 + hello[at]  # compression methods
    if at == len(hello):
        return ""  # no extensions at all
    end = at + 2 + int.from_bytes(hello[at : at + 2], "big")
    if end > len(hello):
        raise ValueError("extensions overrun the ClientHello")
    at += 2
    while at + 4 <= end:
        kind = int.from_bytes(hello[at : at + 2], "big")
        size = int.from_bytes(hello[at + 2 : at + 4], "big")
        body = hello[at + 4 : at + 4 + size]
        if len(body) != size:
            raise ValueError("an extension overruns the ClientHello")
        if kind == _SERVER_NAME:
            return _host_name(body)
        at += 4 + size
    return ""


def _host_name(body: bytes) -> str:
    listed = int.from_bytes(body[0:2], "big")
    at, end = 2, min(2 + listed, len(body))
    while at + 3 <= end:
        kind = body[at]
        size = int.from_bytes(body[at + 1 : at + 3], "big")
        name = body[at + 3 : at + 3 + size]
        if kind == _HOST_NAME:
            if len(name) != size or not name or size > 253:
                raise ValueError("bad host name")
            text = name.decode("ascii")
            if not all(c.isalnum() or c in "-._" for c in text):
                raise ValueError("bad host name")
            return text.lower().rstrip(".")
        at += 3 + size
    return ""
