"""The relay phase of an HTTP/1.1 exchange, after the upstream's 101 (Switching Protocols).

`UpgradeRelay` is a mixin of `exchange.Exchange` (its state lives in the
Exchange's slots): once the upstream switches protocols for a request that
asked to upgrade (WebSocket and others), bytes go both ways as they come,
each side's half-close is passed on, the relay is idle for at most the
route's tunnel timeout, then both sides are closed and the request is
recorded as 101. HTTP/1.1 only: an HTTP/2 stream never asks to upgrade (RFC
8441's extended CONNECT is not served). It uses of its driver only the
`RelayDownstream` calls, of its upstream only `write` and `write_eof` and
`release`, and nothing per chunk beyond a clock read and a count.
"""

from __future__ import annotations

from typing import Any, Protocol

from waygate.proxy.context import ExchangeContext
from waygate.proxy.http1 import RequestHead, ResponseHead
from waygate.proxy.routing import RouteEntry
from waygate.proxy.upstream_h1 import UpstreamConnection


class RelayDownstream(Protocol):
    """What the relay phase needs of the exchange's driver (`exchange.Downstream`)."""

    def start_relay(self, response: ResponseHead, rest: bytes) -> None: ...
    def relay_write(self, data: bytes) -> None: ...
    def relay_eof(self) -> bool: ...
    def relay_closed(self) -> None: ...


class _Relaying(Protocol):
    """What the relay phase uses of its exchange (`exchange.Exchange`)."""

    ctx: ExchangeContext
    loop: Any
    req: RequestHead | None
    entry: RouteEntry | None
    upstream: UpstreamConnection | Any
    response_started: bool
    status: int
    last_client: float
    last_up: float

    @property
    def down(self) -> RelayDownstream: ...
    def _record(self, route: str, req: RequestHead, status: int) -> None: ...
    def _release_pick(self) -> None: ...


class UpgradeRelay:
    """The relay phase of an exchange, after the upstream's 101 (Switching Protocols):
    bytes both ways as they come (WebSocket and other upgrades), each side's
    half-close passed on, idle for at most the route's tunnel timeout, then both
    sides closed and the request recorded as 101. HTTP/1.1 only: an HTTP/2
    stream never asks to upgrade (RFC 8441's extended CONNECT is not served)."""

    __slots__ = ()
    # (Slots of the Exchange, declared for the type checker.)
    req: RequestHead | None
    upstream: UpstreamConnection | None

    def switching(self: _Relaying, response: ResponseHead, rest: bytes) -> bool:
        """The upstream's 101: True when the relay starts (the request asked to upgrade)."""
        req = self.req
        if req is None or not req.upgrade:
            return False
        self.response_started = True
        self.status = 101
        self.last_client = self.last_up = self.loop.time()
        if not response.upgrade:
            response.upgrade = req.upgrade
        self.down.start_relay(response, rest)
        return True

    def relay_send_eof(self: _Relaying) -> bool:
        """The client half-closed during a relay: so does the upstream (True when it could)."""
        upstream = self.upstream
        return upstream is not None and upstream.write_eof()

    def relay_timer(self: _Relaying, now: float) -> float:
        """The delay until a relay's next idle check, or -1 when it was idle too long."""
        entry = self.entry
        limit = entry.options.tunnel_timeout if entry else 3600.0
        idle = now - max(self.last_client, self.last_up)
        return -1.0 if idle >= limit else limit - idle

    def relay_eof(self: _Relaying) -> bool:
        """The upstream half-closed during a relay: so does the client (True when it could)."""
        return self.down.relay_eof()

    def relay_data(self: _Relaying, data: bytes) -> None:
        self.last_up = self.loop.time()
        self.ctx.metrics.bytes_out += len(data)
        self.down.relay_write(data)

    def relay_send(self: _Relaying, data: bytes) -> None:
        """Client bytes during a relay."""
        upstream = self.upstream
        if upstream is not None:
            self.last_client = self.loop.time()
            upstream.write(data)

    def release_relay(self: _Relaying) -> None:
        """The driver ends a relay both sides have finished: the upstream is closed
        (gracefully: bytes still queued for it go first), the request recorded."""
        entry = self.entry
        req = self.req
        if entry is not None and req is not None:
            self._record(entry.options.name, req, 101)
            self.req = None
        upstream = self.upstream
        self.upstream = None
        if upstream is not None:
            upstream.release(False)
        self._release_pick()

    def relay_closed(self: _Relaying) -> None:
        entry = self.entry
        req = self.req
        if entry is not None and req is not None:
            self._record(entry.options.name, req, 101)
            self.req = None
        self.upstream = None
        self._release_pick()
        self.down.relay_closed()
