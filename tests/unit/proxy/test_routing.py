"""Routing tables built from hand-made resolver model objects (no sockets)."""

from __future__ import annotations

import collections

from waygate.core.balancing import POLICIES
from waygate.proxy.routing import Defaults, PassiveHealth, Target, build_table, sticky_value
from waygate.resolver.model import (
    BalancePolicy,
    Endpoint,
    EndpointPort,
    Route,
    RouteBackend,
    Service,
    ServicePort,
    StickySessions,
)


def ep(service: str, address: str, port: int = 8080, **kw: object) -> Endpoint:
    return Endpoint(
        namespace="ns",
        service=service,
        address=address,
        ports=(EndpointPort(name="http", port=port),),
        **kw,  # type: ignore[arg-type]
    )


def build(routes: list[Route], endpoints: list[Endpoint], services=(), previous=None):
    grouped: dict = {}
    for endpoint in endpoints:
        grouped[endpoint.service_key] = (*grouped.get(endpoint.service_key, ()), endpoint)
    return build_table(
        {r.key: r for r in routes},
        grouped,
        {s.key: s for s in services},
        defaults=Defaults(),
        cookie_key=b"x" * 32,
        previous=previous,
    )


def r(name: str, host: str, path: str = "/", backends=(("a", 1),), **kw: object) -> Route:
    return Route(
        namespace="ns",
        name=name,
        host=host,
        path=path,
        backends=tuple(RouteBackend(s, w) for s, w in backends),
        **kw,  # type: ignore[arg-type]
    )


def test_policy_names_are_one_list() -> None:
    assert {p.value for p in BalancePolicy} - {""} == set(POLICIES)


def test_exact_before_wildcard_and_longest_prefix() -> None:
    table = build(
        [
            r("root", "a.test"),
            r("api", "a.test", "/api"),
            r("wild", "*.test"),
            r("deep", "a.test", "/api/v2"),
        ],
        [ep("a", "10.0.0.1")],
    )
    assert table.lookup(b"a.test", b"/x").route.name == "root"
    assert table.lookup(b"a.test", b"/api").route.name == "api"
    assert table.lookup(b"a.test", b"/api/v2/x").route.name == "deep"
    assert table.lookup(b"a.test", b"/apiv2").route.name == "root"
    assert table.lookup(b"b.test", b"/").route.name == "wild"
    assert table.lookup(b"x.b.test", b"/") is None
    assert table.lookup(b"test", b"/") is None


def test_unready_and_terminating_endpoints_are_never_picked() -> None:
    table = build(
        [r("root", "a.test")],
        [
            ep("a", "10.0.0.1"),
            ep("a", "10.0.0.2", ready=False),
            ep("a", "10.0.0.3", terminating=True),
        ],
    )
    entry = table.lookup(b"a.test", b"/")
    health = PassiveHealth()
    picks = {entry.pick(b"c", None, health, None)[0].address for _ in range(10)}
    assert picks == {"10.0.0.1"}


def test_target_port_by_name_number_and_service_mapping() -> None:
    service = Service(namespace="ns", name="a", ports=(ServicePort("web", 80, "http"),))
    table = build([r("root", "a.test", target_port="web")], [ep("a", "10.0.0.1", 9000)], [service])
    entry = table.lookup(b"a.test", b"/")
    assert entry.pick(b"c", None, PassiveHealth(), None)[0].port == 9000


def test_weights_pick_backend_then_endpoint_and_zero_never() -> None:
    table = build(
        [
            r(
                "root",
                "a.test",
                backends=(("a", 1), ("b", 3), ("c", 0)),
                balance=BalancePolicy.ROUND_ROBIN,
            )
        ],
        [ep("a", "10.0.0.1"), ep("b", "10.0.0.2"), ep("b", "10.0.0.3"), ep("c", "10.0.0.4")],
    )
    entry = table.lookup(b"a.test", b"/")
    seen = collections.Counter(
        entry.pick(b"k", None, PassiveHealth(), None)[0].address for _ in range(400)
    )
    assert seen["10.0.0.1"] == 100 and seen["10.0.0.2"] == seen["10.0.0.3"] == 150
    assert "10.0.0.4" not in seen


def test_removed_endpoint_is_never_picked_and_pickers_carry_over() -> None:
    routes = [r("root", "a.test", balance=BalancePolicy.LEAST_CONN)]
    first = build(routes, [ep("a", "10.0.0.1"), ep("a", "10.0.0.2")])
    entry = first.lookup(b"a.test", b"/")
    target, backend = entry.pick(b"k", None, PassiveHealth(), None)
    backend.picker.acquire(target)
    second = build(routes, [ep("a", "10.0.0.1"), ep("a", "10.0.0.3")], previous=first)
    new_entry = second.lookup(b"a.test", b"/")
    assert new_entry.backends[0].picker is backend.picker
    picks = {new_entry.pick(b"k", None, PassiveHealth(), None)[0].address for _ in range(10)}
    assert "10.0.0.2" not in picks
    assert Target("10.0.0.2", 8080) not in second.targets


def test_two_backends_of_one_service_name_keep_a_picker_each_across_tables() -> None:
    # One Service name in two namespaces (Gateway API backendRefs), or at two ports,
    # or a canary's cluster IP beside the main's endpoints: pickers were carried by
    # Service name, so the next table gave both backends the last one's picker and
    # sent every request to its endpoints.
    other = Endpoint(
        namespace="other", service="a", address="10.9.0.1", ports=(EndpointPort("http", 8080),)
    )
    route = Route(
        namespace="ns",
        name="split",
        host="a.test",
        backends=(RouteBackend("a", 1), RouteBackend("a", 1, namespace="other")),
        balance=BalancePolicy.LEAST_CONN,
    )
    first = build([route], [ep("a", "10.0.0.1"), other])
    second = build([route], [ep("a", "10.0.0.1"), other], previous=first)
    for table in (first, second):
        entry = table.lookup(b"a.test", b"/")
        assert [[t.address for t in b.picker.targets] for b in entry.backends] == [
            ["10.0.0.1"],
            ["10.9.0.1"],
        ]
    # (still carried, each its own)
    old, new = first.lookup(b"a.test", b"/"), second.lookup(b"a.test", b"/")
    assert [b.picker for b in new.backends] == [b.picker for b in old.backends]


def test_sticky_cookie_is_opaque_and_wins_over_policy() -> None:
    table = build([r("root", "a.test")], [ep("a", "10.0.0.1"), ep("a", "10.0.0.2")])
    entry = table.lookup(b"a.test", b"/")
    backend = entry.backends[0]
    target = next(t for t in backend.picker.targets if t.address == "10.0.0.2")
    value = sticky_value(b"x" * 32, target)
    assert b"10.0.0.2" not in value and b"8080" not in value
    for _ in range(5):
        assert entry.pick(b"k", value, PassiveHealth(), None)[0] == target
    disabled = build(
        [r("root", "a.test", sticky=StickySessions(disable_cookies=True))], [ep("a", "10.0.0.1")]
    )
    assert disabled.lookup(b"a.test", b"/").options.cookie_name == b""


def test_passive_health_grows_and_resets() -> None:
    now = [0.0]
    health = PassiveHealth(lambda: now[0])
    target = Target("10.0.0.1", 80)
    health.failed(target)
    assert health.skipped(target)
    now[0] = 0.6
    assert not health.skipped(target)
    health.failed(target)
    now[0] = 1.5
    assert health.skipped(target)  # second failure: 1 s
    health.succeeded(target)
    assert not health.skipped(target)


def test_passive_health_skips_a_failing_endpoint() -> None:
    table = build(
        [r("root", "a.test", balance=BalancePolicy.ROUND_ROBIN)],
        [ep("a", "10.0.0.1"), ep("a", "10.0.0.2")],
    )
    entry = table.lookup(b"a.test", b"/")
    health = PassiveHealth()
    health.failed(Target("10.0.0.1", 8080, namespace="ns", service="a"))
    picks = {entry.pick(b"k", None, health, None)[0].address for _ in range(6)}
    assert picks == {"10.0.0.2"}


def test_percent_escaped_request_paths_match_the_route_paths_the_resolver_stores() -> None:
    """The resolver stores /%7Eu as /~u and upper-cases other escapes; a request
    path is put in the same form before matching, so /%61dmin cannot skip /admin."""
    from waygate.resolver.validation import normalize_path

    stored = {p: normalize_path(p, "route") for p in ("/admin", "/%7Eu", "/a%3ab")}
    table = build(
        [
            r("root", "a.test"),
            r("admin", "a.test", stored["/admin"]),
            r("home", "a.test", stored["/%7Eu"]),
            r("colon", "a.test", stored["/a%3ab"]),
        ],
        [ep("a", "10.0.0.1")],
    )
    assert table.lookup(b"a.test", b"/%61dmin").route.name == "admin"
    assert table.lookup(b"a.test", b"/%61dmin/users").route.name == "admin"
    assert table.lookup(b"a.test", b"/%7eu/x").route.name == "home"
    assert table.lookup(b"a.test", b"/~u").route.name == "home"
    assert table.lookup(b"a.test", b"/a%3Ab").route.name == "colon"
    assert table.lookup(b"a.test", b"/a%3ab").route.name == "colon"
    assert table.lookup(b"a.test", b"/%2Fadmin").route.name == "root", "%2F stays encoded"
    assert table.lookup(b"a.test", b"/admin%").route.name == "root", "a bare % is left as is"
