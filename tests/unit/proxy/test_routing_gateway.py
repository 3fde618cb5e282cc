"""Gateway API and Ingress routes in the routing table: matches, precedence, sides, filters
by Gateway, invalid backends (waygate.proxy.routing)."""

from __future__ import annotations

from datetime import UTC, datetime
from types import SimpleNamespace
from typing import Any

from waygate.proxy.routing import Defaults, RouteTable, build_table
from waygate.resolver.model import (
    Endpoint,
    EndpointPort,
    HeaderMatch,
    PathMatchType,
    Route,
    RouteBackend,
    RouteMatch,
    ValueMatchType,
)


def gw_route(
    name: str,
    *matches: RouteMatch,
    host: str = "",
    service: str = "a",
    port: int = 80,
    gateway: str = "ns/gw",
    **kw: Any,
) -> Route:
    return Route(
        namespace="ns",
        name=name,
        host=host,
        backends=(RouteBackend(service, 1, "ns", "http"),),
        matches=matches or (RouteMatch(),),
        listener_port=port,
        gateway=gateway,
        origin=f"HTTPRoute ns/{kw.pop('origin', name)}",
        **kw,
    )


def build(*routes: Route, **kw: Any) -> RouteTable:
    endpoints = {
        ("ns", s): (Endpoint("ns", s, "127.0.0.1", (EndpointPort("http", p),)),)
        for s, p in (("a", 1001), ("b", 1002), ("c", 1003))
    }
    return build_table(
        {r.key: r for r in routes},
        endpoints,
        {},
        defaults=Defaults(),
        cookie_key=b"k" * 32,
        **kw,
    )


def request(method: str = "GET", target: bytes = b"/", **headers: str) -> Any:
    fields = b"".join(f"{k.replace('_', '-')}: {v}\r\n".encode() for k, v in headers.items())
    return SimpleNamespace(method=method.encode(), target=target, fields=fields)


def served(
    table: RouteTable, host: bytes, path: bytes, req: Any = None, secure: bool = False
) -> str:
    entry = table.lookup(host, path, req or request(target=path), secure)
    return "" if entry is None else entry.backends[0].service


def test_exact_beats_regex_beats_the_longest_prefix() -> None:
    table = build(
        gw_route("p", RouteMatch(PathMatchType.PREFIX, "/match"), service="a"),
        gw_route("r", RouteMatch(PathMatchType.REGEX, "/match/[a-z]+"), service="b"),
        gw_route("e", RouteMatch(PathMatchType.EXACT, "/match/exact"), service="c"),
    )
    assert served(table, b"x", b"/match/exact") == "c"
    assert served(table, b"x", b"/match/other") == "b"
    assert served(table, b"x", b"/match/1") == "a"
    assert served(table, b"x", b"/matchbox") == ""


def test_prefix_ignores_a_trailing_slash_and_respects_segments() -> None:
    table = build(gw_route("p", RouteMatch(PathMatchType.PREFIX, "/v2/")))
    assert served(table, b"x", b"/v2") == "a"
    assert served(table, b"x", b"/v2/x") == "a"
    assert served(table, b"x", b"/v2x") == ""


def test_method_headers_and_query_are_anded_and_more_conditions_win() -> None:
    header = HeaderMatch("version", "two")
    color = HeaderMatch("color", "o.*", ValueMatchType.REGEX)
    table = build(
        gw_route("one", RouteMatch(headers=(header,)), service="a"),
        gw_route("two", RouteMatch(headers=(header, color)), service="b"),
        gw_route("q", RouteMatch(query=(HeaderMatch("animal", "whale"),)), service="c"),
        gw_route("m", RouteMatch(PathMatchType.PREFIX, "/m", method="POST"), service="c"),
    )
    assert served(table, b"x", b"/", request(version="two")) == "a"
    assert served(table, b"x", b"/", request(Version="two", Color="orange")) == "b"
    assert served(table, b"x", b"/", request(version="two", color="blue")) == "a"
    assert served(table, b"x", b"/", request(target=b"/?animal=whale&animal=dog")) == "c"
    assert served(table, b"x", b"/", request(target=b"/?animal=dog&animal=whale")) == ""
    assert served(table, b"x", b"/m", request("POST", b"/m")) == "c"
    assert served(table, b"x", b"/m", request("GET", b"/m")) == ""


def test_ties_go_to_the_older_object_then_its_name_then_the_rule() -> None:
    old = datetime(2020, 1, 1, tzinfo=UTC)
    new = datetime(2024, 1, 1, tzinfo=UTC)
    table = build(
        gw_route("young", service="a", created=new),
        gw_route("old", service="b", created=old),
    )
    assert served(table, b"x", b"/") == "b"
    table = build(gw_route("z-second", service="a"), gw_route("a-first", service="b"))
    assert served(table, b"x", b"/") == "b"
    table = build(
        gw_route("r1", service="a", origin="same", rule_index=1),
        gw_route("r0", service="b", origin="same", rule_index=0),
    )
    assert served(table, b"x", b"/") == "b"


def test_hosts_exact_then_deep_wildcards_longest_first_then_any() -> None:
    table = build(
        gw_route("any", service="a"),
        gw_route("wide", host="*.example.com", service="b"),
        gw_route("narrow", host="*.b.example.com", service="c"),
        gw_route("exact", host="x.b.example.com", service="a"),
    )
    assert served(table, b"a.b.c.example.com", b"/") == "b"
    assert served(table, b"x.y.b.example.com", b"/") == "c"
    assert served(table, b"example.com", b"/") == "a"
    assert served(table, b"x.b.example.com", b"/") == "a"


def test_sides_listener_ports_and_the_gateway_filter() -> None:
    plain = gw_route("plain", port=80, service="a")
    secure = gw_route("secure", port=443, service="b")
    other = gw_route("other", port=8000, service="c", gateway="ns/other")
    table = build(plain, secure, other)
    assert served(table, b"x", b"/", secure=False) == "a"
    assert served(table, b"x", b"/", secure=True) == "b"
    assert table.serves_listeners(False) and table.serves_listeners(True)
    mapped = build(plain, secure, other, listener_ports={8000: False})
    assert served(mapped, b"x", b"/") == "c" and not mapped.serves_listeners(True)
    only = build(plain, other, listener_ports={80: False, 8000: False}, gateway="ns/other")
    assert served(only, b"x", b"/") == "c"


def test_invalid_and_missing_backends_are_marked_for_a_500() -> None:
    bad = Route(
        namespace="ns",
        name="bad",
        host="",
        backends=(RouteBackend("ghost", 1, "ns", "", "Service ns/ghost does not exist"),),
        matches=(RouteMatch(),),
        listener_port=80,
        gateway="ns/gw",
    )
    none = Route(
        namespace="ns",
        name="none",
        host="h",
        matches=(RouteMatch(),),
        listener_port=80,
        gateway="ns/gw",
    )
    table = build(bad, none)
    for host in (b"x", b"h"):
        entry = table.lookup(host, b"/", request(), False)
        assert entry is not None
        target, backend = entry.pick(b"", None, _Health(), None)
        assert target is None and backend is not None and backend.invalid


def test_routes_file_routes_keep_their_rules_beside_gateway_routes() -> None:
    legacy = Route(namespace="ns", name="file", host="*.example.com", backends=(RouteBackend("c"),))
    table = build(legacy, gw_route("gw", RouteMatch(PathMatchType.PREFIX, "/gw")))
    # One label only for the routes file's wildcard. Entries naming the host, of every
    # kind, come before host-less ones: the host-less Gateway route takes /gw of hosts
    # no route names, never of a host a route claims (issue 31 finding 7).
    assert served(table, b"a.example.com", b"/") == "c"
    assert served(table, b"a.b.example.com", b"/") == ""
    assert served(table, b"a.example.com", b"/gw") == "c"
    assert served(table, b"other.test", b"/gw") == "a"


class _Health:
    failing = False

    def skipped(self, target: object) -> bool:
        return False


def test_a_listener_on_its_own_port_has_its_own_side() -> None:
    from waygate.proxy.routing import ListenerSide

    side = ListenerSide(8081)
    table = build(
        gw_route("on-80", host="h.test", service="a", port=80),
        gw_route("on-8081", host="h.test", service="b", port=8081),
        listener_ports={80: False, 443: True, 8081: side},
    )
    own = table.lookup(b"h.test", b"/", request(), side)
    assert own is not None and own.route.name == "on-8081"
    plain = table.lookup(b"h.test", b"/", request(), False)
    assert plain is not None and plain.route.name == "on-80"
    # Another own port's side finds nothing of either; the side reads as plain HTTP.
    assert table.lookup(b"h.test", b"/", request(), ListenerSide(8082)) is None
    assert not side and side == ListenerSide(8081) and table.serves_listeners(side)


def test_an_https_listener_mapped_to_the_plain_port_is_not_served_in_clear() -> None:
    table = build(
        gw_route("https-on-80", host="h.test", port=80, listener_protocol="HTTPS"),
        gw_route("http-on-443", host="h.test", service="b", port=443, listener_protocol="HTTP"),
        listener_ports={80: False, 443: True},
    )
    assert table.lookup(b"h.test", b"/", request(), False) is None
    assert table.lookup(b"h.test", b"/", request(), True) is None
    # Routes without a listener protocol (Ingress, an older resolver) are as before.
    ingress = build(gw_route("ingress", host="h.test", port=80, gateway=""))
    assert ingress.lookup(b"h.test", b"/", request(), False) is not None


def test_whole_hosts_are_what_the_lookup_answers_for_every_request() -> None:
    # decide routes these hosts without a lookup (ProxyView.whole_hosts): for each side,
    # every listed host must be answered by its entry whatever the path and headers.
    def file_route(name: str, host: str, path: str = "/") -> Route:
        return Route(namespace="ns", name=name, host=host, path=path, backends=(RouteBackend("c"),))

    table = build(
        file_route("plain", "plain.test"),
        file_route("split", "split.test"),
        file_route("split-api", "split.test", "/api"),
        file_route("shadowed", "a.wild.test"),
        file_route("claimed", "gw.test"),
        gw_route("gw-plain", host="gw.test", service="a", port=80),
        gw_route(
            "gw-header",
            RouteMatch(headers=(HeaderMatch("x-v", "1", ValueMatchType.EXACT),)),
            host="cond.test",
            service="b",
            port=80,
        ),
        gw_route("gw-wild", host="*.wild.test", service="b", port=443),
    )
    whole = table.whole_hosts()
    assert set(whole[False]) == {b"plain.test", b"gw.test", b"a.wild.test"}
    assert whole[False][b"gw.test"].route.name == "gw-plain"
    # The TLS side has a wildcard that comes before the routes file's hosts, and no
    # exact host of its own: every request there is looked up.
    assert whole[True] == {}
    requests = [request(), request(x_v="1"), request(target=b"/api/x?q=1")]
    for side, hosts in whole.items():
        for host, entry in hosts.items():
            for path in (b"/", b"/api", b"/api/x", b"/%61pi", b"/other/deep"):
                for req in requests:
                    assert table.lookup(host, path, req, side) is entry, (side, host, path)
    # Without Gateway routes, both sides share the routes file's hosts.
    only_file = build(file_route("plain", "plain.test"), file_route("split", "split.test", "/x"))
    assert set(only_file.whole_hosts()[True]) == {b"plain.test"}
