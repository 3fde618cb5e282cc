"""Every accepted client connection starts here: HTTP/1.1 or HTTP/2, chosen once.

`ClientProtocol` is the protocol factory of the proxy's HTTP port, its HTTPS
edge (after the TLS handshake, `waygate.proxy.passthrough.TlsFront`) and every
Gateway listener port (`waygate.proxy.listeners`). It decides the HTTP version
and hands the transport over for good: to `downstream_h1.ClientConnection`
(HTTP/1.1) or to `http2.H2ClientConnection` (HTTP/2), which it gives the
stream handler (`h2exchange.start_exchange`), so that the HTTP/2 framing
module imports no exchange. This module is the only one that knows both
client protocols; nothing below it imports it.

With the proxy's --proxy-protocol (`ProxyServer.proxy_protocol_timeout` set),
every connection to the HTTP port and plain Gateway listener ports starts in
`ProxyHeaderFirst`: the PROXY protocol header (v1 or v2, `waygate.proxy.proxyproto`,
bounded in size) must be whole within the timeout, else the connection is closed
(counted in `waygate_proxy_proxy_protocol_headers_total{listener,outcome}`); its
addresses go to `ClientProtocol` as `proxied`, and the connection's client address
is the header's from then on (`http1.client_context`: access checks, rate limits,
X-Forwarded-For and Forwarded, the access log, external authentication). The
HTTPS port reads the header before the ClientHello (`passthrough.TlsFront`).
Without the setting nothing here runs: connections start in `ClientProtocol`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from prometheus_client import Counter

from waygate.proxy import proxyproto
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

    __slots__ = ("h1", "limits", "proxied", "seen", "server", "transport")
    # The routing side an h2c connection looks routes up on: False, the HTTP port's;
    # a Gateway listener on its own port sets its own (waygate.proxy.listeners).
    side: Any = False

    def __init__(
        self,
        server: Any,
        limits: H2Limits | None = None,
        proxied: proxyproto.Addresses | None = None,
    ) -> None:
        self.server = server
        self.limits = limits if limits is not None else getattr(server, "h2_limits", H2Limits())
        self.h1: Any = None
        self.transport: Any = None
        self.seen = b""
        # The PROXY protocol header's addresses (None: none was read, or it had none).
        self.proxied = proxied

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        ssl_object = transport.get_extra_info("ssl_object")
        if ssl_object is not None:
            if ssl_object.selected_alpn_protocol() == "h2":
                proto: Any = H2ClientConnection(
                    self.server, self.limits, secure=True, start_exchange=start_exchange
                )
            else:
                proto = ClientConnection(self.server)
            proto.proxied = self.proxied
            transport.set_protocol(proto)
            proto.connection_made(transport)
            return
        self.h1 = ClientConnection(self.server)
        self.h1.proxied = self.proxied
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
            proto.proxied = self.proxied
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


PROXY_HEADERS = Counter(
    "waygate_proxy_proxy_protocol_headers_total",
    "PROXY protocol headers read first on the HTTP and HTTPS ports (--proxy-protocol) "
    "by outcome: read, invalid, timeout, closed (the peer left before a whole header)",
    ["listener", "outcome"],
)
#: (listener, outcome) -> its counter, resolved once.
HEADER_OUTCOMES = {
    (listener, outcome): PROXY_HEADERS.labels(listener, outcome)
    for listener in ("http", "https")
    for outcome in ("read", "invalid", "timeout", "closed")
}


class ProxyHeaderFirst(asyncio.Protocol):
    """A plain connection that must begin with a PROXY protocol header (--proxy-protocol).

    It holds at most the header's bytes (`proxyproto.read` answers INVALID past
    its bounds) for at most the server's `proxy_protocol_timeout`, counted among
    the server's connections while it waits (`server.awaiting_header`); then the
    transport goes to `make(addresses)` with the bytes after the header. A header
    that does not parse, none in time, or a peer gone first: closed and counted.
    """

    __slots__ = ("buf", "make", "server", "timer", "transport")

    def __init__(
        self, server: Any, make: Callable[[proxyproto.Addresses | None], asyncio.Protocol]
    ) -> None:
        self.server = server
        self.make = make
        self.buf = b""
        self.transport: Any = None
        self.timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        server = self.server
        waiting = server.awaiting_header
        if len(server.connections) + len(waiting) >= server.max_connections and (
            not server.make_room()
        ):
            server.metrics.refused["connection_limit"] = (
                server.metrics.refused.get("connection_limit", 0) + 1
            )
            transport.abort()
            return
        waiting.add(self)
        self.timer = server.loop.call_later(server.proxy_protocol_timeout, self._expired)

    def data_received(self, data: bytes) -> None:
        buf = self.buf = self.buf + data if self.buf else data
        header = proxyproto.read(buf)
        if header.status == proxyproto.NEED_MORE:
            return
        self._done()
        transport = self.transport
        if header.status == proxyproto.INVALID:
            HEADER_OUTCOMES["http", "invalid"].inc()
            transport.abort()
            return
        HEADER_OUTCOMES["http", "read"].inc()
        rest = buf[header.length :]
        self.buf = b""
        proto = self.make(header.addresses)
        transport.set_protocol(proto)
        proto.connection_made(transport)
        if rest and not transport.is_closing():
            proto.data_received(rest)

    def eof_received(self) -> bool | None:
        return None  # the transport closes: connection_lost counts it

    def connection_lost(self, exc: Exception | None) -> None:
        if self.timer is not None:
            self._done()
            HEADER_OUTCOMES["http", "closed"].inc()

    def _expired(self) -> None:
        self.timer = None
        self._done()
        HEADER_OUTCOMES["http", "timeout"].inc()
        self.transport.abort()

    def _done(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        self.server.awaiting_header.discard(self)

    def abort(self) -> None:
        """Drain and close: a connection still waiting for its header has no request."""
        self._done()
        self.transport.abort()


def plain_protocol(
    server: Any, make: Callable[[proxyproto.Addresses | None], asyncio.Protocol]
) -> Callable[[], asyncio.Protocol]:
    """The protocol factory of a plain listener: `make(None)`, or with --proxy-protocol
    (the server's `proxy_protocol_timeout`) the PROXY header first, then
    `make(its addresses)`."""

    def accepted() -> asyncio.Protocol:
        if server.proxy_protocol_timeout:
            return ProxyHeaderFirst(server, make)
        return make(None)

    return accepted
