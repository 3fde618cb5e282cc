"""The HTTP/1.1 upstream protocol: one connection to an endpoint, one exchange at a time.

`UpstreamConnection` is a thin asyncio Protocol: one TCP (or reencrypt TLS)
connection to an endpoint carrying one exchange at a time. It moves bytes and
parses the upstream's response heads with `http1`; every decision about the
response (framing, extras, keep-alive, retry) is its `exchange.Exchange`'s.
The two talk through methods only:

- the Exchange calls `begin(exchange, reused, sent_at, request)` when it
  takes the connection and sends its request, `write`/`writelines`/`write_eof`
  for the rest of it,
  `pause_reading`/`resume_reading` for flow control, and at the end
  `release(reusable, now)` (pooled when reusable and the upstream did not ask
  to close, otherwise closed; a `SingleUseConnection` always closes) or `abort()`;
- the connection calls the Exchange back: `response_head`, `informational`,
  `switching` (a 101), `response_data`, `relay_data`, `relay_eof`,
  `upstream_closed`, `upstream_paused`.

The Exchange is seen through `H1User`, the interface below (as the Exchange
sees its client through `exchange.Downstream`). Idle connections wait in
`pool.Pool`.
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

from waygate.core import flow
from waygate.proxy import http1
from waygate.proxy.http1 import BadMessage, ResponseHead
from waygate.proxy.metrics import ProxyMetrics
from waygate.proxy.pool import Pool
from waygate.proxy.routing import Target

# A head shorter than this is within both head limits (request line, whole head).
_SHORT_HEAD = http1.MAX_REQUEST_LINE - 4


class Host(Protocol):
    """What an upstream connection uses of the proxy (`context.ExchangeContext` is one)."""

    upstreams: set[Any]
    metrics: ProxyMetrics
    pool: Pool[Any]


class H1User(Protocol):
    """What an `UpstreamConnection` calls back on the exchange it carries."""

    loop: asyncio.AbstractEventLoop

    def response_head(self, response: ResponseHead, rest: bytes, now: float) -> bytes | None: ...
    def informational(self, response: ResponseHead, size: int) -> str: ...
    def switching(self, response: ResponseHead, rest: bytes) -> bool: ...
    def response_data(self, data: bytes, now: float) -> None: ...
    def relay_data(self, data: bytes) -> None: ...
    def relay_eof(self) -> bool: ...
    def upstream_closed(self, relay: bool, got_bytes: bool, reused: bool) -> None: ...
    def upstream_failed(self, status: int, reason: str, kind: str) -> None: ...
    def upstream_paused(self, paused: bool) -> None: ...


class UpstreamConnection(asyncio.Protocol):
    """One connection to an endpoint; carries one exchange at a time."""

    __slots__ = (
        "buf",
        "closed",
        "counted",
        "ctx",
        "exchange",
        "flow",
        "got_bytes",
        "idle_since",
        "pool_key",
        "relay",
        "response",
        "reused",
        "sent_at",
        "target",
        "transport",
    )

    def __init__(self, ctx: Host, target: Target) -> None:
        self.ctx = ctx
        self.target = target
        # Where the pool keeps it when idle: the endpoint, with the route's
        # upstream_scope for a reencrypt connection (set by the connect step).
        self.pool_key: Any = target
        self.transport: asyncio.Transport | None = None
        self.flow: flow.FlowControl | None = None
        self.exchange: H1User | None = None
        self.idle_since = 0.0
        # Whether it is counted in the pool's per-endpoint bound (Pool.reserve).
        self.counted = False
        self.buf = b""
        self.response: ResponseHead | None = None
        self.reused = False
        self.got_bytes = False
        self.closed = False
        self.relay = False
        self.sent_at = 0.0

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        transport.set_write_buffer_limits(high=flow.HIGH_WATER, low=flow.LOW_WATER)
        self.flow = flow.FlowControl(transport)
        self.ctx.upstreams.add(self)
        self.ctx.metrics.upstream_connections = len(self.ctx.upstreams)
        self.counted = self.ctx.pool.reserve(self.target, force=True)

    # ------------------------------------------------------------ the H1User's calls

    def begin(
        self, exchange: H1User, reused: bool, sent_at: float, request: bytes | list[bytes]
    ) -> None:
        """`exchange` takes this connection and sends `request` (its head, or the
        head and the body bytes that came with it) on it."""
        self.exchange = exchange
        self.reused = reused
        self.got_bytes = False
        self.buf = b""
        self.response = None
        self.sent_at = sent_at
        if isinstance(request, bytes):
            if request:  # empty: the head went with the connect (a tunnel's early data)
                self.transport.write(request)  # type: ignore[union-attr]
        else:
            self.transport.writelines(request)  # type: ignore[union-attr]

    def write(self, data: bytes) -> None:
        self.transport.write(data)  # type: ignore[union-attr]

    def writelines(self, pieces: list[bytes]) -> None:
        self.transport.writelines(pieces)  # type: ignore[union-attr]

    def write_eof(self) -> bool:
        transport = self.transport
        if transport is not None and transport.can_write_eof():
            transport.write_eof()
            return True
        return False

    def pause_reading(self) -> None:
        """The client stopped reading: so does this connection (core.flow, reason PEER)."""
        if self.flow is not None:
            self.flow.pause(flow.PEER)

    def resume_reading(self) -> None:
        if self.flow is not None:
            self.flow.resume(flow.PEER)

    def release(self, reusable: bool, now: float = 0.0) -> None:
        """The exchange is over: pooled when `reusable` and the upstream keeps it open."""
        response = self.response
        self.exchange = None
        self.response = None
        transport = self.transport
        if (
            reusable
            and response is not None
            and response.keep_alive
            and not self.closed
            and transport is not None
        ):
            if self.flow is not None and self.flow.reasons:
                self.flow.resume(flow.PEER)  # idle in the pool: a peer close must be seen
            if not self.ctx.pool.put(self, now):
                self.close()
        else:
            self.close()

    def close(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()

    def abort(self) -> None:
        self.exchange = None
        if self.transport is not None:
            self.transport.abort()

    # ------------------------------------------------------------ protocol

    def data_received(self, data: bytes) -> None:
        exchange = self.exchange
        if exchange is None:
            # Bytes on an idle connection: the framing is off; never reuse it
            # (out of the pool now, so no request can take it before it closes).
            self.ctx.pool.discard(self)
            self.abort()
            return
        self.got_bytes = True
        if self.relay:
            exchange.relay_data(data)
            return
        now = exchange.loop.time()
        if self.response is not None:
            exchange.response_data(data, now)
            return
        if self.buf:
            data = self.buf + data
            self.buf = b""
        # Response heads (here, not in a method of their own: one frame less per
        # response): 1xx to the H1User, which drops or forwards them, then the final
        # one; the bytes after it are body.
        while True:
            end = data.find(b"\r\n\r\n")
            if 0 <= end < _SHORT_HEAD:
                end += 4  # a short head is within every size limit: nothing to check
            else:
                try:
                    end = http1.find_head_end(data, response=True)
                except BadMessage as exc:
                    self._broken(exchange, exc.reason)
                    return
            if end < 0:
                self.buf = data
                return
            head, data = data[:end], data[end:]
            try:
                response = http1.parse_response_head(head)
            except BadMessage as exc:
                self._broken(exchange, exc.reason)
                return
            if response.status < 200:
                if response.status == 101:
                    if exchange.switching(response, data):
                        self.relay = True
                        return
                    self._broken(exchange, "upstream switched protocols without an upgrade request")
                    return
                broken = exchange.informational(response, end)
                if broken:
                    self._broken(exchange, broken)
                    return
                continue
            self.response = response
            rest = exchange.response_head(response, data, now)
            if rest is not None and self.exchange is not None and self.response is not None:
                exchange.response_data(rest, now)
            return

    def _broken(self, exchange: H1User, reason: str) -> None:
        exchange.upstream_failed(502, reason, "bad_response")

    def eof_received(self) -> bool | None:
        exchange = self.exchange
        if self.relay and exchange is not None and exchange.relay_eof():
            return True
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        ctx = self.ctx
        ctx.upstreams.discard(self)
        ctx.metrics.upstream_connections = len(ctx.upstreams)
        exchange = self.exchange
        self.exchange = None
        if self.counted:
            self.counted = False
            ctx.pool.unreserve(self.target)
        if exchange is None:
            ctx.pool.discard(self)
            return
        exchange.upstream_closed(self.relay, self.got_bytes, self.reused)

    def pause_writing(self) -> None:
        if self.exchange is not None:
            self.exchange.upstream_paused(True)

    def resume_writing(self) -> None:
        if self.exchange is not None:
            self.exchange.upstream_paused(False)


class SingleUseConnection(UpstreamConnection):
    """A connection that carries one exchange and is closed after it, never pooled:
    HTTP/1.0 to the backend (ingress-nginx proxy-http-version 1.0, `http10`)."""

    __slots__ = ()

    def release(self, reusable: bool, now: float = 0.0) -> None:
        super().release(False, now)
