"""The PROXY protocol (HAProxy's, versions 1 and 2): read a header, write one. Sans-IO.

A load balancer in front of the proxy says who the client is by sending one
header before the connection's bytes (`read`); the proxy says the same to a
backend (`v1`, `v2`). The specification: haproxy.org/download/2.9/doc/proxy-protocol.txt.

Invariants:
- `read` never consumes more than the header: `Header.length` bytes, the rest
  is the client's. It answers NEED_MORE until the header is whole, and INVALID
  for anything the specification does not allow (a v1 line over 107 bytes, a
  bad address or port, a v2 header over MAX_V2 bytes, an unknown version or
  command), so a peer cannot hold a connection with an endless header.
- LOCAL (v2) and UNKNOWN (v1) headers carry no addresses: `Header.addresses`
  is None and the connection's own addresses stand.
- TLVs of v2 are skipped (not interpreted): they bear on nothing Waygate does.
"""

from __future__ import annotations

import ipaddress
import struct
from collections.abc import Callable
from typing import NamedTuple

V2_SIGNATURE = b"\r\n\r\n\x00\r\nQUIT\n"
V1_PREFIX = b"PROXY "
#: The longest v1 line, CRLF included (the specification's bound).
MAX_V1 = 107
#: The largest v2 header accepted (16 fixed bytes and addresses with TLVs).
MAX_V2 = 16 + 2048
NEED_MORE, OK, INVALID = range(3)

_V2_PROXY, _V2_LOCAL = 0x21, 0x20
_V2_TCP4, _V2_TCP6, _V2_UNSPEC = 0x11, 0x21, 0x00


class Addresses(NamedTuple):
    source: str
    source_port: int
    destination: str
    destination_port: int


class Header(NamedTuple):
    status: int  # NEED_MORE, OK or INVALID
    length: int = 0  # bytes of the header (OK)
    addresses: Addresses | None = None  # None: LOCAL / UNKNOWN
    reason: str = ""  # INVALID: why


def _invalid(reason: str) -> Header:
    return Header(INVALID, reason=reason)


def read(data: bytes) -> Header:
    """The header at the start of `data` (all the bytes received so far)."""
    if data[:1] == b"P":
        return _read_v1(data)
    if data[:1] == b"\r":
        return _read_v2(data)
    if not data:
        return Header(NEED_MORE)
    return _invalid("not a PROXY protocol header")


def _read_v1(data: bytes) -> Header:
    if not V1_PREFIX.startswith(data[:6]):
        return _invalid("not a PROXY protocol header")
    end = data.find(b"\r\n", 0, MAX_V1)
    if end < 0:
        return Header(NEED_MORE) if len(data) < MAX_V1 else _invalid("v1 line too long")
    fields = data[:end].split(b" ")
    if len(fields) >= 2 and fields[1] == b"UNKNOWN":
        return Header(OK, end + 2)
    if len(fields) != 6 or fields[1] not in (b"TCP4", b"TCP6"):
        return _invalid("v1 line is not PROXY TCP4|TCP6 SRC DST SPORT DPORT")
    version = 4 if fields[1] == b"TCP4" else 6
    try:
        source, destination = (ipaddress.ip_address(f.decode("ascii")) for f in fields[2:4])
        ports = [_v1_port(f) for f in fields[4:6]]
    except ValueError as exc:
        return _invalid(f"v1 {exc}")
    if source.version != version or destination.version != version:
        return _invalid(f"v1 addresses are not IPv{version}")
    return Header(OK, end + 2, Addresses(str(source), ports[0], str(destination), ports[1]))


def _v1_port(field: bytes) -> int:
    # Decimal without leading zeros, 0-65535 (the specification).
    if not field.isdigit() or (len(field) > 1 and field[:1] == b"0") or len(field) > 5:
        raise ValueError(f"port {field[:8]!r} is invalid")
    port = int(field)
    if port > 65535:
        raise ValueError(f"port {port} is invalid")
    return port


def _read_v2(data: bytes) -> Header:
    if not V2_SIGNATURE.startswith(data[:12]):
        return _invalid("not a PROXY protocol header")
    if len(data) < 16:
        return Header(NEED_MORE)
    command, family, size = data[12], data[13], struct.unpack_from("!H", data, 14)[0]
    if command >> 4 != 2:
        return _invalid("v2 header of an unknown version")
    if command not in (_V2_PROXY, _V2_LOCAL):
        return _invalid("v2 header of an unknown command")
    if 16 + size > MAX_V2:
        return _invalid(f"v2 header over {MAX_V2} bytes")
    if len(data) < 16 + size:
        return Header(NEED_MORE)
    length = 16 + size
    if command == _V2_LOCAL or family == _V2_UNSPEC:
        return Header(OK, length)
    body = data[16:length]
    if family == _V2_TCP4 and size >= 12:
        source, destination = (str(ipaddress.IPv4Address(body[i : i + 4])) for i in (0, 4))
        ports = struct.unpack_from("!HH", body, 8)
    elif family == _V2_TCP6 and size >= 36:
        source, destination = (str(ipaddress.IPv6Address(body[i : i + 16])) for i in (0, 16))
        ports = struct.unpack_from("!HH", body, 32)
    else:
        return _invalid("v2 header of an unsupported family (TCP over IPv4 or IPv6 only)")
    return Header(OK, length, Addresses(source, ports[0], destination, ports[1]))


def v1(addresses: Addresses) -> bytes:
    """A v1 header for these addresses (UNKNOWN when they are not of one IP family)."""
    try:
        source = ipaddress.ip_address(addresses.source)
        destination = ipaddress.ip_address(addresses.destination)
    except ValueError:
        return b"PROXY UNKNOWN\r\n"
    if source.version != destination.version:
        return b"PROXY UNKNOWN\r\n"
    family = "TCP4" if source.version == 4 else "TCP6"
    return (
        f"PROXY {family} {source} {destination} "
        f"{addresses.source_port} {addresses.destination_port}\r\n"
    ).encode("ascii")


def v2(addresses: Addresses) -> bytes:
    """A v2 PROXY header for these addresses (LOCAL when they are not of one IP family)."""
    try:
        source = ipaddress.ip_address(addresses.source)
        destination = ipaddress.ip_address(addresses.destination)
    except ValueError:
        return V2_SIGNATURE + bytes((_V2_LOCAL, _V2_UNSPEC, 0, 0))
    if source.version != destination.version:
        return V2_SIGNATURE + bytes((_V2_LOCAL, _V2_UNSPEC, 0, 0))
    body = (
        source.packed
        + destination.packed
        + struct.pack("!HH", addresses.source_port, addresses.destination_port)
    )
    family = _V2_TCP4 if source.version == 4 else _V2_TCP6
    return V2_SIGNATURE + bytes((_V2_PROXY, family)) + struct.pack("!H", len(body)) + body


def encoder(version: int) -> Callable[[Addresses], bytes]:
    """The header writer of a version (1 or 2)."""
    return v2 if version == 2 else v1
