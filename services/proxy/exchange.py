"""One proxied exchange to an HTTP/1.1 backend (a request and its response), without sockets.

An `Exchange` is what an HTTP/1.1 client connection
(`downstream_h1.ClientConnection`) and an HTTP/2 stream to an HTTP/1.1
backend (`h2exchange.StreamDownstream`) both drive. Every per-request rule
(routing, the route's rules, the pick, tracing, filters, the upstream head)
was decided before it starts, once, by `decision.decide`; the Exchange owns
what happens between the request's head and the response's last byte. The
two sides it talks to:

- downstream, the *driver* (the client side), through the `Downstream`
  interface below: the driver hands the Exchange the decided request and its
  body bytes, and the Exchange hands back the response (head, body pieces,
  local answers) and its end;
- upstream, an `upstream_h1.UpstreamConnection` (one HTTP/1.1 connection to
  the endpoint; for an HTTP/1.1 client of an HTTP/2 backend, one stream,
  `h2bridge.H2Bridge`), through its methods only: `begin`, `write`,
  `writelines`, `write_eof`, `release`, `abort`, `pause_reading`/
  `resume_reading`. It calls back the `upstream_h1.H1User` methods
  (`response_head`, `informational`, `response_data`, `switching`,
  `relay_data`, `relay_eof`, `upstream_closed`, `upstream_failed`,
  `upstream_paused`); the pool calls `endpoint_free` for a queued request.

Driving an Exchange (one request at a time; again after the end):

    decided = decision.decide(view, req, facts, now)  # the driver decides
    exchange.answer(req, decided)      # an Answer: counted, then rendered
    delay = exchange.begin(req, decided, now)  # a Forward: the request's state
                                       # here; the driver arms its first deadline
    exchange.dispatch()                # pooled connection, a connect task
                                       # (connect_h1), the endpoint's queue (503
                                       # when it is full), or an HTTP/2 stream
    rest = exchange.request_body(data) # body bytes; returns what follows the body
    delay = exchange.on_timer(now)     # timeouts (timeouts.check); < 0: fired
    exchange.downstream_paused(flag)   # the client stopped/resumed reading
    exchange.relay_send(data)          # after a 101: client bytes (relay_send_eof,
                                       # release_relay when both sides ended)
    exchange.close()                   # the driver went away: release everything

and the Exchange calls `Downstream.response_head/response_body/response_pieces`,
then `exchange_done(keep_alive, now, idle_timeout)` (or `failed`, `refuse`, `abort`).

What the Exchange keeps (the rules between request and response):
- request framing (Content-Length or chunked, bounded while connecting),
  proxy-body-size and request buffering: the request-body phase
  (`requestbody.RequestBody`, a mixin);
- the external-auth step before dispatch (`authstep.AuthStep`, a mixin);
- response framing and its extras (`Forward.extra`: Set-Cookie,
  HSTS; a route's ResponseHeaderModifier), rechunking (the upstream's chunked
  body is re-emitted chunked to a driver that takes chunks, or as bare
  payload otherwise);
- keep-alive and pooling eligibility: an upstream connection is released for
  reuse only when its response was framed cleanly, the whole request was sent
  and neither side asked to close;
- retry eligibility: redispatch only after a connect failed before anything
  was sent (`connect_h1`, `decision.may_redispatch`); a sent request is
  re-sent only when it went out on a reused keep-alive connection that closed
  before any response byte and it is idempotent without a body (RFC 9112
  section 9.3.1), never a sent POST;
- the bounds on 1xx responses (`server.Limits`), the relay after a 101
  (`relay_h1.UpgradeRelay`, a mixin), and its records (`records`: metrics, access log, span);
- everything it holds upstream let go in one place, `abandon_upstream`,
  however the exchange ends.

The per-request path does no logging (the access log is budgeted), no
f-strings and no dict copies; one task exists only while a connect runs.
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

from opentelemetry.trace import Status, StatusCode

from waygate.core import flow
from waygate.proxy import errorpages, filters, http1, http10, mirror, nextupstream, throttle
from waygate.proxy.authstep import AuthStep
from waygate.proxy.bodybuffer import BodyBuffer
from waygate.proxy.connect_h1 import start_connect
from waygate.proxy.context import ExchangeContext
from waygate.proxy.decision import (
    ANSWER_HEALTHZ,
    ANSWER_OPTIONS,
    ANSWER_REDIRECT,
    ANSWER_ROUTE_REDIRECT,
    HEALTHZ,
    OPTIONS_ANY,
    Answer,
    Forward,
    release_pick,
)
from waygate.proxy.filters import SetFields
from waygate.proxy.h2bridge import H2Bridge
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
from waygate.proxy.records import end_span
from waygate.proxy.relay_h1 import UpgradeRelay
from waygate.proxy.requestbody import RequestBody
from waygate.proxy.routing import RouteEntry, Side, Target
from waygate.proxy.throttle import ResponseThrottle
from waygate.proxy.timeouts import check as check_timeouts
from waygate.proxy.upstream_h1 import UpstreamConnection

__all__ = [
    "ANSWER_HEALTHZ",
    "ANSWER_OPTIONS",
    "ANSWER_REDIRECT",
    "ANSWER_ROUTE_REDIRECT",
    "Downstream",
    "Exchange",
]

# A non-idempotent request reuses only connections idle for less than this:
# upstreams' keep-alive timeouts are seconds (Node.js 5 s, nginx 75 s).
SAFE_REUSE_IDLE = 2.0

_IDEMPOTENT = frozenset((b"GET", b"HEAD", b"OPTIONS", b"PUT", b"DELETE", b"TRACE"))


class Downstream(Protocol):
    """What an Exchange needs from its driver (an HTTP/1.1 connection or an HTTP/2 stream).

    `context`, `client_key` and `secure` describe the client's connection; the
    rest are the Exchange's ways to answer it. Response heads come as the
    upstream's parsed `ResponseHead` plus the framing the Exchange chose
    (`http1.FRAMING_*`: LENGTH with `length`, CHUNKED when the body pieces are
    chunk-framed, CLOSE when the body runs to its end, NONE for no body),
    `keep_alive` (whether the client connection may carry another request) and
    `extra`: whole header lines (b"Name: value\\r\\n" each) to add.
    """

    client_key: bytes
    secure: Side
    # Whether this driver forwards chunk-framed body pieces as they are
    # (HTTP/1.1); False: the Exchange hands it the bare payload (HTTP/2).
    chunked_ok: bool
    # Whether the client's transport is paused for writing (its buffer is full).
    write_paused: bool
    # The access log's protocol field ("http/1.1", "h2", "h2c").
    protocol: str

    @property
    def context(self) -> ForwardedContext | None: ...
    def client_identity(self, route: Any) -> tuple[int, str] | bytes: ...
    def response_head(
        self,
        response: ResponseHead,
        framing: int,
        length: int,
        keep_alive: bool,
        extra: bytes,
        body: bytes,
        more: bool,
    ) -> None:
        """The final response head; `body`: all of a small body, sent with it;
        `more`: body bytes follow at once (in the same call chain), so the head
        may be held and sent with them."""

    def response_body(self, data: bytes) -> None: ...
    def response_pieces(self, pieces: list[bytes]) -> None: ...
    def informational(self, status: int) -> None: ...
    def answer(self, req: RequestHead, status: int, reason: str, kind: str) -> None:
        """A local answer (`kind`: ANSWER_HEALTHZ, ANSWER_REDIRECT to HTTPS, or the
        refusal's metric label); the driver renders it and closes when it must."""

    def exchange_done(self, keep_alive: bool, now: float, idle_timeout: float) -> None: ...
    def failed(self, status: int, reason: str, head_only: bool, response: bytes = b"") -> None: ...
    def refuse(self, exc: BadMessage) -> None: ...
    def abort(self) -> None: ...
    def pause_reading(self, reason: int) -> None: ...
    def resume_reading(self, reason: int) -> None: ...
    def start_relay(self, response: ResponseHead, rest: bytes) -> None: ...
    def relay_write(self, data: bytes) -> None: ...
    def relay_eof(self) -> bool: ...
    def relay_closed(self) -> None: ...


class Exchange(AuthStep, RequestBody, UpgradeRelay):
    """One request and its response at a time, between a driver and an upstream."""

    __slots__ = (
        "body_limit",
        "body_rate_base",
        "body_rate_from",
        "body_reader",
        "body_received",
        "body_remaining",
        "bridge",  # the stream to an HTTP/2 backend (h2bridge; None: HTTP/1.1)
        "buffer",  # the request body taken in before dispatch (bodybuffer; None: streamed)
        "connect_task",
        "ctx",
        "dispatch_held",  # dispatch waits for the buffered body's end
        "down",
        "entry",
        "forward",  # what decision.decide chose for this request (None: no request)
        "framing",  # the response's framing as the upstream sends it
        "informational_bytes",
        "informationals",
        "keep_alive",
        "last_client",
        "last_up",
        "loop",
        "pending_body",
        "pending_size",
        "queued",
        "reader",  # the response's chunked framing (None: not chunked)
        "remaining",  # response body bytes still due (FRAMING_LENGTH)
        "req",
        "req_complete",
        "response_started",
        "retried",
        "span",
        "started",
        "status",
        "target",
        "throttle",  # ingress-nginx limit-rate (waygate.proxy.throttle; None: not paced)
        "upstream",
        "upstream_blocked",
        "upstream_head",
    )

    def __init__(self, ctx: ExchangeContext, down: Downstream) -> None:
        self.ctx = ctx
        self.down = down
        self.loop = ctx.loop
        self.forward: Forward | None = None
        self.bridge: H2Bridge | None = None
        self.req: RequestHead | None = None
        self.entry: RouteEntry | None = None
        self.target: Target | None = None
        self.upstream: UpstreamConnection | None = None
        self.connect_task: asyncio.Task[None] | None = None
        # Waiting in the pool's queue for room at its endpoint (see Pool.wait).
        self.queued = False
        self.body_remaining = 0
        self.body_reader: ChunkedReader | None = None
        self.body_limit = 0  # proxy-body-size of a chunked body (waygate.proxy.bodylimit)
        # The minimum request-body rate (Limits.min_request_body_rate) is measured
        # from `body_rate_from`, when `body_rate_base` bytes had come, over the
        # time an upstream takes the body (not while it is connecting, queued or
        # not reading: then the client is paused by us, not slow).
        self.body_received = 0
        self.body_rate_from = 0.0
        self.body_rate_base = 0
        self.upstream_blocked = False
        self.req_complete = True
        self.buffer: BodyBuffer | None = None
        self.dispatch_held = False
        self.pending_body: list[bytes] = []
        self.pending_size = 0
        self.response_started = False
        self.upstream_head = b""
        self.retried = False
        self.last_client = 0.0
        self.last_up = 0.0
        self.started = 0.0
        self.status = 0
        self.span: Any = None
        # Informational responses of this request so far (bounded: see Limits).
        self.informationals = 0
        self.informational_bytes = 0
        self.keep_alive = True
        self.framing = FRAMING_NONE
        self.remaining = 0
        self.reader: ChunkedReader | None = None
        self.throttle: ResponseThrottle | None = None

    # ------------------------------------------------------------ the request

    def answer(self, req: RequestHead, answer: Answer) -> None:
        """A local answer `decision.decide` chose: counted (under its route, "" when none
        matched), logged, then rendered by the driver."""
        if answer.refused:
            self.ctx.records.refused(answer.kind)
        if answer is not HEALTHZ and answer is not OPTIONS_ANY:
            self._record(answer.route, req, answer.status)
        self.down.answer(req, answer.status, answer.reason, answer.kind)

    def begin(self, req: RequestHead, forward: Forward, now: float) -> float:
        """Take a request `decision.decide` forwarded (the driver decided it): its
        state here, its body's framing; `dispatch` next. Returns the delay until the
        exchange's first deadline, which the driver arms: the route's server timeout,
        or, with a body to come, the earliest of its stall and rate checks."""
        self.started = now
        self.forward = forward
        self.req = req
        self.entry = entry = forward.entry
        self.target = forward.target
        self.span = forward.span
        self.upstream_head = forward.upstream_head
        self.throttle = forward.throttle
        self.status = 0
        if self.informationals:
            self.informationals = self.informational_bytes = 0
        self.last_up = self.last_client = now
        self.response_started = False
        self.retried = False
        if self.body_received:
            self.body_received = 0
        if req.chunked:
            limit = self.ctx.limits.max_small_chunks  # (http10: the bare payload, sent whole)
            self.body_reader = ChunkedReader(chunk_budget=limit, rechunk=not forward.http10)
            self.body_limit = forward.body_limit  # proxy-body-size (0: none)
            self.req_complete = False
        elif req.content_length > 0:
            self.body_remaining = req.content_length
            self.body_reader = None
            self.req_complete = False
        else:
            self.req_complete = True
        if forward.buffer_body and not self.req_complete:
            # Request buffering: the body comes in here before any upstream is
            # used; its minimum rate is measured from now.
            self.buffer = self.ctx.buffers.new_buffer()
            self.dispatch_held = False
            self.body_rate_from = now
            self.body_rate_base = 0
            self.upstream_blocked = False
        if forward.mirrors:
            mirrors = self.ctx.mirrors
            for target, head in forward.mirrors:
                mirrors.send(target, head)
        options = entry.options
        if self.req_complete:
            return options.server_timeout
        # A body to come: its stall and rate checks are due earlier.
        return min(
            options.server_timeout, options.client_timeout, self.ctx.limits.request_body_grace
        )

    def dispatch(self) -> None:
        """Send the request upstream: a pooled connection, or a new connect; to an
        HTTP/2 backend, a stream (`h2bridge`: the backend decides the protocol)."""
        buffer = self.buffer
        if buffer is not None:
            if not self.req_complete:
                # The body first (request buffering): dispatched at its last byte.
                self.hold_dispatch()
                return
            if self.forward is not None:
                _body_taken(self.ctx, self.forward, buffer)
        target = self.target
        assert target is not None
        ctx = self.ctx
        forward = self.forward
        if forward is not None and forward.auth is not None:
            self._authorize(forward)
            return
        if forward is not None and forward.http2:
            req = self.req
            if req is not None and req.upgrade:
                self.fail(502, _no_upgrade_to_http2(req.upgrade), "upgrade_to_http2")
                return
            bridge = self.bridge = H2Bridge(ctx.h2, self, forward, self.down)
            bridge.dispatch()
            return
        req = self.req
        # A request that must never be re-sent only takes a recently used
        # connection (see Pool.take); idempotent ones may be retried instead.
        scope = forward.upstream_scope if forward is not None else None
        key: Any = target if scope is None else (target, scope)  # see routing.upstream_scope
        if forward is not None and forward.http10:  # waygate.proxy.http10: never an idle
            key = (key, "http/1.0")  # connection (nothing is put under this key)
        if req is not None and req.method in _IDEMPOTENT:
            upstream = ctx.pool.take(key)
        else:
            upstream = ctx.pool.take(key, idle_at_most=SAFE_REUSE_IDLE)
        if upstream is not None:
            ctx.metrics.pool_reused += 1
            self._attach(upstream, True)  # (positional: a specialised call)
            return
        pool = ctx.pool
        if pool.reserve(target):
            self._start_connect(target)
        elif pool.wait(target, self):
            self.queued = True  # Pool.wake calls endpoint_free
        else:
            self.fail(503, pool.full(target), "endpoint_limit")

    def endpoint_free(self) -> None:
        """Called by the pool: room (or an idle connection) for this queued request."""
        self.queued = False
        if self.req is not None and self.upstream is None and self.connect_task is None:
            self.dispatch()

    # ------------------------------------------------------------ picks

    def _release_pick(self) -> None:
        forward = self.forward
        if forward is not None:
            self.forward = None
            release_pick(forward)
        self.target = None

    # ------------------------------------------------------------ upstream side

    def _start_connect(self, target: Target) -> None:
        """A connect to `target`, reserved in the pool's per-endpoint bound by the
        caller (`connect_h1`: its reservation is released however it ends)."""
        self.connect_task = start_connect(self, target)

    def _attach(self, upstream: UpstreamConnection, reused: bool, head_sent: bool = False) -> None:
        self.upstream = upstream
        sent_at = self.started if reused else self.loop.time()
        if not self.req_complete:
            self._restart_body_rate(sent_at)
            if self.req is not None and self.req.expect_continue:
                # The client waits for the upstream's 100 before its body: the
                # rate is measured from the 100 on (see informational).
                self.upstream_blocked = True
        if self.buffer is not None:
            # A buffered body: the head, then the body as the upstream takes it.
            head = http10.buffered_head(self.forward, self.upstream_head, self.buffer)
            upstream.begin(self, reused, sent_at, head)
            self.upstream_blocked = False
            self._replay()
        elif self.pending_body:
            upstream.begin(self, reused, sent_at, [self.upstream_head, *self.pending_body])
            self.pending_body = []
            self.pending_size = 0
            self.down.resume_reading(flow.CONNECTING)
        else:
            upstream.begin(self, reused, sent_at, b"" if head_sent else self.upstream_head)
        if self.down.write_paused:
            upstream.pause_reading()

    def abandon_upstream(self) -> None:
        """Let go of everything held upstream, however the exchange ends: the place
        in the endpoint's queue, a connect (its reservation is released by its
        task's done callback, even when cancelled before it started), the
        connection (aborted: its exchange did not end cleanly) or the HTTP/2
        stream (reset; its own queue place and connect are the H2Pool's)."""
        if self.queued:
            self.queued = False
            if self.target is not None:
                self.ctx.pool.cancel_wait(self.target, self)
        if self.connect_task is not None:
            self.connect_task.cancel()
            self.connect_task = None
        bridge = self.bridge
        if bridge is not None:
            self.bridge = None
            bridge.abort()
        upstream = self.upstream
        self.upstream = None
        if upstream is not None:
            upstream.abort()

    # ------------------------------------------------------------ upstream callbacks

    def downstream_paused(self, paused: bool) -> None:
        """The driver's client stopped (True) or resumed (False) reading: so does the upstream."""
        # Inactivity is measured from here: the upstream is paused because of us.
        self.last_up = self.loop.time()
        upstream = self.upstream
        if upstream is not None:
            if paused:
                upstream.pause_reading()
            else:
                upstream.resume_reading()

    def informational(self, response: ResponseHead, size: int) -> str:
        """A 1xx other than 101 from the upstream (`size`: its head's bytes): 100
        goes on when the client expects it. Returns why the upstream is broken
        when it sent more 1xx than the limits allow ("" while within them)."""
        self.informationals += 1
        self.informational_bytes += size
        limits = self.ctx.limits
        if (
            self.informationals > limits.max_informational
            or self.informational_bytes > limits.max_informational_bytes
        ):
            return (
                f"upstream sent more than {limits.max_informational} informational (1xx) "
                f"responses or {limits.max_informational_bytes} bytes of them"
            )
        req = self.req
        forward = self.forward
        if (
            response.status == 100
            and req is not None
            and req.expect_continue
            and (forward is None or not forward.buffer_body)
        ):
            self.down.informational(100)
            if not self.req_complete:
                self._restart_body_rate(self.loop.time())
        return ""

    def response_head(self, response: ResponseHead, rest: bytes, now: float) -> bytes | None:
        """The final response head; returns the bytes after it still to handle as
        body (None: the response is complete, or nothing is left)."""
        ctx = self.ctx
        req = self.req
        assert req is not None
        upstream = self.upstream
        assert upstream is not None
        self.last_up = now
        forward = self.forward
        assert forward is not None
        if forward.next_upstream is not None and nextupstream.retried(self, response.status, now):
            return None  # dropped: the request went to another endpoint
        entry = self.entry
        ctx.metrics.latency(now - upstream.sent_at, entry.options.name if entry else "")
        framing = http1.response_framing(req.method, response)
        length = response.content_length
        status = response.status
        keep_alive = req.keep_alive and not ctx.draining
        out_framing = framing
        self.reader = None
        if framing == FRAMING_LENGTH:
            self.remaining = length
        elif framing == FRAMING_CHUNKED:
            if req.http10 or not self.down.chunked_ok:
                self.reader = ChunkedReader(rechunk=False, status=502)
                out_framing = FRAMING_CLOSE
                if req.http10:
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
        self.framing = framing
        self.keep_alive = keep_alive
        self.response_started = True
        self.status = status
        modifier = forward.response_modifier
        if modifier is not None:
            if type(modifier) is SetFields and response.fields is modifier.last_fields:
                response.fields = modifier.last_out  # type: ignore[assignment]  # (no call)
            else:  # (error pages ride only on a modifier with `errors`: no call for others)
                errors = getattr(modifier, "errors", None)
                if errors is not None and errorpages.intercept(self, modifier, status):
                    return None  # ingress-nginx custom-http-errors: the error backend answers
                response.fields = filters.modify_response_fields(response.fields, modifier, status)
        extra = forward.extra  # Set-Cookie, HSTS: decided with the pick
        down = self.down
        if framing == FRAMING_LENGTH and len(rest) == length < 65536 and self.throttle is None:
            # The whole body came with the head (a small response): one send.
            ctx.metrics.bytes_out += length
            down.response_head(response, out_framing, length, keep_alive, extra, rest, False)
            self.remaining = 0
            self.finish(self.keep_alive, now, True)
            return None
        if framing == FRAMING_NONE or (framing == FRAMING_LENGTH and length == 0):
            down.response_head(response, out_framing, length, keep_alive, extra, b"", False)
            # Bytes after a response without a body, in the same read: the
            # upstream's framing is off, so the connection is not pooled.
            self.finish(self.keep_alive, now, not rest)
            return None
        # Held for the body bytes of this same read (`more`): one send for a small response.
        down.response_head(response, out_framing, length, keep_alive, extra, b"", bool(rest))
        return rest

    def response_data(self, data: bytes, now: float) -> None:
        """Response body bytes from the upstream (after the head)."""
        self.last_up = now
        if self.throttle is not None:
            data = throttle.admit(self, self.throttle, data, now)
        if not data:
            return
        framing = self.framing
        metrics = self.ctx.metrics
        down = self.down
        if framing == FRAMING_LENGTH:
            remaining = self.remaining
            if len(data) > remaining:
                # More than the announced length: the framing is not clean.
                data = data[:remaining]
                self.remaining = 0
                metrics.bytes_out += len(data)
                down.response_body(data)
                self.finish(self.keep_alive, 0.0, False)
                return
            self.remaining = remaining - len(data)
            metrics.bytes_out += len(data)
            down.response_body(data)
            if self.remaining == 0:
                self.finish(self.keep_alive, 0.0, True)
        elif framing == FRAMING_CHUNKED:
            reader = self.reader
            assert reader is not None
            try:
                out, used = reader.feed(data)
            except BadMessage:
                self.upstream_failed(502, "upstream sent malformed chunked framing", "bad_response")
                return
            down.response_pieces(out)
            metrics.bytes_out += used
            if reader.done:
                self.finish(self.keep_alive, 0.0, used == len(data))
        elif framing == FRAMING_CLOSE:
            metrics.bytes_out += len(data)
            down.response_body(data)
        else:
            # Bytes after a bodiless response: the upstream's framing is off.
            self.upstream_failed(
                502, "upstream sent bytes after a bodiless response", "bad_response"
            )

    def upstream_closed(self, relay: bool, got_bytes: bool, reused: bool) -> None:
        """The upstream connection closed during this exchange."""
        self.upstream = None
        if relay:
            self.relay_closed()
        elif self.response_started and self.framing == FRAMING_CLOSE:
            self.finish(False)
        elif self.response_started:
            self.upstream_failed(502, "upstream closed mid-response", "upstream_closed")
        elif not got_bytes and reused and self._retry_after_reuse_race():
            return
        elif got_bytes:
            self.upstream_failed(
                502,
                "upstream closed the connection in the middle of its response head",
                "upstream_closed",
            )
        else:
            self.upstream_failed(
                502, "upstream closed the connection before answering", "upstream_closed"
            )

    def _retry_after_reuse_race(self) -> bool:
        """The reused upstream closed before answering: resend once if that is safe."""
        req = self.req
        if (
            req is None
            or self.retried
            or req.method not in _IDEMPOTENT
            or req.has_body
            or self.response_started
        ):
            return False
        self.retried = True
        self.upstream = None
        target = self.target
        assert target is not None
        # Counted as every connect is (its connection closed and uncounted itself).
        self.ctx.pool.reserve(target, force=True)
        self._start_connect(target)
        return True

    def upstream_failed(self, status: int, reason: str, kind: str) -> None:
        """The upstream broke before or during the response."""
        if kind == "bad_response" and nextupstream.retried_broken(self):
            return  # proxy-next-upstream invalid_header: another endpoint
        if self.response_started:
            self.abandon_upstream()
            self.down.abort()
            return
        self.fail(status, reason, kind)

    # ------------------------------------------------------------ the end

    def finish(self, keep_alive: bool, now: float = 0.0, clean: bool = False) -> None:
        """The response is complete: the upstream connection let go (pooled only when
        `clean`, the whole request went out unbuffered and nothing asks to close),
        the request recorded; the driver may take the next request."""
        upstream = self.upstream
        if upstream is not None:
            # Released first: a pipelined request the driver starts next may reuse it.
            self.upstream = None
            upstream.release(
                clean
                and self.req_complete
                and self.buffer is None
                and self.framing != FRAMING_CLOSE
                and not self.ctx.draining,
                now,
            )
        entry = self.entry
        req = self.req
        if entry is not None:
            options = entry.options
            idle_timeout = options.keep_alive_timeout
            if req is not None:
                # _record, without its call for the common request (no log, no span).
                records = self.ctx.records
                status = self.status or 502
                records.metrics.request(options.name, req.method, status)
                if records.logging or self.span is not None:
                    self._log(options.name, req, status)
        else:
            idle_timeout = 0.0
        self.bridge = None
        forward = self.forward
        if forward is not None:
            self.forward = None
            # (The common request holds nothing: no call for it.)
            if forward.counted or forward.held is not None:
                release_pick(forward)
        self.target = None
        self.req = None
        self.entry = None
        self.body_reader = None
        if self.buffer is not None:
            self._drop_buffer()
        self.down.exchange_done(keep_alive, now, idle_timeout)

    def fail(self, status: int, reason: str, kind: str, response: bytes = b"") -> None:
        """A failure the proxy answers itself (before the response started); `response`:
        the answer already rendered (a redirect), else the error page."""
        forward = self.forward
        if (
            forward is not None
            and forward.response_modifier is not None
            and not response
            and errorpages.intercept(self, forward.response_modifier, status, kind)
        ):
            return  # ingress-nginx custom-http-errors: the error backend answers
        metrics = self.ctx.metrics
        metrics.refused[kind] = metrics.refused.get(kind, 0) + 1
        entry = self.entry
        req = self.req
        if entry is not None and req is not None:
            self._record(entry.options.name, req, status)
        self.abandon_upstream()
        self._drop_buffer()
        self.req = None
        if self.response_started:
            self.down.abort()
            return
        self.down.failed(status, reason, req is not None and req.method == b"HEAD", response)

    def close(self, reason: str = "client connection lost") -> None:
        """The driver went away: release the upstream, the connect, the pick, the span."""
        self.abandon_upstream()
        self._release_pick()
        self._drop_buffer()
        self.pending_body = []
        self.req = None
        if self.span is not None:
            self.span.set_status(Status(StatusCode.ERROR, reason))
            self.span.end()
            self.span = None

    # ------------------------------------------------------------ timers

    def on_timer(self, now: float) -> float:
        """The exchange's deadline passed: the delay until the next check, or -1
        when a timeout fired (`timeouts.check`)."""
        return check_timeouts(self, now)

    # ------------------------------------------------------------ records

    def _record(self, route: str, req: RequestHead, status: int) -> None:
        """Count one answered request; its access-log line and span when due."""
        records = self.ctx.records
        records.metrics.request(route, req.method, status)
        if records.logging or self.span is not None:
            self._log(route, req, status)

    def _log(self, route: str, req: RequestHead, status: int) -> None:
        """An answered request's access-log line (when that logger is on) and its span's end."""
        records = self.ctx.records
        span = self.span
        if records.logging:
            started = self.started
            records.log(
                route,
                req,
                status,
                self.down.client_key,
                self.target,
                self.loop.time() - started if started else 0.0,
                span,
                self.down.protocol,
            )
        if span is not None:
            self.span = None
            end_span(span, status)


def _body_taken(ctx: ExchangeContext, forward: Forward, buffer: Any) -> None:
    """A buffered request body, whole: ingress-nginx's mirror-target copy and
    proxy-next-upstream's resend copy take it before it goes upstream."""
    if forward.body_mirror is not None:
        mirror.send_with_body(ctx.mirrors, forward, buffer)
    if forward.next_upstream is not None:
        nextupstream.keep_body(forward, buffer)


def _no_upgrade_to_http2(upgrade: bytes) -> str:
    return (
        "the backend speaks HTTP/2: an upgrade to "
        + upgrade.decode("ascii", "replace")
        + " cannot be relayed to it"
    )
