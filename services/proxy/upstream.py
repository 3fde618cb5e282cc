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

`Dialer.open` is `connect` for callers that can take a transport instead of
a socket (the HTTP/1.1 upstream step without reencrypt): a tunnel endpoint
then comes back as the tunnel's data connection itself (`Attachable`:
`attach(protocol)` makes it that protocol's transport), so the bytes go from
the client's connection to the tunnel server's in one relay, with no
socketpair in between. Callers that need a socket (reencrypt TLS, HTTP/2,
passthrough, mirrors) keep `connect`.

The connections themselves, and the pool of idle ones, are in `pool.py`.
"""

from __future__ import annotations

import asyncio
import errno
import socket
from collections.abc import Awaitable
from typing import Protocol

from waygate.proxy.routing import Target


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


class Attachable(Protocol):
    """A connection the connect step holds as a transport already (see the docstring)."""

    def attach(self, protocol: asyncio.BaseProtocol) -> None: ...
    def close(self) -> None: ...


class OpenConnect(Protocol):
    def __call__(
        self, target: Target, timeout: float, trace_context: str | None
    ) -> Awaitable[socket.socket | Attachable]: ...


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

    def __init__(
        self,
        direct: Connect = tcp_connect,
        tunnel: Connect | None = None,
        tunnel_open: OpenConnect | None = None,
    ) -> None:
        self.direct = direct
        self.tunnel = tunnel
        self.tunnel_open = tunnel_open  # a tunnel step that may return a transport

    async def open(
        self, target: Target, timeout: float, trace_context: str | None
    ) -> socket.socket | Attachable:
        """`connect`, but a tunnel endpoint may come back as a transport (`Attachable`)."""
        if target.tunnel and self.tunnel_open is not None:
            return await self.tunnel_open(target, timeout, trace_context)
        return await self.connect(target, timeout, trace_context)

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
