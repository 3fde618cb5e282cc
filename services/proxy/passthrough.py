"""The HTTPS port's front door: TLS passthrough by SNI, everything else terminated.

Every connection to the HTTPS port is accepted here. Its ClientHello is
peeked (MSG_PEEK: the kernel keeps the bytes) and parsed by the sans-IO
`waygate.proxy.sni` until the server name is known, within
`HELLO_TIMEOUT` and `sni.MAX_HELLO` bytes, however the ClientHello is split
across records and reads. Then:

- a name with a passthrough route: the connection is relayed, bytes
  untouched (nothing is decrypted), to an endpoint of the route's backend,
  picked by source address unless the route sets another policy. The client's
  ClientHello is still in the socket, so the backend receives it first.
- any other name, or none: the connection goes to the edge listener
  (`waygate.proxy.tls`: the route's certificate by SNI, else the default).
- not TLS, a ClientHello over the bound, or nothing within the timeout: closed.

Each outcome is counted in `waygate_proxy_tls_connections_total{outcome}`.

With --proxy-protocol (`server.proxy_protocol_timeout`), the same peeks read the
PROXY header before the ClientHello first (`proxyproto.read`, whole within that
timeout and `proxyproto.MAX_V2` bytes, else the connection is closed and counted
in `waygate_proxy_proxy_protocol_headers_total`); once the route is known exactly
the header's bytes are taken off the socket, so the backend of a passthrough
route gets the ClientHello first as before, and the terminated connection's
client address is the header's (`accept.ClientProtocol`'s `proxied`, a
passthrough's source-hash key too).

A relay pauses reading on one side while the other's write buffer is past
its high-water mark, closes both sides when either closes, and closes after
the route's tunnel timeout of inactivity; SIGTERM closes relays after the
grace period. The peek adds one recv per connection; no task per chunk.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import select
import socket
from collections.abc import Callable
from typing import Any, Protocol

from prometheus_client import Counter

from waygate.core import flow
from waygate.proxy import proxyproto, sni
from waygate.proxy.accept import HEADER_OUTCOMES, ClientProtocol
from waygate.proxy.routing import RouteTable
from waygate.proxy.upstream import ConnectError, start
from waygate.proxy.view import HTTPS_FRONT

log = logging.getLogger(__name__)

HELLO_TIMEOUT = 10.0
_PEEK_RETRY = 0.005
_PEEK_RETRY_MAX = 0.2
HIGH_WATER = flow.HIGH_WATER
LOW_WATER = flow.LOW_WATER

TLS_CONNECTIONS = Counter(
    "waygate_proxy_tls_connections_total",
    "connections to the HTTPS port by what became of them: passthrough, terminated, "
    "not_tls, too_large, timeout, no_endpoint, connect_failed",
    ["outcome"],
)


def bind_listener(host: str, port: int, *, reuse_port: bool = False) -> socket.socket:
    """A listening, non-blocking socket (OSError as the kernel says: in use, not permitted)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        listener.bind((host, port))
        listener.listen(1024)
        listener.setblocking(False)
    except OSError:
        listener.close()
        raise
    return listener


_HEADER_PENDING = proxyproto.Header(proxyproto.NEED_MORE)
_HEADER_INVALID = proxyproto.Header(proxyproto.INVALID, reason="invalid")
_HEADER_TIMEOUT = proxyproto.Header(proxyproto.INVALID, reason="timeout")
_HEADER_CLOSED = proxyproto.Header(proxyproto.INVALID, reason="closed")


def _consume(conn: socket.socket, length: int) -> None:
    """Take `length` bytes the socket holds (peeked: they are there) off it."""
    while length:
        taken = len(conn.recv(length))
        if not taken:
            raise ConnectionError("closed")
        length -= taken


def _peer_closed(conn: socket.socket) -> bool:
    """Has the peer shut down its side (FIN or RST), whatever is still unread?"""
    poller = select.poll()
    poller.register(conn.fileno(), select.POLLRDHUP)
    return any(
        events & (select.POLLRDHUP | select.POLLHUP | select.POLLERR)
        for _, events in poller.poll(0)
    )


class _Side(asyncio.Protocol):
    """One side of a byte relay; `peer` is the other side. Its reading pauses (core.flow,
    reason PEER) while the peer's write buffer is past its high-water mark."""

    __slots__ = ("closed", "early", "eof", "flow", "peer", "relay", "transport")

    def __init__(self, relay: Relay) -> None:
        self.relay = relay
        self.peer: _Side | None = None
        self.transport: asyncio.Transport | None = None
        self.flow: flow.FlowControl | None = None
        self.closed = False
        self.eof = False
        # Bytes the backend sent before the client side was attached (bounded).
        self.early = b""

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        self.flow = flow.FlowControl(transport, high=HIGH_WATER, low=LOW_WATER)
        transport.set_write_buffer_limits(high=HIGH_WATER, low=LOW_WATER)
        peer = self.peer
        if peer is not None and peer.early:
            transport.write(peer.early)
            peer.early = b""

    def data_received(self, data: bytes) -> None:
        self.relay.last = self.relay.loop.time()
        peer = self.peer
        if peer is not None and peer.transport is not None:
            peer.transport.write(data)
        elif len(self.early) + len(data) <= HIGH_WATER:
            self.early += data
        else:
            self.relay.close()

    def eof_received(self) -> bool | None:
        self.eof = True
        peer = self.peer
        if peer is None or peer.eof or peer.transport is None:
            self.relay.close()  # both directions finished
            return None
        if peer.transport.can_write_eof():
            peer.transport.write_eof()
            return True  # half-close: the other direction carries on
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.flow is not None:
            self.flow.closed()
        self.relay.close()

    def pause_writing(self) -> None:
        peer = self.peer
        if peer is not None and peer.flow is not None:
            peer.flow.pause(flow.PEER)

    def resume_writing(self) -> None:
        peer = self.peer
        if peer is not None and peer.flow is not None:
            peer.flow.resume(flow.PEER)


class RelayOwner(Protocol):
    """What a relay needs of the listener that holds it (a TlsFront, a TCP service port)."""

    loop: asyncio.AbstractEventLoop
    relays: set[Relay]


class Relay:
    """Client <-> backend bytes for one passthrough or TCP service connection."""

    def __init__(self, front: RelayOwner, timeout: float) -> None:
        self.front = front
        self.loop = front.loop
        self.timeout = timeout
        self.last = self.loop.time()
        self.client = _Side(self)
        self.backend = _Side(self)
        self.client.peer = self.backend
        self.backend.peer = self.client
        self.done = False

    def close(self) -> None:
        if self.done:
            return
        self.done = True
        self.front.relays.discard(self)
        for side in (self.client, self.backend):
            if side.transport is not None and not side.closed:
                side.transport.close()

    def abort(self) -> None:
        self.done = True
        self.front.relays.discard(self)
        for side in (self.client, self.backend):
            if side.transport is not None:
                side.transport.abort()


async def drain_relays(owner: RelayOwner, pending: set[asyncio.Task[None]], grace: float) -> None:
    """Connections not relayed yet are cancelled; open relays get `grace`, then are closed."""
    for task in list(pending):
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    deadline = owner.loop.time() + grace
    while owner.relays and owner.loop.time() < deadline:
        await asyncio.sleep(0.05)
    for relay in list(owner.relays):
        relay.abort()


_NO_ROUTES = RouteTable.empty()


class TlsFront:
    """The HTTPS port as a runtime Listener: peek the SNI, relay or terminate."""

    def __init__(
        self,
        server: Any,
        certificates: Any,
        host: str,
        port: int,
        *,
        reuse_port: bool = False,
        protocol: Callable[[proxyproto.Addresses | None], asyncio.Protocol] | None = None,
    ) -> None:
        self.server = server  # the ProxyServer that serves terminated connections
        # Terminated connections' protocol; set: a Gateway listener's own port
        # (waygate.proxy.listeners), which is not the proxy's HTTPS port.
        self._protocol = protocol
        self.certificates = certificates  # waygate.proxy.tls.EdgeCertificates
        server.edge = certificates
        self.host = host
        self.port = port
        self.reuse_port = reuse_port
        self.loop = asyncio.get_running_loop()
        # Its passthrough table in the server's view (view.ProxyView.passthrough).
        self.view_key = HTTPS_FRONT if protocol is None else port
        self.relays: set[Relay] = set()
        self.pending: set[asyncio.Task[None]] = set()
        self.bound_port = 0
        self._listener: socket.socket | None = None
        self._accepting: asyncio.Task[None] | None = None
        self._sweeper: asyncio.TimerHandle | None = None

    @property
    def table(self) -> RouteTable:
        """The passthrough routes this front relays, by SNI (the current view's)."""
        table = self.server.context.view.passthrough.get(self.view_key)
        return table if table is not None else _NO_ROUTES

    # ------------------------------------------------------------ Listener

    async def start(self) -> None:
        self.serve(bind_listener(self.host, self.port, reuse_port=self.reuse_port))

    def serve(self, listener: socket.socket) -> None:
        """Accept on `listener` (bound and listening)."""
        self._listener = listener
        self.bound_port = listener.getsockname()[1]
        self._accepting = self.loop.create_task(self._accept_forever(listener))
        self._sweeper = self.loop.call_later(1.0, self._sweep)
        if self._protocol is None:
            self.server.https_port = self.bound_port  # redirects and X-Forwarded-Port
            log.info("proxy listening", extra={"https_port": self.bound_port})

    def stop_accepting(self) -> None:
        if self._accepting is not None:
            self._accepting.cancel()
            self._accepting = None
        if self._listener is not None:
            self._listener.close()
            self._listener = None

    async def drain(self, grace: float) -> None:
        """Relays carry opaque bytes: they get the grace period, then are closed.
        (Terminated connections are drained by the HTTP listener's ProxyServer.)"""
        self.stop_accepting()
        await drain_relays(self, self.pending, grace)
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None

    # ------------------------------------------------------------ per connection

    async def _accept_forever(self, listener: socket.socket) -> None:
        while True:
            try:
                conn, _ = await self.loop.sock_accept(listener)
            except OSError as exc:
                log.warning("HTTPS accept failed", extra={"error": exc.strerror or str(exc)})
                await asyncio.sleep(0.1)
                continue
            open_now = len(self.server.connections) + len(self.relays) + len(self.pending)
            if open_now >= self.server.max_connections and not self.server.make_room():
                conn.close()  # every connection is busy: nothing idle to close instead
                continue
            conn.setblocking(False)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            task = self.loop.create_task(self._route(conn))
            self.pending.add(task)
            task.add_done_callback(self.pending.discard)

    async def _route(self, conn: socket.socket) -> None:
        try:
            outcome, name, header = await self._peek(conn)
            proxied = None
            if header is not None:
                if header.status != proxyproto.OK:
                    HEADER_OUTCOMES["https", header.reason].inc()
                    conn.close()
                    return
                HEADER_OUTCOMES["https", "read"].inc()
                proxied = header.addresses
            if outcome != sni.FOUND:
                label = {sni.NOT_TLS: "not_tls", sni.TOO_LARGE: "too_large"}.get(outcome, "timeout")
                TLS_CONNECTIONS.labels(label).inc()
                conn.close()
                return
            if header is not None:
                # Peeked, so whole in the socket: consumed exactly, the ClientHello stays.
                _consume(conn, header.length)
            entry = self.table.lookup(name.encode(), b"/") if name else None
            if entry is None:
                TLS_CONNECTIONS.labels("terminated").inc()
                await self.loop.connect_accepted_socket(
                    lambda: self._client_protocol(proxied),
                    conn,
                    ssl=self.certificates.context,
                    ssl_handshake_timeout=HELLO_TIMEOUT,
                )
                return
            await self._relay(conn, entry, proxied)
        except (OSError, EOFError, TimeoutError, ConnectionError):
            # A client gone or a failed handshake: asyncio closed its transport.
            conn.close()
        except BaseException:
            conn.close()
            raise

    def _client_protocol(self, proxied: proxyproto.Addresses | None) -> asyncio.Protocol:
        # HTTP/1.1 or HTTP/2, as ALPN chose (waygate.proxy.accept).
        if self._protocol is not None:
            return self._protocol(proxied)
        return ClientProtocol(self.server, proxied=proxied)

    async def _peek(self, conn: socket.socket) -> tuple[int, str, proxyproto.Header | None]:
        """Peek until the ClientHello's server name is known (bounded in time and size);
        with --proxy-protocol, the PROXY header before it first (its own timeout).
        The header: None without the setting; else OK, or not OK with its reason
        ("invalid", "timeout", "closed") and the connection is to be closed."""
        now = self.loop.time()
        deadline = now + HELLO_TIMEOUT
        header_timeout = self.server.proxy_protocol_timeout
        header: proxyproto.Header | None = None
        if header_timeout:
            header = _HEADER_PENDING
            header_deadline = now + header_timeout
        limit = sni.MAX_HELLO + 64 + (proxyproto.MAX_V2 if header_timeout else 0)
        seen = -1
        delay = _PEEK_RETRY
        while True:
            try:
                data = conn.recv(limit, socket.MSG_PEEK)
            except BlockingIOError:
                data = None
            if data is not None:
                if not data:
                    if header is not None and header.status == proxyproto.NEED_MORE:
                        return sni.NOT_TLS, "", _HEADER_CLOSED
                    return sni.NOT_TLS, "", header  # closed before a ClientHello
                start = 0
                if header is not None:
                    if header.status == proxyproto.NEED_MORE:
                        header = proxyproto.read(data)
                        if header.status == proxyproto.INVALID:
                            return sni.NOT_TLS, "", _HEADER_INVALID
                    start = header.length
                if header is None or header.status == proxyproto.OK:
                    status, name = sni.read_server_name(data[start:] if start else data)
                    if status != sni.NEED_MORE:
                        return status, name, header
                if len(data) >= limit:
                    return sni.TOO_LARGE, "", header
            now = self.loop.time()
            if header is not None and header.status == proxyproto.NEED_MORE:
                if now >= header_deadline:
                    return sni.NEED_MORE, "", _HEADER_TIMEOUT
                wait_until = min(deadline, header_deadline)
            elif now >= deadline:
                return sni.NEED_MORE, "", header
            else:
                wait_until = deadline
            if data is None:
                await self._readable(conn, wait_until)
            elif len(data) == seen:
                # Nothing new: a peeked socket stays readable, so readiness says
                # nothing. A client gone behind its partial ClientHello is seen by
                # POLLRDHUP; otherwise wait, backing off (only split ClientHellos
                # get here, and their next bytes usually follow within a few ms).
                if _peer_closed(conn):
                    pending = header is not None and header.status == proxyproto.NEED_MORE
                    gone = _HEADER_CLOSED if pending else header
                    return sni.NOT_TLS, "", gone
                await asyncio.sleep(delay)
                delay = min(delay * 2, _PEEK_RETRY_MAX)
            seen = len(data) if data is not None else seen

    async def _readable(self, conn: socket.socket, deadline: float) -> None:
        ready = self.loop.create_future()
        fd = conn.fileno()

        def wake() -> None:
            if not ready.done():
                ready.set_result(None)

        self.loop.add_reader(fd, wake)
        try:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(0.0, deadline - self.loop.time())):
                    await ready
        finally:
            self.loop.remove_reader(fd)

    async def _relay(
        self, conn: socket.socket, entry: Any, proxied: proxyproto.Addresses | None
    ) -> None:
        if proxied is not None:
            client_key = proxied.source.encode()
        else:
            peer = conn.getpeername()
            client_key = (peer[0] if peer else "").encode()
        target, _ = entry.pick(client_key, None, self.server.health, None)
        if target is None:
            TLS_CONNECTIONS.labels("no_endpoint").inc()
            conn.close()
            return
        try:
            upstream = await self.server.dialer.connect(target, entry.options.connect_timeout, None)
        except ConnectError as exc:
            self.server.health.failed(target)
            TLS_CONNECTIONS.labels("connect_failed").inc()
            log.warning(
                "passthrough connect failed",
                extra={"route": entry.options.name, "reason": exc.reason},
            )
            conn.close()
            return
        self.server.health.succeeded(target)
        relay = Relay(self, entry.options.tunnel_timeout)
        self.relays.add(relay)
        try:
            # A socket, or a tunnel endpoint's data connection: attached as it is
            # (no socketpair), the client's raw bytes go straight onto it.
            await start(upstream, lambda: relay.backend)
            await self.loop.connect_accepted_socket(lambda: relay.client, conn)
        except BaseException:
            relay.abort()
            upstream.close()
            conn.close()
            raise
        TLS_CONNECTIONS.labels("passthrough").inc()

    def _sweep(self) -> None:
        now = self.loop.time()
        for relay in [r for r in self.relays if now - r.last > r.timeout]:
            relay.close()
        self._sweeper = self.loop.call_later(1.0, self._sweep)
