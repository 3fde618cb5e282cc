"""The request-body phase of an HTTP/1.1 exchange: the client's body bytes on their way upstream.

`RequestBody` is a mixin of `exchange.Exchange` (its state lives in the
Exchange's slots, as `relay_h1.UpgradeRelay`'s does). It takes the body
bytes the driver hands over (`request_body`) and sends them on by the
request's framing (Content-Length, or chunked through an `http1.ChunkedReader`
that re-frames the chunks it checked), to one of three places:

- the upstream connection, when one is attached;
- the request buffer (`bodybuffer`, ingress-nginx's proxy-request-buffering):
  the whole body is taken in before any upstream is used, and dispatch waits
  for its last byte (`hold_dispatch`); then it is replayed (`_replay`) as the
  upstream takes it (`upstream_paused` stops and resumes it);
- while a connect runs, a pending list: past `PENDING_HIGH_WATER` the client
  is paused (`flow.CONNECTING`) until the upstream is attached and takes it.

Invariants: a chunked body over the route's proxy-body-size (`bodylimit`) is
refused with 413 (an abort once the response started) at the chunk size that
crosses it, and nothing more is relayed; malformed chunked framing is refused,
never passed on; the minimum body rate (`timeouts.check`) is measured only
while an upstream or the buffer takes the body (`_restart_body_rate` whenever
that starts again), so a client the proxy paused is never called slow; the
buffer is freed (`_drop_buffer`) however the exchange ends. A request without
a body never enters `request_body`, the hold or the replay.
"""

from __future__ import annotations

from typing import Any, Protocol

from waygate.core import flow
from waygate.proxy import bodylimit
from waygate.proxy.bodybuffer import BodyBuffer, BufferRefused
from waygate.proxy.context import ExchangeContext
from waygate.proxy.http1 import BadMessage, ChunkedReader, RequestHead
from waygate.proxy.upstream_h1 import UpstreamConnection

# Request body bytes held while the upstream connect runs before reading pauses.
PENDING_HIGH_WATER = flow.HIGH_WATER


class BodyDownstream(Protocol):
    """What the body phase needs of the exchange's driver (`exchange.Downstream`)."""

    def informational(self, status: int) -> None: ...
    def refuse(self, exc: BadMessage) -> None: ...
    def abort(self) -> None: ...
    def pause_reading(self, reason: int) -> None: ...
    def resume_reading(self, reason: int) -> None: ...


class _Bodied(Protocol):
    """What the body phase uses of its exchange (`exchange.Exchange`)."""

    ctx: ExchangeContext
    loop: Any
    req: RequestHead | None
    upstream: UpstreamConnection | Any
    response_started: bool
    last_client: float
    body_limit: int
    body_rate_base: int
    body_rate_from: float
    body_reader: ChunkedReader | None
    body_received: int
    body_remaining: int
    buffer: BodyBuffer | None
    dispatch_held: bool
    pending_body: list[bytes]
    pending_size: int
    req_complete: bool
    upstream_blocked: bool

    @property
    def down(self) -> BodyDownstream: ...
    def dispatch(self) -> None: ...
    def fail(self, status: int, reason: str, kind: str, response: bytes = b"") -> None: ...
    def abandon_upstream(self) -> None: ...
    def _replay(self) -> None: ...
    def _drop_buffer(self) -> None: ...
    def _restart_body_rate(self, now: float) -> None: ...


class RequestBody:
    """The request-body phase of an exchange: framing, proxy-body-size, request
    buffering, the bytes held while connecting and the minimum body rate's base."""

    __slots__ = ()
    # (Slots of the Exchange, declared for the type checker.)
    buffer: BodyBuffer | None
    req: RequestHead | None

    def hold_dispatch(self: _Bodied) -> None:
        """Request buffering: dispatch waits for the body's last byte (refused when
        the buffers cannot take a body of its announced length)."""
        req = self.req
        assert req is not None
        try:
            self.ctx.buffers.check(req.content_length)
        except BufferRefused as exc:
            self.fail(exc.status, exc.reason, exc.kind)
            return
        if not self.dispatch_held:
            self.dispatch_held = True
            if req.expect_continue:
                # The body is for the proxy now: it invites it itself (as nginx
                # does); the upstream's own 100 is not passed on.
                self.down.informational(100)

    def request_body(self: _Bodied, data: bytes) -> bytes:
        """Forward request body bytes; returns what follows the body (next request)."""
        self.last_client = self.loop.time()
        self.body_received += len(data)
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
                    self.down.abort()
                else:
                    self.abandon_upstream()
                    self.req = None
                    self.down.refuse(exc)
                return b""
            if self.body_limit and reader.payload > self.body_limit:
                # proxy-body-size crossed by the chunk sizes announced: 413 (or an
                # abort once the answer started), nothing more relayed.
                self.fail(413, bodylimit.reason(self.body_limit), bodylimit.KIND)
                return b""
            if used < len(data):
                rest = data[used:]
            if reader.done:
                self.req_complete = True
        upstream = self.upstream
        if upstream is not None:
            upstream.writelines(out)
        elif self.buffer is not None:
            try:
                self.buffer.write(out)
            except BufferRefused as exc:
                self.fail(exc.status, exc.reason, exc.kind)
                return b""
            if self.req_complete and self.dispatch_held:
                self.dispatch_held = False
                self.dispatch()
        else:
            self.pending_body.extend(out)
            self.pending_size += len(data)
            if self.pending_size > PENDING_HIGH_WATER:
                self.down.pause_reading(flow.CONNECTING)
        return rest

    def _restart_body_rate(self: _Bodied, now: float) -> None:
        self.upstream_blocked = False
        self.body_rate_from = now
        self.body_rate_base = self.body_received

    def upstream_paused(self: _Bodied, paused: bool) -> None:
        """The upstream's write buffer is full (True) or took its bytes (False)."""
        self.last_client = now = self.loop.time()
        if paused:
            self.upstream_blocked = True
        else:
            self._restart_body_rate(now)
        if paused:
            self.down.pause_reading(flow.PEER)
        else:
            self.down.resume_reading(flow.PEER)
            if self.buffer is not None and self.req_complete:
                self._replay()

    def _replay(self: _Bodied) -> None:
        """The buffered body to the upstream while it takes it (`upstream_paused`
        resumes it); at its end the buffer is freed and the upstream told (an
        empty write: the HTTP/2 bridge ends its stream)."""
        buffer = self.buffer
        upstream = self.upstream
        while buffer is not None and upstream is not None and not self.upstream_blocked:
            data = buffer.read()
            if not data:
                self._drop_buffer()
                upstream.writelines([])
                return
            upstream.writelines([data])
            upstream = self.upstream
            buffer = self.buffer

    def _drop_buffer(self: _Bodied) -> None:
        buffer = self.buffer
        if buffer is not None:
            self.buffer = None
            buffer.close()
