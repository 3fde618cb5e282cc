"""The per-endpoint bound on upstream connections and the pool of idle HTTP/1.1 ones.

`Pool` keeps idle keep-alive connections (`upstream_h1.UpstreamConnection`)
per endpoint (and, for reencrypt connections, per the TLS the route asked
for: `routing.upstream_scope`, so a connection is only reused for what it was
verified and presented as): at most `max_idle` each, closed after
`idle_timeout` (swept once a second, so the request path only reads the
clock) and dropped at once when the endpoint leaves the routing table. A
connection goes back only when its response framing was clean (the Exchange
decides); one the peer closes while idle removes itself.

It also keeps the endpoint's bound, `max_per_endpoint`, that HTTP/1.1 and
HTTP/2 upstream connections share: a connect in progress holds a reservation
(`reserve`/`unreserve`), an open connection counts itself; at the bound a
request waits in the endpoint's queue (`wait`, woken by `wake`) or is refused.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Callable, Hashable
from typing import Any, Generic, Protocol, TypeVar

from waygate.proxy.routing import Target


class PooledConnection(Protocol):
    """What the pool reads of an idle connection (`upstream_h1.UpstreamConnection`)."""

    target: Target
    pool_key: Any
    idle_since: float
    closed: bool

    @property
    def transport(self) -> Any: ...
    def close(self) -> None: ...


UpstreamConnection = TypeVar("UpstreamConnection", bound=PooledConnection)


class Pool(Generic[UpstreamConnection]):
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
