"""The proxy's view of the world for one resolver view: every table, built once, swapped whole.

`ProxyView.build(resolver_view, previous, settings)` turns one resolver view
(routes, services, endpoints) and the listener set it is served on
(`ViewSettings.listener_ports`, `ViewSettings.own_tls_ports`: which Gateway
listener ports are bound) into one immutable object:

- `table`: the HTTP routing table (`routing.RouteTable`: hosts, paths, Gateway
  API sides, backends with their endpoints, sticky cookies, and each
  backend's `http2` flag, computed by `routing.backend_speaks_http2` with the
  same namespace and port rules that give the backend its endpoints);
- `passthrough`: the TLS fronts' passthrough tables by SNI, keyed by front
  (`HTTPS_FRONT`, 0, for the HTTPS port; a Gateway TLS listener's own port
  for its front), each routing only the routes that front serves;
- `certificates`: the edge certificates by SNI (`tls.SniCertificates`, built
  by the TLS front's `tls.EdgeCertificates`; None without one);
- `listener_sides`: the Gateway listeners' sides by listener port;
- `reencrypt_routes`: the routes with an upstream TLS scope
  (`routing.upstream_scope`: reencrypt), the reencrypt step keeps its
  sessions and its backends' certificates for these only (`upstream_tls`);
- `whole_hosts`: per side, the hosts whose first route takes every request
  (`routing.RouteTable.whole_hosts`), routed by `decision.decide` without a lookup;
- `health`: the passive health of endpoints and `trace_ratio`.

Per-endpoint state outlives views: the pickers (with their in-flight counts)
of every table are carried over from `previous`'s table of the same kind, and
the passive health object is `previous`'s. A request, an HTTP/2 stream and a
TLS connection read the view they started with (an HTTP/2 stream looks its
route up once, `decision.decide`). `server.ProxyServer.set_view` swaps the
one object; it runs on the loop, so no request sees two views' tables.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

from waygate.proxy.routing import (
    Defaults,
    PassiveHealth,
    RouteEntry,
    RouteTable,
    Side,
    build_table,
    upstream_scope,
)
from waygate.resolver.client import BalancePolicy, Route, TLSTermination

# The passthrough table of the proxy's HTTPS port (other keys: a TLS listener's own port).
HTTPS_FRONT = 0


class ViewSettings(NamedTuple):
    """What a ProxyView is built with besides the resolver's view: the settings, and
    the listener set (which ports are bound) the view is served on."""

    defaults: Defaults
    cookie_key: bytes
    trace_ratio: float = 0.0
    # Gateway listener port -> its side (None: 80 plain, 443 TLS).
    listener_ports: Mapping[int, Any] | None = None
    gateway: str = ""  # "NS/NAME": serve only that Gateway's routes
    # The Gateway TLS listener ports bound on their own (each has its own front).
    own_tls_ports: frozenset[int] = frozenset()
    # tls.EdgeCertificates: builds the certificates by SNI (None: no TLS front).
    edge: Any = None


def is_passthrough(route: Route) -> bool:
    return route.tls is not None and route.tls.termination == TLSTermination.PASSTHROUGH


def passthrough_table(
    routes: Mapping[Any, Route],
    endpoints: Any,
    services: Any,
    *,
    defaults: Defaults,
    cookie_key: bytes,
    previous: RouteTable | None,
    ports: Callable[[int], bool] | None = None,
) -> RouteTable:
    """The passthrough routes as a routing table (host -> backends), balanced by source
    unless the route says otherwise; the HTTP table leaves them out. `ports`: only the
    routes whose listener port it accepts (a front of a Gateway listener's own port)."""
    chosen = {
        key: dataclasses.replace(
            route,
            tls=None,
            # A Gateway TLS listener's routes: this listener serves them all.
            listener_port=0,
            balance=route.balance
            if route.balance != BalancePolicy.DEFAULT
            else BalancePolicy.SOURCE,
        )
        for key, route in routes.items()
        if is_passthrough(route) and (ports is None or ports(route.listener_port))
    }
    return build_table(
        chosen, endpoints, services, defaults=defaults, cookie_key=cookie_key, previous=previous
    )


_EMPTY: Mapping[Any, Any] = {}


class ProxyView:
    """One immutable set of tables (see the module docstring)."""

    __slots__ = (
        "certificates",
        "health",
        "listener_sides",
        "passthrough",
        "reencrypt_routes",
        "table",
        "trace_ratio",
        "whole_hosts",
    )

    def __init__(
        self,
        table: RouteTable,
        health: PassiveHealth,
        trace_ratio: float,
        *,
        passthrough: Mapping[int, RouteTable] = _EMPTY,
        certificates: Any = None,
        listener_sides: Mapping[int, Any] = _EMPTY,
        reencrypt_routes: tuple[Route, ...] = (),
    ) -> None:
        self.table = table
        # Per side, the hosts one route takes whatever the request (RouteTable.whole_hosts):
        # decide routes them without a lookup.
        self.whole_hosts: Mapping[Side, Mapping[bytes, RouteEntry]] = table.whole_hosts()
        # Endpoints whose connects fail, skipped for a while: state that outlives
        # views (carried over), the only part of a view that is not frozen.
        self.health = health
        self.trace_ratio = trace_ratio
        self.passthrough = passthrough
        self.certificates = certificates  # tls.SniCertificates (None: no TLS front)
        self.listener_sides = listener_sides
        self.reencrypt_routes = reencrypt_routes

    @classmethod
    def empty(cls, health: PassiveHealth, trace_ratio: float = 0.0) -> ProxyView:
        return cls(RouteTable.empty(), health, trace_ratio)

    @classmethod
    def build(cls, resolver_view: Any, previous: ProxyView, settings: ViewSettings) -> ProxyView:
        """Every table of `resolver_view` on the listener set `settings` names; pickers
        (in-flight counts) and passive health carried over from `previous`."""
        routes = resolver_view.routes
        endpoints = resolver_view.endpoints
        services = resolver_view.services
        table = build_table(
            routes,
            endpoints,
            services,
            defaults=settings.defaults,
            cookie_key=settings.cookie_key,
            previous=previous.table,
            listener_ports=settings.listener_ports,
            gateway=settings.gateway,
        )
        own = settings.own_tls_ports

        def front_table(key: int, ports: Callable[[int], bool]) -> RouteTable:
            return passthrough_table(
                routes,
                endpoints,
                services,
                defaults=settings.defaults,
                cookie_key=settings.cookie_key,
                previous=previous.passthrough.get(key),
                ports=ports,
            )

        # TLS listeners on their own ports are served there only.
        passthrough = {HTTPS_FRONT: front_table(HTTPS_FRONT, lambda port: port not in own)}
        for own_port in own:
            passthrough[own_port] = front_table(own_port, own_port.__eq__)
        certificates = None
        if settings.edge is not None:
            # A route another one's claim keeps out serves no certificate for its host.
            certificates = settings.edge.build(
                [r for r in routes.values() if r.status is None or r.status.admitted],
                keys_withheld=resolver_view.route_keys_withheld,
            )
        return cls(
            table,
            previous.health,
            settings.trace_ratio,
            passthrough=passthrough,
            certificates=certificates,
            listener_sides=dict(settings.listener_ports or {}),
            reencrypt_routes=tuple(r for r in routes.values() if upstream_scope(r) is not None),
        )

    def replace(self, **changes: Any) -> ProxyView:
        """This view with some tables replaced (tests and benchmarks build tables alone)."""
        fields = {name: getattr(self, name) for name in self.__slots__ if name != "whole_hosts"}
        fields.update(changes)
        table = fields.pop("table")
        health = fields.pop("health")
        trace_ratio = fields.pop("trace_ratio")
        return ProxyView(table, health, trace_ratio, **fields)

    def with_table(self, table: RouteTable) -> ProxyView:
        """This view with another routing table (tests and benchmarks build tables alone)."""
        return self.replace(table=table)
