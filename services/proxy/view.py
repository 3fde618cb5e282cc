"""The proxy's view of the world for one resolver view: every request-time table, built once.

`ProxyView.build(resolver_view, previous, settings)` turns one resolver view
(routes, services, endpoints) into one immutable object the request path only
reads: the HTTP routing table (`routing.RouteTable`: hosts, paths, Gateway
API sides, backends with their endpoints, sticky cookies, and each backend's
`http2` flag, computed by `routing.backend_speaks_http2` with the same
namespace and port rules that give the backend its endpoints), the passive
health of endpoints (carried over from `previous`, as pickers are) and the
trace sample ratio. An HTTP/2 stream and an HTTP/1.1 request look their route
up in it once (`decision.decide`). A new resolver view builds a new
ProxyView, swapped in whole (`server.ProxyServer.set_view`).

The TLS front's tables (passthrough by SNI, certificates by SNI) and the
Gateway listeners' sides are built beside it in `app.py` from the same
resolver view: they need the listeners' bound state (ports), which is not
the request path's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

from waygate.proxy.routing import Defaults, PassiveHealth, RouteTable, build_table


class ViewSettings(NamedTuple):
    """What a ProxyView is built with besides the resolver's view (from the settings)."""

    defaults: Defaults
    cookie_key: bytes
    trace_ratio: float = 0.0
    # Gateway listener port -> its side (None: 80 plain, 443 TLS).
    listener_ports: Mapping[int, Any] | None = None
    gateway: str = ""  # "NS/NAME": serve only that Gateway's routes


class ProxyView:
    """One immutable set of request-time tables (see the module docstring)."""

    __slots__ = ("health", "table", "trace_ratio")

    def __init__(self, table: RouteTable, health: PassiveHealth, trace_ratio: float) -> None:
        self.table = table
        # Endpoints whose connects fail, skipped for a while: state that outlives
        # views (carried over), the only part of a view that is not frozen.
        self.health = health
        self.trace_ratio = trace_ratio

    @classmethod
    def empty(cls, health: PassiveHealth, trace_ratio: float = 0.0) -> ProxyView:
        return cls(RouteTable.empty(), health, trace_ratio)

    @classmethod
    def build(cls, resolver_view: Any, previous: ProxyView, settings: ViewSettings) -> ProxyView:
        """The tables of `resolver_view` (routes, endpoints, services); pickers and
        passive health carried over from `previous`."""
        table = build_table(
            resolver_view.routes,
            resolver_view.endpoints,
            resolver_view.services,
            defaults=settings.defaults,
            cookie_key=settings.cookie_key,
            previous=previous.table,
            listener_ports=settings.listener_ports,
            gateway=settings.gateway,
        )
        return cls(table, previous.health, settings.trace_ratio)

    def with_table(self, table: RouteTable) -> ProxyView:
        """This view with another routing table (tests and benchmarks build tables alone)."""
        return ProxyView(table, self.health, self.trace_ratio)
