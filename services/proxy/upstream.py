"""The upstream-connect step and the per-endpoint connection pool.

The connect step is one interface, so the TLS issue (reencrypt) and the
tunnel's dial client replace it without touching the data path:

    async def connect(target: Target, timeout: float, trace_context: str | None)
        -> socket.socket

It returns a connected, non-blocking socket (a tunnel dialer may hand back one
end of a `socket.socketpair()` whose other end it bridges to its stream) and
raises `ConnectError` with a short reason and a `retryable` flag: True only
when nothing at all reached the endpoint (refused, timed out, unreachable),
which is what allows a redispatch to another endpoint. `trace_context` is the
W3C traceparent of the request's span, or None when unsampled.

`Dialer` chooses the step per target: endpoints the resolver marks `tunnel`
go through `Dialer.tunnel` (None until the tunnel lands: such a request gets
502 with the reason); every other endpoint through `Dialer.direct`.

`Pool` keeps idle keep-alive connections per endpoint (and, for reencrypt
connections, per the TLS the route asked for: `routing.upstream_scope`, so a
connection is only reused for what it was verified and presented as): at
most `max_idle` each, closed after `idle_timeout` (swept once a second, so the request path
only reads the clock) and dropped at once when the endpoint leaves the
routing table. A connection goes back only when its response framing was
clean (see server.py); one the peer closes while idle removes itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import socket
from collections.abc import Awaitable, Callable, Hashable
from typing import TYPE_CHECKING, Protocol

from waygate.proxy.routing import Target

if TYPE_CHECKING:
    from waygate.proxy.server import UpstreamConnection


class ConnectError(Exception):
    """The connect step failed; `reason` is short and safe to show a client."""

    def __init__(self, reason: str, kind: str, *, retryable: bool) -> None:
        super().__init__(reason)
        self.reason = reason
        self.kind = kind  # metric label: refused, timeout, unreachable, tunnel, error
        self.retryable = retryable


class Connect(Protocol):
    def __call__(
        self, target: Target, timeout: float, trace_context: str | None
    ) -> Awaitable[socket.socket]: ...


async def tcp_connect(target: Target, timeout: float, trace_context: str | None) -> socket.socket:
    """A direct TCP connection (TCP_NODELAY), within `timeout` seconds."""
    loop = asyncio.get_running_loop()
    family = socket.AF_INET6 if ":" in target.address else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setblocking(False)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    where = f"{target.address}:{target.port}"
    try:
        async with asyncio.timeout(timeout):
            await loop.sock_connect(sock, (target.address, target.port))
    except TimeoutError:
        sock.close()
        raise ConnectError(
            f"connect to {where} timed out after {timeout:g}s", "timeout", retryable=True
        ) from None
    except ConnectionRefusedError:
        sock.close()
        raise ConnectError(f"connection refused by {where}", "refused", retryable=True) from None
    except OSError as exc:
        sock.close()
        unreachable = exc.errno in (errno.ENETUNREACH, errno.EHOSTUNREACH, errno.EADDRNOTAVAIL)
        raise ConnectError(
            f"cannot connect to {where}: {exc.strerror or exc}",
            "unreachable" if unreachable else "error",
            retryable=unreachable,
        ) from None
    except BaseException:
        sock.close()
        raise
    return sock


class Dialer:
    """Direct connects, or the tunnel dialer for endpoints marked `tunnel`."""

    def __init__(self, direct: Connect = tcp_connect, tunnel: Connect | None = None) -> None:
        self.direct = direct
        self.tunnel = tunnel

    async def connect(
        self, target: Target, timeout: float, trace_context: str | None
    ) -> socket.socket:
        if target.tunnel:
            if self.tunnel is None:
                raise ConnectError(
                    f"endpoint {target.address}:{target.port} is on edge node "
                    f"{target.node or '?'} and reachable only through a tunnel, "
                    "which this proxy has no dialer for yet",
                    "tunnel",
                    retryable=False,
                )
            return await self.tunnel(target, timeout, trace_context)
        return await self.direct(target, timeout, trace_context)


class Pool:
    """Idle upstream connections per pool key (endpoint, or endpoint and TLS scope)."""

    def __init__(
        self,
        *,
        max_idle: int,
        idle_timeout: float,
        clock: Callable[[], float],
    ) -> None:
        self.max_idle = max_idle
        self.idle_timeout = idle_timeout
        self._clock = clock
        # Idle connections per pool key: the endpoint (Target), or (Target, scope)
        # for reencrypt connections (UpstreamConnection.pool_key).
        self._idle: dict[Hashable, list[UpstreamConnection]] = {}

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
