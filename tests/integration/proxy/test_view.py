"""`view.ProxyView`: every table one resolver view needs, built once and swapped whole.

A view holds the HTTP routing table, the passthrough table of each TLS front
(the HTTPS port's and a Gateway TLS listener's own port's), the edge
certificates by SNI, the listener sides and the reencrypt routes. Building the
next one changes nothing that is served; `ProxyServer.set_view` switches every
table at once. Per-endpoint state (in-flight counts, passive health) survives
a view change. Real parts: a real ProxyServer on a socket, real TLS fronts,
real route certificates (tests.support.pki).
"""

from __future__ import annotations

from typing import Any

from tests.support.pki import LocalCA
from tests.support.proxyharness import endpoint, route, running_proxy
from waygate.proxy.passthrough import TlsFront
from waygate.proxy.routing import Defaults
from waygate.proxy.tls import DefaultCertificate, EdgeCertificates
from waygate.proxy.view import HTTPS_FRONT, ProxyView, ViewSettings
from waygate.resolver.client import View
from waygate.resolver.model import Endpoint, Route, RouteTLS, TLSTermination

OWN_TLS_PORT = 9443


def resolver_view(routes: list[Route], endpoints: list[Endpoint]) -> View:
    grouped: dict[tuple[str, str], tuple[Endpoint, ...]] = {}
    for ep in endpoints:
        grouped[ep.service_key] = (*grouped.get(ep.service_key, ()), ep)
    return View(
        version=1,
        epoch=1,
        source="test",
        last_sync=None,
        services={},
        endpoints=grouped,
        routes={r.key: r for r in routes},
        tunnels={},
    )


def passthrough(host: str, name: str, listener_port: int = 0) -> Route:
    tls = RouteTLS(termination=TLSTermination.PASSTHROUGH)
    return route(host, [("web", 100)], name=name, tls=tls, listener_port=listener_port)


def edge(host: str, name: str, ca: LocalCA) -> Route:
    cert, key = ca.issue(dns=[host])
    tls = RouteTLS(termination=TLSTermination.EDGE, certificate=cert.decode(), key=key.decode())
    return route(host, [("web", 100)], name=name, tls=tls)


def reencrypt(host: str, name: str, server_name: str) -> Route:
    tls = RouteTLS(termination=TLSTermination.REENCRYPT, destination_server_name=server_name)
    return route(host, [("web", 100)], name=name, tls=tls)


def settings(edge_certificates: Any, sides: dict[int, Any]) -> ViewSettings:
    return ViewSettings(
        Defaults(),
        b"k" * 32,
        listener_ports=sides,
        own_tls_ports=frozenset({OWN_TLS_PORT}),
        edge=edge_certificates,
    )


def served(front: TlsFront, host: str) -> bool:
    return front.table.lookup(host.encode(), b"/") is not None


async def test_a_view_change_swaps_every_table_at_once() -> None:
    ca = LocalCA()
    certificates = EdgeCertificates(DefaultCertificate.self_signed())
    default_context = certificates.context_for("nothing.test")
    one = resolver_view(
        [
            route("web.test", [("web", 100)], name="web"),
            passthrough("pass.test", "pass"),
            passthrough("own.test", "own", listener_port=OWN_TLS_PORT),
            edge("edge.test", "edge", ca),
            reencrypt("re.test", "re", "re.internal"),
        ],
        [endpoint("web", 8080)],
    )
    two = resolver_view(
        [
            route("web2.test", [("web", 100)], name="web2"),
            passthrough("pass2.test", "pass2"),
            edge("edge2.test", "edge2", ca),
        ],
        [endpoint("web", 8080)],
    )
    async with running_proxy() as (server, _):
        https = TlsFront(server, certificates, "127.0.0.1", 0)
        own = TlsFront(server, certificates, "127.0.0.1", OWN_TLS_PORT, protocol=lambda: None)  # type: ignore[arg-type,return-value]
        first = ProxyView.build(one, server.view, settings(certificates, {OWN_TLS_PORT: "own"}))
        server.set_view(first)
        assert server.table.lookup(b"web.test", b"/") is not None
        # Each front relays only its own passthrough routes.
        assert served(https, "pass.test") and not served(https, "own.test")
        assert served(own, "own.test") and not served(own, "pass.test")
        assert certificates.context_for("edge.test") is not default_context
        assert first.listener_sides == {OWN_TLS_PORT: "own"}
        assert [r.name for r in first.reencrypt_routes] == ["re"]

        second = ProxyView.build(two, server.view, settings(certificates, {}))
        # Built, not swapped: everything served is still the first view's.
        assert server.table.lookup(b"web.test", b"/") is not None
        assert served(https, "pass.test") and not served(https, "pass2.test")
        assert certificates.context_for("edge.test") is not default_context
        assert certificates.context_for("edge2.test") is default_context

        server.set_view(second)
        assert server.view is second
        assert server.table.lookup(b"web.test", b"/") is None
        assert server.table.lookup(b"web2.test", b"/") is not None
        assert served(https, "pass2.test") and not served(https, "pass.test")
        assert not served(own, "own.test")
        assert certificates.context_for("edge.test") is default_context
        assert certificates.context_for("edge2.test") is not default_context
        assert second.listener_sides == {} and second.reencrypt_routes == ()
        # The first view, still held by whoever started with it, is unchanged.
        assert first.table.lookup(b"web.test", b"/") is not None
        assert first.passthrough[HTTPS_FRONT].lookup(b"pass.test", b"/") is not None


async def test_the_next_view_keeps_in_flight_counts_and_passive_health() -> None:
    one = resolver_view(
        [route("web.test", [("web", 100)], name="web"), passthrough("pass.test", "pass")],
        [endpoint("web", 8080), endpoint("web", 8080, address="127.0.0.2")],
    )
    # A change elsewhere (a third endpoint, another route): the same routes carry on.
    two = resolver_view(
        [
            route("web.test", [("web", 100)], name="web"),
            passthrough("pass.test", "pass"),
            route("other.test", [("web", 100)], name="other"),
        ],
        [
            endpoint("web", 8080),
            endpoint("web", 8080, address="127.0.0.2"),
            endpoint("web", 8080, address="127.0.0.3"),
        ],
    )
    async with running_proxy() as (server, _):
        first = ProxyView.build(one, server.view, settings(None, {}))
        server.set_view(first)
        entry = first.table.lookup(b"web.test", b"/")
        assert entry is not None
        target, backend = entry.pick(b"client", None, first.health, None)
        assert target is not None and backend is not None
        backend.picker.acquire(target)  # a request in flight on `target`
        relayed = first.passthrough[HTTPS_FRONT].lookup(b"pass.test", b"/")
        assert relayed is not None
        relay_target, relay_backend = relayed.pick(b"client", None, first.health, None)
        assert relay_target is not None and relay_backend is not None
        relay_backend.picker.acquire(relay_target)  # a relay open on `relay_target`
        failing = next(t for t in backend.picker.targets if t != target)
        first.health.failed(failing)

        second = ProxyView.build(two, first, settings(None, {}))
        server.set_view(second)
        assert second.health is first.health and second.health.skipped(failing)
        entry = second.table.lookup(b"web.test", b"/")
        assert entry is not None
        carried = next(b for b in entry.backends if target in b.picker.targets)
        assert carried.picker.inflight(target) == 1
        relayed = second.passthrough[HTTPS_FRONT].lookup(b"pass.test", b"/")
        assert relayed is not None
        carried_relay = next(b for b in relayed.backends if relay_target in b.picker.targets)
        assert carried_relay.picker.inflight(relay_target) == 1
        # The request ends under the new view: its count goes back to zero.
        carried.picker.release(target)
        assert carried.picker.inflight(target) == 0
