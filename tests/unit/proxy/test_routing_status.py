"""The proxy serves admitted routes only: a route the resolver found Conflicted
(another namespace owns its host, or an older route its host and path) never
takes that traffic from the owner."""

from __future__ import annotations

import dataclasses

from waygate.proxy.routing import Defaults, build_table, unavailable_reason
from waygate.resolver.model import Endpoint, EndpointPort, Route, RouteBackend
from waygate.resolver.store import Store


def test_a_conflicted_route_is_left_out_of_the_table() -> None:
    store = Store(initial_version=0)
    for ns in ("demo", "evil"):
        store.set_endpoints(
            ns,
            "web",
            [Endpoint(ns, "web", f"10.0.0.{len(ns)}", (EndpointPort("", 80),))],
            source="test",
        )
    store.upsert_route(
        Route("demo", "echo", "echo.example", "/", (RouteBackend("web"),)), source="test"
    )
    store.upsert_route(
        Route("evil", "api", "echo.example", "/api", (RouteBackend("web"),)), source="test"
    )
    routes = {r.key: r for r in store.routes()}
    endpoints = {
        ("demo", "web"): store.endpoints_of("demo", "web"),
        ("evil", "web"): store.endpoints_of("evil", "web"),
    }
    table = build_table(routes, endpoints, {}, defaults=Defaults(), cookie_key=b"k" * 16)
    entry = table.lookup(b"echo.example", b"/api/x")
    assert entry is not None
    assert entry.route.key == ("demo", "echo"), "the owner keeps /api; evil/api is not served"
    # Without status (an older resolver), every route is served as before.
    bare = {key: dataclasses.replace(r, status=None) for key, r in routes.items()}
    table = build_table(bare, endpoints, {}, defaults=Defaults(), cookie_key=b"k" * 16)
    entry = table.lookup(b"echo.example", b"/api/x")
    assert entry is not None and entry.route.key == ("evil", "api")


def test_the_503_reason_names_the_route_condition() -> None:
    store = Store(initial_version=0)
    store.upsert_route(
        Route("mine", "ghost", "ghost.example", "/", (RouteBackend("doesnotexist"),)),
        source="test",
    )
    routes = {r.key: r for r in store.routes()}
    table = build_table(routes, {}, {}, defaults=Defaults(), cookie_key=b"k" * 16)
    entry = table.lookup(b"ghost.example", b"/")
    assert entry is not None
    assert unavailable_reason(entry) == "route mine/ghost: service mine/doesnotexist not found"
    bare = {k: dataclasses.replace(r, status=None) for k, r in routes.items()}
    entry = build_table(bare, {}, {}, defaults=Defaults(), cookie_key=b"k" * 16).lookup(
        b"ghost.example", b"/"
    )
    assert entry is not None
    assert unavailable_reason(entry) == "no endpoint ready for route mine/ghost"
