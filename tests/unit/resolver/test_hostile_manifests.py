"""Hostile route authors at admission (issue 31): regular expressions RE2 cannot express,
YAML amplification, the Gateway API CRDs' bounds, and hosts owned across route kinds."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from tests.support.gatewayapi import GATEWAY_CLASS, conformance_text
from waygate.core.errors import InvalidArgument
from waygate.resolver.filesource import FileError
from waygate.resolver.manifests import ManifestsContent, parse_manifests
from waygate.resolver.model import (
    HeaderMatch,
    PathMatchType,
    Route,
    RouteBackend,
    RouteMatch,
    ValueMatchType,
)
from waygate.resolver.validation import validate_route

NS = "gateway-conformance-infra"


def parse(*texts: str) -> ManifestsContent:
    return parse_manifests([(Path(f"m{i}.yaml"), t) for i, t in enumerate(texts)])


# ---------------------------------------------------------------- regular expressions


def test_apply_route_refuses_a_match_pattern_re2_cannot_express() -> None:
    route = Route(
        namespace="demo",
        name="web",
        host="web.example.com",
        backends=(RouteBackend("web", 100),),
        matches=(RouteMatch(PathMatchType.REGEX, "/ok/[a-z]+"),),
    )
    assert validate_route(route).matches == route.matches
    looking = dataclasses.replace(
        route,
        matches=(
            RouteMatch(
                headers=(HeaderMatch("x-a", "(?!admin).*", ValueMatchType.REGEX),),
            ),
        ),
    )
    with pytest.raises(InvalidArgument, match=r"matches\[0\]\.headers\[0\]\.value: .*lookahead"):
        validate_route(looking)
    backreference = dataclasses.replace(
        route, matches=(RouteMatch(PathMatchType.REGEX, r"/(a)\1"),)
    )
    with pytest.raises(InvalidArgument, match=r"matches\[0\]\.path: .*backreferences"):
        validate_route(backreference)


@pytest.mark.parametrize(
    ("match", "field"),
    [
        ('{path: {type: RegularExpression, value: "/(a)\\\\1"}}', "matches[0].path.value"),
        (
            '{headers: [{name: x-a, type: RegularExpression, value: "(?<=a)b"}]}',
            "matches[0].headers[0].value",
        ),
        (
            '{queryParams: [{name: q, type: RegularExpression, value: "a++"}]}',
            "matches[0].queryParams[0].value",
        ),
    ],
)
def test_gateway_regex_matches_re2_cannot_express_are_refused_naming_the_line(
    match: str, field: str
) -> None:
    route = f"""apiVersion: gateway.networking.k8s.io/v1
kind: HTTPRoute
metadata:
  name: bad
  namespace: {NS}
spec:
  parentRefs: [{{name: same-namespace}}]
  rules:
  - matches:
    - {match}
"""
    with pytest.raises(FileError) as caught:
        parse(GATEWAY_CLASS, conformance_text("base.yaml"), route)
    error = caught.value
    assert error.path == Path("m2.yaml") and error.line == 10
    assert f"HTTPRoute {NS}/bad: spec.rules[0].{field}: " in error.reason
    assert "not supported: Waygate matches with RE2" in error.reason


# ---------------------------------------------------------------- YAML amplification


def amplified_route(count: int = 1000) -> str:
    """The audit's manifest (finding 8): 1,000 rules of 1,000 matches through aliases,
    about 9 KB of YAML."""
    matches = ",".join(["*m"] * count)
    rules = ",".join(["*r"] * count)
    return f"""apiVersion: gateway.networking.k8s.io/v1
kind: HTTPRoute
metadata: {{name: amplified, namespace: {NS}}}
spec:
  parentRefs: [{{name: same-namespace}}]
  hostnames: [amplified.example]
  x-match: &m {{path: {{type: PathPrefix, value: /a}}, headers: [{{name: x, value: y}}]}}
  x-matches: &ms [{matches}]
  x-rule: &r {{matches: *ms, backendRefs: [{{name: infra-backend-v1, port: 8080}}]}}
  rules: [{rules}]
"""


def test_alias_expansion_is_refused_before_anything_is_built() -> None:
    import tracemalloc

    text = amplified_route()
    assert len(text) < 16 * 1024
    tracemalloc.start()
    try:
        with pytest.raises(FileError) as caught:
            parse(GATEWAY_CLASS, conformance_text("base.yaml"), text)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    error = caught.value
    # The anchor expanded most: the rule (1,000 times, each 1,000 matches).
    assert error.path == Path("m2.yaml") and error.line == 9, error
    assert "YAML aliases of the node on this line expand the document" in error.reason
    # Refused from the composed nodes: nothing of the million matches was built.
    assert peak < 32 << 20, peak


def test_a_billion_laughs_is_refused_at_once() -> None:
    """80 levels of doubling aliases: 2^80 nodes if expanded; refused from 165 nodes."""
    lines = ["a: &a [x, x]"]
    lines += [
        f"b{i}: &b{i} [*{'a' if i == 0 else f'b{i - 1}'}, *{'a' if i == 0 else f'b{i - 1}'}]"
        for i in range(80)
    ]
    with pytest.raises(FileError, match="expand the document to more than 281,474,976,710,656"):
        parse("\n".join(lines) + "\n")


def test_aliases_within_bounds_still_load() -> None:
    small = amplified_route(3)
    content = parse(GATEWAY_CLASS, conformance_text("base.yaml"), small)
    routes = [r for r in content.routes if r.origin == f"HTTPRoute {NS}/amplified"]
    assert len(routes) == 3 and all(len(r.matches) == 3 for r in routes)


def test_a_recursive_alias_is_refused() -> None:
    with pytest.raises(FileError, match="m0.yaml:3: a YAML alias refers to a node that contains"):
        parse("kind: List\napiVersion: v1\nitems: &i [*i]\n")


@pytest.mark.parametrize(
    ("text", "line", "key"),
    [
        ("apiVersion: v1\nkind: Namespace\nmetadata: {name: a}\nkind: Service\n", 4, "kind"),
        (
            "apiVersion: v1\nkind: Service\nmetadata:\n  name: web\n  namespace: a\n"
            "  namespace: demo\nspec: {ports: [{port: 80}]}\n",
            6,
            "namespace",
        ),
    ],
)
def test_duplicate_keys_in_manifests_are_refused_with_both_lines(
    text: str, line: int, key: str
) -> None:
    with pytest.raises(FileError) as caught:
        parse(text)
    assert caught.value.line == line
    assert f"key '{key}' appears twice in one mapping (first on line " in caught.value.reason


def test_duplicate_keys_in_the_routes_file_are_refused_with_both_lines() -> None:
    from waygate.resolver.filesource import parse_routes_file

    text = "routes:\n  - name: a\n    host: a.example.com\n    to: web\n    to: evil\n"
    with pytest.raises(FileError) as caught:
        parse_routes_file(Path("routes.yaml"), text)
    assert str(caught.value) == (
        "routes.yaml:5: key 'to' appears twice in one mapping (first on line 4)"
    )


def test_merge_keys_are_not_duplicates() -> None:
    text = (
        "apiVersion: v1\nkind: List\nitems:\n"
        "- &a {apiVersion: v1, kind: Namespace, metadata: {name: a}}\n"
        "- {<<: *a, metadata: {name: b}}\n"
    )
    assert parse(text).skipped == []


def test_a_60_mb_document_is_refused_before_it_is_parsed(tmp_path: Path) -> None:
    """The audit's 60 MB document left 220 MiB resident; now at most the bound is read."""
    import tracemalloc

    from waygate.resolver.filesource import FileSource
    from waygate.resolver.gateway.status import StatusBoard
    from waygate.resolver.manifests import ManifestsSource
    from waygate.resolver.store import Store
    from waygate.resolver.yamlload import MAX_YAML_BYTES

    big = tmp_path / "big.yaml"
    line = "# " + "x" * 1021 + "\n"
    with big.open("w") as handle:
        handle.write("routes: []\n")
        for _ in range(60 * 1024):
            handle.write(line)
    assert big.stat().st_size > 60 << 20
    tracemalloc.start()
    try:
        manifests = ManifestsSource(Store(), StatusBoard(), big)
        assert not manifests.load()
        files = FileSource(Store(), big)
        assert not files.load()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    for error in (manifests.last_error, files.last_error):
        assert error is not None and f"larger than {MAX_YAML_BYTES >> 20} MiB" in error
    assert peak < MAX_YAML_BYTES + (4 << 20), peak


# ---------------------------------------------------------------- the CRDs' bounds


def http_route(rules: str, hostnames: str = "[bounded.example]") -> str:
    return f"""apiVersion: gateway.networking.k8s.io/v1
kind: HTTPRoute
metadata:
  name: bounded
  namespace: {NS}
spec:
  parentRefs: [{{name: same-namespace}}]
  hostnames: {hostnames}
  rules:
{rules}"""


def rule(matches: int = 1, filters: int = 0, backends: int = 1) -> str:
    out = "  - matches:\n" + "".join(
        f"    - {{path: {{type: PathPrefix, value: /p{i}}}}}\n" for i in range(matches)
    )
    if filters:
        out += "    filters:\n" + "".join(
            "    - {type: RequestHeaderModifier, requestHeaderModifier: "
            f"{{set: [{{name: x-{i}, value: v}}]}}}}\n"
            for i in range(filters)
        )
    out += "    backendRefs:\n" + "".join(
        "    - {name: infra-backend-v1, port: 8080}\n" for _ in range(backends)
    )
    return out


@pytest.mark.parametrize(
    ("route", "field", "reason"),
    [
        (http_route(rule() * 17), "spec.rules", "must have at most 16 items (has 17)"),
        (
            http_route(rule(matches=65)),
            "spec.rules[0].matches",
            "must have at most 64 items (has 65)",
        ),
        (
            http_route(rule(matches=64) + rule(matches=64) + rule(matches=1)),
            "spec.rules",
            "the rules have 129 matches in all; at most 128",
        ),
        (
            http_route(rule(filters=17)),
            "spec.rules[0].filters",
            "must have at most 16 items (has 17)",
        ),
        (
            http_route(rule(backends=17)),
            "spec.rules[0].backendRefs",
            "must have at most 16 items (has 17)",
        ),
        (
            http_route(rule(), "[" + ",".join(f"h{i}.example" for i in range(17)) + "]"),
            "spec.hostnames",
            "must have at most 16 items (has 17)",
        ),
    ],
)
def test_the_crd_bounds_are_enforced_in_manifests_naming_the_line(
    route: str, field: str, reason: str
) -> None:
    with pytest.raises(FileError) as caught:
        parse(GATEWAY_CLASS, conformance_text("base.yaml"), route)
    assert caught.value.path == Path("m2.yaml") and caught.value.line is not None
    assert f"HTTPRoute {NS}/bounded: {field}: {reason}" in caught.value.reason


def test_the_crd_bounds_hold_for_objects_from_kubernetes_too() -> None:
    """The Kubernetes source translates the same way: the object is not served and its
    status says why (in a cluster the API server refuses it first)."""
    import yaml

    from waygate.resolver.gateway.translate import Objects, translate

    objects = Objects()
    for text in (GATEWAY_CLASS, conformance_text("base.yaml"), http_route(rule() * 17)):
        for doc in yaml.safe_load_all(text):
            if doc and doc["kind"] in ("GatewayClass", "Gateway", "HTTPRoute"):
                namespace = doc["metadata"].get("namespace", "")
                objects.of(doc["kind"])[(namespace, doc["metadata"]["name"])] = doc
    translation = translate(objects)
    (rejected,) = translation.rejected
    assert (rejected.kind, rejected.name) == ("HTTPRoute", "bounded")
    assert str(rejected.error) == "spec.rules: must have at most 16 items (has 17)"
    assert not [r for r in translation.routes if r.origin == f"HTTPRoute {NS}/bounded"]


# ---------------------------------------------------------------- hosts across kinds


def claims(*routes: Route, share: bool = False) -> dict[tuple[str, str], str | None]:
    """Each route's verdict in a status book that saw them in this order (older first):
    None when admitted, else the HostAlreadyClaimed message."""
    from datetime import UTC, datetime

    from waygate.resolver.status import RouteStatusBook

    book = RouteStatusBook(share_hosts=share)
    by_key = {}
    for route in routes:  # one update each: first sight decides the age
        by_key[route.key] = route
        book.update(
            by_key,
            lambda ns, name: None,
            lambda ns, name: (),
            changed_routes=[route.key],
            now=datetime.now(UTC),
        )
    out: dict[tuple[str, str], str | None] = {}
    for key in by_key:
        status = book.status(key)
        assert status is not None
        admitted = status.condition("Admitted")
        assert admitted is not None
        out[key] = None if admitted.status == "True" else admitted.message
        conflicted = status.condition("Conflicted")
        assert conflicted is not None and (conflicted.status == "True") == (
            admitted.status != "True"
        )
    return out


def plain(namespace: str, name: str, host: str = "echo.localtest.me", path: str = "/") -> Route:
    return Route(
        namespace=namespace, name=name, host=host, path=path, backends=(RouteBackend("web", 100),)
    )


def merged(
    namespace: str,
    origin: str,
    path: str = "/",
    host: str = "echo.localtest.me",
    claim: object = None,
) -> Route:
    from waygate.resolver.model import HostClaim

    assert claim is None or isinstance(claim, HostClaim)
    return Route(
        namespace=namespace,
        name=f"{origin.lower()}:{path}",
        host=host,
        backends=(RouteBackend("web", 1, namespace, "http"),),
        matches=(RouteMatch(PathMatchType.PREFIX, path),),
        origin=f"{origin} {namespace}/x",
        host_claim=claim,
    )


def test_an_ingress_or_httproute_of_another_namespace_cannot_take_an_owned_host() -> None:
    verdicts = claims(
        plain("demo", "echo"),
        merged("evil", "Ingress"),
        merged("evil", "HTTPRoute", "/api"),
    )
    assert verdicts[("demo", "echo")] is None
    for key in (("evil", "ingress:/"), ("evil", "httproute:/api")):
        assert verdicts[key] == (
            "host echo.localtest.me belongs to namespace demo "
            "(its route demo/echo claimed it first)"
        )


def test_an_older_ingress_owns_the_host_against_a_younger_route() -> None:
    verdicts = claims(merged("shop", "Ingress"), plain("other", "echo"), plain("shop", "web"))
    assert verdicts[("shop", "ingress:/")] is None and verdicts[("shop", "web")] is None
    assert verdicts[("other", "echo")] == (
        "host echo.localtest.me belongs to namespace shop (its Ingress shop/x claimed it first)"
    )


def test_a_gateway_listener_hostname_claims_for_its_namespace_and_shares_with_its_routes() -> None:
    from datetime import UTC, datetime

    from waygate.resolver.model import HostClaim

    listener = HostClaim("infra", "gw", "http", datetime(2020, 1, 1, tzinfo=UTC))
    verdicts = claims(
        plain("demo", "echo"),  # first seen, but younger than the Gateway
        merged("team-a", "HTTPRoute", "/a", claim=listener),
        merged("team-b", "HTTPRoute", "/b", claim=listener),
    )
    assert verdicts[("team-a", "httproute:/a")] is None
    assert verdicts[("team-b", "httproute:/b")] is None
    assert verdicts[("demo", "echo")] == (
        "host echo.localtest.me belongs to namespace infra "
        "(its Gateway infra/gw listener http claimed it first)"
    )


def test_route_host_sharing_lets_namespaces_share_and_hostless_routes_claim_nothing() -> None:
    shared = claims(plain("demo", "echo"), merged("evil", "Ingress"), share=True)
    assert set(shared.values()) == {None}
    hostless = claims(plain("demo", "echo"), merged("evil", "HTTPRoute", host=""))
    assert set(hostless.values()) == {None}


def test_the_store_tells_which_objects_lost_their_host() -> None:
    from waygate.resolver.store import Store

    store = Store()
    calls: list[int] = []
    store.on_route_changes(lambda: calls.append(1))
    store.replace_source("file", routes=[plain("demo", "echo")])
    store.replace_source(
        "manifests",
        routes=[
            merged("evil", "Ingress"),
            merged("evil", "HTTPRoute", "/api"),
            merged("evil", "HTTPRoute", "/", host="evil.example"),
        ],
    )
    assert calls
    conflicts = store.host_conflicts()
    assert set(conflicts) == {("Ingress", "evil", "x"), ("HTTPRoute", "evil", "x")}
    assert conflicts[("Ingress", "evil", "x")].every is True
    # The HTTPRoute keeps its own host: not every route of it lost.
    lost = conflicts[("HTTPRoute", "evil", "x")]
    assert lost.every is False and "belongs to namespace demo" in lost.message


# ---------------------------------------------------------------- route budgets


def multiplied_route(name: str, hostnames: int = 16) -> str:
    """An HTTPRoute within every CRD bound that multiplies: hostnames x 128 matches."""
    hosts = "[" + ",".join(f"h{i}.{name}.example" for i in range(hostnames)) + "]"
    return http_route(rule(matches=64) * 2, hosts).replace("name: bounded", f"name: {name}")


THREE_LISTENERS = f"""apiVersion: gateway.networking.k8s.io/v1
kind: Gateway
metadata: {{name: same-namespace, namespace: {NS}}}
spec:
  gatewayClassName: waygate
  listeners:
  - {{name: a, port: 80, protocol: HTTP}}
  - {{name: b, port: 81, protocol: HTTP}}
  - {{name: c, port: 82, protocol: HTTP}}
"""


def test_an_object_that_multiplies_past_its_budget_is_refused() -> None:
    from waygate.resolver.gateway.translate import MAX_ENTRIES_PER_OBJECT

    fits = parse(GATEWAY_CLASS, THREE_LISTENERS, multiplied_route("fits", hostnames=8))
    entries = sum(len(r.matches) for r in fits.routes)
    assert entries == 8 * 128 * 3 <= MAX_ENTRIES_PER_OBJECT
    with pytest.raises(FileError) as caught:
        parse(GATEWAY_CLASS, THREE_LISTENERS, multiplied_route("big"))
    assert caught.value.path == Path("m2.yaml")
    assert (
        f"HTTPRoute {NS}/big: spec: amounts to 6,144 route entries (routes times matches, "
        f"over its hostnames and listeners); at most {MAX_ENTRIES_PER_OBJECT:,} per object"
    ) in caught.value.reason


def test_a_source_past_its_budget_refuses_the_object_that_crosses_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from waygate.resolver.gateway import translate

    monkeypatch.setattr(translate, "MAX_ENTRIES_PER_SOURCE", 5000)
    routes = [multiplied_route(f"r{i}", hostnames=8) for i in range(3)]  # 3,072 entries each
    with pytest.raises(FileError) as caught:
        parse(GATEWAY_CLASS, THREE_LISTENERS, *routes)
    assert caught.value.path == Path("m3.yaml")
    assert "its 3,072 route entries would take this source past 5,000" in caught.value.reason


def test_a_refused_object_is_not_counted_as_attached() -> None:
    """In Kubernetes mode a refused object is skipped (its status says why): its
    listeners do not count it among their attached routes."""
    import yaml

    from waygate.resolver.gateway.translate import Objects, translate

    objects = Objects()
    for text in (GATEWAY_CLASS, THREE_LISTENERS, multiplied_route("big")):
        for doc in yaml.safe_load_all(text):
            namespace = doc["metadata"].get("namespace", "")
            objects.of(doc["kind"])[(namespace, doc["metadata"]["name"])] = doc
    translation = translate(objects)
    assert [r.name for r in translation.rejected] == ["big"]
    (gateway,) = [s for s in translation.statuses if s.kind == "Gateway"]
    assert [item["attachedRoutes"] for item in gateway.status["listeners"]] == [0, 0, 0]
    (route,) = [s for s in translation.statuses if s.kind == "HTTPRoute"]
    (parent,) = route.status["parents"]
    accepted = next(c for c in parent["conditions"] if c["type"] == "Accepted")
    assert accepted["status"] == "False" and "route entries" in accepted["message"]


def test_a_listener_hostname_claims_its_host_with_no_route_attached() -> None:
    from datetime import UTC, datetime, timedelta

    from waygate.resolver.model import HostClaim
    from waygate.resolver.store import Store

    t0 = datetime(2026, 1, 1, tzinfo=UTC)
    older = HostClaim("infra", "gw", "shop", t0)
    store = Store()
    store.replace_source("gateways", routes=[], claims=[("shop.example.com", older)])
    late = dataclasses.replace(
        plain("other", "shop", "shop.example.com"), created=t0 + timedelta(1)
    )
    store.replace_source("file", routes=[late])
    route = store.get_route("other", "shop")
    assert route is not None and route.status is not None and not route.status.admitted
    admitted = route.status.condition("Admitted")
    assert admitted is not None and admitted.message == (
        "host shop.example.com belongs to namespace infra "
        "(its Gateway infra/gw listener shop claimed it first)"
    )
    # The listener leaves: the Route gets its host.
    store.replace_source("gateways", routes=[], claims=[])
    route = store.get_route("other", "shop")
    assert route is not None and route.status is not None and route.status.admitted


def test_a_younger_listener_hostname_is_conflicted_in_its_gateway() -> None:
    from waygate.resolver.model import HostClaim
    from waygate.resolver.store import Store

    store = Store()
    seen: list[int] = []
    store.on_route_changes(lambda: seen.append(1))
    store.replace_source("file", routes=[plain("demo", "echo")])
    seen.clear()
    evil = HostClaim("evil", "gw", "http")
    store.replace_source("gateways", routes=[], claims=[("echo.localtest.me", evil)])
    assert seen  # no route changed, but the Gateway's status must be told
    conflict = store.host_conflicts()[("Gateway", "evil", "gw")]
    assert conflict.listeners == ("http",)
    assert conflict.message == (
        "host echo.localtest.me belongs to namespace demo (its route demo/echo claimed it first)"
    )
    route = store.get_route("demo", "echo")
    assert route is not None and route.status is not None and route.status.admitted


def test_an_ingress_nginx_regex_path_re2_cannot_express_is_refused_alone() -> None:
    """use-regex makes every Ingress author a route author: what RE2 cannot express is
    refused with the reason (the proxy matches with RE2), the other Ingresses served."""
    from tests.unit.resolver.test_ingress_nginx import P, ingress, refusal, routes_of, served

    nginx = {P + "use-regex": "true"}
    routes = routes_of(
        ingress("back", nginx, path=r"/(a+)/\1", path_type="ImplementationSpecific"),
        ingress(
            "fine",
            nginx,
            path="/api/v[0-9]+",
            path_type="ImplementationSpecific",
            host="fine.example.com",
        ),
    )
    assert served(routes, "fine") and not served(routes, "back")
    reason, message = refusal(routes, "back")
    assert "backreferences are not supported" in message, (reason, message)
