"""Upstream HTTP/1.1 connections and the per-endpoint pool of idle ones.

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
  to close, otherwise closed) or `abort()`;
- the connection calls the Exchange back: `response_head`, `informational`,
  `switching` (a 101), `response_data`, `relay_data`, `relay_eof`,
  `upstream_closed`, `upstream_paused`.

`Pool` keeps idle keep-alive connections per endpoint (and, for reencrypt
connections, per the TLS the route asked for: `routing.upstream_scope`, so a
connection is only reused for what it was verified and presented as): at
most `max_idle` each, closed after `idle_timeout` (swept once a second, so the
request path only reads the clock) and dropped at once when the endpoint
leaves the routing table. A connection goes back only when its response
framing was clean (the Exchange decides); one the peer closes while idle
removes itself.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING, Any

from waygate.core import flow
from waygate.proxy import http1
from waygate.proxy.http1 import BadMessage, ResponseHead
from waygate.proxy.routing import Target

if TYPE_CHECKING:
    from waygate.proxy.exchange import Exchange
    from waygate.proxy.server import ProxyServer

# A head shorter than this is within both head limits (request line, whole head).
_SHORT_HEAD = http1.MAX_REQUEST_LINE - 4


class UpstreamConnection(asyncio.Protocol):
    """One connection to an endpoint; carries one exchange at a time."""

    __slots__ = (
        "buf",
        "closed",
        "counted",
        "exchange",
        "flow",
        "got_bytes",
        "idle_since",
        "pool_key",
        "relay",
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
        self.flow: flow.FlowControl | None = None
        self.exchange: Exchange | None = None
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
        self.server.upstreams.add(self)
        self.server.metrics.upstream_connections = len(self.server.upstreams)
        self.counted = self.server.pool.reserve(self.target, force=True)

    # ------------------------------------------------------------ the Exchange's calls

    def begin(
        self, exchange: Exchange, reused: bool, sent_at: float, request: bytes | list[bytes]
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
            if not self.server.pool.put(self, now):
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
            self.server.pool.discard(self)
            self.abort()
            return
        self.got_bytes = True
        if self.relay:
            exchange.relay_data(data)
            return
        now = exchange.loop.time()
        if self.response is None:
            if self.buf:
                data = self.buf + data
                self.buf = b""
            rest = self._head(exchange, data, now)
            if rest is None or self.exchange is None or self.response is None:
                return
            data = rest
        exchange.response_data(data, now)

    def _head(self, exchange: Exchange, data: bytes, now: float) -> bytes | None:
        """Parse response heads (1xx to the Exchange, which drops or forwards them)
        and hand over the final one; returns the rest (None: nothing more to do)."""
        while True:
            end = data.find(b"\r\n\r\n")
            if 0 <= end < _SHORT_HEAD:
                end += 4  # a short head is within every size limit: nothing to check
            else:
                try:
                    end = http1.find_head_end(data, response=True)
                except BadMessage as exc:
                    self._broken(exchange, exc.reason)
                    return None
            if end < 0:
                self.buf = data
                return None
            head, data = data[:end], data[end:]
            try:
                response = http1.parse_response_head(head)
            except BadMessage as exc:
                self._broken(exchange, exc.reason)
                return None
            if response.status < 200:
                if response.status == 101:
                    if exchange.switching(response, data):
                        self.relay = True
                        return None
                    self._broken(exchange, "upstream switched protocols without an upgrade request")
                    return None
                broken = exchange.informational(response, end)
                if broken:
                    self._broken(exchange, broken)
                    return None
                continue
            self.response = response
            return exchange.response_head(response, data, now)

    def _broken(self, exchange: Exchange, reason: str) -> None:
        exchange.upstream_failed(502, reason, "bad_response")

    def eof_received(self) -> bool | None:
        exchange = self.exchange
        if self.relay and exchange is not None and exchange.relay_eof():
            return True
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        server = self.server
        server.upstreams.discard(self)
        server.metrics.upstream_connections = len(server.upstreams)
        exchange = self.exchange
        self.exchange = None
        if self.counted:
            self.counted = False
            server.pool.unreserve(self.target)
        if exchange is None:
            server.pool.discard(self)
            return
        exchange.upstream_closed(self.relay, self.got_bytes, self.reused)

    def pause_writing(self) -> None:
        if self.exchange is not None:
            self.exchange.upstream_paused(True)

    def resume_writing(self) -> None:
        if self.exchange is not None:
            self.exchange.upstream_paused(False)


class Pool:
    """Idle upstream connections per pool key (endpoint, or endpoint and TLS scope)."""

    def __init__(
        self,
        *,
        max_idle: int,
        idle_timeout: float,
        clock: Callable[[], float],
        max_per_endpoint: int = 0,
        max_queue: int = 0,
    ) -> None:
        self.max_idle = max_idle
        self.idle_timeout = idle_timeout
        self._clock = clock
        # Connections open or being opened per endpoint, busy and idle, bounded by
        # `max_per_endpoint` (0: unbounded, nothing counted); exchanges that find
        # their endpoint at the bound wait in a FIFO of at most `max_queue`.
        self.max_per_endpoint = max_per_endpoint
        self.max_queue = max_queue
        self.opened: dict[Target, int] = {}
        self.waiting: dict[Target, deque[Any]] = {}
        # Idle connections per pool key: the endpoint (Target), or (Target, scope)
        # for reencrypt connections (UpstreamConnection.pool_key).
        self._idle: dict[Hashable, list[UpstreamConnection]] = {}

    # ------------------------------------------------------------ per-endpoint bound

    def reserve(self, target: Target, *, force: bool = False) -> bool:
        """Count a connection about to be opened to `target` (or, `force`, one that
        opened: connections count themselves from connection_made to
        connection_lost); False when the endpoint is at its bound. Unbounded:
        True for a connect, False (nothing counted) for `force`."""
        if not self.max_per_endpoint:
            return not force
        count = self.opened.get(target, 0)
        if count >= self.max_per_endpoint and not force:
            return False
        self.opened[target] = count + 1
        return True

    def unreserve(self, target: Target) -> None:
        """A counted connection closed (or its connect failed): room for a waiter."""
        if not self.max_per_endpoint:
            return
        count = self.opened.get(target, 0) - 1
        if count > 0:
            self.opened[target] = count
        else:
            self.opened.pop(target, None)
        if count < self.max_per_endpoint:
            self.wake(target)

    def full(self, target: Target) -> str:
        """Why a request for `target` is refused at the bound with a full queue (503)."""
        return (
            f"endpoint {target.address}:{target.port} is at its limit of "
            f"{self.max_per_endpoint} connections and {self.max_queue} requests wait for it"
        )

    def wait(self, target: Target, exchange: Any) -> bool:
        """Queue `exchange` for a connection to `target`; False when the queue is full."""
        queue = self.waiting.get(target)
        if queue is None:
            queue = self.waiting[target] = deque()
        if len(queue) >= self.max_queue:
            return False
        queue.append(exchange)
        return True

    def cancel_wait(self, target: Target, exchange: Any) -> None:
        queue = self.waiting.get(target)
        if queue is not None:
            with contextlib.suppress(ValueError):
                queue.remove(exchange)
            if not queue:
                del self.waiting[target]

    def wake(self, target: Target) -> None:
        """An idle connection or room for one appeared: the first waiter goes on."""
        queue = self.waiting.get(target)
        if not queue:
            return
        exchange = queue.popleft()
        if not queue:
            del self.waiting[target]
        exchange.endpoint_free()

    # ------------------------------------------------------------ idle connections

    def take(
        self, key: Hashable, *, idle_at_most: float | None = None
    ) -> UpstreamConnection | None:
        """The most recently used idle connection kept under `key`, or None.

        `idle_at_most`: only a connection idle for less than that many seconds
        (for requests that may not be re-sent: a connection idle for long is the
        one an upstream's keep-alive timeout is about to close under us).
        """
        idle = self._idle.get(key)
        while idle:
            if idle_at_most is not None and self._clock() - idle[-1].idle_since > idle_at_most:
                return None
            connection = idle.pop()
            transport = connection.transport
            if not connection.closed and transport is not None and not transport.is_closing():
                return connection
        return None

    def put(self, connection: UpstreamConnection, now: float = 0.0) -> bool:
        """Keep `connection` idle; False (the caller closes it) when the pool is full.

        `now`: the clock's reading when the caller has one already.
        """
        key = connection.pool_key
        idle = self._idle.get(key)
        if idle is None:
            idle = self._idle[key] = []
        if len(idle) >= self.max_idle:
            return False
        connection.idle_since = now or self._clock()
        idle.append(connection)
        if self.waiting:
            self.wake(connection.target)
        return True

    def discard(self, connection: UpstreamConnection) -> None:
        idle = self._idle.get(connection.pool_key)
        if idle is not None:
            with contextlib.suppress(ValueError):
                idle.remove(connection)
            if not idle:
                del self._idle[connection.pool_key]

    def idle_count(self) -> int:
        return sum(len(v) for v in self._idle.values())

    def sweep(self) -> None:
        """Close connections idle past the timeout."""
        deadline = self._clock() - self.idle_timeout
        for key in list(self._idle):
            idle = self._idle[key]
            stale = [c for c in idle if c.idle_since <= deadline]
            for connection in stale:
                idle.remove(connection)
                connection.close()
            if not idle:
                del self._idle[key]

    def keep_only(self, alive: set[Target]) -> None:
        """Close idle connections to endpoints that left the routing table."""
        for key in [k for k, idle in self._idle.items() if idle and idle[0].target not in alive]:
            for connection in self._idle.pop(key):
                connection.close()

    def close_all(self) -> None:
        for idle in self._idle.values():
            for connection in idle:
                connection.close()
        self._idle.clear()
