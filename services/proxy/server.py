"""The proxy's connections: thin asyncio Protocols over the sans-IO rules.

`ClientConnection` (one per accepted connection) finds request heads, lets
`http1` parse and check them, lets `routing` pick the endpoint, and streams
the body; `UpstreamConnection` (one per upstream TCP connection, pooled per
endpoint) parses the response head with `http1` and streams the body back.
No task exists per request: everything runs in protocol callbacks, except
the connect of a new upstream connection (one task per connect).

Invariants:
- One exchange at a time per client connection; pipelined requests wait in
  a bounded buffer (reading pauses past the high-water mark) and are answered
  in order.
- Reading pauses at the high-water mark in both directions: a slow client
  pauses its upstream, a slow upstream pauses its client.
- An upstream connection goes back to the pool only when its response was
  framed cleanly (length or chunked, fully read, nothing extra), the whole
  request was sent, and neither side asked to close; otherwise it is closed.
- Redispatch: only after a connect failed before anything was sent (refused,
  timed out, unreachable). A request already sent is retried only when it
  went out on a reused keep-alive connection that closed before any response
  byte and the request is idempotent without a body (the RFC 9112 section 9.3.1
  race), never a sent POST.
- Timeouts cost no timer object per request: a connection keeps one deadline
  and its kind (head, idle keep-alive, exchange, relay), and the server's
  100 ms ticker fires the expired ones (so a timeout may fire a tick late).
- Every upstream is released and every deadline dropped when the client
  connection goes away; tests count fds and tasks.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import re
import socket
from typing import Any

from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from waygate.core.tracing import tracer
from waygate.proxy import http1, tls
from waygate.proxy.http1 import (
    FRAMING_CHUNKED,
    FRAMING_CLOSE,
    FRAMING_LENGTH,
    FRAMING_NONE,
    BadMessage,
    ChunkedReader,
    ForwardedContext,
    RequestHead,
    ResponseHead,
)
from waygate.proxy.metrics import ProxyMetrics
from waygate.proxy.routing import (
    Backend,
    Defaults,
    PassiveHealth,
    RouteEntry,
    RouteTable,
    Target,
)
from waygate.proxy.upstream import ConnectError, Dialer, Pool

log = logging.getLogger(__name__)
access_log = logging.getLogger("waygate.proxy.access")

_PROPAGATOR = TraceContextTextMapPropagator()
_TRACEPARENT = re.compile(rb"00-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}")


def _log_access(connection: ClientConnection, route: str, req: RequestHead, status: int) -> None:
    """One JSON access-log line (within the per-second budget; see ProxyServer)."""
    access_log.info(
        "request",
        extra={
            "client": connection.context.client_ip.decode(),
            "method": req.method.decode("ascii", "replace"),
            "host": req.host.decode("ascii", "replace"),
            "path": req.target.decode("ascii", "replace")[:256],
            "status": status,
            "route": route,
            "upstream": f"{connection.target.address}:{connection.target.port}"
            if connection.target is not None
            else "",
            "duration_ms": round((connection.loop.time() - connection.started) * 1000, 3)
            if connection.started
            else 0.0,
        },
    )


# Timeouts are checked this often (so they fire up to one tick late).
TICK = 0.1
TICKS_PER_SECOND = 10
# A non-idempotent request reuses only connections idle for less than this:
# upstreams' keep-alive timeouts are seconds (Node.js 5 s, nginx 75 s).
SAFE_REUSE_IDLE = 2.0
HIGH_WATER = 256 * 1024
# A head shorter than this is within both head limits (request line, whole head).
_SHORT_HEAD = http1.MAX_REQUEST_LINE - 4
LOW_WATER = 64 * 1024
MAX_CONNECT_ATTEMPTS = 3

_IDEMPOTENT = frozenset((b"GET", b"HEAD", b"OPTIONS", b"PUT", b"DELETE", b"TRACE"))

# Why a client connection's reading is paused (bits).
_PAUSE_UPSTREAM = 1  # the upstream's write buffer is full
_PAUSE_PIPELINE = 2  # pipelined requests wait behind the current exchange
_PAUSE_CONNECTING = 4  # body buffered while the upstream connect runs
_PAUSE_WRITING = 8  # local answers wait until the client reads (resume_writing)

# Client timer kinds.
_T_NONE, _T_IDLE, _T_HEAD, _T_EXCHANGE, _T_RELAY = range(5)


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
    ) -> None:
        self.loop = asyncio.get_running_loop()
        self.defaults = defaults
        self.dialer = dialer
        self.metrics = metrics
        self.cookie_key = cookie_key
        self.max_connections = max_connections
        self.unavailable_page = unavailable_page
        self.listen_port = listen_port
        self.table = RouteTable.empty()
        self.health = PassiveHealth(self.loop.time)
        self.health.on_change = self._health_changed
        self.pool = Pool(
            max_idle=max_idle_per_endpoint, idle_timeout=pool_idle_timeout, clock=self.loop.time
        )
        self.connections: set[ClientConnection] = set()
        self.upstreams: set[UpstreamConnection] = set()
        self.draining = False
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
        # Access-log lines allowed per second; the rest are counted and summarised.
        self.access_log_rate = access_log_rate
        self.access_log_budget = access_log_rate
        self.access_log_suppressed = 0
        # Whether the access logger logs INFO at all, checked once a second (not
        # per request): while it is off no record is built.
        self.access_log_on = access_log.isEnabledFor(logging.INFO)
        self._drained = asyncio.Event()
        # TLS (waygate.proxy.tls, upstream_tls): the HTTPS port once bound (for
        # redirects), and the reencrypt step (None: no route reencrypts).
        self.https_port = 0
        self.upstream_tls: Any = None
        self.edge: Any = None  # waygate.proxy.tls.EdgeCertificates (client-CA routes)

    # ------------------------------------------------------------ routing table

    def set_table(self, table: RouteTable) -> None:
        """Swap the routing table (called on the loop; the next request uses it)."""
        self.table = table
        self.pool.keep_only(table.targets)
        self.health.forget_except(table.targets)

    def _health_changed(self, count: int) -> None:
        self.metrics.passive_health_skipped = count

    # ------------------------------------------------------------ listener

    async def start(
        self, host: str, port: int, *, reuse_port: bool = False, ssl: Any = None
    ) -> int:
        server = await self.loop.create_server(
            lambda: ClientConnection(self),
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
            due = [c for c in self.connections if c._timer_kind != _T_NONE and c._deadline <= until]
        else:
            due = [c for c in dict.fromkeys(self.soon) if c._timer_kind != _T_NONE]
        self.soon = [c for c in due if c._deadline > now]
        for connection in [c for c in due if c._deadline <= now]:
            connection._on_timer()
        self._ticks += 1
        if self._ticks % TICKS_PER_SECOND:
            self._schedule_sweep()
            return
        self.pool.sweep()
        if self.access_log_suppressed:
            access_log.info(
                "access log lines suppressed",
                extra={
                    "suppressed": self.access_log_suppressed,
                    "per_second": self.access_log_rate,
                },
            )
            self.access_log_suppressed = 0
        self.access_log_budget = self.access_log_rate
        self.access_log_on = access_log.isEnabledFor(logging.INFO)
        self._schedule_sweep()

    def stop_accepting(self) -> None:
        for server in self._servers:
            server.close()

    async def drain(self, grace: float) -> None:
        """Stop accepting, let exchanges finish within `grace`, close idle keep-alives."""
        self.draining = True
        self.stop_accepting()
        for connection in list(self.connections):
            connection.drain()
        if self.connections:
            self._drained.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._drained.wait(), grace)
        for connection in list(self.connections):
            connection.abort()
        self.close()

    def close(self) -> None:
        self.stop_accepting()
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        self.pool.close_all()
        for upstream in list(self.upstreams):
            upstream.abort()

    def connection_closed(self, connection: ClientConnection) -> None:
        self.connections.discard(connection)
        self.metrics.client_connections = len(self.connections)
        if self.draining and not self.connections:
            self._drained.set()


class ClientConnection(asyncio.Protocol):
    """One client connection: request heads in, responses out, in order."""

    __slots__ = (
        "_connect_task",
        "_deadline",
        "_eof",
        "_identity",
        "_identity_route",
        "_pauses",
        "_relay",
        "_timer_kind",
        "_write_paused",
        "backend",
        "body_reader",
        "body_remaining",
        "buf",
        "client_key",
        "closed",
        "context",
        "cookie",
        "counted",
        "entry",
        "hsts",
        "last_client",
        "last_up",
        "loop",
        "path",
        "pending_body",
        "pending_size",
        "req",
        "req_complete",
        "response_started",
        "retried",
        "scanned",
        "secure",
        "server",
        "span",
        "started",
        "status",
        "target",
        "transport",
        "upstream",
        "upstream_head",
        "upstream_traceparent",
    )

    def __init__(self, server: ProxyServer) -> None:
        self.server = server
        self.loop = server.loop
        self.transport: asyncio.Transport | None = None
        # Bytes not yet handled: a head still arriving, or pipelined requests
        # waiting behind the current exchange (bounded by the limits / HIGH_WATER).
        self.buf = bytearray()
        self.scanned = 0
        self.closed = False
        self.req: RequestHead | None = None
        self.entry: RouteEntry | None = None
        self.target: Target | None = None
        self.backend: Backend | None = None
        # Whether this request is counted in its picker's in-flight numbers (only
        # a choice among endpoints reads them; a one-endpoint route skips both calls).
        self.counted = False
        self.upstream: UpstreamConnection | None = None
        self.body_remaining = 0
        self.body_reader: ChunkedReader | None = None
        self.req_complete = True
        self.pending_body: list[bytes] = []
        self.pending_size = 0
        self.response_started = False
        self.upstream_head = b""
        # The proxy span's context when the request is sampled: the tunnel's dial
        # spans become its children (None: unsampled, nothing to continue).
        self.upstream_traceparent: str | None = None
        self.retried = False
        self.last_client = 0.0
        self.last_up = 0.0
        self.started = 0.0
        self.status = 0
        self._pauses = 0
        self._deadline = 0.0
        self._timer_kind = _T_NONE
        self._connect_task: asyncio.Task[None] | None = None
        self._relay = False
        self._write_paused = False
        self._eof = False
        self.path = b""
        self.cookie: bytes | None = None
        self.span: Any = None
        self.secure = False
        self.hsts = b""
        # An auth-proxy route's answer for this connection's client certificate
        # (identity header lines, or the refusal), per route: a connection's
        # certificate never changes (no renegotiation), so it is read once.
        self._identity_route: Any = None
        self._identity: tuple[int, str] | bytes = b""

    # ------------------------------------------------------------ asyncio.Protocol

    def connection_made(self, transport: Any) -> None:
        server = self.server
        self.transport = transport
        if len(server.connections) >= server.max_connections or server.draining:
            self.closed = True
            transport.abort()
            return
        server.connections.add(self)
        server.metrics.client_connections = len(server.connections)
        peer = transport.get_extra_info("peername")
        address = peer[0] if peer else "unknown"
        self.secure = transport.get_extra_info("ssl_object") is not None
        if self.secure:
            self.context = ForwardedContext(address, server.https_port, b"https")
        else:
            self.context = ForwardedContext(address, server.listen_port)
        self.client_key = address.encode()
        transport.set_write_buffer_limits(high=HIGH_WATER, low=LOW_WATER)
        self._arm(server.defaults.http_request_timeout, _T_HEAD)

    def data_received(self, data: bytes) -> None:
        self.server.metrics.bytes_in += len(data)
        if self._relay:
            upstream = self.upstream
            if upstream is not None:
                self.last_client = self.loop.time()
                upstream.transport.write(data)  # type: ignore[union-attr]
            return
        if self.req is not None:
            if not self.req_complete:
                self.last_client = self.loop.time()
                rest = self._feed_body(data)
                if rest:
                    self._hold(rest)
            else:
                self._hold(data)
            return
        buf = self.buf
        if not buf and not self._write_paused:
            end = data.find(b"\r\n\r\n")
            if 0 <= end < _SHORT_HEAD and end + 4 == len(data):
                # Exactly one short head (a keep-alive client's next GET): what
                # _process would do, without its walk.
                if self._on_head(data):
                    if self.req is not None:
                        self._dispatch()
                    else:
                        self._arm(self._idle_timeout(), _T_IDLE)
                return
        if buf:
            # A head arriving in pieces: appended in place, searched from where
            # the last search stopped (linear however it is trickled).
            buf += data
            try:
                end = http1.find_head_end(buf, start=self.scanned)
            except BadMessage as exc:
                self._refuse(exc)
                return
            if end < 0:
                self.scanned = max(0, len(buf) - 3)
                return
            data = bytes(buf)
            buf.clear()
            self.scanned = 0
        self._process(data)

    def eof_received(self) -> bool | None:
        if self._relay and self.upstream is not None:
            upstream_transport = self.upstream.transport
            if upstream_transport is not None and upstream_transport.can_write_eof():
                upstream_transport.write_eof()
                return True
        if self.req is not None and self.req_complete:
            # A client may half-close after its request; answer it, then close.
            self._eof = True
            return True
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._cancel_timer()
        if self._connect_task is not None:
            self._connect_task.cancel()
            self._connect_task = None
        upstream = self.upstream
        if upstream is not None:
            self.upstream = None
            upstream.client = None
            upstream.abort()
        self._release_pick()
        self.pending_body = []
        if self.span is not None:
            self.span.set_status(Status(StatusCode.ERROR, "client connection lost"))
            self.span.end()
            self.span = None
        self.server.connection_closed(self)

    def pause_writing(self) -> None:
        self._write_paused = True
        # Inactivity is measured from here: the upstream is paused because of us.
        self.last_up = self.loop.time()
        upstream = self.upstream
        if upstream is not None and upstream.transport is not None:
            upstream.transport.pause_reading()

    def resume_writing(self) -> None:
        self._write_paused = False
        self.last_up = self.loop.time()
        upstream = self.upstream
        if upstream is not None and upstream.transport is not None:
            upstream.transport.resume_reading()
        if self._pauses & _PAUSE_WRITING:
            # The client reads again: answer the requests held meanwhile.
            self._unpause(_PAUSE_WRITING)
            if self.req is None and self.buf and not self.closed:
                data = self.buf
                self.buf = bytearray()
                self.scanned = 0
                self._process(data)

    # ------------------------------------------------------------ requests

    def _process(self, data: bytes | bytearray) -> None:
        """Parse heads from `data`; answer local ones; start at most one exchange.

        `data` is walked with an offset: each head is sliced out, the rest is
        never copied per head (many small pipelined requests in one read cost
        linear time). Local answers (healthz, 503, 302, 401/403) stop while the
        client's transport is paused for writing: the rest is held and reading
        paused until `resume_writing`, so a client that never reads cannot grow
        the proxy's buffers (a 503 page would amplify each small request).
        """
        pos = 0
        size = len(data)
        while True:
            if self._write_paused and pos < size:
                self._keep(data, pos)
                self._pause(_PAUSE_WRITING)
                self._arm(self._idle_timeout(), _T_IDLE)
                return
            end = data.find(b"\r\n\r\n", pos)
            if 0 <= end < pos + _SHORT_HEAD:
                end += 4  # a short head is within every size limit: nothing to check
            else:
                try:
                    end = http1.find_head_end(data, start=pos, origin=pos)
                except BadMessage as exc:
                    self._refuse(exc)
                    return
            if end < 0:
                self._keep(data, pos)
                self.scanned = max(0, len(self.buf) - 3)
                if pos < size and self._timer_kind == _T_IDLE:
                    self._arm(self._head_timeout(), _T_HEAD)
                return
            if pos == 0 and end == size and type(data) is bytes:
                head = data
            else:
                head = bytes(memoryview(data)[pos:end])
            pos = end
            if not self._on_head(head):
                return  # closed
            if self.req is not None:
                # An exchange started: the body bytes already here are checked
                # before anything is sent upstream, then pipelined requests wait.
                if pos < size and not self.req_complete:
                    rest = self._feed_body(bytes(memoryview(data)[pos:]))
                    if self.closed or self.req is None:
                        return
                    self._dispatch()
                    if rest:
                        self._hold(rest)
                    return
                self._dispatch()
                if pos < size:
                    self._keep(data, pos)
                    if len(self.buf) > HIGH_WATER:
                        self._pause(_PAUSE_PIPELINE)
                return
            if pos == size:
                self._arm(self._idle_timeout(), _T_IDLE)
                return

    def _keep(self, data: bytes | bytearray, pos: int) -> None:
        """Hold data[pos:] in `buf`: a bytearray is kept as it is (deleting its
        front is amortised O(1)), bytes are copied once."""
        if pos >= len(data):
            return
        if type(data) is bytearray and not self.buf:
            del data[:pos]
            self.buf = data
        else:
            self.buf += memoryview(data)[pos:]

    def _hold(self, data: bytes) -> None:
        """Keep bytes of later (pipelined) requests until the current exchange ends."""
        self.buf += data
        if len(self.buf) > HIGH_WATER:
            self._pause(_PAUSE_PIPELINE)

    def _on_head(self, head: bytes) -> bool:
        """Handle one request head; False when the connection is now closing."""
        server = self.server
        try:
            req = http1.parse_request_head(head)
        except BadMessage as exc:
            self._refuse(exc)
            return False
        self.started = now = self.loop.time()
        target = req.target
        if target == http1.HEALTHZ_PATH:
            return self._local(req, http1.HEALTHZ_RESPONSE, 200, "healthz")
        query = target.find(b"?")
        path = target if query < 0 else target[:query]
        self.path = path
        entry = server.table.lookup(req.host, path)
        if entry is None:
            reason = "no route for host " + req.host.decode("ascii", "replace")
            return self._unavailable(req, reason, "no_route")
        self.hsts = b""
        identity = b""
        if entry.route.tls is not None:
            if self.secure:
                self.hsts = entry.hsts
                if entry.route.tls.client_ca_certificate:
                    if self._identity_route is entry.route:
                        checked = self._identity
                    else:
                        checked = server.edge.client_identity(
                            self.transport.get_extra_info("ssl_object"),  # type: ignore[union-attr]
                            entry.route,
                        )
                        self._identity_route = entry.route
                        self._identity = checked
                    if isinstance(checked, tuple):
                        return self._refuse_client(req, entry, *checked)
                    identity = checked
            elif (rule := tls.edge_rule(entry.route)) != tls.EDGE_ALLOW:
                return self._insecure(req, entry, rule)
        if req.cookie:
            cookie = self.cookie = self._sticky_cookie(req, entry)
        else:
            cookie = self.cookie = None
        single = entry.single
        if single is not None and cookie is None:
            picked, backend = single
            self.counted = False
        else:
            chosen, chosen_backend = entry.pick(self.client_key, cookie, server.health, None)
            if chosen is None or chosen_backend is None:
                reason = "no endpoint ready for route " + entry.options.name
                return self._unavailable(req, reason, "no_endpoint")
            picked, backend = chosen, chosen_backend
            backend.picker.acquire(picked)
            self.counted = True
        options = entry.options
        # The exchange's deadline (see _arm), armed without a second clock read.
        self._deadline = deadline = now + options.server_timeout
        self._timer_kind = _T_EXCHANGE
        if deadline <= server.soon_until:
            server.soon.append(self)
        self.req = req
        self.entry = entry
        self.status = 0
        self.last_up = self.last_client = now
        self.response_started = False
        self.retried = False
        self.target = picked
        self.backend = backend
        if req.chunked:
            self.body_reader = ChunkedReader()
            self.req_complete = False
        elif req.content_length > 0:
            self.body_remaining = req.content_length
            self.body_reader = None
            self.req_complete = False
        else:
            self.req_complete = True
        traceparent = req.traceparent
        if traceparent:
            self.upstream_traceparent = None
            if traceparent[-3:] == b"-01" and _TRACEPARENT.fullmatch(traceparent):
                # Sampled upstream of us (parent-based): a span, and its id goes on.
                traceparent = self._start_span(req, entry)
                self.upstream_traceparent = traceparent.decode("ascii")
        elif self.upstream_traceparent is not None:
            self.upstream_traceparent = None
        upstream_head = http1.build_upstream_head(
            req, self.context, options.forwarded_mode, traceparent
        )
        if identity:
            # Set from the verified certificate; the client's own copies were stripped.
            upstream_head = upstream_head[:-2] + identity + b"\r\n"
        self.upstream_head = upstream_head
        return True

    def _dispatch(self) -> None:
        """Send the request upstream: a pooled connection, or a new connect."""
        target = self.target
        assert target is not None
        server = self.server
        req = self.req
        # A request that must never be re-sent only takes a recently used
        # connection (see Pool.take); idempotent ones may be retried instead.
        entry = self.entry
        if entry is not None and entry.upstream_scope is not None:
            key: Any = (target, entry.upstream_scope)  # see routing.upstream_scope
        else:
            key = target
        if req is not None and req.method in _IDEMPOTENT:
            upstream = server.pool.take(key)
        else:
            upstream = server.pool.take(key, idle_at_most=SAFE_REUSE_IDLE)
        if upstream is not None:
            server.metrics.pool_reused += 1
            self._attach(upstream, reused=True)
        else:
            self._connect_task = self.loop.create_task(self._connect(target))

    def _sticky_cookie(self, req: RequestHead, entry: RouteEntry) -> bytes | None:
        name = entry.options.cookie_name
        if not name:
            return None
        prefix = name + b"="
        for value in req.cookie:
            for part in value.split(b";"):
                part = part.strip()
                if part.startswith(prefix):
                    return part[len(prefix) :]
        return None

    def _set_pick(self, target: Target, backend: Backend) -> None:
        self.target = target
        self.backend = backend
        backend.picker.acquire(target)
        self.counted = True

    def _release_pick(self) -> None:
        if self.counted and self.backend is not None and self.target is not None:
            self.backend.picker.release(self.target)
        self.counted = False
        self.backend = None
        self.target = None

    def _feed_body(self, data: bytes) -> bytes:
        """Forward request body bytes; returns what follows the body (next request)."""
        reader = self.body_reader
        rest = b""
        if reader is None:
            remaining = self.body_remaining
            if len(data) > remaining:
                data, rest = data[:remaining], data[remaining:]
            self.body_remaining = remaining - len(data)
            out = [data]
            if self.body_remaining == 0:
                self.req_complete = True
        else:
            try:
                out, used = reader.feed(data)
            except BadMessage as exc:
                if self.response_started:
                    self.abort()
                else:
                    self._refuse(exc)
                return b""
            if used < len(data):
                rest = data[used:]
            if reader.done:
                self.req_complete = True
        upstream = self.upstream
        if upstream is not None and upstream.transport is not None:
            upstream.transport.writelines(out)
        else:
            self.pending_body.extend(out)
            self.pending_size += len(data)
            if self.pending_size > HIGH_WATER:
                self._pause(_PAUSE_CONNECTING)
        return rest

    # ------------------------------------------------------------ upstream side

    async def _connect(self, target: Target) -> None:
        server = self.server
        entry = self.entry
        assert entry is not None
        options = entry.options
        attempts = 0
        while True:
            attempts += 1
            try:
                sock = await server.dialer.connect(
                    target, options.connect_timeout, self.upstream_traceparent
                )
            except ConnectError as exc:
                server.metrics.connect_error(exc.kind)
                server.health.failed(target)
                if exc.retryable and attempts < MAX_CONNECT_ATTEMPTS and not self.closed:
                    # The current table's entry: an endpoint removed meanwhile is not picked.
                    current = server.table.lookup(self.req.host, self.path) if self.req else None
                    current = current if current is not None else entry
                    again, backend = current.pick(self.client_key, None, server.health, target)
                    if again is not None and backend is not None:
                        server.metrics.redispatches += 1
                        self._release_pick()
                        self._set_pick(again, backend)
                        target = again
                        continue
                self._connect_task = None
                self._fail(502, exc.reason, "connect_" + exc.kind)
                return
            try:
                factory = functools.partial(UpstreamConnection, server, target)
                upstream_tls = server.upstream_tls
                if upstream_tls is not None and upstream_tls.applies(entry.route):
                    # Reencrypt: a failed handshake is a 502 that says why.
                    upstream = await upstream_tls.open(
                        self.loop,
                        factory,
                        sock,
                        entry.route,
                        target,
                        options.connect_timeout,
                        self.span,
                    )
                else:
                    _, upstream = await self.loop.create_connection(factory, sock=sock)
            except ConnectError as exc:
                self._connect_task = None
                server.metrics.connect_error(exc.kind)
                self._fail(502, exc.reason, "connect_" + exc.kind)
                return
            except OSError as exc:
                sock.close()
                self._connect_task = None
                self._fail(502, "upstream connection failed: " + str(exc), "connect_error")
                return
            break
        self._connect_task = None
        if entry.upstream_scope is not None:
            upstream.pool_key = (target, entry.upstream_scope)  # see routing.upstream_scope
        server.health.succeeded(target)
        server.metrics.upstream_opened += 1
        if self.closed or self.req is None:
            upstream.close()
            return
        self._attach(upstream, reused=False)

    def _attach(self, upstream: UpstreamConnection, *, reused: bool) -> None:
        self.upstream = upstream
        # The upstream's exchange starts (see UpstreamConnection.__init__).
        upstream.client = self
        upstream.reused = reused
        upstream.got_bytes = False
        upstream.buf = b""
        upstream.response = None
        upstream.sent_at = self.started if reused else self.loop.time()
        transport = upstream.transport
        assert transport is not None
        if self.pending_body:
            transport.writelines([self.upstream_head, *self.pending_body])
            self.pending_body = []
            self.pending_size = 0
            self._unpause(_PAUSE_CONNECTING)
        else:
            transport.write(self.upstream_head)
        if self._write_paused:
            transport.pause_reading()

    def retry_after_reuse_race(self) -> bool:
        """The reused upstream closed before answering: resend once if that is safe."""
        req = self.req
        if (
            req is None
            or self.retried
            or self.closed
            or req.method not in _IDEMPOTENT
            or req.has_body
            or self.response_started
        ):
            return False
        self.retried = True
        self.upstream = None
        target = self.target
        assert target is not None
        self._connect_task = self.loop.create_task(self._connect(target))
        return True

    # ------------------------------------------------------------ responses

    def response_head(self, head: bytes, status: int) -> None:
        """Called by the upstream with the client-bound head of the final response."""
        self.response_started = True
        self.status = status
        self.transport.write(head)  # type: ignore[union-attr]

    def exchange_done(self, keep_alive: bool, now: float = 0.0) -> None:
        """The response is complete; the next request (if any) may start."""
        server = self.server
        entry = self.entry
        req = self.req
        if entry is not None:
            options = entry.options
            if req is not None:
                self._record(options.name, req, self.status or 502)
            idle_timeout = options.keep_alive_timeout
        else:
            idle_timeout = server.defaults.keep_alive_timeout
        self.upstream = None
        if self.counted:
            self._release_pick()
        self.backend = None
        self.target = None
        self.req = None
        self.entry = None
        self.body_reader = None
        if not keep_alive or not self.req_complete or server.draining or self.closed or self._eof:
            self._close()
            return
        if self._pauses:
            self._unpause(_PAUSE_PIPELINE | _PAUSE_UPSTREAM)
        # The keep-alive deadline (see _arm), from the clock read of the response.
        self._deadline = deadline = (now or self.loop.time()) + idle_timeout
        self._timer_kind = _T_IDLE
        if deadline <= server.soon_until:
            server.soon.append(self)
        if self.buf:
            data = self.buf  # handed over, not copied: _process walks it in place
            self.buf = bytearray()
            self.scanned = 0
            self._process(data)

    def start_relay(self, rest_from_upstream: bytes) -> None:
        """After the upstream's 101: bytes flow both ways untouched."""
        self._relay = True
        self.response_started = True
        self.status = 101
        entry = self.entry
        self._arm(entry.options.tunnel_timeout if entry else 3600.0, _T_RELAY)
        self.last_client = self.last_up = self.loop.time()
        transport = self.transport
        assert transport is not None
        if rest_from_upstream:
            transport.write(rest_from_upstream)
        upstream = self.upstream
        if upstream is not None and upstream.transport is not None:
            if self.buf:
                upstream.transport.write(bytes(self.buf))
                self.buf.clear()
            if self._eof and upstream.transport.can_write_eof():
                # The client half-closed before the 101 arrived.
                upstream.transport.write_eof()
        self._unpause(_PAUSE_PIPELINE)

    def relay_closed(self) -> None:
        entry = self.entry
        req = self.req
        if entry is not None and req is not None:
            self._record(entry.options.name, req, 101)
            self.req = None
        self.upstream = None
        self._release_pick()
        self._close()

    def upstream_failed(self, status: int, reason: str, kind: str) -> None:
        """The upstream broke before or during the response."""
        self.upstream = None
        if self.response_started or self.closed:
            self.abort()
            return
        self._fail(status, reason, kind)

    # ------------------------------------------------------------ records

    def _record(self, route: str, req: RequestHead, status: int) -> None:
        """Count one answered request; its access-log line and span when due."""
        server = self.server
        server.metrics.request(route, req.method, status)
        if server.access_log_on:
            if server.access_log_budget > 0:
                server.access_log_budget -= 1
                _log_access(self, route, req, status)
            else:
                server.access_log_suppressed += 1
        span = self.span
        if span is not None:
            self.span = None
            span.set_attribute("http.response.status_code", status)
            if status >= 500:
                span.set_status(Status(StatusCode.ERROR))
            span.end()

    def _start_span(self, req: RequestHead, entry: RouteEntry) -> bytes:
        """A server span for a sampled request; returns the traceparent to send upstream."""
        carrier = {"traceparent": req.traceparent.decode("ascii", "replace")}
        parent = _PROPAGATOR.extract(carrier)
        span = tracer().start_span(
            "proxy " + entry.options.name,
            context=parent,
            kind=SpanKind.SERVER,
            attributes={
                "http.request.method": req.method.decode("ascii", "replace"),
                "url.path": req.target.decode("ascii", "replace")[:256],
                "server.address": req.host.decode("ascii", "replace"),
                "waygate.route": entry.options.name,
            },
        )
        self.span = span
        context = span.get_span_context()
        return b"00-%032x-%016x-01" % (context.trace_id, context.span_id)

    # ------------------------------------------------------------ local answers

    def _local(self, req: RequestHead, response: bytes, status: int, kind: str) -> bool:
        transport = self.transport
        assert transport is not None
        if req.has_body or not req.keep_alive or self.server.draining:
            # The body is not read: close after answering, so it cannot be
            # taken for the next request.
            if response is http1.HEALTHZ_RESPONSE:
                response = response.replace(b"\r\n\r\n", b"\r\nConnection: close\r\n\r\n", 1)
            transport.write(response)
            self._close()
            return False
        transport.write(response)
        return True

    def _refuse_client(self, req: RequestHead, entry: RouteEntry, status: int, reason: str) -> bool:
        """An auth-proxy route without the client certificate it requires: 401/403."""
        self._record(entry.options.name, req, status)
        metrics = self.server.metrics
        metrics.refused["client_certificate"] = metrics.refused.get("client_certificate", 0) + 1
        response = http1.error_response(status, reason, head_only=req.method == b"HEAD")
        return self._local(req, response, status, "client_certificate")

    def _insecure(self, req: RequestHead, entry: RouteEntry, rule: int) -> bool:
        """A TLS route asked for on plain HTTP: 302 to HTTPS, or no route on HTTP."""
        if rule == tls.EDGE_REDIRECT:
            self._record(entry.options.name, req, 302)
            close = req.has_body or not req.keep_alive or self.server.draining
            port = self.server.https_port or 443
            response = tls.redirect_response(req.host, req.target, port, close=close)
            return self._local(req, response, 302, "redirect")
        reason = f"route {entry.options.name} is served on HTTPS only"
        return self._unavailable(req, reason, "https_only")

    def _unavailable(self, req: RequestHead, reason: str, kind: str) -> bool:
        metrics = self.server.metrics
        metrics.refused[kind] = metrics.refused.get(kind, 0) + 1
        self._record("", req, 503)
        close = req.has_body or not req.keep_alive or self.server.draining
        response = http1.error_response(
            503,
            reason,
            close=close,
            head_only=req.method == b"HEAD",
            body=self.server.unavailable_page.replace(b"{reason}", reason.encode())
            if self.server.unavailable_page
            else b"",
        )
        return self._local(req, response, 503, kind)

    def _refuse(self, exc: BadMessage) -> None:
        """A refused request: the status with the rule it broke, then close."""
        metrics = self.server.metrics
        metrics.refused["bad_request"] = metrics.refused.get("bad_request", 0) + 1
        transport = self.transport
        if transport is not None and not self.closed:
            transport.write(http1.error_response(exc.status, exc.reason))
        self._abandon_upstream()
        self.req = None
        self._close()

    def _fail(self, status: int, reason: str, kind: str) -> None:
        metrics = self.server.metrics
        metrics.refused[kind] = metrics.refused.get(kind, 0) + 1
        entry = self.entry
        req = self.req
        if entry is not None and req is not None:
            self._record(entry.options.name, req, status)
        self._abandon_upstream()
        transport = self.transport
        if self.closed or transport is None:
            return
        if self.response_started:
            self.abort()
            return
        head_only = req is not None and req.method == b"HEAD"
        transport.write(http1.error_response(status, reason, head_only=head_only))
        self.req = None
        self._close()

    def _abandon_upstream(self) -> None:
        upstream = self.upstream
        self.upstream = None
        if upstream is not None:
            upstream.client = None
            upstream.abort()
        if self._connect_task is not None:
            self._connect_task.cancel()
            self._connect_task = None

    # ------------------------------------------------------------ timers

    def _head_timeout(self) -> float:
        return self.server.defaults.http_request_timeout

    def _idle_timeout(self) -> float:
        entry = self.entry
        if entry is not None:
            return entry.options.keep_alive_timeout
        return self.server.defaults.keep_alive_timeout

    def _arm(self, delay: float, kind: int) -> None:
        # No timer object per request: the server's ticker compares deadlines
        # (a deadline before its next full walk goes on its short list).
        deadline = self._deadline = self.loop.time() + delay
        self._timer_kind = kind
        server = self.server
        if deadline <= server.soon_until:
            server.soon.append(self)

    def _cancel_timer(self) -> None:
        self._timer_kind = _T_NONE

    def _on_timer(self) -> None:
        kind = self._timer_kind
        self._timer_kind = _T_NONE
        if self.closed:
            return
        if kind == _T_IDLE:
            self._close()
        elif kind == _T_HEAD:
            if self.buf:
                self._fail(
                    408, "request head not received within the http-request timeout", "timeout"
                )
            else:
                self._close()
        elif kind == _T_EXCHANGE:
            self._exchange_timer()
        elif kind == _T_RELAY:
            entry = self.entry
            limit = entry.options.tunnel_timeout if entry else 3600.0
            idle = self.loop.time() - max(self.last_client, self.last_up)
            if idle >= limit:
                self.abort()
            else:
                self._arm(limit - idle, _T_RELAY)

    def _exchange_timer(self) -> None:
        entry = self.entry
        assert entry is not None
        options = entry.options
        now = self.loop.time()
        up_idle = now - self.last_up
        if up_idle >= options.server_timeout:
            if self.response_started:
                self.abort()
            else:
                self._fail(
                    504,
                    f"upstream did not answer within {options.server_timeout:g}s",
                    "server_timeout",
                )
            return
        wait = options.server_timeout - up_idle
        if not self.req_complete:
            client_idle = now - self.last_client
            if client_idle >= options.client_timeout:
                if self.response_started:
                    self.abort()
                else:
                    self._fail(
                        408,
                        f"request body stalled for {options.client_timeout:g}s",
                        "client_timeout",
                    )
                return
            wait = min(wait, options.client_timeout - client_idle)
        self._arm(wait, _T_EXCHANGE)

    # ------------------------------------------------------------ flow control

    def _pause(self, reason: int) -> None:
        if not self._pauses and self.transport is not None:
            self.transport.pause_reading()
        self._pauses |= reason

    def _unpause(self, reason: int) -> None:
        if self._pauses & reason:
            self._pauses &= ~reason
            if not self._pauses and self.transport is not None and not self.closed:
                self.transport.resume_reading()

    def upstream_paused(self, paused: bool) -> None:
        self.last_client = self.loop.time()
        if paused:
            self._pause(_PAUSE_UPSTREAM)
        else:
            self._unpause(_PAUSE_UPSTREAM)

    # ------------------------------------------------------------ closing

    def drain(self) -> None:
        """Draining: close now if idle; otherwise after the current response."""
        if self.req is None and not self.buf:
            self._close()

    def _close(self) -> None:
        self.closed = True
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()
        self._cancel_timer()

    def abort(self) -> None:
        self._abandon_upstream()
        self._cancel_timer()
        if self.transport is not None:
            self.transport.abort()


class UpstreamConnection(asyncio.Protocol):
    """One connection to an endpoint; carries one exchange at a time."""

    __slots__ = (
        "buf",
        "client",
        "client_keep_alive",
        "closed",
        "framing",
        "got_bytes",
        "idle_since",
        "pending_head",
        "pool_key",
        "reader",
        "relay",
        "remaining",
        "response",
        "reused",
        "sent_at",
        "server",
        "target",
        "transport",
    )

    def __init__(self, server: ProxyServer, target: Target) -> None:
        self.server = server
        self.target = target
        # Where the pool keeps it when idle: the endpoint, with the route's
        # upstream_scope for a reencrypt connection (set by the connect step).
        self.pool_key: Any = target
        self.transport: asyncio.Transport | None = None
        self.client: ClientConnection | None = None
        self.idle_since = 0.0
        self.buf = b""
        self.response: ResponseHead | None = None
        self.framing = FRAMING_NONE
        self.remaining = 0
        self.reader: ChunkedReader | None = None
        self.reused = False
        self.got_bytes = False
        self.client_keep_alive = True
        self.closed = False
        self.relay = False
        self.sent_at = 0.0
        self.pending_head = b""

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        transport.set_write_buffer_limits(high=HIGH_WATER, low=LOW_WATER)
        self.server.upstreams.add(self)
        self.server.metrics.upstream_connections = len(self.server.upstreams)

    # ------------------------------------------------------------ protocol

    def data_received(self, data: bytes) -> None:
        client = self.client
        if client is None:
            # Bytes on an idle connection: the framing is off; never reuse it
            # (out of the pool now, so no request can take it before it closes).
            self.server.pool.discard(self)
            self.abort()
            return
        self.got_bytes = True
        client.last_up = now = client.loop.time()
        if self.relay:
            client.server.metrics.bytes_out += len(data)
            client.transport.write(data)  # type: ignore[union-attr]
            return
        if self.response is None:
            if self.buf:
                data = self.buf + data
                self.buf = b""
            rest = self._head(client, data, now)
            if rest is None or self.client is None or self.response is None:
                return
            data = rest
        self._body(client, data)

    def _head(self, client: ClientConnection, data: bytes, now: float) -> bytes | None:
        """Parse response heads (skipping 1xx) and send the final one on; returns the
        rest (None: nothing more to do with `data`)."""
        while True:
            end = data.find(b"\r\n\r\n")
            if 0 <= end < _SHORT_HEAD:
                end += 4  # a short head is within every size limit: nothing to check
            else:
                try:
                    end = http1.find_head_end(data)
                except BadMessage:
                    self._broken(client, "upstream sent an oversized response head")
                    return None
            if end < 0:
                self.buf = data
                return None
            head, data = data[:end], data[end:]
            try:
                response = http1.parse_response_head(head)
            except BadMessage as exc:
                self._broken(client, exc.reason)
                return None
            status = response.status
            req = client.req
            assert req is not None
            if status < 200:
                if status == 101:
                    if req.upgrade:
                        self._switch(client, response, data)
                        return None
                    self._broken(client, "upstream switched protocols without an upgrade request")
                    return None
                if status == 100 and req.expect_continue and client.transport is not None:
                    client.transport.write(http1.CONTINUE_100)
                continue  # other 1xx: informational, dropped
            return self._final_head(client, req, response, data, now)

    def _final_head(
        self,
        client: ClientConnection,
        req: RequestHead,
        response: ResponseHead,
        rest: bytes,
        now: float,
    ) -> bytes | None:
        """Send the final response head on; returns the bytes after it still to
        handle as body (None: the response is complete, or nothing is left)."""
        server = self.server
        server.metrics.latency(now - self.sent_at)
        framing = http1.response_framing(req.method, response)
        length = response.content_length
        status = response.status
        keep_alive = req.keep_alive and not server.draining
        out_framing = framing
        self.reader = None
        if framing == FRAMING_LENGTH:
            self.remaining = length
        elif framing == FRAMING_CHUNKED:
            if req.http10:
                self.reader = ChunkedReader(rechunk=False, status=502)
                out_framing = FRAMING_CLOSE
                keep_alive = False
            else:
                self.reader = ChunkedReader(status=502)
        elif framing == FRAMING_CLOSE:
            keep_alive = False
        elif response.status != 204 and response.status >= 200:
            # HEAD and 304 carry the length the body would have had.
            if length >= 0:
                out_framing = FRAMING_LENGTH
            elif response.chunked and not req.http10:
                out_framing = FRAMING_CHUNKED
        self.response = response
        self.framing = framing
        self.client_keep_alive = keep_alive
        extra = b""
        backend = client.backend
        if backend is not None and backend.set_cookie:
            target = self.target
            if client.cookie != backend.by_target.get(target):
                extra = backend.set_cookie.get(target, b"")
        if client.hsts:
            extra += client.hsts
        head = http1.build_client_head(response, out_framing, length, keep_alive, extra)
        client.response_started = True
        client.status = status
        if framing == FRAMING_LENGTH and len(rest) == length < 65536:
            # The whole body came with the head (a small response): one send.
            server.metrics.bytes_out += length
            client.transport.write(head + rest)  # type: ignore[union-attr]
            self.remaining = 0
            self._done(client, clean=True, now=now)
            return None
        if framing == FRAMING_NONE or (framing == FRAMING_LENGTH and length == 0):
            client.transport.write(head)  # type: ignore[union-attr]
            # Bytes after a response without a body, in the same read: the
            # upstream's framing is off, so the connection is not pooled.
            self._done(client, clean=not rest, now=now)
            return None
        # Written with the first body bytes: one send for a small response.
        self.pending_head = head
        return rest

    def _body(self, client: ClientConnection, data: bytes) -> None:
        transport = client.transport
        assert transport is not None
        head = self.pending_head
        if head:
            self.pending_head = b""
            if not data:
                transport.write(head)
                return
            if self.framing == FRAMING_LENGTH and len(data) <= self.remaining < 65536:
                self.remaining -= len(data)
                self.server.metrics.bytes_out += len(data)
                transport.write(head + data)
                if self.remaining == 0:
                    self._done(client, clean=True)
                return
            transport.write(head)
        if not data:
            return
        framing = self.framing
        metrics = self.server.metrics
        if framing == FRAMING_LENGTH:
            remaining = self.remaining
            if len(data) > remaining:
                # More than the announced length: the framing is not clean.
                data = data[:remaining]
                self.remaining = 0
                metrics.bytes_out += len(data)
                transport.write(data)
                self._done(client, clean=False)
                return
            self.remaining = remaining - len(data)
            metrics.bytes_out += len(data)
            transport.write(data)
            if self.remaining == 0:
                self._done(client, clean=True)
        elif framing == FRAMING_CHUNKED:
            reader = self.reader
            assert reader is not None
            try:
                out, used = reader.feed(data)
            except BadMessage:
                self.abort()
                client.upstream_failed(
                    502, "upstream sent malformed chunked framing", "bad_response"
                )
                return
            transport.writelines(out)
            metrics.bytes_out += used
            if reader.done:
                self._done(client, clean=used == len(data))
        elif framing == FRAMING_CLOSE:
            metrics.bytes_out += len(data)
            transport.write(data)
        else:
            # Bytes after a bodiless response: the upstream's framing is off.
            self.abort()

    def _done(self, client: ClientConnection, *, clean: bool, now: float = 0.0) -> None:
        """The response is complete: pool or close this connection, free the client."""
        response = self.response
        self.client = None
        self.response = None
        server = self.server
        transport = self.transport
        if (
            clean
            and client.req_complete
            and self.framing != FRAMING_CLOSE
            and response is not None
            and response.keep_alive
            and not server.draining
            and not self.closed
            and transport is not None
        ):
            transport.resume_reading()
            if not server.pool.put(self, now):
                self.close()
        else:
            self.close()
        client.exchange_done(self.client_keep_alive, now)

    def _broken(self, client: ClientConnection, reason: str) -> None:
        self.abort()
        client.upstream_failed(502, reason, "bad_response")

    def _switch(self, client: ClientConnection, response: ResponseHead, rest: bytes) -> None:
        req = client.req
        assert req is not None
        client.transport.write(  # type: ignore[union-attr]
            b"HTTP/1.1 101 Switching Protocols%s\r\nConnection: Upgrade\r\nUpgrade: %s\r\n\r\n"
            % (response.fields, response.upgrade or req.upgrade)
        )
        self.relay = True
        client.start_relay(rest)

    def eof_received(self) -> bool | None:
        client = self.client
        if (
            self.relay
            and client is not None
            and client.transport is not None
            and client.transport.can_write_eof()
        ):
            client.transport.write_eof()
            return True
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        server = self.server
        server.upstreams.discard(self)
        server.metrics.upstream_connections = len(server.upstreams)
        client = self.client
        self.client = None
        if client is None:
            server.pool.discard(self)
            return
        if self.relay:
            client.relay_closed()
        elif self.response is not None and self.framing == FRAMING_CLOSE:
            client.exchange_done(False)
        elif self.response is not None:
            client.upstream_failed(502, "upstream closed mid-response", "upstream_closed")
        elif not self.got_bytes and self.reused and client.retry_after_reuse_race():
            return
        else:
            client.upstream_failed(
                502, "upstream closed the connection before answering", "upstream_closed"
            )

    def pause_writing(self) -> None:
        if self.client is not None:
            self.client.upstream_paused(True)

    def resume_writing(self) -> None:
        if self.client is not None:
            self.client.upstream_paused(False)

    def close(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()

    def abort(self) -> None:
        self.client = None
        if self.transport is not None:
            self.transport.abort()


def set_nodelay(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
