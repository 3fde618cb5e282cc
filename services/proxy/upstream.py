"""The upstream-connect step and the per-endpoint connection pool.

The connect step is one interface, so the TLS issue (reencrypt) and the
tunnel's dial client replace it without touching the data path:

    async def connect(target: Target, timeout: float, trace_context: str | None)
        -> socket.socket | Attachable

It returns a connected, non-blocking socket (a direct endpoint), or a
connection that already is a transport (`Attachable`: a tunnel endpoint comes
back as the tunnel's data connection itself, so the bytes go from the client's
connection to the tunnel server's in one relay, with no socketpair in
between). It raises `ConnectError` with a short reason and a `retryable`
flag: True only when nothing at all reached the endpoint (refused, timed out,
unreachable), which is what allows a redispatch to another endpoint.
`trace_context` is the W3C traceparent of the request's span, or None when
unsampled.

`Dialer` chooses the step per target: endpoints the resolver marks `tunnel`
go through `Dialer.tunnel` (None until the tunnel lands: such a request gets
502 with the reason); every other endpoint through `Dialer.direct`.

`start` is the one way every caller (HTTP/1.1 and HTTP/2 upstreams,
reencrypt, passthrough, mirrors) turns what the step returned into its
protocol, with TLS to the backend when asked: over a socket, the loop's own
TLS transport; over an `Attachable`, its `start_tls` (TLS inside the
tunnel's mTLS: the backend's certificate is verified by the proxy, end to
end; the tunnel only carries the records).

The connections themselves, and the pool of idle ones, are in `pool.py`.
"""

from __future__ import annotations

import asyncio
import errno
import socket
import ssl
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, TypeVar

from waygate.proxy.routing import Target


class ConnectError(Exception):
    """The connect step failed; `reason` is short and safe to show a client."""

    def __init__(self, reason: str, kind: str, *, retryable: bool) -> None:
        super().__init__(reason)
        self.reason = reason
        self.kind = kind  # metric label: refused, timeout, unreachable, tunnel, error
        self.retryable = retryable


class Attachable(Protocol):
    """A connection the connect step holds as a transport already (see the docstring).

    `attach(protocol)` makes it `protocol`'s transport (connection_made, then any
    bytes the endpoint sent first); `start_tls` returns the TLS connection inside
    it, not yet attached, the handshake done within `timeout` (ssl.SSLError with
    the verification's own code when it failed, TimeoutError, ConnectionError);
    `close` and `abort` cut it (with a reset: an unfinished exchange is no clean
    end)."""

    def attach(self, protocol: asyncio.BaseProtocol) -> None: ...
    def close(self) -> None: ...
    def abort(self) -> None: ...
    def get_extra_info(self, name: str, default: Any = None) -> Any: ...
    async def start_tls(
        self, context: ssl.SSLContext, server_hostname: str, timeout: float
    ) -> Attachable: ...


Connection = socket.socket | Attachable


class Connect(Protocol):
    def __call__(
        self, target: Target, timeout: float, trace_context: str | None
    ) -> Awaitable[Connection]: ...


class EarlyConnect(Protocol):
    """A connect step that can send the request's first bytes with the connect itself (the
    tunnel's early data, `waygate.tunnel.early`): (the connection, whether it sent them).
    `replay_safe`: the bytes may reach the endpoint twice (an idempotent request), so a
    connect that failed after sending them may be retried."""

    def __call__(
        self,
        target: Target,
        timeout: float,
        trace_context: str | None,
        early: bytes,
        replay_safe: bool,
    ) -> Awaitable[tuple[Connection, bool]]: ...


P = TypeVar("P", bound=asyncio.BaseProtocol)


async def start(
    connection: Connection,
    factory: Callable[[], P],
    *,
    tls: ssl.SSLContext | None = None,
    server_hostname: str | None = None,
    timeout: float | None = None,
) -> tuple[Any, P]:
    """(transport, protocol): `factory`'s protocol on `connection`, over TLS when `tls`
    is given (handshake within `timeout`). The connection is closed when this fails
    or is cancelled. The transport answers `get_extra_info` (ssl_object) and `abort`."""
    if isinstance(connection, socket.socket):
        loop = asyncio.get_running_loop()
        try:
            if tls is None:
                return await loop.create_connection(factory, sock=connection)
            return await loop.create_connection(
                factory,
                sock=connection,
                ssl=tls,
                server_hostname=server_hostname,
                ssl_handshake_timeout=timeout,
            )
        except BaseException:
            connection.close()
            raise
    if tls is not None:
        # The handshake failing or cancelled aborts the connection it runs in.
        connection = await connection.start_tls(tls, server_hostname or "", timeout or 10.0)
    protocol = factory()
    connection.attach(protocol)
    return connection, protocol


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
        tunnel_early: EarlyConnect | None = None,
    ) -> None:
        self.direct = direct
        self.tunnel = tunnel
        # The tunnel's connect with early data; None: request heads go after the connect.
        self.tunnel_early = tunnel_early

    async def connect_early(
        self,
        target: Target,
        timeout: float,
        trace_context: str | None,
        early: bytes,
        replay_safe: bool,
    ) -> tuple[Connection, bool]:
        """`connect`, handing `early` to a tunnel endpoint's dial where the tunnel step
        takes it: (the connection, whether `early` went with it; if not, the caller
        sends it as usual)."""
        if target.tunnel and self.tunnel_early is not None:
            return await self.tunnel_early(target, timeout, trace_context, early, replay_safe)
        return await self.connect(target, timeout, trace_context), False

    async def connect(
        self, target: Target, timeout: float, trace_context: str | None
    ) -> Connection:
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
