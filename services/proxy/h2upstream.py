"""HTTP/2 to backends: multiplexed connections, and the exchange of an HTTP/2 stream over one.

A backend speaks HTTP/2 when its route's `upstreamProtocol` or the `appProtocol`
of the Service port it names says so (`routing.Backend.http2`, by the
backend's own namespace and port; gRPC servers speak nothing else):
cleartext with prior knowledge (h2c), or TLS with ALPN h2 when the route
reencrypts (`waygate.proxy.upstream_tls`, the same verification and
explained failures as HTTP/1.1).

- `H2Upstreams`: the connections (`H2Pool`) and the start of an `H2Exchange`.
- `H2Pool`: connections per (endpoint, TLS scope). A stream takes a
  connection with room (open streams below the peer's
  SETTINGS_MAX_CONCURRENT_STREAMS, stream ids left, no GOAWAY received); else
  one connect is started per key and the streams wanting it wait for it
  (its trace context into a tunnel's dial; after a failed connect or a failed
  certificate verification each waiter may go to another endpoint,
  `decision.repick`). Every connection counts in the endpoint's bound that
  HTTP/1.1 connections keep (`waygate.proxy.pool.Pool`): at the bound a
  stream waits in the same queue, or gets the same 503; a connect's
  reservation is released by its task's done callback however it ends.
- `H2UpstreamConnection`: a thin Protocol over the `h2` client state machine;
  its streams' users are `H2Exchange`s and `h2bridge.H2Bridge`s.
- `H2Exchange`: one client stream forwarded as one upstream stream. Every
  per-request rule was decided by `decision.decide` (from the HTTP/1.1 head
  the stream means, `http2.request_head`), as for every other request; the
  upstream head leaves as HTTP/2 fields again (`h2_request_fields`). Trailers
  are relayed (gRPC's status lives there). END_STREAM goes to the backend once
  (with the HEADERS of a bodiless request, or after its body).
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
from collections.abc import Sequence
from typing import Any

import h2.events
import h2.exceptions
import h2.settings
from h2.errors import ErrorCodes

from waygate.core import flow, httpheaders
from waygate.proxy import (
    authcheck,
    bodylimit,
    errorpages,
    extauth,
    filters,
    grpcstatus,
    http1,
    mirror,
    nextupstream,
    throttle,
)
from waygate.proxy.bodybuffer import BodyBuffer, BufferRefused
from waygate.proxy.context import ExchangeContext
from waygate.proxy.decision import Forward, may_redispatch, release_pick, repick
from waygate.proxy.http2 import (
    H2ClientConnection,
    H2Limits,
    Request,
    Stream,
    h2_connection,
)
from waygate.proxy.routing import RouteEntry, Target
from waygate.proxy.upstream import ConnectError, start

_STATUS = re.compile(rb"[1-9][0-9][0-9]").fullmatch
_VALUE_CONTROL = http1.value_control


def malformed_field(name: bytes, value: bytes) -> bool:
    """A backend's HTTP/2 response field the HTTP/1.1 rule book refuses (a control
    character in the value, or a :status that is not three digits): a 502, whichever
    protocol the client speaks (h2 itself refuses only NUL, CR and LF)."""
    return _VALUE_CONTROL(value) is not None or (name == b":status" and _STATUS(value) is None)


log = logging.getLogger(__name__)

MAX_STREAM_ID = 2**31 - 1
HIGH_WATER = flow.HIGH_WATER
LOW_WATER = flow.LOW_WATER


class H2Upstreams:
    """The connections to HTTP/2 backends (which backends: `routing.Backend.http2`)."""

    def __init__(self, ctx: ExchangeContext, limits: H2Limits, serve: Any = None) -> None:
        self.ctx = ctx
        self.limits = limits
        self.pool = H2Pool(self)
        # What serves a stream's decided request anew (h2exchange.serve, handed in by
        # the server: this module imports no exchange): ingress-nginx's error backend.
        self.serve = serve
        ctx.h2 = self

    def start(
        self,
        conn: H2ClientConnection,
        stream: Stream,
        request: Request,
        req: http1.RequestHead,
        forward: Forward,
        end: bool,
    ) -> None:
        """Forward one client stream `decide` sent to an HTTP/2 backend."""
        H2Exchange(self, conn, stream, request, req, forward, end).start()

    def close(self) -> None:
        self.pool.close_all()


# ---------------------------------------------------------------- connections


class H2Pool:
    """HTTP/2 connections per (endpoint, TLS scope), shared by streams."""

    def __init__(self, upstreams: H2Upstreams) -> None:
        self.upstreams = upstreams
        self.connections: dict[Any, list[H2UpstreamConnection]] = {}
        self.connecting: dict[Any, list[UpstreamStream]] = {}
        self.tasks: set[asyncio.Task[None]] = set()

    def take(self, key: Any) -> H2UpstreamConnection | None:
        for connection in self.connections.get(key, ()):
            if connection.has_room():
                return connection
        return None

    def wait_for(self, key: Any, exchange: UpstreamStream) -> None:
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
        pool = self.upstreams.ctx.pool
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
        # The reservation is released in one place, however the task ends
        # (cancelled before it started included: close_all, a client gone).
        task.add_done_callback(lambda _task: pool.unreserve(target))
        task.add_done_callback(self.tasks.discard)

    async def _connect(self, key: Any, waiters: list[UpstreamStream]) -> None:
        """Open a connection for `key` (reserved in the endpoint's bound by the caller;
        the reservation ends with this task, the open connection counts itself)."""
        ctx = self.upstreams.ctx
        first = waiters[0]
        target, route, connect_timeout = first.target, first.entry.route, first.connect_timeout
        connection: H2UpstreamConnection | None = None
        failure: ConnectError | None = None
        try:
            # A socket, or a tunnel endpoint's data connection (upstream.Attachable);
            # the first waiter's trace context goes with a tunnel's dial.
            upstream = await ctx.dialer.connect(target, connect_timeout, first.traceparent)

            def factory() -> H2UpstreamConnection:
                return H2UpstreamConnection(self, key, self.upstreams.limits)

            upstream_tls = ctx.upstream_tls
            if upstream_tls is not None and key[1] is not None:  # (the TLS scope)
                connection = await upstream_tls.open(
                    factory, upstream, route, target, connect_timeout, first.span, http2=True
                )
            else:
                _, connection = await start(upstream, factory)
        except ConnectError as exc:
            ctx.metrics.connect_error(exc.kind)
            ctx.view.health.failed(target)
            failure = exc
        except OSError as exc:
            failure = ConnectError(
                "upstream connection failed: " + str(exc), "error", retryable=False
            )
        if self.connecting.get(key) is waiters:
            del self.connecting[key]
        if connection is None:
            assert failure is not None
            for exchange in waiters:
                if not exchange.finished:
                    exchange.connect_failed(failure)
            return
        ctx.view.health.succeeded(target)
        ctx.metrics.upstream_opened += 1
        self.connections.setdefault(key, []).append(connection)
        for exchange in waiters:
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
        self.exchanges: dict[int, UpstreamStream] = {}
        self.blocked: set[UpstreamStream] = set()
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
        ctx = self.pool.upstreams.ctx
        ctx.upstreams.add(self)
        ctx.metrics.upstream_connections = len(ctx.upstreams)
        self.counted = ctx.pool.reserve(self.target, force=True)
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
        self, exchange: UpstreamStream, fields: list[tuple[bytes, bytes]], end: bool
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
        elif self.pool.upstreams.ctx.pool.waiting:
            # Room for a stream: a request waiting at the endpoint's bound may take it
            # (an HTTP/1.1 one woken here finds no connection and waits again).
            self.pool.upstreams.ctx.pool.wake(self.target)

    def _fail_all(self, reason: str) -> None:
        exchanges = list(self.exchanges.values())
        self.exchanges.clear()
        for exchange in exchanges:
            exchange.upstream_broke(reason)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.pool.discard(self)
        ctx = self.pool.upstreams.ctx
        ctx.upstreams.discard(self)
        ctx.metrics.upstream_connections = len(ctx.upstreams)
        if self.counted:
            self.counted = False
            ctx.pool.unreserve(self.target)
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


class UpstreamStream:
    """One stream on a backend's HTTP/2 connection, the part its two users share
    (`H2Exchange`, an HTTP/2 client's stream; `h2bridge.H2Bridge`, an HTTP/1.1
    client's request): getting a stream (a connection with room, or the
    pool's connect and the endpoint's queue), redispatch after a failed
    connect, request DATA as the stream's window allows with END_STREAM sent
    once, and the acknowledgement of response DATA. The connection calls the
    rest (`on_response` ... `upstream_writable`) on each stream's user."""

    upstreams: H2Upstreams
    forward: Forward
    facts: Any  # the client connection (decision.ConnectionFacts)
    entry: RouteEntry
    target: Target
    upstream: H2UpstreamConnection | None
    stream_id: int
    held: list[bytes]
    request_done: bool
    end_sent: bool
    finished: bool
    queued: bool
    attempts: int
    retried: bool
    data_sent = False  # request DATA went on this stream (it cannot be sent again)
    span: Any
    traceparent: str | None
    connect_timeout: float

    def attach(self, connection: H2UpstreamConnection | None) -> None:
        raise NotImplementedError

    def on_response(self, headers: list[tuple[bytes, bytes]], ended: bool) -> None:
        raise NotImplementedError

    def on_data(self, data: bytes, flow: int) -> None:
        raise NotImplementedError

    def on_trailers(self, headers: list[tuple[bytes, bytes]]) -> None:
        raise NotImplementedError

    def on_end(self) -> None:
        raise NotImplementedError

    def on_reset(self, code: int) -> None:
        raise NotImplementedError

    def unprocessed(self) -> None:
        """The backend never processed the stream (GOAWAY above it, REFUSED_STREAM):
        sent again, once, on another connection, if none of its body went yet
        (what went is not held any more)."""
        upstream = self.upstream
        self.upstream = None
        if upstream is not None:
            upstream.exchanges.pop(self.stream_id, None)
        self.stream_id = 0
        self.end_sent = False
        if self.retried or self.finished or self.data_sent or self._answered():
            self._gone("upstream went away before answering")
            return
        self.retried = True
        self.upstreams.ctx.metrics.redispatches += 1
        self.dispatch()

    def _answered(self) -> bool:
        """Whether the backend's answer has begun."""
        raise NotImplementedError

    def _gone(self, reason: str) -> None:
        """The stream cannot be had again: a 502 with `reason`."""
        raise NotImplementedError

    def upstream_broke(self, reason: str) -> None:
        raise NotImplementedError

    def send_held(self) -> None:
        raise NotImplementedError

    def upstream_writable(self, writable: bool) -> None:
        raise NotImplementedError

    def fail(self, status: int, reason: str, kind: str) -> None:
        raise NotImplementedError

    def _moved(self) -> None:
        """A redispatch chose another endpoint (`forward.target`)."""

    def _blocked(self, blocked: bool) -> None:
        """The stream's window shut (True) with request DATA held, or opened (False)."""

    def dispatch(self) -> None:
        key = (self.target, self.forward.upstream_scope, "h2")
        upstreams = self.upstreams
        connection = upstreams.pool.take(key)
        if connection is not None:
            upstreams.ctx.metrics.pool_reused += 1
            self.attach(connection)
        else:
            upstreams.pool.wait_for(key, self)

    def endpoint_free(self) -> None:
        """Called by the endpoint's queue (Pool.wake): room for a connection or a stream."""
        self.queued = False
        if not self.finished and self.upstream is None:
            self.dispatch()
        elif self.finished:
            self.upstreams.ctx.pool.wake(self.target)  # not needed here: the next one's turn

    def connect_failed(self, exc: ConnectError) -> None:
        """The connect this stream waited for failed: another endpoint when the
        failure allows it and one is left (`decision.repick`), else 502."""
        ctx = self.upstreams.ctx
        route = self.forward.entry.route
        if may_redispatch(exc.retryable, exc.kind, self.attempts, route) and repick(
            ctx.view, self.forward, self.facts, self.target
        ):
            self.attempts += 1
            ctx.metrics.redispatches += 1
            self.target = self.forward.target
            self._moved()
            self.dispatch()
            return
        self.fail(502, exc.reason, "connect_" + exc.kind)

    def _send(self) -> bool:
        """Request DATA as the stream's window allows, then END_STREAM (once) when the
        request is done; False when the window shut with DATA still held."""
        upstream = self.upstream
        assert upstream is not None
        h2conn = upstream.h2
        held = self.held
        try:
            while held:
                data = held[0]
                window = min(
                    h2conn.local_flow_control_window(self.stream_id), h2conn.max_outbound_frame_size
                )
                if window <= 0:
                    if self not in upstream.blocked:
                        upstream.blocked.add(self)
                        self._blocked(True)
                    upstream.flush()
                    return False
                h2conn.send_data(self.stream_id, data[:window])
                self.data_sent = True
                if len(data) > window:
                    held[0] = data[window:]
                else:
                    held.pop(0)
            if self in upstream.blocked:
                upstream.blocked.discard(self)
                self._blocked(False)
            if self.request_done and not self.end_sent:
                self.end_sent = True
                h2conn.end_stream(self.stream_id)
        except (h2.exceptions.StreamClosedError, h2.exceptions.ProtocolError):
            self.held = []
        upstream.flush()
        return True

    def _ack(self, size: int) -> None:
        upstream = self.upstream
        if upstream is None or not self.stream_id:
            return
        with contextlib.suppress(h2.exceptions.ProtocolError):
            upstream.h2.acknowledge_received_data(size, self.stream_id)
        upstream.flush()


class H2Exchange(UpstreamStream):
    """One request `decide` forwarded to an HTTP/2 backend, carried as one upstream stream.

    The client side is an HTTP/2 stream (`http2.Stream`); every per-request rule
    was decided before (`decision.decide`): this class moves DATA, windows and
    trailers, keeps the deadline, and records the end (`records`)."""

    # Request buffering (bodybuffer; set per request only when the body is
    # buffered): the body is taken in here with the client's window kept open,
    # the upstream stream opened at its end, then the body replayed from here.
    buffer: BodyBuffer | None = None
    buffering = False  # the body is still coming in (no stream upstream yet)
    last_client = 0.0  # when the client last sent body bytes (while buffering)
    body_seen = 0  # request DATA counted against proxy-body-size (only with one)
    # ingress-nginx limit-rate (set per request only when paced; waygate.proxy.throttle).
    throttle: throttle.ResponseThrottle | None = None

    def __init__(
        self,
        upstreams: H2Upstreams,
        conn: H2ClientConnection,
        stream: Stream,
        request: Request,
        req: http1.RequestHead,
        forward: Forward,
        end: bool,
    ) -> None:
        self.upstreams = upstreams
        self.ctx = upstreams.ctx
        self.conn = conn
        self.facts = conn
        self.stream = stream
        self.request = request
        self.req = req
        self.forward = forward
        self.entry: RouteEntry = forward.entry
        self.target: Target = forward.target
        self.span: Any = forward.span
        self.traceparent = forward.traceparent
        self.request_done = end
        self.connect_timeout = forward.entry.options.connect_timeout
        self.fields: list[tuple[bytes, bytes]] = []
        self.upstream: H2UpstreamConnection | None = None
        self.stream_id = 0
        self.held: list[bytes] = []  # request DATA waiting for the backend's window
        # END_STREAM went to the backend (with the HEADERS or after the body): never twice.
        self.end_sent = False
        self.responded = False
        self.finished = False
        self.queued = False  # waiting at the endpoint's connection bound (Pool.wait)
        self.retried = False
        self.attempts = 1  # connects tried (redispatch after a failed one)
        self.status = 0
        self.extra: list[tuple[bytes, bytes]] = []
        self.ack_held = 0  # response bytes not yet acknowledged to the backend
        self.source_paused = False
        self.started = self.ctx.loop.time()
        self.last_up = self.started
        # When the ticker (H2ClientConnection.arm_stream) calls on_timer; 0: none.
        self.deadline = 0.0
        self.grpc_deadline = 0.0
        # The route's ResponseHeaderModifier (HTTPRoute filters; None: none).
        self.response_modifier = forward.response_modifier
        # Request buffering (bodybuffer): the body is taken in here, the window
        # kept open, and the stream opened upstream at its end; then replayed.
        if forward.buffer_body and not end:
            self.buffer = self.ctx.buffers.new_buffer()
            self.buffering = True
            self.last_client = self.started

    # ------------------------------------------------------------ start

    def start(self) -> None:
        forward = self.forward
        self.stream.exchange = self
        if forward.hsts:
            name, _, value = forward.hsts.partition(b":")
            self.extra.append((name.lower(), value.strip()))
        self._add_cookie()
        upstream_tls = self.ctx.upstream_tls
        self.fields_authority = forward.authority or self.request.authority
        self.fields_scheme = (
            b"https" if upstream_tls is not None and forward.upstream_scope is not None else b"http"
        )
        self.fields = h2_request_fields(
            forward.upstream_head, self.fields_authority, self.fields_scheme, self.request.grpc
        )
        if forward.mirrors:
            mirrors = self.ctx.mirrors
            for target, head in forward.mirrors:
                mirrors.send(target, head)
        if forward.throttle is not None:
            self.throttle = forward.throttle
        allowed = forward.entry.options.server_timeout
        if forward.deadline:
            self.grpc_deadline = forward.deadline  # grpc-timeout, shorter than the route's
            allowed = forward.deadline - self.started
        buffer = self.buffer
        if buffer is not None:
            try:
                self.ctx.buffers.check(self.req.content_length)
            except BufferRefused as exc:
                self.local(exc.status, exc.reason, exc.kind)
                return
            limits = self.ctx.limits
            self._arm(min(allowed, forward.entry.options.client_timeout, limits.request_body_grace))
            return
        self._arm(allowed)
        if forward.auth is not None:
            self._authorize()
            return
        self.dispatch()

    auth_task: Any = None  # the auth subrequest while it runs (authcheck)

    def _authorize(self) -> None:
        """ingress-nginx auth-url: the auth service is asked first; its answer lets
        the stream go on, with the answer's headers, or answers the client."""
        context = self.conn.context
        assert context is not None
        found = authcheck.authorize(
            self.ctx,
            self.forward,
            self.req,
            bool(self.conn.secure),
            context.client_ip,
            self._authorized,
        )
        if isinstance(found, asyncio.Task):
            self.auth_task = found
        else:
            self._authorized(found)  # a cached answer

    def _authorized(self, response: http1.ResponseHead | None) -> None:
        self.auth_task = None
        forward = self.forward
        plan = forward.auth
        if self.finished or plan is None:
            return
        forward.auth = None
        result = extauth.outcome(plan, response, self.req, bool(self.conn.secure), forward)
        self.response_modifier = forward.response_modifier  # (with the answer's Set-Cookie)
        if isinstance(result, bytes):
            if plan.copied:
                head = extauth.with_auth_headers(forward.upstream_head, plan, result)
                forward.upstream_head = head
                self.fields = h2_request_fields(
                    head, self.fields_authority, self.fields_scheme, self.request.grpc
                )
            self.dispatch()
            return
        extra = extauth.field_pairs(result.lines)
        if result.location:
            self.stream.respond(result.status, [(b"location", result.location), *extra], end=True)
            self._finish(result.status)
            return
        if extra and not self.request.grpc:  # (WWW-Authenticate, Set-Cookie)
            self.ctx.records.refused("external_auth")
            respond_locally(self.stream, False, result.status, result.reason, extra)
            self._finish(result.status)
            return
        self.local(result.status, result.reason, "external_auth")

    def _add_cookie(self) -> None:
        line = self.forward.set_cookie_line(self.target)
        if line:
            _, _, value = line.rstrip(b"\r\n").partition(b":")
            self.extra.append((b"set-cookie", value.strip()))

    def client_key(self) -> bytes:
        return self.conn.client_key  # type: ignore[no-any-return]

    def _moved(self) -> None:
        # The sticky cookie names the endpoint the request went to.
        self.extra = [item for item in self.extra if item[0] != b"set-cookie"]
        self._add_cookie()

    def attach(self, connection: H2UpstreamConnection | None) -> None:
        if self.finished:
            return
        if connection is None:
            self.dispatch()  # the new connection filled up meanwhile
            return
        self.upstream = connection
        end = self.request_done and not self.held
        try:
            self.stream_id = connection.open_stream(self, self.fields, end)
        except (h2.exceptions.ProtocolError, h2.exceptions.TooManyStreamsError):
            self.upstream = None
            self.dispatch()
            return
        self.end_sent = end
        if self.held or (self.request_done and not end) or self.buffer is not None:
            self.send_held()

    # ------------------------------------------------------------ the client's side

    def request_data(self, data: bytes) -> None:
        if self.finished or not data:
            return
        limit = self.forward.body_limit
        if limit:  # proxy-body-size on a body without content-length (bodylimit)
            self.body_seen += len(data)
            if self.body_seen > limit:
                self._cancel_upstream()
                self.fail(413, bodylimit.reason(limit), bodylimit.KIND)
                return
        buffer = self.buffer
        if self.buffering and buffer is not None:
            # Taken in (the stream's window is given back as for any consumed DATA).
            self.last_client = self.ctx.loop.time()
            try:
                buffer.write([data])
            except BufferRefused as exc:
                self.local(exc.status, exc.reason, exc.kind)
            return
        self.held.append(data)
        if self.upstream is not None:
            self.send_held()
        if self.held:
            self.stream.upload_paused = True

    def request_end(self) -> None:
        # The client's END_STREAM may be reported after a HEADERS that carried it
        # (the request was bodiless: its stream already ended upstream, on a
        # reused connection with the HEADERS): it ends nothing twice.
        if self.finished or self.end_sent:
            self.request_done = True
            return
        if self.buffering:
            self.buffering = False
            if self.forward.body_mirror is not None and self.buffer is not None:
                mirror.send_with_body(self.ctx.mirrors, self.forward, self.buffer)
            # The buffered body is all here: now a stream upstream (the body is
            # replayed by send_held; END_STREAM after its last byte).
            self._arm(self.entry.options.server_timeout)
            self.dispatch()
            return
        self.request_done = True
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
        buffer = self.buffer
        while buffer is not None:
            # The buffered body, a piece at a time as the backend's window allows.
            if self.held and not self._send():
                return
            data = buffer.read()
            if data:
                self.held.append(data)
            else:
                self.buffer = None
                self.request_done = True
                buffer.close()
                buffer = None
        if self._send() and self.stream.upload_paused and not upstream.write_paused:
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
        for name, value in headers:
            if malformed_field(name, value):
                # Not relayed: the HTTP/1.1 rule book's 502 (h2 refuses NUL, CR, LF only).
                if self.forward.next_upstream is not None and nextupstream.retried_h2(
                    self, 0, broken=True
                ):
                    return  # proxy-next-upstream invalid_header: another endpoint
                self._cancel_upstream()
                self.fail(502, "upstream sent a malformed response head", "upstream_head")
                return
            if name == b":status":
                status = int(value)
            elif name[:1] != b":" and name not in httpheaders.HOP_BY_HOP:
                out.append((name, value))
        if status < 200:
            return
        if self.forward.next_upstream is not None and nextupstream.retried_h2(self, status):
            return  # dropped: the stream went to another endpoint
        if self.response_modifier is not None and errorpages.intercept_stream(
            self, self.response_modifier, status
        ):
            return  # ingress-nginx custom-http-errors: the error backend answers
        self.status = status
        self.responded = True
        self.last_up = self.ctx.loop.time()
        self.ctx.metrics.latency(self.last_up - self.started, self.entry.options.name)
        if self.response_modifier is not None:
            out = _modified(out, self.response_modifier, status)
        out += self.extra
        self.stream.respond(status, out, end=ended)
        if ended:
            self._finish(status)
        else:
            self._arm(self.entry.options.server_timeout)

    def on_data(self, data: bytes, flow: int) -> None:
        self.last_up = now = self.ctx.loop.time()
        paced = self.throttle
        if paced is not None and not throttle.admit_h2(self, paced, data, flow, now):
            return
        self.stream.send(data)
        if flow:
            if self.source_paused:
                self.ack_held += flow
            else:
                self._ack(flow)

    def on_trailers(self, headers: list[tuple[bytes, bytes]]) -> None:
        trailers = [(n, v) for n, v in headers if n[:1] != b":"]
        if not self.responded:
            return
        if any(http1.value_control(v) is not None for _, v in trailers):
            self._cancel_upstream()
            self.fail(502, "upstream sent a malformed trailer", "upstream_head")
            return
        paced = self.throttle
        if paced is not None and throttle.held_end(paced, lambda: self.on_trailers(headers)):
            return
        self.stream.finish(trailers)
        self._finish(self.status)

    def on_end(self) -> None:
        paced = self.throttle
        if paced is not None and throttle.held_end(paced, self.on_end):
            return
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

    def _answered(self) -> bool:
        return self.responded

    def _gone(self, reason: str) -> None:
        self.fail(502, reason, "upstream_closed")

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

    def local(self, status: int, reason: str, kind: str) -> None:
        """A local answer: the error page's reason, or a gRPC status on gRPC."""
        if self.response_modifier is not None and errorpages.intercept_stream(
            self, self.response_modifier, status, kind
        ):
            return  # ingress-nginx custom-http-errors: the error backend answers
        self.ctx.records.refused(kind)
        respond_locally(self.stream, self.request.grpc, status, reason)
        self._finish(status)

    def _finish(self, status: int, record: bool = True) -> None:
        if self.finished:
            return
        self.finished = True
        self.deadline = 0.0
        if self.auth_task is not None:
            self.auth_task.cancel()  # the client went: so does the subrequest
            self.auth_task = None
        if self.queued:
            self.queued = False
            self.ctx.pool.cancel_wait(self.target, self)
        upstream = self.upstream
        if upstream is not None:
            upstream.blocked.discard(self)
            if self.stream_id:
                upstream.stream_done(self.stream_id)
                if self.ack_held:
                    self.ack_held = 0
        release_pick(self.forward)
        self.stream.exchange = None
        self.held = []
        buffer = self.buffer
        if buffer is not None:
            self.buffer = None
            buffer.close()
        if not record:
            return  # handed to ingress-nginx's error backend (errorpages), which records it
        span = self.span
        self.span = None
        ctx = self.ctx
        ctx.records.finish(
            self.entry.options.name,
            self.req,
            status or 502,
            self.conn.client_key,
            self.target,
            ctx.loop.time() - self.started,
            span,
            "h2" if self.conn.secure else "h2c",
        )

    # ------------------------------------------------------------ timeouts

    def _arm(self, seconds: float) -> None:
        """The next check: no timer object, the HTTP/2 connection's ticker entry
        calls `on_timer` (as for the streams driving an Exchange)."""
        when = self.ctx.loop.time() + seconds
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
        now = self.ctx.loop.time()
        options = self.entry.options
        if self.grpc_deadline and now >= self.grpc_deadline:
            self._cancel_upstream()
            self.fail(
                504, f"grpc-timeout of {self.grpc_deadline - self.started:g}s passed", "deadline"
            )
            return
        if self.buffering:
            self._buffer_timer(now, options)
            return
        idle = now - self.last_up
        if idle < options.server_timeout and self.responded:
            self._arm(options.server_timeout - idle)
            return
        self._cancel_upstream()
        self.fail(
            504, f"upstream did not answer within {options.server_timeout:g}s", "server_timeout"
        )

    def _buffer_timer(self, now: float, options: Any) -> None:
        """While the body is taken in (request buffering): the client timeout and
        the minimum body rate, as `timeouts.check` keeps them for an Exchange."""
        buffer = self.buffer
        assert buffer is not None
        if now - self.last_client >= options.client_timeout:
            self.fail(
                408, f"request body stalled for {options.client_timeout:g}s", "client_timeout"
            )
            return
        limits = self.ctx.limits
        rate = limits.min_request_body_rate
        elapsed = now - self.started
        if rate and elapsed >= limits.request_body_grace and buffer.size < rate * elapsed:
            self.fail(408, f"request body slower than {rate} bytes/s", "slow_body")
            return
        self._arm(min(1.0, options.client_timeout))

    def _cancel_upstream(self) -> None:
        upstream = self.upstream
        if upstream is not None and self.stream_id:
            with contextlib.suppress(h2.exceptions.ProtocolError):
                upstream.h2.reset_stream(self.stream_id, ErrorCodes.CANCEL)
            upstream.flush()


def respond_locally(
    stream: Stream, grpc: bool, status: int, reason: str, extra: Sequence[tuple[bytes, bytes]] = ()
) -> None:
    """The proxy's own failure on an HTTP/2 stream: the reason as a short text page
    (and X-Waygate-Error, and `extra` fields), or a gRPC status (trailers-only) on gRPC."""
    if grpc:
        stream.respond(200, grpcstatus.trailers_only(status, reason), end=True)
        return
    body = reason.encode("ascii", "replace") + b"\n"
    stream.respond(
        status,
        [
            (b"content-type", b"text/plain; charset=utf-8"),
            (b"content-length", b"%d" % len(body)),
            (b"cache-control", b"no-store"),
            (b"x-waygate-error", reason.encode("ascii", "replace")),
            *extra,
        ],
    )
    stream.send(body)
    stream.finish()


def _modified(
    fields: list[tuple[bytes, bytes]], modifier: Any, status: int
) -> list[tuple[bytes, bytes]]:
    """Response fields after a ResponseHeaderModifier (the one rule of waygate.proxy.filters,
    applied to the field block these fields mean)."""
    block = b"".join(b"\r\n" + name + b": " + value for name, value in fields)
    out = []
    for line in filters.modify_response_fields(block, modifier, status).split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        out.append((name.strip().lower(), value.strip(b" \t")))
    return out


def h2_request_fields(
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
