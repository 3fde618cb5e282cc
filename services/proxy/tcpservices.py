"""TCP services: ports the proxy binds and relays, byte for byte, to a Service's endpoints.

A TCP service is a route whose listener_protocol is TCP (ingress-nginx's
--tcp-services-configmap entries, waygate.resolver.ingress_nginx.tcpservices):
its `listener_port` is bound on the proxy's bind address, and each accepted
connection is relayed to a ready endpoint of its one backend, picked by the
route's balancing policy (the proxy's routing table: `routing.build_table`,
one picker per route, carried over between views). The relay is the
passthrough's (`passthrough.Relay`: backpressure both ways, half-close, idle
timeout); the PROXY protocol (`proxyproto`) is read from the client first
and/or written to the backend first, as the route says.

Invariants:
- A proxy of one Gateway (--gateway) serves none (it serves no Ingress either).
- Binding is synchronous, per view: a port that cannot be bound is reported
  (the status page, `waygate_proxy_tcp_service_up{port} 0`, a warning once
  per reason) and tried again on each view and every RETRY seconds; the other
  ports are served.
- Every connection is bounded: at most `max_connections` per port at once
  (more are closed on accept and counted), a PROXY header within
  HEADER_TIMEOUT and `proxyproto.MAX_V2` bytes, a connect within the route's
  connect timeout, and the route's tunnel timeout of inactivity.
- A port no route names any more stops accepting at once; its connections get
  `drain` seconds, then are closed. `close` does the same for every port.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import socket
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import Counter, Gauge

from waygate.core.statuspage import Section, cell
from waygate.proxy import proxyproto
from waygate.proxy.listeners import _why as bind_problem
from waygate.proxy.passthrough import Relay, bind_listener, drain_relays
from waygate.proxy.routing import Defaults, RouteTable, build_table
from waygate.proxy.upstream import ConnectError, start
from waygate.resolver.client import TCP_LISTENER, Route

log = logging.getLogger(__name__)

#: How long a client has to send its PROXY protocol header.
HEADER_TIMEOUT = 5.0
#: How often ports that could not be bound are tried again, and idle relays swept.
RETRY = 5.0
SWEEP = 1.0

TCP_CONNECTIONS = Counter(
    "waygate_proxy_tcp_connections_total",
    "connections to TCP service ports by what became of them: relayed, over_limit, "
    "bad_proxy_header, no_endpoint, connect_failed",
    ["port", "outcome"],
)
TCP_ACTIVE = Gauge(
    "waygate_proxy_tcp_active_connections", "relays open on a TCP service port", ["port"]
)
TCP_UP = Gauge(
    "waygate_proxy_tcp_service_up",
    "1 while a TCP service port is bound, 0 if it cannot be",
    ["port"],
)


def tcp_routes(routes: Iterable[Route]) -> dict[int, Route]:
    """The admitted TCP services by port."""
    return {
        route.listener_port: route
        for route in routes
        if route.listener_protocol == TCP_LISTENER
        and route.listener_port
        and (route.status is None or route.status.admitted)
    }


def _host(port: int) -> bytes:
    # The key a TCP service's entry is found under in its own routing table.
    return f"tcp-{port}.invalid".encode()


class CountedRelay(Relay):
    """A relay that holds its endpoint's in-flight count while it lasts: least-conn
    balancing sees long-lived TCP connections, not only their connects."""

    def __init__(self, owner: Any, timeout: float, picker: Any, target: Any) -> None:
        super().__init__(owner, timeout)
        picker.acquire(target)
        self._held: tuple[Any, Any] | None = (picker, target)

    def _give_back(self) -> None:
        if self._held is not None:
            picker, target = self._held
            self._held = None
            picker.release(target)

    def close(self) -> None:
        self._give_back()
        super().close()

    def abort(self) -> None:
        self._give_back()
        super().abort()


class TcpPort:
    """One bound TCP service port: accepts, relays; `relays` and `loop` are what
    `passthrough.Relay` needs of its owner."""

    def __init__(self, owner: TcpServices, port: int, sock: socket.socket) -> None:
        self.owner = owner
        self.port = port
        self.label = str(port)
        self.key = _host(port)
        self.sock = sock
        self.loop = owner.loop
        self.route: Route | None = None
        self.relays: set[Relay] = set()
        self.pending: set[asyncio.Task[None]] = set()
        self.accepting: asyncio.Task[None] | None = self.loop.create_task(self._accept())

    def stop_accepting(self) -> None:
        if self.accepting is not None:
            self.accepting.cancel()
            self.accepting = None
        self.sock.close()

    async def drain(self, grace: float) -> None:
        self.stop_accepting()
        await drain_relays(self, self.pending, grace)
        TCP_ACTIVE.labels(self.label).set(0)

    async def _accept(self) -> None:
        limit = self.owner.max_connections
        while True:
            try:
                conn, _ = await self.loop.sock_accept(self.sock)
            except OSError as exc:
                log.warning("TCP service accept failed", extra={"error": exc.strerror or str(exc)})
                await asyncio.sleep(0.1)
                continue
            if len(self.relays) + len(self.pending) >= limit:
                TCP_CONNECTIONS.labels(self.label, "over_limit").inc()
                conn.close()
                continue
            conn.setblocking(False)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            task = self.loop.create_task(self._serve(conn))
            self.pending.add(task)
            task.add_done_callback(self.pending.discard)

    async def _serve(self, conn: socket.socket) -> None:
        try:
            await self._relay(conn)
        except (OSError, EOFError, TimeoutError, ConnectionError):
            conn.close()
        except BaseException:
            conn.close()
            raise

    async def _header(self, conn: socket.socket) -> tuple[proxyproto.Header, bytes]:
        """The client's PROXY header and the bytes after it, within the bounds."""
        data = b""
        async with asyncio.timeout(HEADER_TIMEOUT):
            while True:
                chunk = await self.loop.sock_recv(conn, 4096)
                if not chunk:
                    return proxyproto.Header(proxyproto.INVALID, reason="closed"), b""
                data += chunk
                header = proxyproto.read(data)
                if header.status != proxyproto.NEED_MORE:
                    return header, data[header.length :]

    async def _relay(self, conn: socket.socket) -> None:
        route = self.route
        entry = self.owner.table.lookup(self.key, b"/")
        if route is None or entry is None:
            conn.close()
            return
        peer = conn.getpeername()
        local = conn.getsockname()
        addresses = proxyproto.Addresses(peer[0], peer[1], local[0], local[1])
        early = b""
        if route.proxy_protocol_from_client:
            try:
                header, early = await self._header(conn)
            except TimeoutError:
                header = proxyproto.Header(proxyproto.INVALID, reason="timeout")
            if header.status != proxyproto.OK:
                TCP_CONNECTIONS.labels(self.label, "bad_proxy_header").inc()
                conn.close()
                return
            addresses = header.addresses or addresses
        server = self.owner.server
        target, backend = entry.pick(addresses.source.encode(), None, server.health, None)
        if target is None or backend is None:
            TCP_CONNECTIONS.labels(self.label, "no_endpoint").inc()
            conn.close()
            return
        try:
            upstream = await server.dialer.connect(target, entry.options.connect_timeout, None)
        except ConnectError as exc:
            server.health.failed(target)
            TCP_CONNECTIONS.labels(self.label, "connect_failed").inc()
            log.warning(
                "TCP service connect failed", extra={"port": self.port, "reason": exc.reason}
            )
            conn.close()
            return
        server.health.succeeded(target)
        relay = CountedRelay(self, entry.options.tunnel_timeout, backend.picker, target)
        self.relays.add(relay)
        try:
            transport, _ = await start(upstream, lambda: relay.backend)
            if route.proxy_protocol_to_backend:
                transport.write(self.owner.encode(addresses))
            if early:
                transport.write(early)
            await self.loop.connect_accepted_socket(lambda: relay.client, conn)
        except BaseException:
            relay.abort()
            upstream.close()
            conn.close()
            raise
        TCP_CONNECTIONS.labels(self.label, "relayed").inc()


class TcpServices:
    """Every TCP service port of the proxy, laid out again on each resolver view."""

    def __init__(
        self,
        server: Any,
        host: str,
        *,
        defaults: Defaults,
        cookie_key: bytes,
        max_connections: int,
        drain: float,
        proxy_protocol_version: int = 1,
        reuse_port: bool = False,
        serve: bool = True,
    ) -> None:
        self.server = server  # the ProxyServer: dialer and passive health
        self.host = host
        self.defaults = defaults
        self.cookie_key = cookie_key
        self.max_connections = max_connections
        self.drain_grace = drain
        self.encode: Callable[[proxyproto.Addresses], bytes] = proxyproto.encoder(
            proxy_protocol_version
        )
        self.reuse_port = reuse_port
        # False: a proxy of one Gateway (--gateway) serves no TCP services (no Ingress either).
        self.serve = serve
        self.loop = asyncio.get_running_loop()
        self.table = RouteTable.empty()
        self.ports: dict[int, TcpPort] = {}
        self.failed: dict[int, str] = {}  # port -> why it cannot be bound
        self.routes: dict[int, Route] = {}
        self.draining: set[asyncio.Task[None]] = set()
        self._last: Any = None
        self._sweeper: asyncio.TimerHandle | None = self.loop.call_later(SWEEP, self._sweep)
        self._next_retry = self.loop.time() + RETRY

    def on_view(self, view: Any) -> None:
        """The view's TCP services: ports bound or closed, the table rebuilt."""
        self._last = view
        self.routes = tcp_routes(view.routes.values()) if self.serve else {}
        chosen = {
            route.key: dataclasses.replace(
                route, host=_host(port).decode(), listener_port=0, listener_protocol=""
            )
            for port, route in self.routes.items()
        }
        self.table = build_table(
            chosen,
            view.endpoints,
            view.services,
            defaults=self.defaults,
            cookie_key=self.cookie_key,
            previous=self.table,
        )
        self._bind()

    def _bind(self) -> None:
        for port in [p for p in self.ports if p not in self.routes]:
            self._retire(self.ports.pop(port))
        for port in [p for p in self.failed if p not in self.routes]:
            del self.failed[port]
            TCP_UP.remove(str(port))
        for port, route in self.routes.items():
            bound = self.ports.get(port)
            if bound is None:
                try:
                    sock = bind_listener(self.host, port, reuse_port=self.reuse_port)
                except OSError as exc:
                    why = bind_problem(port, exc)
                    if self.failed.get(port) != why:
                        log.warning("TCP service port not bound", extra={"port": port, "why": why})
                    self.failed[port] = why
                    TCP_UP.labels(str(port)).set(0)
                    continue
                self.failed.pop(port, None)
                bound = self.ports[port] = TcpPort(self, port, sock)
                TCP_UP.labels(str(port)).set(1)
                log.info("proxy listening", extra={"tcp_service_port": port})
            bound.route = route

    def _retire(self, bound: TcpPort) -> None:
        bound.stop_accepting()
        TCP_UP.remove(bound.label)
        task = self.loop.create_task(bound.drain(self.drain_grace))
        self.draining.add(task)
        task.add_done_callback(self.draining.discard)

    def _sweep(self) -> None:
        now = self.loop.time()
        for bound in self.ports.values():
            for relay in [r for r in bound.relays if now - r.last > r.timeout]:
                relay.close()
            TCP_ACTIVE.labels(bound.label).set(len(bound.relays))
        if self.failed and now >= self._next_retry:
            self._next_retry = now + RETRY
            self._bind()
        self._sweeper = self.loop.call_later(SWEEP, self._sweep)

    async def close(self, grace: float | None = None) -> None:
        """Stop every port; connections get `grace` (default: the drain bound)."""
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        ports, self.ports = list(self.ports.values()), {}
        for bound in ports:
            TCP_UP.remove(bound.label)
        wait = self.drain_grace if grace is None else grace
        await asyncio.gather(*(b.drain(wait) for b in ports), *self.draining)
        for port in list(self.failed):
            with contextlib.suppress(KeyError):
                TCP_UP.remove(str(port))
        self.failed.clear()

    def sections(self) -> list[Section]:
        """The status page's TCP services: per port, its service, endpoints, connections
        (none when the view has no TCP service)."""
        if not self.routes:
            return []
        rows: list[list[Any]] = []
        bad = False
        for port, route in sorted(self.routes.items()):
            backend = route.backends[0] if route.backends else None
            service = (
                f"{backend.namespace or route.namespace}/{backend.service}:{backend.port}"
                if backend
                else ""
            )
            entry = self.table.lookup(_host(port), b"/")
            targets = [t for b in entry.backends for t in b.picker.targets] if entry else []
            bound = self.ports.get(port)
            proxy = "/".join(
                side
                for side, on in (
                    ("from client", route.proxy_protocol_from_client),
                    ("to backend", route.proxy_protocol_to_backend),
                )
                if on
            )
            bad = bad or bound is None or not targets
            rows.append(
                [
                    port,
                    service,
                    cell(len(targets), "ok" if targets else "bad"),
                    len(bound.relays) if bound else 0,
                    proxy or "no",
                    cell("listening", "ok")
                    if bound
                    else cell(self.failed.get(port, "not bound"), "bad"),
                ]
            )
        return [
            Section(
                "TCP services",
                ("port", "service", "endpoints", "connections", "PROXY protocol", "state"),
                rows,
                state="bad" if bad else "ok",
                empty="no TCP services",
            )
        ]
