"""The proxy's listeners as one server: accepting, connection bounds, the timeout ticker, drain.

`ProxyServer` binds the HTTP port (its connections start in
`waygate.proxy.accept.ClientProtocol`, HTTP/1.1 or h2c), counts client
connections (total and per source, evicting idle keep-alives before refusing
anyone), runs the one 100 ms ticker that fires every connection's deadline
(`downstream_h1.ClientConnection`, `http2.H2ClientConnection`: no timer object
per request), renews the access log's budget once a second, and drains on
SIGTERM. The exchanges' collaborators are `self.context`
(`waygate.proxy.context.ExchangeContext`), built here once.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import logging
import operator
import socket
from typing import Any, NamedTuple

from waygate.proxy.accept import ClientProtocol, ProxyHeaderFirst, plain_protocol
from waygate.proxy.bodybuffer import BufferLimits
from waygate.proxy.context import ExchangeContext
from waygate.proxy.downstream_h1 import DRAINING, T_NONE, ClientConnection
from waygate.proxy.h2exchange import serve
from waygate.proxy.h2upstream import H2Upstreams
from waygate.proxy.http2 import H2Limits
from waygate.proxy.metrics import ProxyMetrics
from waygate.proxy.mirror import Mirrors
from waygate.proxy.pool import Pool
from waygate.proxy.records import Records
from waygate.proxy.routing import Defaults, PassiveHealth, RouteTable
from waygate.proxy.upstream import Dialer
from waygate.proxy.upstream_h1 import UpstreamConnection
from waygate.proxy.view import ProxyView

log = logging.getLogger(__name__)
access_log = logging.getLogger("waygate.proxy.access")

# Timeouts are checked this often (so they fire up to one tick late).
TICK = 0.1
TICKS_PER_SECOND = 10

_IDLE_SINCE = operator.attrgetter("idle_since")

# Client timer kinds.


class Limits(NamedTuple):
    """The HTTP/1.1 data plane's bounds against hostile clients and upstreams
    (each a `waygate proxy serve` flag; defaults in the README's Limits section)."""

    # Informational (1xx) responses an upstream may send before its final one,
    # per request, and their head bytes together: more is a 502 (a 103 flood
    # cost seconds of CPU per request).
    max_informational: int = 16
    max_informational_bytes: int = 64 * 1024
    # Client connections from one address at once. When the address is at its
    # cap, its oldest idle keep-alive connection makes room; with none idle the
    # newcomer gets 503 (one client's idle connections cannot lock others out).
    max_connections_per_source: int = 1000
    # Chunks a chunked request body may have beyond one per 256 bytes of payload
    # (more: 400): 1-byte chunks cost the proxy microseconds each.
    max_small_chunks: int = 1024
    # Connections to one endpoint at once (busy and idle; 0: unbounded), and the
    # requests that may wait for one (more: 503): slow clients cannot take every
    # connection a backend accepts.
    max_connections_per_endpoint: int = 1024
    endpoint_queue: int = 1024
    # A request body must average at least this many bytes/s (0: no minimum),
    # measured after `request_body_grace` seconds while the upstream takes it
    # (408 otherwise): a body trickled at 1 byte / 5 s never trips the client
    # timeout but holds an upstream connection.
    min_request_body_rate: int = 1024
    request_body_grace: float = 10.0
    # Request buffering's bounds (waygate.proxy.bodybuffer): memory per body and
    # for all, the largest body (more: 413), the temporary files' directory.
    request_buffer: BufferLimits = BufferLimits()


DEFAULT_LIMITS = Limits()


class ProxyServer:
    """Shared state of one proxy process's HTTP listener."""

    def __init__(
        self,
        *,
        defaults: Defaults,
        dialer: Dialer,
        metrics: ProxyMetrics,
        cookie_key: bytes,
        max_connections: int,
        max_idle_per_endpoint: int = 64,
        pool_idle_timeout: float = 15.0,
        unavailable_page: bytes = b"",
        listen_port: int = 0,
        access_log_rate: int = 100,
        limits: Limits = DEFAULT_LIMITS,
        h2_limits: H2Limits | None = None,
        trace_ratio: float = 0.0,
        upstream_tls: Any = None,
        proxy_protocol_timeout: float = 0.0,
    ) -> None:
        self.loop = asyncio.get_running_loop()
        # --proxy-protocol: every connection to the HTTP and HTTPS ports (and Gateway
        # listener ports) starts with a PROXY header, due within this (0: off).
        self.proxy_protocol_timeout = proxy_protocol_timeout
        # Plain connections still waiting for their header (waygate.proxy.accept).
        self.awaiting_header: set[ProxyHeaderFirst] = set()
        self.limits = limits
        self.defaults = defaults
        self.dialer = dialer
        # HTTPRoute RequestMirror copies in flight (bounded, never waited for).
        self.mirrors = Mirrors(dialer)
        self.metrics = metrics
        self.cookie_key = cookie_key
        self.max_connections = max_connections
        self.unavailable_page = unavailable_page
        self.listen_port = listen_port
        health = PassiveHealth(self.loop.time)
        health.on_change = self._health_changed
        self.pool: Pool[UpstreamConnection] = Pool(
            max_idle=max_idle_per_endpoint,
            idle_timeout=pool_idle_timeout,
            clock=self.loop.time,
            max_per_endpoint=limits.max_connections_per_endpoint,
            max_queue=limits.endpoint_queue,
        )
        self.connections: set[ClientConnection] = set()
        # Client connections per source address (the per-source cap, eviction).
        self.sources: dict[bytes, set[ClientConnection]] = {}
        # HTTP/2 on both sides: the listeners' limits (waygate.proxy.accept).
        self.h2_limits = h2_limits if h2_limits is not None else H2Limits()
        # Metrics, access log and spans of every exchange (waygate.proxy.records).
        self.records = Records(metrics, access_log_rate)
        # What every exchange may use (waygate.proxy.context), built once here.
        self.context = ExchangeContext(
            loop=self.loop,
            view=ProxyView.empty(health, trace_ratio),
            limits=limits,
            metrics=metrics,
            records=self.records,
            pool=self.pool,
            dialer=dialer,
            mirrors=self.mirrors,
            upstream_tls=upstream_tls,
        )
        # The connections to HTTP/2 backends (registered in the context it is given).
        self.h2_upstreams = H2Upstreams(self.context, self.h2_limits, serve)
        self.upstreams: set[Any] = self.context.upstreams
        self._servers: list[asyncio.AbstractServer] = []
        self._sweeper: asyncio.TimerHandle | None = None
        self._ticks = 0
        # The timer sweep walks every connection once a second; the connections
        # whose deadline falls before the next walk (`soon_until`) are listed in
        # `soon` for the ticks in between (ClientConnection._arm adds those armed
        # meanwhile), so 10,000 idle keep-alives cost one walk a second, not ten.
        self._full_sweep_at = 0.0
        self.soon_until = 0.0
        self.soon: list[ClientConnection] = []
        self._drained = asyncio.Event()
        # TLS (waygate.proxy.tls, upstream_tls): the HTTPS port once bound (for
        # redirects), and the reencrypt step (None: no route reencrypts).
        self.https_port = 0
        # waygate.proxy.tls.EdgeCertificates (client-CA routes), given by the TLS
        # front that serves this server's terminated connections.
        self.edge: Any = None

    # ------------------------------------------------------------ the view

    @property
    def view(self) -> ProxyView:
        return self.context.view

    @property
    def table(self) -> RouteTable:
        return self.context.view.table

    @property
    def health(self) -> PassiveHealth:
        return self.context.view.health

    @property
    def draining(self) -> bool:
        return self.context.draining

    @property
    def upstream_tls(self) -> Any:
        """The reencrypt step (waygate.proxy.upstream_tls; None: no route reencrypts)."""
        return self.context.upstream_tls

    @upstream_tls.setter
    def upstream_tls(self, upstream_tls: Any) -> None:
        self.context.upstream_tls = upstream_tls

    @property
    def trace_ratio(self) -> float:
        """Share of requests without trace context that start a trace here (0..1)."""
        return self.context.view.trace_ratio

    @trace_ratio.setter
    def trace_ratio(self, ratio: float) -> None:
        self.context.view = self.context.view.replace(trace_ratio=ratio)

    def set_view(self, view: ProxyView) -> None:
        """Swap the view whole (called on the loop: the next request, stream and TLS
        handshake use every table of it): the edge certificates by SNI are
        installed in the same call, and what outlives views (idle connections,
        passive health, reencrypt sessions) is kept only for what it still names."""
        if view.certificates is not None and self.edge is not None:
            self.edge.install(view.certificates)
        self.context.view = view
        upstream_tls = self.context.upstream_tls
        if upstream_tls is not None:
            upstream_tls.keep_only(view.reencrypt_routes)
        table = view.table
        self.context.records.quiet = frozenset(
            entry.options.name for entry in table.entries() if entry.route.access_log_disabled
        )
        self.pool.keep_only(table.targets)
        self.health.forget_except(table.targets)

    def set_table(self, table: RouteTable) -> None:
        """The current view with another routing table (tests, benchmarks)."""
        self.set_view(self.context.view.with_table(table))

    def _health_changed(self, count: int) -> None:
        self.metrics.passive_health_skipped = count

    # ------------------------------------------------------------ listener

    async def start(
        self, host: str, port: int, *, reuse_port: bool = False, ssl: Any = None
    ) -> int:
        if ssl is not None and self.proxy_protocol_timeout:
            raise ValueError("a PROXY header comes before TLS: serve TLS with passthrough.TlsFront")
        server = await self.loop.create_server(
            # HTTP/1.1 or, by its first bytes, h2c with prior knowledge (waygate.proxy.http2).
            plain_protocol(self, lambda proxied: ClientProtocol(self, proxied=proxied)),
            host,
            port,
            reuse_port=reuse_port or None,
            backlog=1024,
            ssl=ssl,
            ssl_handshake_timeout=self.defaults.http_request_timeout if ssl else None,
        )
        self._servers.append(server)
        bound = server.sockets[0].getsockname()[1]
        if not self.listen_port:
            self.listen_port = bound
        self._schedule_sweep()
        return int(bound)

    def _schedule_sweep(self) -> None:
        self._sweeper = self.loop.call_later(TICK, self._sweep)

    def _sweep(self) -> None:
        now = self.loop.time()
        # Connection timeouts: deadlines compared by this ticker instead of a
        # timer armed and cancelled twice per request; they fire up to one tick
        # late, as before the walk became once a second.
        if now >= self._full_sweep_at:
            self._full_sweep_at = now + 1.0
            self.soon_until = until = self._full_sweep_at + TICK
            due = [c for c in self.connections if c._timer_kind != T_NONE and c._deadline <= until]
        else:
            due = [c for c in dict.fromkeys(self.soon) if c._timer_kind != T_NONE]
        self.soon = [c for c in due if c._deadline > now]
        for connection in [c for c in due if c._deadline <= now]:
            connection._on_timer()
        self._ticks += 1
        if self._ticks % TICKS_PER_SECOND:
            self._schedule_sweep()
            return
        self.pool.sweep()
        self.records.tick()
        self._schedule_sweep()

    def stop_accepting(self) -> None:
        for server in self._servers:
            server.close()
        # Connections that have not even said who they are carry no request.
        for waiting in list(self.awaiting_header):
            waiting.abort()

    async def drain(self, grace: float) -> None:
        """Stop accepting, let exchanges finish within `grace`, close idle keep-alives."""
        self.context.draining = True
        self.stop_accepting()
        for connection in list(self.connections):
            connection.drain()
        if self.connections:
            self._drained.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._drained.wait(), grace)
        for connection in list(self.connections):
            connection.abort()
        await self.mirrors.close()
        self.close()

    def close(self) -> None:
        self.stop_accepting()
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        self.pool.close_all()
        self.h2_upstreams.close()
        for upstream in list(self.upstreams):
            upstream.abort()

    def admit(self, connection: ClientConnection) -> str:
        """Take a new client connection in; "" when admitted, else why not.

        Room is made before anyone is refused: at the per-source cap the
        source's oldest idle connection is closed, at the total cap the oldest
        idle ones anywhere (a batch, so a flood of newcomers costs one walk per
        batch, not one per accept). Refused only when everything is busy.
        """
        if self.draining:
            return DRAINING
        source = connection.client_key
        held = self.sources.get(source)
        if (
            held is not None
            and len(held) >= self.limits.max_connections_per_source
            and not self._evict(held, 1)
        ):
            self._count_refusal("source_connection_limit")
            return "too many connections from " + source.decode("ascii", "replace")
        if len(self.connections) >= self.max_connections and not self.make_room():
            self._count_refusal("connection_limit")
            return "the proxy is at its connection limit; retry later"
        self.connections.add(connection)
        if held is None:
            held = self.sources[source] = set()
        held.add(connection)
        self.metrics.client_connections = len(self.connections)
        return ""

    def make_room(self) -> int:
        """At the connection limit: close the oldest idle client connections (a
        batch); how many were closed (0: every connection is busy)."""
        return self._evict(self.connections, max(1, self.max_connections // 64))

    def _evict(self, among: set[Any], count: int) -> int:
        """Close up to `count` of the oldest idle connections in `among`: HTTP/1.1
        keep-alives between requests, HTTP/2 connections with no stream open."""
        idle = [c for c in among if c.idle()]
        if not idle:
            return 0
        oldest = heapq.nsmallest(count, idle, key=_IDLE_SINCE)
        for connection in oldest:
            self._forget(connection)
            connection.evict()
        self.metrics.evicted_idle += len(oldest)
        return len(oldest)

    def _count_refusal(self, kind: str) -> None:
        refused = self.metrics.refused
        refused[kind] = refused.get(kind, 0) + 1

    def _forget(self, connection: Any) -> None:
        self.connections.discard(connection)
        held = self.sources.get(getattr(connection, "client_key", b""))
        if held is not None:
            held.discard(connection)
            if not held:
                del self.sources[connection.client_key]

    def connection_closed(self, connection: ClientConnection) -> None:
        self._forget(connection)
        self.metrics.client_connections = len(self.connections)
        if self.draining and not self.connections:
            self._drained.set()


def set_nodelay(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
