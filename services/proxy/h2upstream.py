"""HTTP/2 to backends: multiplexed connections, and the exchange of an HTTP/2 stream over one.

A route speaks HTTP/2 to its backends when its `upstreamProtocol` or its
service port's `appProtocol` says so (`waygate.resolver.model.speaks_http2`;
gRPC servers speak nothing else): cleartext with prior knowledge (h2c), or
TLS with ALPN h2 when the route reencrypts (`waygate.proxy.upstream_tls`,
the same verification and explained failures as HTTP/1.1).

- `H2Pool`: connections per (endpoint, TLS scope). A stream takes a
  connection with room (open streams below the peer's
  SETTINGS_MAX_CONCURRENT_STREAMS, stream ids left, no GOAWAY received); else
  one connect is started per key and the streams wanting it wait for it.
  Every connection counts in the endpoint's bound that HTTP/1.1 connections
  keep (`waygate.proxy.pool.Pool`): at the bound a stream waits in the same
  queue, or gets the same 503.
- `H2UpstreamConnection`: a thin Protocol over the `h2` client state machine.
- `H2Exchange`: one client stream forwarded as one upstream stream. The
  request passes the HTTP/1.1 rule book first (`http2.request_head`: the
  head it means, by `http1.request_from_fields`: identity headers dropped, X-Forwarded-*/Forwarded per the
  route) and leaves as HTTP/2 fields again; routing by :authority, the
  endpoint pick (balancing, sticky cookie), the TLS edge rules and auth-proxy
  identity are the routing table's and `tls`'s, as on HTTP/1.1; so are the
  route's HTTPRoute filters (`waygate.proxy.filters`: redirect, rewrite,
  request and response header modifiers; not mirrors). Trailers are
  relayed (gRPC's status lives there).
- Flow control, both ways, bounded: request DATA goes on as the backend's
  window allows; what does not fit is held and the client's WINDOW_UPDATEs
  with it (so at most one client stream window is held). Response DATA is
  acknowledged to the backend only while the client stream's buffer is below
  its bound (`H2Limits.stream_buffer`), so a slow client shuts the backend's
  window, and the backend's TCP connection is never read faster than the
  client drains it.
- Deadlines: `grpc-timeout` (when shorter) or the route's server timeout is
  the time allowed for the answer; then 504, or DEADLINE_EXCEEDED on gRPC.
  During the answer, the server timeout is the backend's inactivity allowed.
- GOAWAY from a backend: streams above its last stream id were never
  processed and are sent again, once, on another connection; the others finish.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from typing import Any

import h2.events
import h2.exceptions
import h2.settings
from h2.errors import ErrorCodes
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from waygate.core import httpheaders
from waygate.core.tracing import tracer
from waygate.proxy import filters, grpcstatus, http1, tls
from waygate.proxy.http1 import BadMessage, ForwardedContext
from waygate.proxy.http2 import (
    H2ClientConnection,
    H2Limits,
    Request,
    Stream,
    h2_connection,
    request_head,
)
from waygate.proxy.routing import RouteEntry, Target, unavailable_reason
from waygate.proxy.upstream import ConnectError, start
from waygate.resolver.model import speaks_http2

# As waygate.proxy.exchange reads a client's trace context.
_TRACEPARENT = re.compile(rb"00-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}")
_PROPAGATOR = TraceContextTextMapPropagator()
_STATUS = re.compile(rb"[1-9][0-9][0-9]")

log = logging.getLogger(__name__)
access_log = logging.getLogger("waygate.proxy.access")

MAX_STREAM_ID = 2**31 - 1
HIGH_WATER = 256 * 1024
LOW_WATER = 64 * 1024


class H2Upstreams:
    """Which routes speak HTTP/2 to their backends, and the connections to them."""

    def __init__(self, server: Any, limits: H2Limits) -> None:
        self.server = server
        self.limits = limits
        self.routes: frozenset[tuple[str, str]] = frozenset()
        # The hosts those routes serve, so that a request for any other host skips
        # the lookup here (its exchange looks the route up once, not twice);
        # None: one of them serves any host or a wildcard (always looked up).
        self.hosts: frozenset[bytes] | None = frozenset()
        self.pool = H2Pool(self)

    def update(self, routes: Any, services: Any) -> None:
        """The routes whose backends speak HTTP/2 (called with every resolver view)."""
        chosen = set()
        hosts: set[bytes] | None = set()
        for key, route in routes.items():
            for backend in route.backends:
                service = services.get((route.namespace, backend.service))
                port = _service_port(service, route.target_port) if service else None
                if speaks_http2(route, port):
                    chosen.add(key)
                    if hosts is not None:
                        if not route.host or "*" in route.host:
                            hosts = None
                        else:
                            hosts.add(route.host.lower().encode())  # as routing keys it
                    break
        self.routes = frozenset(chosen)
        self.hosts = frozenset(hosts) if hosts is not None else None

    def try_start(
        self, conn: H2ClientConnection, stream: Stream, request: Request, end: bool
    ) -> bool:
        """Start the stream's exchange if its route speaks HTTP/2; False otherwise."""
        if not self.routes:
            return False
        host = _host_of(request.authority)
        if self.hosts is not None and host not in self.hosts:
            return False
        path = request.path.partition(b"?")[0]
        # With the request: Gateway API routes may match its method, headers, query.
        entry = self.server.table.lookup(host, path, request, conn.secure)
        if entry is None or entry.route.key not in self.routes:
            return False
        H2Exchange(self, conn, stream, request, entry, end).start()
        return True

    def close(self) -> None:
        self.pool.close_all()


def _service_port(service: Any, target_port: str) -> Any:
    ports = service.ports
    if not target_port:
        return ports[0] if len(ports) == 1 else None
    for port in ports:
        if port.name == target_port or str(port.port) == target_port:
            return port
    return None


def _host_of(authority: bytes) -> bytes:
    if authority[:1] == b"[":
        return authority[: authority.find(b"]") + 1].lower()
    return authority.partition(b":")[0].lower()


# ---------------------------------------------------------------- connections


class H2Pool:
    """HTTP/2 connections per (endpoint, TLS scope), shared by streams."""

    def __init__(self, upstreams: H2Upstreams) -> None:
        self.upstreams = upstreams
        self.connections: dict[Any, list[H2UpstreamConnection]] = {}
        self.connecting: dict[Any, list[H2Exchange]] = {}
        self.tasks: set[asyncio.Task[None]] = set()

    def take(self, key: Any) -> H2UpstreamConnection | None:
        for connection in self.connections.get(key, ()):
            if connection.has_room():
                return connection
        return None

    def wait_for(self, key: Any, exchange: H2Exchange) -> None:
        """Queue the exchange for a new connection to `key` (one connect per key).

        A new connection counts in the endpoint's bound that HTTP/1.1 upstream
        connections keep (`Pool.reserve`, `--max-connections-per-endpoint`): at
        the bound the exchange waits in the same queue as HTTP/1.1 requests
        (woken when a connection closes or a stream ends), or is refused with
        the same 503 when that queue is full."""
        waiting = self.connecting.get(key)
        if waiting is not None and len(waiting) < self.upstreams.limits.max_concurrent_streams:
            waiting.append(exchange)
            return
        pool = self.upstreams.server.pool
        target = exchange.target
        if not pool.reserve(target):
            if pool.wait(target, exchange):
                exchange.queued = True  # Pool.wake calls endpoint_free
            else:
                exchange.fail(503, pool.full(target), "endpoint_limit")
            return
        # Each connect has its own waiters; new ones join the latest connect's.
        waiters = self.connecting[key] = [exchange]
        task = asyncio.get_running_loop().create_task(self._connect(key, waiters))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _connect(self, key: Any, waiters: list[H2Exchange]) -> None:
        """Open a connection for `key` (reserved in the endpoint's bound by the caller;
        the reservation ends here, the open connection counts itself)."""
        target = waiters[0].target
        try:
            await self._open(key, waiters)
        finally:
            self.upstreams.server.pool.unreserve(target)

    async def _open(self, key: Any, waiters: list[H2Exchange]) -> None:
        server = self.upstreams.server
        first = waiters[0]
        target, route, connect_timeout = first.target, first.entry.route, first.connect_timeout
        connection: H2UpstreamConnection | None = None
        failure: tuple[str, str] | None = None
        try:
            # A socket, or a tunnel endpoint's data connection (upstream.Attachable).
            upstream = await server.dialer.connect(target, connect_timeout, None)
        except ConnectError as exc:
            server.metrics.connect_error(exc.kind)
            server.health.failed(target)
            failure = (exc.reason, "connect_" + exc.kind)
        else:
            try:

                def factory() -> H2UpstreamConnection:
                    return H2UpstreamConnection(self, key, self.upstreams.limits)

                upstream_tls = server.upstream_tls
                if upstream_tls is not None and upstream_tls.applies(route):
                    connection = await upstream_tls.open(
                        factory, upstream, route, target, connect_timeout, None, http2=True
                    )
                else:
                    _, connection = await start(upstream, factory)
            except ConnectError as exc:
                server.metrics.connect_error(exc.kind)
                failure = (exc.reason, "connect_" + exc.kind)
            except OSError as exc:
                failure = ("upstream connection failed: " + str(exc), "connect_error")
        if self.connecting.get(key) is waiters:
            del self.connecting[key]
        waiting = waiters
        if connection is None:
            for exchange in waiting:
                exchange.fail(502, *(failure or ("upstream connection failed", "connect_error")))
            return
        server.health.succeeded(target)
        server.metrics.upstream_opened += 1
        self.connections.setdefault(key, []).append(connection)
        for exchange in waiting:
            if not exchange.finished:
                exchange.attach(connection if connection.has_room() else None)

    def discard(self, connection: H2UpstreamConnection) -> None:
        connections = self.connections.get(connection.key)
        if connections is not None and connection in connections:
            connections.remove(connection)
            if not connections:
                del self.connections[connection.key]

    def close_all(self) -> None:
        for task in list(self.tasks):
            task.cancel()
        for connections in list(self.connections.values()):
            for connection in list(connections):
                connection.abort()
        self.connections.clear()


class H2UpstreamConnection(asyncio.Protocol):
    """One HTTP/2 connection to a backend (client side of the h2 state machine)."""

    def __init__(self, pool: H2Pool, key: Any, limits: H2Limits) -> None:
        self.pool = pool
        self.key = key
        self.target: Target = key[0]
        # Counted in the endpoint's connection bound from connection_made to
        # connection_lost (waygate.proxy.pool.Pool.reserve), as HTTP/1.1 ones are.
        self.counted = False
        self.limits = limits
        self.h2 = h2_connection(limits, client_side=True)
        self.transport: asyncio.Transport | None = None
        self.exchanges: dict[int, H2Exchange] = {}
        self.blocked: set[H2Exchange] = set()
        self.closed = False
        self.goaway = False
        self.write_paused = False
        self._flush_soon = False

    def has_room(self) -> bool:
        if self.closed or self.goaway or self.write_paused:
            return False
        h2conn = self.h2
        if h2conn.highest_outbound_stream_id and h2conn.highest_outbound_stream_id >= (
            MAX_STREAM_ID - 2
        ):
            return False  # stream ids exhausted: the next stream takes a new connection
        return len(self.exchanges) < min(
            h2conn.remote_settings.max_concurrent_streams, self.limits.max_concurrent_streams
        )

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        transport.set_write_buffer_limits(high=HIGH_WATER, low=LOW_WATER)
        server = self.pool.upstreams.server
        server.upstreams.add(self)
        server.metrics.upstream_connections = len(server.upstreams)
        self.counted = server.pool.reserve(self.target, force=True)
        self.h2.initiate_connection()
        increment = self.limits.connection_window - 65535
        if increment > 0:
            self.h2.increment_flow_control_window(increment)
        self.flush()

    def flush(self) -> None:
        """Send what h2 queued, once per loop turn (one send for many frames)."""
        if not self._flush_soon:
            self._flush_soon = True
            asyncio.get_running_loop().call_soon(self._flush_now)

    def _flush_now(self) -> None:
        self._flush_soon = False
        data = self.h2.data_to_send()
        if data and self.transport is not None and not self.closed:
            self.transport.write(data)

    def open_stream(
        self, exchange: H2Exchange, fields: list[tuple[bytes, bytes]], end: bool
    ) -> int:
        stream_id = self.h2.get_next_available_stream_id()
        self.h2.send_headers(stream_id, fields, end_stream=end)
        self.exchanges[stream_id] = exchange
        self.flush()
        return stream_id

    def data_received(self, data: bytes) -> None:
        try:
            events = self.h2.receive_data(data)
        except h2.exceptions.ProtocolError as exc:
            self._flush_now()
            self._fail_all(f"upstream broke HTTP/2: {exc}")
            self.abort()
            return
        event: Any
        for event in events:
            kind = type(event)
            exchange = self.exchanges.get(getattr(event, "stream_id", 0) or 0)
            if kind is h2.events.ResponseReceived:
                if exchange is not None:
                    exchange.on_response(event.headers, event.stream_ended is not None)
            elif kind is h2.events.DataReceived:
                if exchange is not None:
                    exchange.on_data(event.data, event.flow_controlled_length)
                elif event.flow_controlled_length:
                    with contextlib.suppress(h2.exceptions.ProtocolError):
                        self.h2.acknowledge_received_data(
                            event.flow_controlled_length, event.stream_id
                        )
            elif kind is h2.events.TrailersReceived:
                if exchange is not None:
                    exchange.on_trailers(event.headers)
            elif kind is h2.events.StreamEnded:
                if exchange is not None:
                    exchange.on_end()
            elif kind is h2.events.StreamReset:
                exchange = self.exchanges.pop(event.stream_id, None)
                if exchange is not None:
                    exchange.on_reset(event.error_code)
            elif kind is h2.events.WindowUpdated or kind is h2.events.RemoteSettingsChanged:
                for waiting in list(self.blocked):
                    waiting.send_held()
            elif kind is h2.events.ConnectionTerminated:
                self._goaway(event.last_stream_id)
        self.flush()

    def _goaway(self, last_stream_id: int | None) -> None:
        """GOAWAY: no new streams here; those above its last id were never processed."""
        self.goaway = True
        self.pool.discard(self)
        last = last_stream_id if last_stream_id is not None else MAX_STREAM_ID
        for stream_id in [s for s in self.exchanges if s > last]:
            exchange = self.exchanges.pop(stream_id)
            exchange.unprocessed()
        if not self.exchanges:
            self.close()

    def stream_done(self, stream_id: int) -> None:
        self.exchanges.pop(stream_id, None)
        if self.goaway and not self.exchanges:
            self.close()
        elif self.pool.upstreams.server.pool.waiting:
            # Room for a stream: a request waiting at the endpoint's bound may take it
            # (an HTTP/1.1 one woken here finds no connection and waits again).
            self.pool.upstreams.server.pool.wake(self.target)

    def _fail_all(self, reason: str) -> None:
        exchanges = list(self.exchanges.values())
        self.exchanges.clear()
        for exchange in exchanges:
            exchange.upstream_broke(reason)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.pool.discard(self)
        server = self.pool.upstreams.server
        server.upstreams.discard(self)
        server.metrics.upstream_connections = len(server.upstreams)
        if self.counted:
            self.counted = False
            server.pool.unreserve(self.target)
        self._fail_all("upstream closed the connection")

    def pause_writing(self) -> None:
        # The backend reads slower than clients send: hold the clients' windows.
        self.write_paused = True
        for exchange in self.exchanges.values():
            exchange.upstream_writable(False)

    def resume_writing(self) -> None:
        self.write_paused = False
        for exchange in list(self.exchanges.values()):
            exchange.upstream_writable(True)

    def close(self) -> None:
        self.pool.discard(self)
        if self.transport is not None and not self.transport.is_closing() and not self.closed:
            with contextlib.suppress(h2.exceptions.ProtocolError):
                self.h2.close_connection()
            self._flush_now()  # the GOAWAY, and whatever else is queued
            self.transport.close()
        self.closed = True

    def abort(self) -> None:
        self.closed = True
        self.pool.discard(self)
        if self.transport is not None:
            self.transport.abort()


# ---------------------------------------------------------------- one exchange


class H2Exchange:
    """One client stream forwarded as one stream to an HTTP/2 backend."""

    def __init__(
        self,
        upstreams: H2Upstreams,
        conn: H2ClientConnection,
        stream: Stream,
        request: Request,
        entry: RouteEntry,
        end: bool,
    ) -> None:
        self.upstreams = upstreams
        self.server = upstreams.server
        self.conn = conn
        self.stream = stream
        self.request = request
        self.entry = entry
        self.request_done = end
        self.connect_timeout = entry.options.connect_timeout
        self.target: Target = None  # type: ignore[assignment]
        self.backend: Any = None
        self.counted = False
        self.fields: list[tuple[bytes, bytes]] = []
        self.upstream: H2UpstreamConnection | None = None
        self.stream_id = 0
        self.held: list[bytes] = []  # request DATA waiting for the backend's window
        self.held_end = False
        self.responded = False
        self.finished = False
        self.queued = False  # waiting at the endpoint's connection bound (Pool.wait)
        self.retried = False
        self.status = 0
        self.extra: list[tuple[bytes, bytes]] = []
        self.ack_held = 0  # response bytes not yet acknowledged to the backend
        self.source_paused = False
        self.started = self.server.loop.time()
        self.last_up = self.started
        # When the ticker (H2ClientConnection.arm_stream) calls on_timer; 0: none.
        self.deadline = 0.0
        self.grpc_deadline = 0.0
        self.span: Any = None
        # The route's ResponseHeaderModifier (HTTPRoute filters; None: none).
        self.response_modifier: Any = None

    # ------------------------------------------------------------ start

    def start(self) -> None:
        stream, request, entry, server = self.stream, self.request, self.entry, self.server
        stream.exchange = self
        chunked = not self.request_done and request.content_length < 0
        try:
            req = request_head(request, chunked)
        except BadMessage as exc:
            self.local(exc.status, exc.reason, "bad_request")
            return
        route = entry.route
        secure = self.conn.secure
        identity = b""
        if route.tls is not None:
            if secure:
                if entry.hsts:
                    name, _, value = entry.hsts.partition(b":")
                    self.extra.append((name.lower(), value.strip()))
                if route.tls.client_ca_certificate:
                    checked = server.edge.client_identity(
                        self.conn.transport.get_extra_info("ssl_object"),  # type: ignore[union-attr]
                        route,
                    )
                    if isinstance(checked, tuple):
                        self.local(checked[0], checked[1], "client_certificate")
                        return
                    identity = checked
            elif tls.edge_rule(route) != tls.EDGE_ALLOW:
                self.local(503, f"route {entry.options.name} is served on HTTPS only", "https_only")
                return
        cookie = None
        if req.cookie and entry.options.cookie_name:
            prefix = entry.options.cookie_name + b"="
            for value in req.cookie:
                for part in value.split(b";"):
                    part = part.strip()
                    if part.startswith(prefix):
                        cookie = part[len(prefix) :]
        if entry.single is not None and cookie is None:
            self.target, self.backend = entry.single
        else:
            target, backend = entry.pick(self.client_key(), cookie, server.health, None)
            if target is None or backend is None:
                self.local(503, unavailable_reason(entry), "no_endpoint")
                return
            self.target, self.backend = target, backend
            backend.picker.acquire(target)
            self.counted = True
        if (
            self.backend is not None
            and self.backend.set_cookie
            and cookie != self.backend.by_target.get(self.target)
        ):
            line = self.backend.set_cookie.get(self.target, b"")
            if line:
                _, _, value = line.rstrip(b"\r\n").partition(b":")
                self.extra.append((b"set-cookie", value.strip()))
        authority = request.authority
        route_filters = route.filters
        if route_filters is not None:
            # HTTPRoute filters, as waygate.proxy.exchange applies them for HTTP/1.1
            # backends: a redirect is answered here; the request's rewrite and header
            # modifier shape the head the backend gets; the response's modifier its
            # answer (on_response). Mirrors are not sent for HTTP/2 backends (the
            # mirror copy is an HTTP/1.1 head).
            redirect = route_filters.redirect
            if redirect is not None:
                location = filters.redirect_location(
                    req, redirect, entry.path, secure=secure, listener_port=route.listener_port
                )
                self.redirect(redirect.status, location)
                return
            rewrite = route_filters.rewrite
            if rewrite is not None or route_filters.request_headers is not None:
                req = filters.rewritten_request(
                    req, rewrite, route_filters.request_headers, entry.path
                )
                if rewrite is not None and rewrite.hostname:
                    authority = rewrite.hostname.encode()
            self.response_modifier = route_filters.response_headers
        context = self.conn.context or ForwardedContext(self.conn.peer, server.listen_port)
        traceparent = req.traceparent
        if traceparent[-3:] == b"-01" and _TRACEPARENT.fullmatch(traceparent):
            # Sampled upstream of us (parent-based), as on HTTP/1.1: a server span,
            # and its id goes on to the backend.
            traceparent = self._start_span(req, entry)
        upstream_head = http1.build_upstream_head(
            req, context, entry.options.forwarded_mode, traceparent
        )
        if identity:
            upstream_head = upstream_head[:-2] + identity + b"\r\n"
        self.fields = _h2_fields(
            upstream_head,
            authority,
            b"https"
            if server.upstream_tls is not None and server.upstream_tls.applies(route)
            else b"http",
            request.grpc,
        )
        # The answer's deadline: the route's server timeout, or grpc-timeout when shorter.
        allowed = entry.options.server_timeout
        for name, value in request.headers:
            if name == b"grpc-timeout":
                timeout = grpcstatus.parse_timeout(value)
                if timeout is not None and timeout < allowed:
                    allowed = timeout
                    self.grpc_deadline = self.started + timeout
        self._arm(allowed)
        self.dispatch()

    def client_key(self) -> bytes:
        return self.conn.peer.encode()

    def dispatch(self) -> None:
        entry = self.entry
        scope = entry.upstream_scope
        key = (self.target, scope, "h2")
        connection = self.upstreams.pool.take(key)
        if connection is not None:
            self.server.metrics.pool_reused += 1
            self.attach(connection)
        else:
            self.upstreams.pool.wait_for(key, self)

    def endpoint_free(self) -> None:
        """Called by the endpoint's queue (Pool.wake): room for a connection or a stream."""
        self.queued = False
        if not self.finished and self.upstream is None:
            self.dispatch()
        elif self.finished:
            self.server.pool.wake(self.target)  # not needed here: the next one's turn

    def attach(self, connection: H2UpstreamConnection | None) -> None:
        if self.finished:
            return
        if connection is None:
            self.dispatch()  # the new connection filled up meanwhile
            return
        self.upstream = connection
        end = self.request_done and not self.held
        if end:
            self.held_end = False
        try:
            self.stream_id = connection.open_stream(self, self.fields, end)
        except (h2.exceptions.ProtocolError, h2.exceptions.TooManyStreamsError):
            self.upstream = None
            self.dispatch()
            return
        if self.held or self.held_end:
            self.send_held()

    # ------------------------------------------------------------ the client's side

    def request_data(self, data: bytes) -> None:
        if self.finished or not data:
            return
        self.held.append(data)
        if self.upstream is not None:
            self.send_held()
        if self.held:
            self.stream.upload_paused = True

    def request_end(self) -> None:
        self.request_done = True
        if self.finished:
            return
        self.held_end = True
        if self.upstream is not None:
            self.send_held()

    def request_trailers(self, headers: Any) -> None:
        # Request trailers are dropped, as on HTTP/1.1 (see waygate.proxy.http1).
        self.request_end()

    def send_held(self) -> None:
        """Request DATA as the backend's windows allow; the client's window opens after."""
        upstream = self.upstream
        if upstream is None or self.finished or not self.stream_id:
            return
        h2conn = upstream.h2
        try:
            while self.held:
                data = self.held[0]
                window = min(
                    h2conn.local_flow_control_window(self.stream_id), h2conn.max_outbound_frame_size
                )
                if window <= 0:
                    upstream.blocked.add(self)
                    upstream.flush()
                    return
                piece, rest = data[:window], data[window:]
                h2conn.send_data(self.stream_id, piece)
                if rest:
                    self.held[0] = rest
                else:
                    self.held.pop(0)
            upstream.blocked.discard(self)
            if self.held_end:
                self.held_end = False
                h2conn.end_stream(self.stream_id)
        except (h2.exceptions.StreamClosedError, h2.exceptions.ProtocolError):
            self.held = []
        upstream.flush()
        if not self.held and self.stream.upload_paused and not upstream.write_paused:
            self.stream.upload_resume()

    def upstream_writable(self, writable: bool) -> None:
        if not writable:
            self.stream.upload_paused = True
        elif not self.held:
            self.stream.upload_resume()

    def pause_source(self, paused: bool) -> None:
        """The client's stream buffer is full (or drained): hold (or give back) the
        backend's window."""
        self.source_paused = paused
        if not paused and self.ack_held:
            held, self.ack_held = self.ack_held, 0
            self._ack(held)

    def abandon(self) -> None:
        """The client reset the stream or went."""
        if self.finished:
            return
        upstream = self.upstream
        if upstream is not None and self.stream_id:
            with contextlib.suppress(h2.exceptions.ProtocolError):
                upstream.h2.reset_stream(self.stream_id, ErrorCodes.CANCEL)
            upstream.flush()
        self._finish(self.status or 499)

    # ------------------------------------------------------------ the backend's side

    def on_response(self, headers: list[tuple[bytes, bytes]], ended: bool) -> None:
        status = 0
        out: list[tuple[bytes, bytes]] = []
        control = http1.value_control
        for name, value in headers:
            if control(value) is not None or (name == b":status" and not _STATUS.fullmatch(value)):
                # Not relayed: the HTTP/1.1 rule book's 502 (h2 refuses NUL, CR, LF only).
                self._cancel_upstream()
                self.fail(502, "upstream sent a malformed response head", "upstream_head")
                return
            if name == b":status":
                status = int(value)
            elif name[:1] != b":" and name not in httpheaders.HOP_BY_HOP:
                out.append((name, value))
        if status < 200:
            return
        self.status = status
        self.responded = True
        self.last_up = self.server.loop.time()
        server = self.server
        server.metrics.latency(self.last_up - self.started, self.entry.options.name)
        if self.response_modifier is not None:
            out = _modified(out, self.response_modifier)
        out += self.extra
        self.stream.respond(status, out, end=ended)
        if ended:
            self._finish(status)
        else:
            self._arm(self.entry.options.server_timeout)

    def on_data(self, data: bytes, flow: int) -> None:
        self.last_up = self.server.loop.time()
        self.stream.send(data)
        if flow:
            if self.source_paused:
                self.ack_held += flow
            else:
                self._ack(flow)

    def _ack(self, size: int) -> None:
        upstream = self.upstream
        if upstream is None:
            return
        with contextlib.suppress(h2.exceptions.ProtocolError):
            upstream.h2.acknowledge_received_data(size, self.stream_id)
        upstream.flush()

    def on_trailers(self, headers: list[tuple[bytes, bytes]]) -> None:
        trailers = [(n, v) for n, v in headers if n[:1] != b":"]
        if not self.responded:
            return
        if any(http1.value_control(v) is not None for _, v in trailers):
            self._cancel_upstream()
            self.fail(502, "upstream sent a malformed trailer", "upstream_head")
            return
        self.stream.finish(trailers)
        self._finish(self.status)

    def on_end(self) -> None:
        if not self.finished:
            self.stream.finish()
            self._finish(self.status)

    def on_reset(self, code: int) -> None:
        if self.finished:
            return
        if code == ErrorCodes.REFUSED_STREAM and not self.responded and not self.retried:
            self.unprocessed()
            return
        if self.responded:
            self.stream.reset(ErrorCodes.INTERNAL_ERROR)
            self._finish(self.status)
            return
        self.fail(502, f"upstream reset the stream ({ErrorCodes(code).name})", "upstream_reset")

    def unprocessed(self) -> None:
        """The backend never processed the stream (GOAWAY above it, REFUSED_STREAM):
        sent again, once, on another connection, if its body was not sent yet."""
        upstream = self.upstream
        self.upstream = None
        if upstream is not None:
            upstream.exchanges.pop(self.stream_id, None)
        self.stream_id = 0
        if self.retried or self.responded or self.finished:
            self.fail(502, "upstream went away before answering", "upstream_closed")
            return
        self.retried = True
        self.server.metrics.redispatches += 1
        self.dispatch()

    def upstream_broke(self, reason: str) -> None:
        if self.finished:
            return
        if self.responded:
            self.stream.reset(ErrorCodes.INTERNAL_ERROR)
            self._finish(self.status)
        else:
            self.fail(502, reason, "upstream_closed")

    # ------------------------------------------------------------ outcomes

    def fail(self, status: int, reason: str, kind: str) -> None:
        if self.finished:
            return
        if self.responded:
            self.stream.reset(ErrorCodes.INTERNAL_ERROR)
            self._finish(self.status)
            return
        self.local(status, reason, kind)

    def redirect(self, status: int, location: bytes) -> None:
        """An HTTPRoute RequestRedirect: answered here, the backend never asked."""
        self.stream.respond(status, [(b"location", location), (b"content-length", b"0")], end=True)
        self._finish(status)

    def local(self, status: int, reason: str, kind: str) -> None:
        """A local answer: the error page's reason, or a gRPC status on gRPC."""
        metrics = self.server.metrics
        metrics.refused[kind] = metrics.refused.get(kind, 0) + 1
        stream = self.stream
        if self.request.grpc:
            stream.respond(200, grpcstatus.trailers_only(status, reason), end=True)
        else:
            body = reason.encode("ascii", "replace") + b"\n"
            stream.respond(
                status,
                [
                    (b"content-type", b"text/plain; charset=utf-8"),
                    (b"content-length", b"%d" % len(body)),
                    (b"cache-control", b"no-store"),
                    (b"x-waygate-error", reason.encode("ascii", "replace")),
                ],
            )
            stream.send(body)
            stream.finish()
        self._finish(status)

    def _start_span(self, req: http1.RequestHead, entry: RouteEntry) -> bytes:
        """A server span for a sampled request (the attributes the Exchange sets);
        returns the traceparent to send upstream."""
        parent = _PROPAGATOR.extract({"traceparent": req.traceparent.decode("ascii", "replace")})
        span = tracer().start_span(
            "proxy " + entry.options.name,
            context=parent,
            kind=SpanKind.SERVER,
            attributes={
                "http.request.method": req.method.decode("ascii", "replace"),
                "url.path": req.target.decode("ascii", "replace")[:256],
                "server.address": req.host.decode("ascii", "replace"),
                "waygate.route": entry.options.name,
                "network.protocol.version": "2",
            },
        )
        self.span = span
        context = span.get_span_context()
        return b"00-%032x-%016x-01" % (context.trace_id, context.span_id)

    def _finish(self, status: int) -> None:
        if self.finished:
            return
        self.finished = True
        self.deadline = 0.0
        if self.queued:
            self.queued = False
            self.server.pool.cancel_wait(self.target, self)
        span = self.span
        if span is not None:
            self.span = None
            span.set_attribute("http.response.status_code", status or 499)
            if not status or status >= 500:
                span.set_status(Status(StatusCode.ERROR))
            span.end()
        upstream = self.upstream
        if upstream is not None:
            upstream.blocked.discard(self)
            if self.stream_id:
                upstream.stream_done(self.stream_id)
                if self.ack_held:
                    self.ack_held = 0
        if self.counted and self.backend is not None:
            self.backend.picker.release(self.target)
            self.counted = False
        self.stream.exchange = None
        self.held = []
        server = self.server
        name = self.entry.options.name
        server.metrics.request(name, self.request.method, status or 502)
        if server.access_log_on:
            if server.access_log_budget > 0:
                server.access_log_budget -= 1
                self._log(name, status)
            else:
                server.access_log_suppressed += 1

    def _log(self, route: str, status: int) -> None:
        request = self.request
        access_log.info(
            "request",
            extra={
                "client": self.conn.peer,
                "method": request.method.decode("ascii", "replace"),
                "host": request.authority.decode("ascii", "replace"),
                "path": request.path.decode("ascii", "replace")[:256],
                "status": status,
                "route": route,
                "protocol": "h2" if self.conn.secure else "h2c",
                "upstream": f"{self.target.address}:{self.target.port}" if self.target else "",
                "duration_ms": round((self.server.loop.time() - self.started) * 1000, 3),
            },
        )

    # ------------------------------------------------------------ timeouts

    def _arm(self, seconds: float) -> None:
        """The next check: no timer object, the HTTP/2 connection's ticker entry
        calls `on_timer` (as for the streams driving an Exchange)."""
        when = self.server.loop.time() + seconds
        if self.grpc_deadline and self.grpc_deadline < when:
            when = self.grpc_deadline
        self.deadline = when
        self.conn.arm_stream(when)

    def on_timer(self, now: float) -> None:
        if self.finished or not self.deadline or now < self.deadline:
            return
        self.deadline = 0.0
        self._on_timer()

    def _on_timer(self) -> None:
        if self.finished:
            return
        now = self.server.loop.time()
        options = self.entry.options
        if self.grpc_deadline and now >= self.grpc_deadline:
            self._cancel_upstream()
            self.fail(
                504, f"grpc-timeout of {self.grpc_deadline - self.started:g}s passed", "deadline"
            )
            return
        idle = now - self.last_up
        if idle < options.server_timeout and self.responded:
            self._arm(options.server_timeout - idle)
            return
        self._cancel_upstream()
        self.fail(
            504, f"upstream did not answer within {options.server_timeout:g}s", "server_timeout"
        )

    def _cancel_upstream(self) -> None:
        upstream = self.upstream
        if upstream is not None and self.stream_id:
            with contextlib.suppress(h2.exceptions.ProtocolError):
                upstream.h2.reset_stream(self.stream_id, ErrorCodes.CANCEL)
            upstream.flush()


def _modified(fields: list[tuple[bytes, bytes]], modifier: Any) -> list[tuple[bytes, bytes]]:
    """Response fields after a ResponseHeaderModifier (the one rule of waygate.proxy.filters,
    applied to the field block these fields mean)."""
    block = b"".join(b"\r\n" + name + b": " + value for name, value in fields)
    out = []
    for line in filters.modify_response_fields(block, modifier).split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        out.append((name.strip().lower(), value.strip(b" \t")))
    return out


def _h2_fields(
    head: bytes, authority: bytes, scheme: bytes, grpc: bool
) -> list[tuple[bytes, bytes]]:
    """The HTTP/1.1 head the rule book produced, as HTTP/2 request fields."""
    lines = head.split(b"\r\n")
    method, _, rest = lines[0].partition(b" ")
    path = rest.rpartition(b" ")[0]
    fields = [
        (b":method", method),
        (b":scheme", scheme),
        (b":authority", authority),
        (b":path", path),
    ]
    for line in lines[1:]:
        if not line:
            continue
        name, _, value = line.partition(b":")
        lname = name.lower()
        if lname == b"host" or lname in httpheaders.HOP_BY_HOP:
            continue
        fields.append((lname, value.strip(b" \t")))
    if grpc:
        fields.append((b"te", b"trailers"))
    return fields
