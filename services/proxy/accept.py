"""Every accepted client connection starts here: HTTP/1.1 or HTTP/2, chosen once.

`ClientProtocol` is the protocol factory of the proxy's HTTP port, its HTTPS
edge (after the TLS handshake, `waygate.proxy.passthrough.TlsFront`) and every
Gateway listener port (`waygate.proxy.listeners`). It decides the HTTP version
and hands the transport over for good: to `downstream_h1.ClientConnection`
(HTTP/1.1) or to `http2.H2ClientConnection` (HTTP/2), which it gives the
stream handler (`h2exchange.start_exchange`), so that the HTTP/2 framing
module imports no exchange. This module is the only one that knows both
client protocols; nothing below it imports it.
"""

from __future__ import annotations

import asyncio
from typing import Any

from waygate.proxy.downstream_h1 import ClientConnection
from waygate.proxy.h2exchange import start_exchange
from waygate.proxy.http2 import PREFACE, H2ClientConnection, H2Limits


def _not_http1(first: bytes) -> bool:
    """A complete first line of three tokens whose last is no HTTP version
    ("INVALID CONNECTION PREFACE"): not an HTTP/1 request line. Anything
    else, malformed or not, is left to the HTTP/1.1 rules (and their 400)."""
    end = first.find(b"\r\n")
    if end < 0:
        return False
    parts = first[:end].split(b" ")
    return len(parts) == 3 and parts[2][:5].upper() != b"HTTP/"


class ClientProtocol(asyncio.Protocol):
    """Every accepted connection starts here and becomes HTTP/1.1 or HTTP/2.

    On TLS (after the handshake) ALPN decides: `h2` -> HTTP/2, else HTTP/1.1.
    On plain TCP the HTTP/1.1 connection starts at once (counted, its head
    timeout armed) and the first bytes decide: the HTTP/2 preface (h2c with
    prior knowledge) hands the transport over to HTTP/2; anything else goes
    to HTTP/1.1 untouched. The cost to HTTP/1.1: one call on the first read.
    """

    __slots__ = ("h1", "limits", "seen", "server", "transport")
    # The routing side an h2c connection looks routes up on: False, the HTTP port's;
    # a Gateway listener on its own port sets its own (waygate.proxy.listeners).
    side: Any = False

    def __init__(self, server: Any, limits: H2Limits | None = None) -> None:
        self.server = server
        self.limits = limits if limits is not None else getattr(server, "h2_limits", H2Limits())
        self.h1: Any = None
        self.transport: Any = None
        self.seen = b""

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        ssl_object = transport.get_extra_info("ssl_object")
        if ssl_object is not None:
            if ssl_object.selected_alpn_protocol() == "h2":
                proto: asyncio.Protocol = H2ClientConnection(
                    self.server, self.limits, secure=True, start_exchange=start_exchange
                )
            else:
                proto = ClientConnection(self.server)
            transport.set_protocol(proto)
            proto.connection_made(transport)
            return
        self.h1 = ClientConnection(self.server)
        self.h1.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        # Only plain connections get here (TLS ones were handed over at once).
        seen = self.seen + data if self.seen else data
        if seen[:24] == PREFACE[: min(24, len(seen))]:
            if len(seen) < 24:
                self.seen = seen
                return
            self.seen = b""
            h1 = self.h1
            self.h1 = None
            # The HTTP/1.1 connection was counted and timed: let it go quietly.
            h1.transport = None
            h1.connection_lost(None)
            proto = H2ClientConnection(
                self.server, self.limits, secure=self.side, start_exchange=start_exchange
            )
            self.transport.set_protocol(proto)
            proto.connection_made(self.transport)
            proto.data_received(seen)
            return
        self.seen = b""
        h1 = self.h1
        if _not_http1(seen):
            # Neither an HTTP/2 preface nor an HTTP/1 request line: what a client
            # with a broken preface expects is the connection closed, not a page.
            h1.transport = None
            h1.connection_lost(None)
            self.h1 = None
            self.server.metrics.refused["not_http"] = (
                self.server.metrics.refused.get("not_http", 0) + 1
            )
            self.transport.close()
            return
        self.transport.set_protocol(h1)
        h1.data_received(seen)

    def eof_received(self) -> bool | None:
        if self.h1 is not None:
            return self.h1.eof_received()  # type: ignore[no-any-return]
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        if self.h1 is not None:
            self.h1.connection_lost(exc)

    def pause_writing(self) -> None:
        if self.h1 is not None:
            self.h1.pause_writing()

    def resume_writing(self) -> None:
        if self.h1 is not None:
            self.h1.resume_writing()
