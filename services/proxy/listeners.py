"""Gateway listeners on ports of their own, and what the proxy reports about them.

`--listener-ports` maps Gateway listener ports to the proxy's HTTP and HTTPS
ports (default 80 -> HTTP, 443 -> HTTPS; a listener on the proxy's own HTTP or
HTTPS port number is served there). A Gateway listener on any other port is
bound as is once routes for it arrive: an HTTP listener gets a plain
listener of its own on that port, an HTTPS or TLS listener a TLS front of its
own (`passthrough.TlsFront`: TLSRoutes of that port relayed by SNI, the rest
terminated with the HTTPS port's certificates). Their connections look routes
up on that listener's own side of the table (`routing.ListenerSide`), so port
8081's routes never answer on port 80 nor the other way round. An HTTPS
listener whose port maps to the plain HTTP port is not served (never HTTPS
routes in clear text).

What cannot be served is reported, never only logged: the full state of every
Gateway listener port the proxy has routes for goes to the resolver
(`ReportListeners`, through `waygate.resolver.client.report_listeners`)
whenever it changes, and the resolver shows a listener some proxy cannot serve
as Programmed=False with the reason ("port 8081 is in use"), in
`waygate gateways` and in the Gateway's Kubernetes status.

Invariants:
- Binding is synchronous (bind and listen on a socket before the table that
  names the port is built), so a table never has a side whose port failed.
- A port no route uses any more is closed; a port that failed is tried again
  on each resolver view and every RETRY seconds, so freeing it heals.
- The report stream holds one channel per attempt and reconnects with backoff;
  a resolver that is away costs only the report, never the serving.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from typing import Any

from waygate.core.backoff import Backoff
from waygate.proxy.accept import ClientProtocol, plain_protocol
from waygate.proxy.http1 import client_context
from waygate.proxy.passthrough import TlsFront, bind_listener
from waygate.proxy.routing import ListenerSide
from waygate.resolver.client import ListenerState, Route, keep_reporting, report_listeners

log = logging.getLogger(__name__)

#: How often ports that failed to bind are tried again without a new view.
RETRY = 5.0
PORT_UNAVAILABLE = "PortUnavailable"


class _ListenerProtocol(ClientProtocol):
    """An accepted connection on a Gateway listener's own port: HTTP/1.1 or h2c whose
    routes are that listener's (its `side`), its X-Forwarded-Port that port."""

    def __init__(self, server: Any, side: ListenerSide, proxied: Any = None) -> None:
        super().__init__(server, proxied=proxied)
        self.side = side

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        # Plain: the HTTP/1.1 connection waiting for its first bytes; TLS: the
        # HTTP/1.1 or HTTP/2 connection ALPN chose, already handed the transport.
        connection = self.h1 if self.h1 is not None else transport.get_protocol()
        if connection is None or connection is self or getattr(connection, "closed", False):
            return
        connection.secure = self.side
        connection.context = client_context(
            transport, self.proxied, self.side.port, self.side.secure
        )


class _Bound:
    """One own port: a plain HTTP server, or a TLS front (SNI, passthrough, terminate)."""

    __slots__ = ("front", "server", "side", "sock", "task")

    def __init__(self, sock: socket.socket, side: ListenerSide) -> None:
        self.sock = sock
        self.side = side
        self.server: asyncio.AbstractServer | None = None
        self.front: TlsFront | None = None
        # The task creating `server` (plain ports): cancelled if the port is closed first.
        self.task: asyncio.Task[None] | None = None


def _why(port: int, exc: OSError) -> str:
    if exc.errno == errno.EADDRINUSE:
        return f"port {port} is in use"
    if exc.errno == errno.EACCES:
        return f"port {port} is not permitted (a port below 1024 needs CAP_NET_BIND_SERVICE)"
    return f"port {port} cannot be bound: {exc.strerror or exc}"


class GatewayListeners:
    """The Gateway listener ports one proxy serves, binds and reports."""

    def __init__(
        self,
        server: Any,
        host: str,
        mapped: Mapping[int, bool],
        local_ports: Callable[[], tuple[int, int]],
        *,
        gateway: str = "",
        reuse_port: bool = False,
        certificates: Any = None,
    ) -> None:
        self.server = server
        # The HTTPS port's EdgeCertificates: TLS listeners' own ports share them (None:
        # HTTPS and TLS listeners are served on mapped ports only).
        self.certificates = certificates
        self.reuse_port = reuse_port
        self.host = host
        self.mapped = dict(mapped)
        self._local_ports = local_ports  # (HTTP port, HTTPS port) as bound
        self.gateway = gateway
        self._bound: dict[int, _Bound] = {}
        # (gateway, port, protocol) of the last view's Gateway routes.
        self._wanted: set[tuple[str, int, str]] = set()
        self._failed: dict[int, str] = {}
        self._secure: set[int] = set()
        self.changed = asyncio.Event()
        self._last: tuple[ListenerState, ...] = ()
        # Closed TLS fronts' drains, referenced until they end.
        self._draining: set[asyncio.Task[None]] = set()

    # ------------------------------------------------------------ per view

    def sides(self, routes: Iterable[Route]) -> dict[int, Any]:
        """Bind the own ports these routes need and close the rest; the listener port ->
        table side map for `routing.build_table`."""
        wanted: set[tuple[str, int, str]] = set()
        for route in routes:
            if not route.gateway or not route.listener_port:
                continue
            if self.gateway and route.gateway != self.gateway:
                continue
            wanted.add((route.gateway, route.listener_port, route.listener_protocol or "HTTP"))
        self._wanted = wanted
        mapped = self._mapping()
        # Own port -> whether TLS is terminated there (an HTTPS or TLS listener's).
        own: dict[int, bool] = {}
        for _, port, protocol in wanted:
            if port in mapped or (protocol != "HTTP" and self.certificates is None):
                continue
            own[port] = own.get(port, False) or protocol != "HTTP"
        for port in [p for p, b in self._bound.items() if own.get(p) != b.side.secure]:
            self._unbind(port)
        for port in sorted(set(own) - set(self._bound)):
            self._try_bind(port, own[port])
        self._secure = {port for port, secure in own.items() if secure}
        for port in [p for p in self._failed if p not in own]:
            del self._failed[port]
        sides: dict[int, Any] = dict(mapped)
        sides.update({port: bound.side for port, bound in self._bound.items()})
        self._publish()
        return sides

    def _mapping(self) -> dict[int, bool]:
        """--listener-ports, and the proxy's own ports as themselves: a listener on
        the port the proxy serves HTTP (HTTPS) on is served there, not bound twice."""
        mapped = dict(self.mapped)
        http_port, https_port = self._local_ports()
        for port, secure in ((http_port, False), (https_port, True)):
            if port and port not in mapped:
                mapped[port] = secure
        return mapped

    def retry(self) -> bool:
        """Try the failed ports again; True when one is bound now (build the table anew)."""
        healed = False
        for port in list(self._failed):
            if self._try_bind(port, port in self._secure):
                healed = True
        self._publish()
        return healed

    def _try_bind(self, port: int, secure: bool) -> bool:
        try:
            # --workers: every worker binds the same listener port, as the HTTP port.
            sock = bind_listener(self.host, port, reuse_port=self.reuse_port)
        except OSError as exc:
            reason = _why(port, exc)
            if self._failed.get(port) != reason:
                log.warning(
                    "Gateway listener port not served", extra={"port": port, "reason": reason}
                )
            self._failed[port] = reason
            return False
        self._failed.pop(port, None)
        side = ListenerSide(port, secure)
        bound = self._bound[port] = _Bound(sock, side)
        server = self.server
        log.info("proxy listening", extra={"gateway_listener_port": port, "tls": secure})
        if secure:
            bound.front = TlsFront(
                server,
                self.certificates,
                self.host,
                port,
                protocol=lambda proxied: _ListenerProtocol(server, side, proxied),
            )
            bound.front.serve(sock)
            return True

        async def serve() -> None:
            # Not serving yet: creating the server has no await with `sock` given, so
            # either `bound.server` is set or `_unbind` cancelled this before it ran
            # (and closed the socket itself): never a server nobody closes.
            bound.server = await asyncio.get_running_loop().create_server(
                plain_protocol(server, lambda proxied: _ListenerProtocol(server, side, proxied)),
                sock=sock,
                backlog=1024,
                start_serving=False,
            )
            await bound.server.start_serving()

        bound.task = asyncio.get_running_loop().create_task(serve())
        bound.task.add_done_callback(_log_failure)
        return True

    def _unbind(self, port: int) -> None:
        bound = self._bound.pop(port)
        if bound.front is not None:
            # The port is free at once; its relays end with it (terminated
            # connections belong to the server).
            bound.front.stop_accepting()
            task = asyncio.get_running_loop().create_task(bound.front.drain(0.0))
            self._draining.add(task)
            task.add_done_callback(self._draining.discard)
            task.add_done_callback(_log_failure)
            return
        if bound.task is not None:
            # Closed before serve() ran: it must not run on a closed socket.
            bound.task.cancel()
        if bound.server is not None:
            bound.server.close()
        else:
            bound.sock.close()

    def fronts(self) -> dict[int, TlsFront]:
        """The TLS fronts of own ports (each gets the passthrough routes of its port)."""
        return {port: b.front for port, b in self._bound.items() if b.front is not None}

    def close(self) -> None:
        for port in list(self._bound):
            self._unbind(port)

    # ------------------------------------------------------------ the report

    def states(self) -> tuple[ListenerState, ...]:
        http_port, https_port = self._local_ports()
        mapped = self._mapping()
        out = []
        for gateway, port, protocol in sorted(self._wanted):
            local, reason, message = 0, "", ""
            if (
                port in mapped
                and protocol in ("HTTP", "HTTPS")
                and (protocol == "HTTPS") != mapped[port]
            ):
                side = "HTTPS" if mapped[port] else "HTTP"
                right = http_port if protocol == "HTTP" else https_port
                reason = PORT_UNAVAILABLE
                message = (
                    f"port {port} maps to the proxy's {side} port: an {protocol} listener is "
                    f"not served there (--listener-ports {port}={right})"
                )
            elif port in mapped:
                local = https_port if mapped[port] else http_port
            elif protocol != "HTTP" and self.certificates is None:
                reason = PORT_UNAVAILABLE
                message = (
                    f"{protocol} listeners are served on the proxy's HTTPS port only: map "
                    f"port {port} to it (--listener-ports {port}={https_port})"
                )
            elif port in self._bound:
                local = port
            else:
                reason = PORT_UNAVAILABLE
                message = self._failed.get(port, f"port {port} is not bound")
            out.append(ListenerState(gateway, port, protocol, local, reason, message))
        return tuple(out)

    def _publish(self) -> None:
        states = self.states()
        if states != self._last:
            self._last = states
            self.changed.set()

    async def reports(self) -> AsyncIterator[list[ListenerState]]:
        """Full states: from the first Gateway route on (a proxy without any opens no
        stream), then on each change."""
        while not self._wanted:
            self.changed.clear()
            await self.changed.wait()
        while True:
            self.changed.clear()
            yield list(self.states())
            await self.changed.wait()

    async def run(self, on_healed: Callable[[], None]) -> None:
        """Every RETRY seconds, the ports that failed are tried again; when one binds,
        `on_healed` rebuilds the table so its routes are served."""
        while True:
            await asyncio.sleep(RETRY)
            if self._failed and self.retry():
                on_healed()


class ListenerReporter:
    """Keeps one ReportListeners stream to the resolver open, reconnecting with backoff."""

    def __init__(
        self,
        listeners: GatewayListeners,
        channel: Callable[[], Any],
        proxy: str,
        *,
        backoff: Backoff | None = None,
    ) -> None:
        self.listeners = listeners
        self._channel = channel  # an async context manager holding a channel
        self.proxy = proxy
        self._backoff = backoff or Backoff(initial=0.2, maximum=10.0)

    async def run(self) -> None:
        await keep_reporting(
            self._channel,
            lambda channel: report_listeners(channel, self.proxy, self._reports()),
            self._backoff,
            what="Gateway listener report",
        )

    async def _reports(self) -> AsyncIterator[list[ListenerState]]:
        async for states in self.listeners.reports():
            self._backoff.reset()
            yield states


def _log_failure(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("Gateway listener failed to serve", exc_info=task.exception())
