"""Gateway listeners on ports of their own, and what the proxy reports about them.

`--listener-ports` maps Gateway listener ports to the proxy's HTTP and HTTPS
ports (default 80 -> HTTP, 443 -> HTTPS; a listener on the proxy's own HTTP or
HTTPS port number is served there). A Gateway listener on any other port is
bound as is once routes for it arrive: an HTTP listener gets a plain
listener of its own on that port, whose connections look routes up on that
listener's own side of the table (`routing.ListenerSide`), so port 8081's
routes never answer on port 80 nor the other way round. HTTPS and TLS
listeners are served on the HTTPS port only, so one on a port that is not
mapped is not served.

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

import grpc

from waygate.core.backoff import Backoff
from waygate.proxy.http1 import ForwardedContext
from waygate.proxy.http2 import ClientProtocol
from waygate.proxy.routing import ListenerSide
from waygate.resolver.client import ListenerState, Route, report_listeners

log = logging.getLogger(__name__)

#: How often ports that failed to bind are tried again without a new view.
RETRY = 5.0
PORT_UNAVAILABLE = "PortUnavailable"


class _ListenerProtocol(ClientProtocol):
    """An accepted connection on a Gateway listener's own port: HTTP/1.1 or h2c whose
    routes are that listener's (its `side`), its X-Forwarded-Port that port."""

    def __init__(self, server: Any, side: ListenerSide) -> None:
        super().__init__(server)
        self.side = side

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        h1 = self.h1
        if h1 is not None and not h1.closed:
            h1.secure = self.side
            peer = transport.get_extra_info("peername")
            h1.context = ForwardedContext(peer[0] if peer else "unknown", self.side.port)


class _Bound:
    __slots__ = ("server", "side", "sock")

    def __init__(self, sock: socket.socket, side: ListenerSide) -> None:
        self.sock = sock
        self.side = side
        self.server: asyncio.AbstractServer | None = None


def _bind(host: str, port: int, reuse_port: bool) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            # --workers: every worker binds the same listener port, as the HTTP port.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
        sock.listen(1024)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


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
    ) -> None:
        self.server = server
        self.reuse_port = reuse_port
        self.host = host
        self.mapped = dict(mapped)
        self._local_ports = local_ports  # (HTTP port, HTTPS port) as bound
        self.gateway = gateway
        self._bound: dict[int, _Bound] = {}
        # (gateway, port, protocol) of the last view's Gateway routes.
        self._wanted: set[tuple[str, int, str]] = set()
        self._failed: dict[int, str] = {}
        self.changed = asyncio.Event()
        self._last: tuple[ListenerState, ...] = ()

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
        own = {port for _, port, protocol in wanted if port not in mapped and protocol == "HTTP"}
        for port in [p for p in self._bound if p not in own]:
            self._unbind(port)
        for port in sorted(own - set(self._bound)):
            self._try_bind(port)
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
            if self._try_bind(port):
                healed = True
        self._publish()
        return healed

    def _try_bind(self, port: int) -> bool:
        try:
            sock = _bind(self.host, port, self.reuse_port)
        except OSError as exc:
            reason = _why(port, exc)
            if self._failed.get(port) != reason:
                log.warning(
                    "Gateway listener port not served", extra={"port": port, "reason": reason}
                )
            self._failed[port] = reason
            return False
        self._failed.pop(port, None)
        side = ListenerSide(port)
        bound = self._bound[port] = _Bound(sock, side)
        server = self.server

        async def serve() -> None:
            bound.server = await asyncio.get_running_loop().create_server(
                lambda: _ListenerProtocol(server, side), sock=sock, backlog=1024
            )

        task = asyncio.get_running_loop().create_task(serve())
        task.add_done_callback(_log_failure)
        log.info("proxy listening", extra={"gateway_listener_port": port})
        return True

    def _unbind(self, port: int) -> None:
        bound = self._bound.pop(port)
        if bound.server is not None:
            bound.server.close()
        else:
            bound.sock.close()

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
            elif protocol != "HTTP":
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
        while True:
            try:
                async with self._channel() as channel:
                    await report_listeners(channel, self.proxy, self._reports())
            except grpc.aio.AioRpcError as exc:
                log.warning(
                    "Gateway listener report failed",
                    extra={"error": f"{exc.code().name}: {exc.details()}"},
                )
            await asyncio.sleep(self._backoff.next_delay())

    async def _reports(self) -> AsyncIterator[list[ListenerState]]:
        async for states in self.listeners.reports():
            self._backoff.reset()
            yield states


def _log_failure(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("Gateway listener failed to serve", exc_info=task.exception())
