"""ingress-nginx Ingresses: class selection, annotations as route fields, fail closed, injection.

The injection payloads are the published ones of IngressNightmare (Wiz, March 2025:
CVE-2025-24514 auth-url, CVE-2025-1097 auth-tls-match-cn, CVE-2025-1098 mirror and
the Ingress UID, CVE-2025-1974 the ssl_engine load through the admission path) and
CVE-2026-24512 (nginx configuration injected through spec.rules[].http.paths[].path).
Each must leave its Ingress not served, name the Ingress, the field and the reason,
and leave every other Ingress served.
"""

from __future__ import annotations

import copy
import re
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support.gatewayapi import tls_secret
from waygate.resolver.gateway.translate import Objects, translate
from waygate.resolver.ingress_nginx import catalogue
from waygate.resolver.ingress_nginx.annotations import judge, parse_snippet
from waygate.resolver.ingress_nginx.catalogue import CATALOGUE, Verdict
from waygate.resolver.ingress_nginx.config import IngressNginx
from waygate.resolver.manifests import parse_manifests
from waygate.resolver.model import (
    ADMITTED,
    FALSE,
    BalancePolicy,
    Canary,
    ExternalAuth,
    PathMatchType,
    PathModifierType,
    RateLimit,
    Route,
    SameSite,
    Service,
    ServicePort,
    UrlMirror,
)
from waygate.resolver.status import RouteStatusBook

P = "nginx.ingress.kubernetes.io/"
SETTINGS = IngressNginx()


def ingress(
    name: str,
    annotations: dict[str, str] | None = None,
    *,
    host: str = "app.example.com",
    path: str = "/",
    path_type: str = "Prefix",
    class_name: str | None = "nginx",
    tls: bool = False,
    namespace: str = "default",
) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "rules": [
            {
                "host": host,
                "http": {
                    "paths": [
                        {
                            "path": path,
                            "pathType": path_type,
                            "backend": {"service": {"name": "web", "port": {"number": 80}}},
                        }
                    ]
                },
            }
        ]
    }
    if class_name is not None:
        spec["ingressClassName"] = class_name
    if tls:
        spec["tls"] = [{"hosts": [host], "secretName": "cert"}]
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "Ingress",
        "metadata": {"name": name, "namespace": namespace, "annotations": annotations or {}},
        "spec": spec,
    }


def objects(*items: dict[str, Any], secrets: dict[Any, Any] | None = None) -> Objects:
    web = Service("default", "web", ports=(ServicePort("http", 80, "8080"),))
    found = Objects(services={web.key: web}, secrets=secrets or {})
    for item in items:
        meta = item["metadata"]
        found.of(item["kind"])[(meta.get("namespace", ""), meta["name"])] = item
    return found


def routes_of(*items: dict[str, Any], settings: IngressNginx | None = SETTINGS) -> list[Route]:
    return translate(objects(*items), ingress_nginx=settings).routes


def by_ingress(routes: list[Route], name: str) -> list[Route]:
    return [r for r in routes if r.origin.endswith("/" + name)]


def served(routes: list[Route], name: str) -> bool:
    mine = by_ingress(routes, name)
    return bool(mine) and all(r.ingress_refusal is None for r in mine)


def refusal(routes: list[Route], name: str) -> tuple[str, str]:
    mine = by_ingress(routes, name)
    assert mine, f"no routes for {name}"
    found = mine[0].ingress_refusal
    assert found is not None, f"{name} is served"
    assert all(b.invalid for r in mine for b in r.backends), "a refused route has a usable backend"
    return found


# ---------------------------------------------------------------- the class


def test_class_nginx_without_an_ingressclass_object_is_served_with_the_flag_only():
    item = ingress("plain")
    assert served(routes_of(item), "plain")
    assert routes_of(item, settings=None) == []


def test_legacy_class_annotation_and_a_renamed_class():
    legacy = ingress("legacy", class_name=None)
    legacy["metadata"]["annotations"]["kubernetes.io/ingress.class"] = "nginx"
    assert served(routes_of(legacy), "legacy")
    other = ingress("other", class_name="internal")
    assert routes_of(other) == []
    assert served(routes_of(other, settings=IngressNginx(class_name="internal")), "other")


def test_ingressclass_of_controller_k8s_io_ingress_nginx_is_ours_whatever_its_name():
    klass = {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "IngressClass",
        "metadata": {"name": "public"},
        "spec": {"controller": "k8s.io/ingress-nginx"},
    }
    assert served(routes_of(klass, ingress("pub", class_name="public")), "pub")


def test_an_ingressclass_named_nginx_of_another_controller_is_not_ours():
    klass = {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "IngressClass",
        "metadata": {"name": "nginx"},
        "spec": {"controller": "example.com/other"},
    }
    assert routes_of(klass, ingress("x")) == []


def test_custom_annotation_prefix():
    item = ingress("pre", {"example.org/rewrite-target": "/v2", P + "rewrite-target": "/v1"})
    [route] = routes_of(item, settings=IngressNginx(prefix="example.org"))
    assert route.filters is not None and route.filters.rewrite is not None
    assert route.filters.rewrite.path == "/v2"


# ---------------------------------------------------------------- annotations honoured


def test_rewrite_target_prefix_idiom_becomes_a_prefix_replacement():
    item = ingress(
        "rw",
        {P + "use-regex": "true", P + "rewrite-target": "/$2"},
        path="/something(/|$)(.*)",
        path_type="ImplementationSpecific",
    )
    [route] = routes_of(item)
    assert route.matches[0].path_type is PathMatchType.PREFIX
    assert route.matches[0].path == "/something"
    assert route.filters and route.filters.rewrite
    assert route.filters.rewrite.path_type is PathModifierType.PREFIX
    assert route.filters.rewrite.path == "/"


def test_rewrite_target_without_groups_replaces_the_whole_path_and_matches_by_regex():
    [route] = routes_of(ingress("rw", {P + "rewrite-target": "/"}, path="/api"))
    # ingress-nginx makes the location a regex (`location ~* "^/api"`) once rewriting.
    assert route.matches[0].path_type is PathMatchType.REGEX
    assert re.fullmatch(route.matches[0].path, "/API/users")
    assert route.filters and route.filters.rewrite
    assert route.filters.rewrite.path_type is PathModifierType.FULL


def test_use_regex_is_case_insensitive_and_anchored_at_the_start_as_nginx_location():
    item = ingress(
        "re", {P + "use-regex": "true"}, path="/api/v[0-9]+", path_type="ImplementationSpecific"
    )
    [route] = routes_of(item)
    match = route.matches[0]
    assert match.path_type is PathMatchType.REGEX
    pattern = re.compile(match.path)
    assert pattern.fullmatch("/API/v12/users")
    assert not pattern.fullmatch("/x/api/v1")


def test_ssl_redirect_is_on_by_default_for_tls_hosts_with_308():
    secret = yaml.safe_load(tls_secret("default", "cert", "app.example.com"))
    found = objects(ingress("tls", tls=True), secrets={("default", "cert"): secret})
    routes = translate(found, ingress_nginx=SETTINGS).routes
    plain = [r for r in routes if r.listener_port == 80]
    secure = [r for r in routes if r.listener_port == 443]
    assert plain and secure
    assert plain[0].filters and plain[0].filters.redirect
    assert plain[0].filters.redirect.scheme == "https"
    assert plain[0].filters.redirect.status == 308
    assert secure[0].tls is not None and secure[0].tls.hsts is not None
    assert secure[0].tls.hsts.max_age == 31536000


def test_ssl_redirect_false_and_force_ssl_redirect():
    [route] = routes_of(ingress("f", {P + "force-ssl-redirect": "true"}))
    assert route.filters and route.filters.redirect and route.filters.redirect.status == 308
    [route] = routes_of(ingress("n", {P + "ssl-redirect": "false"}))
    assert route.filters is not None and route.filters.redirect is None


def test_permanent_redirect_app_root_www_alias_vhost_and_headers():
    item = ingress(
        "many",
        {
            P + "permanent-redirect": "https://new.example.com/landing",
            P + "permanent-redirect-code": "308",
        },
    )
    [route] = routes_of(item)
    redirect = route.filters.redirect if route.filters else None
    assert redirect is not None
    # nginx's `return 308 URL`: the Location is the target as written.
    assert (route.redirect_location, redirect.status) == ("https://new.example.com/landing", 308)
    item = ingress(
        "more",
        {
            P + "app-root": "/app",
            P + "from-to-www-redirect": "true",
            P + "server-alias": "alias.example.com",
            P + "upstream-vhost": "internal.local",
            P + "x-forwarded-prefix": "/prefix",
        },
        host="www.example.com",
    )
    routes = routes_of(item)
    hosts = {r.host for r in routes}
    assert {"www.example.com", "alias.example.com", "example.com"} <= hosts
    app_root = [r for r in routes if ":app-root:" in r.name and r.host == "www.example.com"]
    assert app_root and app_root[0].filters and app_root[0].filters.redirect
    assert app_root[0].filters.redirect.path == "/app"
    assert app_root[0].filters.redirect.status == 302
    www = [r for r in routes if r.host == "example.com"]
    assert www[0].filters and www[0].filters.redirect
    assert www[0].filters.redirect.hostname == "www.example.com"
    main = next(r for r in routes if r.host == "www.example.com" and ":p0:" in r.name)
    assert (
        main.filters and main.filters.rewrite and main.filters.rewrite.hostname == "internal.local"
    )
    assert main.filters.request_headers
    assert ("X-Forwarded-Prefix", "/prefix") in main.filters.request_headers.set


def test_affinity_balance_timeouts_and_backend_protocol():
    item = ingress(
        "traffic",
        {
            P + "affinity": "cookie",
            P + "session-cookie-name": "route",
            P + "session-cookie-samesite": "Strict",
            P + "load-balance": "ewma",
            P + "proxy-connect-timeout": "3",
            P + "proxy-read-timeout": "120",
            P + "backend-protocol": "GRPC",
        },
    )
    [route] = routes_of(item)
    assert not route.sticky.disable_cookies
    assert route.sticky.cookie_name == "route"
    assert route.sticky.same_site is SameSite.STRICT
    assert route.balance is BalancePolicy.LEAST_CONN
    assert route.timeouts.connect == 3 and route.timeouts.server == 120
    assert route.upstream_protocol == "grpc"
    assert any(
        line.startswith("load-balance: honoured-with-difference") for line in route.ingress_verdicts
    )


@pytest.mark.parametrize(("value", "buffered"), [(None, True), ("on", True), ("off", False)])
def test_proxy_request_buffering_maps_onto_the_routes_request_buffering(value, buffered):
    # On by default, as nginx: the body is taken in before a backend connection is used.
    annotations = {} if value is None else {P + "proxy-request-buffering": value}
    [route] = routes_of(ingress("uploads", annotations))
    assert route.request_buffering is buffered
    # Honoured: nothing is reported as not honoured or different.
    assert not [v for v in route.ingress_verdicts if v.startswith("proxy-request-buffering")]


def test_default_balance_is_round_robin_as_ingress_nginx():
    [route] = routes_of(ingress("rr"))
    assert route.balance is BalancePolicy.ROUND_ROBIN


def test_custom_headers_from_a_configmap():
    headers = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "hdrs", "namespace": "default"},
        "data": {"X-Frame-Options": "DENY"},
    }
    listed = {"global-allowed-response-headers": "X-Frame-Options"}
    [route] = _global(listed, headers, ingress("ch", {P + "custom-headers": "hdrs"}))
    assert route.filters and route.filters.response_headers
    assert ("X-Frame-Options", "DENY") in route.filters.response_headers.set
    # customheaders/main.go: a header the ConfigMap's list does not name (exactly)
    # denies the location (503): here the Ingress is not served.
    for data in ({}, {"global-allowed-response-headers": "x-frame-options,X-Other"}):
        [unlisted] = _global(data, headers, ingress("ch", {P + "custom-headers": "hdrs"}))
        assert unlisted.ingress_refusal is not None
        assert "global-allowed-response-headers" in unlisted.ingress_refusal[1]


# ---------------------------------------------------------------- fail closed


@pytest.mark.parametrize(
    "annotation,value",
    [
        ("auth-type", "digest"),  # (without auth-secret)
        ("auth-tls-secret", "default/ca"),
        ("limit-rate", "-1"),
        ("enable-modsecurity", "true"),
        ("enable-owasp-core-rules", "true"),
        ("modsecurity-snippet", "SecRuleEngine On"),
        ("limit-something-new", "1"),
    ],
)
def test_an_access_annotation_not_honoured_makes_the_ingress_not_served(annotation, value):
    routes = routes_of(
        ingress("guarded", {P + annotation: value}), ingress("other", host="o.example.com")
    )
    reason, message = refusal(routes, "guarded")
    assert reason == "UnsupportedAnnotation"
    assert "Ingress default/guarded" in message and annotation in message
    assert served(routes, "other")


def test_a_refused_route_is_not_admitted_by_the_status_book():
    routes = routes_of(ingress("guarded", {P + "enable-modsecurity": "true"}))
    book = RouteStatusBook()
    statuses = book.update(
        {r.key: r for r in routes},
        lambda ns, name: Service(ns, name, ports=(ServicePort("http", 80, "8080"),)),
        lambda ns, name: (),
        changed_routes=[r.key for r in routes],
        now=datetime.now(UTC),
    )
    [status] = statuses.values()
    admitted = status.condition(ADMITTED)
    assert admitted is not None and admitted.status == FALSE
    assert admitted.reason == "UnsupportedAnnotation"
    assert not status.admitted
    honoured = status.condition("AnnotationsHonoured")
    assert honoured is not None and "enable-modsecurity: not-honoured" in honoured.message


def test_non_access_annotation_not_honoured_is_served_and_reported():
    [route] = routes_of(
        ingress(
            "otel",
            {
                P + "fastcgi-index": "index.php",
                P + "enable-opentelemetry": "true",
                P + "opentelemetry-operation-name": "HTTP $request_id",
            },
        )
    )
    assert route.ingress_refusal is None
    assert any(line.startswith("fastcgi-index: not-honoured") for line in route.ingress_verdicts)
    assert any(
        line.startswith("opentelemetry-operation-name: not-honoured ($request_id")
        for line in route.ingress_verdicts
    )
    assert route.span_name == "" and not route.tracing_off


def canary_ingress(name: str, annotations: dict[str, str], path: str = "/") -> dict[str, Any]:
    item = ingress(name, {P + "canary": "true", **annotations}, path=path)
    item["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"]["name"] = "web-v2"
    return item


def test_a_canary_by_weight_is_folded_into_its_main_route():
    routes = routes_of(ingress("main"), canary_ingress("canary", {P + "canary-weight": "10"}))
    [route] = routes
    assert route.origin == "Ingress default/main"
    assert [(b.service, b.weight) for b in route.backends] == [("web", 90), ("web-v2", 10)]
    assert by_ingress(routes, "canary") == []


def test_a_canary_weight_total_above_the_proxys_scale_is_scaled():
    canary = canary_ingress(
        "canary", {P + "canary-weight": "250", P + "canary-weight-total": "1000"}
    )
    [route] = routes_of(ingress("main"), canary)
    assert [(b.service, b.weight) for b in route.backends] == [("web", 192), ("web-v2", 64)]


def test_a_canary_by_header_and_cookie_become_the_main_routes_canary_policy():
    # The proxy decides per request (waygate.proxy.canary), so no route of its own.
    routes = routes_of(
        ingress("main"),
        canary_ingress(
            "canary",
            {
                P + "canary-by-header": "X-Region",
                P + "canary-by-header-value": "eu",
                P + "canary-by-cookie": "Canary-By-Cookie",
                P + "canary-weight": "5",
                P + "canary-weight-total": "10",
            },
        ),
    )
    [route] = routes
    assert [(b.service, b.weight) for b in route.backends] == [("web", 95), ("web-v2", 5)]
    # balancer.lua draws 1..max(100, weight-total): a total under 100 counts as 100.
    assert route.canary == Canary(
        main_backends=1,
        weight=5,
        weight_total=100,
        header="X-Region",
        header_value="eu",
        cookie="Canary-By-Cookie",
    )
    assert not [line for line in route.ingress_verdicts if "canary-by-cookie" in line]
    [route] = routes_of(
        ingress("main"),
        canary_ingress(
            "canary", {P + "canary-by-header": "User-Agent", P + "canary-by-header-pattern": "Beta"}
        ),
    )
    assert route.canary is not None and route.canary.header_pattern == "Beta"


def test_affinity_canary_behavior_is_read_on_the_canary_ingress():
    main = ingress("main", {P + "affinity": "cookie"})
    [route] = routes_of(main, canary_ingress("canary", {P + "canary-weight": "50"}))
    assert route.canary is not None and not route.canary.legacy_affinity
    [route] = routes_of(
        main,
        canary_ingress(
            "canary", {P + "canary-weight": "50", P + "affinity-canary-behavior": "legacy"}
        ),
    )
    assert route.canary is not None and route.canary.legacy_affinity
    # Judged on the canary Ingress; on a main Ingress it does nothing.
    verdicts = {
        name: {f.annotation: f.verdict for f in judge(item, SETTINGS, {})[0].findings}
        for name, item in (
            ("canary", canary_ingress("c", {P + "affinity-canary-behavior": "sticky"})),
            ("main", ingress("m", {P + "affinity-canary-behavior": "sticky"})),
        )
    }
    assert verdicts["canary"]["affinity-canary-behavior"] is Verdict.DIFFERENT
    assert verdicts["main"]["affinity-canary-behavior"] is Verdict.NOOP


def test_a_second_canary_of_one_main_route_is_not_used():
    # balancer.lua uses the first alternative backend only.
    [route] = routes_of(
        ingress("main"),
        canary_ingress("one", {P + "canary-weight": "10"}),
        canary_ingress("two", {P + "canary-weight": "90"}),
    )
    assert route.canary is not None and route.canary.weight in (10, 90)
    assert len(route.backends) == 2


def test_mirror_target_host_and_request_body_become_the_routes_url_mirror():
    # mirror/main.go: the target as given, the body on unless "off"; Host the
    # mirror-host (the proxy takes the URL's host when it is empty).
    [route] = routes_of(
        ingress(
            "m",
            {
                P + "mirror-target": "https://test.env.com$request_uri",
                P + "mirror-host": "copies.example.com",
                P + "mirror-request-body": "off",
            },
        )
    )
    assert route.url_mirror == UrlMirror(
        "https://test.env.com$request_uri", "copies.example.com", request_body=False
    )
    assert route.ingress_refusal is None
    [route] = routes_of(ingress("m", {P + "mirror-target": "http://localhost/mirror"}))
    assert route.url_mirror == UrlMirror("http://localhost/mirror")
    # Another nginx variable is not filled in: reported, the Ingress still served.
    [route] = routes_of(ingress("m", {P + "mirror-target": "http://m.example$host$uri"}))
    assert route.url_mirror is None and route.ingress_refusal is None
    assert any(line.startswith("mirror-target: not-honoured") for line in route.ingress_verdicts)
    # Configuration syntax stays refused (the grammar: CVE-2025-1974's class).
    [route] = routes_of(ingress("m", {P + "mirror-target": "http://m.example/;evil"}))
    assert route.ingress_refusal is not None and route.ingress_refusal[0] == "InvalidAnnotation"


def test_a_canary_without_a_main_ingress():
    assert routes_of(canary_ingress("alone", {P + "canary-weight": "50"})) == []


def test_a_controller_configmap_key_bearing_on_access_refuses_every_ingress_and_applies_live():
    config = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "ingress-nginx-controller", "namespace": "ingress-nginx"},
        "data": {"enable-modsecurity": "true"},
    }
    settings = IngressNginx(configmap=("ingress-nginx", "ingress-nginx-controller"))
    routes = routes_of(config, ingress("a"), settings=settings)
    assert refusal(routes, "a")[0] == "UnsupportedConfiguration"
    relaxed = copy.deepcopy(config)
    relaxed["data"] = {"ssl-redirect": "false", "proxy-read-timeout": "90"}
    [route] = routes_of(relaxed, ingress("a"), settings=settings)
    assert route.ingress_refusal is None and route.timeouts.server == 90


# ---------------------------------------------------------------- snippets


def _allowing(*items: dict[str, Any]) -> list[Route]:
    config = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "c", "namespace": "ingress-nginx"},
        "data": {"allow-snippet-annotations": "true", "annotations-risk-level": "Critical"},
    }
    return routes_of(config, *items, settings=IngressNginx(configmap=("ingress-nginx", "c")))


def test_snippets_are_refused_unless_the_configmap_allows_them():
    snippet = {P + "configuration-snippet": 'more_set_headers "X-Test: 1";'}
    routes = routes_of(ingress("s", snippet), ingress("t", host="t.example.com"))
    assert refusal(routes, "s")[0] == "SnippetsNotAllowed"
    assert served(routes, "t")
    [route] = _allowing(ingress("s", snippet))
    assert route.filters and route.filters.response_headers
    assert ("X-Test", "1") in route.filters.response_headers.set


def test_the_literal_snippet_subset():
    text = (
        'more_set_headers "X-A: a" "X-B: b";\n'
        "more_clear_headers Server;\n"
        "add_header X-C c always;\n"
        "proxy_set_header X-D d;\n"
    )
    [route] = _allowing(ingress("s", {P + "configuration-snippet": text}))
    assert route.filters and route.filters.response_headers and route.filters.request_headers
    assert route.filters.response_headers.set == (("X-A", "a"), ("X-B", "b"))
    assert route.filters.response_headers.remove == ("Server",)
    assert route.filters.response_headers.add == (("X-C", "c"),)
    assert route.filters.request_headers.set == (("X-D", "d"),)
    [route] = _allowing(ingress("r", {P + "server-snippet": "return 301 https://x.example.com/;"}))
    assert route.filters and route.filters.redirect and route.filters.redirect.status == 301


@pytest.mark.parametrize(
    "text,named",
    [
        ("proxy_pass http://evil;", "proxy_pass"),
        ("content_by_lua_block { os.execute('id') }", "blocks"),
        ('more_set_headers "X: $host";', "variables"),
        ("add_header X y; # hidden", "comments"),
        ("load_module /tmp/x.so;", "load_module"),
        ("more_set_headers 'X: 1'", "terminated"),
        ("proxy_set_header Content-Length 0;", "Content-Length"),
    ],
)
def test_anything_else_in_a_snippet_refuses_the_ingress_naming_it(text, named):
    routes = _allowing(ingress("s", {P + "configuration-snippet": text}), ingress("t", host="t.x"))
    reason, message = refusal(routes, "s")
    assert reason == "UnsupportedAnnotation" and named in message
    assert served(routes, "t")


def test_auth_and_stream_snippets_are_never_honoured():
    routes = _allowing(ingress("s", {P + "stream-snippet": "server { listen 9000; }"}))
    assert refusal(routes, "s")[0] == "UnsupportedAnnotation"


def test_parse_snippet_keeps_quoted_words_literal():
    assert parse_snippet("add_header 'X-Y' \"a b\";") == [("add_header", ["X-Y", "a b"])]


# ---------------------------------------------------------------- injection (published payloads)

# Wiz, "IngressNightmare" (2025-03-24): the annotation payloads as published.
CVE_2025_24514 = {P + "auth-url": "http://example.com/#;\ninjection_point"}
CVE_2025_1097 = {
    P + "auth-tls-match-cn": "CN=abc #(\n){}\n }}\nssl_engine foobar;\n#",
    P + "auth-tls-secret": "default/ca",
}
CVE_2025_1974 = {
    P + "auth-tls-match-cn": "CN=abc #(\n){}\n }}\nssl_engine ../../../../../../proc/22/fd/45;\n#",
    P + "auth-tls-secret": "kube-system/konnectivity-certs",
}
CVE_2025_1098_MIRROR = {
    P + "mirror-target": "https://127.0.0.1:443",
    P + "mirror-host": "test.com\n}\nssl_engine foobar;\n#",
}
CVE_2026_24512_PATH = (
    '/x" {\n}\nserver { listen 1337; location / { return 200 pwned; } }\nlocation /y {#'
)


@pytest.mark.parametrize(
    "annotations,field",
    [
        (CVE_2025_24514, "auth-url"),
        (CVE_2025_1097, "auth-tls-match-cn"),
        (CVE_2025_1974, "auth-tls-match-cn"),
        (CVE_2025_1098_MIRROR, "mirror-host"),
    ],
    ids=["CVE-2025-24514", "CVE-2025-1097", "CVE-2025-1974", "CVE-2025-1098"],
)
def test_ingressnightmare_annotation_payloads_are_refused_alone(annotations, field):
    routes = routes_of(ingress("evil", annotations), ingress("good", host="good.example.com"))
    reason, message = refusal(routes, "evil")
    assert reason == "InvalidAnnotation"
    assert "Ingress default/evil" in message and field in message
    assert served(routes, "good")


def test_cve_2025_1098_the_ingress_uid_is_never_used():
    item = ingress("uid", {P + "mirror-target": "https://127.0.0.1:443"})
    item["metadata"]["uid"] = "InjectTest#;\n\n}\n}\n}\nssl_engine foobar"
    [route] = routes_of(item)
    assert "InjectTest" not in repr(route)
    # The mirror goes to the URL itself (no location named after the uid).
    assert route.url_mirror is not None and route.url_mirror.target == "https://127.0.0.1:443"


@pytest.mark.parametrize("path_type", ["ImplementationSpecific", "Prefix", "Exact"])
def test_cve_2026_24512_path_injection_is_refused_alone(path_type):
    evil = ingress("evil", path=CVE_2026_24512_PATH, path_type=path_type)
    routes = routes_of(evil, ingress("good", host="good.example.com"))
    reason, message = refusal(routes, "evil")
    assert reason in ("InvalidPath", "InvalidAnnotation")
    assert "spec.rules[0].http.paths[0].path" in message
    assert served(routes, "good")


def test_a_regex_path_needs_use_regex_and_exact_never_takes_one():
    routes = routes_of(ingress("r", path="/api/(.*)", path_type="ImplementationSpecific"))
    assert refusal(routes, "r")[0] == "InvalidPath"
    routes = routes_of(ingress("e", {P + "use-regex": "true"}, path="/api/(.*)", path_type="Exact"))
    assert refusal(routes, "e")[0] == "InvalidPath"


def test_in_manifests_mode_an_injected_ingress_is_refused_alone(tmp_path: Path):
    documents = [
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": "web", "namespace": "default"},
            "spec": {"ports": [{"port": 80, "targetPort": 8080, "name": "http"}]},
        },
        ingress("evil", CVE_2025_24514),
        ingress("path", path=CVE_2026_24512_PATH, host="p.example.com"),
        ingress("good", host="good.example.com"),
    ]
    text = yaml.safe_dump_all(documents)
    content = parse_manifests([(tmp_path / "all.yaml", text)], ingress_nginx=SETTINGS)
    assert served(content.routes, "good")
    assert refusal(content.routes, "evil")[0] == "InvalidAnnotation"
    assert refusal(content.routes, "path")[0] == "InvalidPath"


# ---------------------------------------------------------------- the catalogue


def test_the_catalogue_covers_every_documented_annotation():
    documented = set(_DOCUMENTED.split())
    missing = documented - set(CATALOGUE)
    assert not missing, missing
    assert len(CATALOGUE) >= 130


@pytest.mark.parametrize("entry", catalogue.ENTRIES, ids=lambda e: e.name)
def test_every_grammar_refuses_configuration_syntax(entry):
    for payload in ("x;\nload_module /tmp/evil.so;", "a}\n#", "'quoted'", '"q"', "$host"):
        if entry.grammar is catalogue.any_text:
            continue
        if payload == "$host" and entry.name in (
            "upstream-hash-by",
            "auth-cache-key",
            "opentelemetry-operation-name",
        ):
            continue  # its grammar names variables (filled in by the proxy, never rendered)
        assert entry.grammar(payload) is not None, (entry.name, payload)
    if entry.access:  # what bears on access is honoured (its differences named), or refused
        assert entry.verdict is not Verdict.DIFFERENT or entry.note


def test_the_proxy_lacks_list_is_what_the_catalogue_says():
    lacks = catalogue.proxy_lacks()
    assert "auth-tls-secret" not in lacks and "global-rate-limit" in lacks
    assert "whitelist-source-range" not in lacks and "enable-cors" not in lacks
    assert "use-regex" not in lacks


# The annotation table of docs/user-guide/nginx-configuration/annotations.md
# (kubernetes/ingress-nginx, controller v1.15.1), plus those its source reads.
_DOCUMENTED = """
app-root affinity affinity-mode affinity-canary-behavior auth-realm auth-secret
auth-secret-type auth-type auth-tls-secret auth-tls-verify-depth auth-tls-verify-client
auth-tls-error-page auth-tls-pass-certificate-to-upstream auth-tls-match-cn auth-url
auth-cache-key auth-cache-duration auth-keepalive auth-keepalive-share-vars
auth-keepalive-requests auth-keepalive-timeout auth-proxy-set-headers auth-snippet
enable-global-auth backend-protocol canary canary-by-header canary-by-header-value
canary-by-header-pattern canary-by-cookie canary-weight canary-weight-total
client-body-buffer-size configuration-snippet custom-http-errors custom-headers
default-backend enable-cors cors-allow-origin cors-allow-methods cors-allow-headers
cors-expose-headers cors-allow-credentials cors-max-age force-ssl-redirect
from-to-www-redirect http2-push-preload limit-connections limit-rps permanent-redirect
permanent-redirect-code temporal-redirect temporal-redirect-code preserve-trailing-slash
proxy-body-size proxy-cookie-domain proxy-cookie-path proxy-connect-timeout
proxy-send-timeout proxy-read-timeout proxy-next-upstream proxy-next-upstream-timeout
proxy-next-upstream-tries proxy-request-buffering proxy-redirect-from proxy-redirect-to
proxy-http-version proxy-ssl-secret proxy-ssl-ciphers proxy-ssl-name proxy-ssl-protocols
proxy-ssl-verify proxy-ssl-verify-depth proxy-ssl-server-name enable-rewrite-log
rewrite-target satisfy server-alias server-snippet service-upstream
session-cookie-change-on-failure session-cookie-conditional-samesite-none
session-cookie-domain session-cookie-expires session-cookie-max-age session-cookie-name
session-cookie-path session-cookie-samesite session-cookie-secure ssl-redirect
ssl-passthrough stream-snippet upstream-hash-by x-forwarded-prefix load-balance
upstream-vhost denylist-source-range whitelist-source-range proxy-buffering
proxy-buffers-number proxy-buffer-size proxy-busy-buffers-size proxy-max-temp-file-size
ssl-ciphers ssl-prefer-server-ciphers connection-proxy-header enable-access-log
enable-opentelemetry opentelemetry-trust-incoming-span use-regex enable-modsecurity
enable-owasp-core-rules modsecurity-transaction-id modsecurity-snippet mirror-request-body
mirror-target mirror-host allowlist-source-range auth-always-set-cookie auth-method
auth-request-redirect auth-response-headers auth-signin auth-signin-redirect-param
disable-proxy-intercept-errors fastcgi-index fastcgi-params-configmap limit-allowlist
limit-burst-multiplier limit-rate limit-rate-after limit-rpm limit-whitelist
opentelemetry-operation-name relative-redirects upstream-hash-by-subset
upstream-hash-by-subset-size use-port-in-redirects
"""


# ---------------------------------------------------------------- the resolver's flags


@pytest.mark.parametrize(
    "flags,message",
    [
        ({"ingress_nginx_configmap": "ns/cm"}, "needs --ingress-nginx"),
        ({"ingress_nginx": "true"}, "needs --kubernetes or --manifests"),
        (
            {"ingress_nginx": "true", "manifests": "{dir}", "ingress_nginx_configmap": "nope"},
            "must be NAMESPACE/NAME",
        ),
        (
            {"ingress_nginx": "true", "manifests": "{dir}", "tcp_services_configmap": "a"},
            "tcp_services_configmap: 'a' must be NAMESPACE/NAME",
        ),
        (
            {"ingress_nginx": "true", "manifests": "{dir}", "annotations_prefix": "Bad Prefix"},
            "DNS",
        ),
        ({"admission_webhook_port": "8443"}, "needs --ingress-nginx"),
        (
            {"ingress_nginx": "true", "manifests": "{dir}", "admission_webhook_port": "8443"},
            "needs --kubernetes",
        ),
    ],
)
def test_ingress_nginx_flags_are_checked(tmp_path: Path, flags: dict[str, str], message: str):
    from waygate.core.settings import SettingsError, load_settings
    from waygate.resolver.app import Settings

    flags = {k: v.format(dir=tmp_path) for k, v in flags.items()}
    with pytest.raises(SettingsError, match=message):
        load_settings(Settings, flags=flags, env={})


def test_ingress_nginx_flags_become_the_settings(tmp_path: Path):
    from waygate.core.settings import load_settings
    from waygate.resolver.app import Settings

    flags = {
        "ingress_nginx": "true",
        "manifests": str(tmp_path),
        "ingress_nginx_class": "public",
        "annotations_prefix": "example.org",
        "ingress_nginx_configmap": "ingress-nginx/controller",
        "default_ssl_certificate": "ingress-nginx/default-cert",
    }
    settings = load_settings(Settings, flags=flags, env={}).ingress_nginx_settings()
    assert settings == IngressNginx(
        class_name="public",
        prefix="example.org",
        configmap=("ingress-nginx", "controller"),
        default_certificate=("ingress-nginx", "default-cert"),
    )


def test_the_default_ssl_certificate_serves_tls_hosts_without_a_secret():
    secret = yaml.safe_load(tls_secret("ingress-nginx", "default-cert", "app.example.com"))
    item = ingress("nosecret")
    item["spec"]["tls"] = [{"hosts": ["app.example.com"]}]
    found = objects(item, secrets={("ingress-nginx", "default-cert"): secret})
    settings = IngressNginx(default_certificate=("ingress-nginx", "default-cert"))
    routes = translate(found, ingress_nginx=settings).routes
    assert any(r.listener_port == 443 and r.tls is not None for r in routes)
    assert not any(r.listener_port == 443 for r in routes_of(item))


def test_every_condition_is_a_metric_sample():
    from waygate.resolver.metrics import RouteEndpoints
    from waygate.resolver.store import Store

    store = Store()
    store.replace_source(
        "test", routes=routes_of(ingress("guarded", {P + "enable-modsecurity": "true"}))
    )
    collector = RouteEndpoints()
    collector.store = store
    samples = [s for family in collector.collect() for s in family.samples]
    labels = [s.labels for s in samples if s.name == "waygate_resolver_route_condition"]
    assert {"type": "Admitted", "status": "False", "reason": "UnsupportedAnnotation"}.items() <= (
        next(lab for lab in labels if lab["type"] == "Admitted").items()
    )
    assert any(lab["type"] == "AnnotationsHonoured" for lab in labels)


def test_ssl_passthrough_relays_the_host_by_sni_and_terminates_nothing():
    item = ingress("argocd", {P + "ssl-passthrough": "true"}, tls=True)
    secret = yaml.safe_load(tls_secret("default", "cert", "app.example.com"))
    routes = translate(
        objects(item, secrets={("default", "cert"): secret}), ingress_nginx=SETTINGS
    ).routes
    passthrough = [
        r for r in routes if r.tls is not None and r.tls.termination.value == "passthrough"
    ]
    assert [(r.host, r.listener_port, r.matches) for r in passthrough] == [
        ("app.example.com", 443, ())
    ]
    assert not [r for r in routes if r.listener_port == 443 and r not in passthrough]
    [plain] = [r for r in routes if r.listener_port == 80]
    assert plain.filters and plain.filters.redirect and plain.filters.redirect.scheme == "https"


def test_forwarded_headers_follow_the_configmap_as_ingress_nginx():
    from waygate.resolver.model import ForwardedHeadersMode

    [route] = routes_of(ingress("f"))
    assert route.forwarded_headers is ForwardedHeadersMode.REPLACE
    settings = IngressNginx(configmap=("ingress-nginx", "c"))
    for data, mode in (
        ({"use-forwarded-headers": "true"}, ForwardedHeadersMode.IF_NONE),
        (
            {"use-forwarded-headers": "true", "compute-full-forwarded-for": "true"},
            ForwardedHeadersMode.APPEND,
        ),
    ):
        config = {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": "c", "namespace": "ingress-nginx"},
            "data": data,
        }
        [route] = routes_of(config, ingress("f"), settings=settings)
        assert route.forwarded_headers is mode


def test_a_regex_on_a_host_makes_every_prefix_path_of_the_host_a_regex():
    plain = ingress("plain", path="/.well-known/acme/challenge")
    rewriting = ingress("rewriting", {P + "rewrite-target": "/new"}, path="/")
    other_host = ingress("other", host="other.example.com", path="/x")
    routes = routes_of(plain, rewriting, other_host)
    by_name = {r.origin.rpartition("/")[2]: r for r in routes}
    assert by_name["plain"].matches[0].path_type is PathMatchType.REGEX
    assert re.fullmatch(by_name["plain"].matches[0].path, "/.WELL-KNOWN/acme/challenge/x")
    assert by_name["other"].matches[0].path_type is PathMatchType.PREFIX
    # Longest path first, as ingress-nginx sorts a server's locations.
    assert len(by_name["plain"].matches[0].path) > len(by_name["rewriting"].matches[0].path)


def test_waygates_own_class_with_ingress_nginx_annotations_is_judged_too():
    # The issue's first finding: an Ingress of Waygate's class with auth-url and
    # whitelist-source-range was served, both silently ignored.
    klass = {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "IngressClass",
        "metadata": {"name": "waygate"},
        "spec": {"controller": "waygate.io/ingress-controller"},
    }
    guarded = ingress(
        "guarded",
        {P + "auth-url": "https://auth.example.com/", P + "enable-modsecurity": "true"},
        class_name="waygate",
    )
    plain = ingress("plain", class_name="waygate", host="plain.example.com")
    for settings in (None, SETTINGS):
        routes = routes_of(klass, guarded, plain, settings=settings)
        assert refusal(routes, "guarded")[0] == "UnsupportedAnnotation"
        [route] = by_ingress(routes, "plain")
        assert route.ingress_refusal is None and route.balance is BalancePolicy.DEFAULT


@pytest.mark.parametrize(
    "annotations",
    [
        {P + "enable-modsecurity": "false", P + "enable-owasp-core-rules": "false"},
        {P + "limit-rps": "0"},
        {P + "enable-cors": "false", P + "cors-allow-origin": "https://a.example.com"},
        {P + "auth-realm": "Realm", P + "auth-secret": "basic"},  # no auth-type
        {P + "auth-tls-verify-client": "off"},  # no auth-tls-secret
        {P + "session-cookie-path": "/"},  # no affinity
    ],
)
def test_annotations_that_ask_for_nothing_do_not_refuse(annotations):
    [route] = routes_of(ingress("quiet", annotations))
    assert route.ingress_refusal is None
    assert not any(": not-honoured" in line for line in route.ingress_verdicts)


def test_the_status_page_shows_why_an_ingress_is_not_served():
    import json

    from waygate.resolver import page
    from waygate.resolver.store import Store

    store = Store()
    store.replace_source(
        "test", routes=routes_of(ingress("guarded", {P + "enable-modsecurity": "true"}))
    )
    text = json.dumps([section.__dict__ for section in page.sections(store)], default=str)
    assert (
        "Ingress default/guarded: annotation nginx.ingress.kubernetes.io/enable-modsecurity" in text
    )
    assert "Admitted=False (UnsupportedAnnotation)" in text


def test_configmap_keys_not_honoured_are_reported_on_every_route():
    config = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "c", "namespace": "ingress-nginx"},
        "data": {"enable-brotli": "true", "worker-processes": "auto", "hsts": "true"},
    }
    settings = IngressNginx(configmap=("ingress-nginx", "c"))
    [route] = routes_of(config, ingress("a"), settings=settings)
    assert route.ingress_verdicts == ("ConfigMap ingress-nginx/c key enable-brotli: not-honoured",)


def test_proxy_body_size_from_the_annotation_or_the_configmap_default():
    config = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "c", "namespace": "ingress-nginx"},
        "data": {"proxy-body-size": "16m"},
    }
    settings = IngressNginx(configmap=("ingress-nginx", "c"))
    [route] = routes_of(config, ingress("a"), settings=settings)
    assert route.max_request_body == 16 * 1024**2 and route.ingress_verdicts == ()
    [default] = routes_of(ingress("b"))
    assert default.max_request_body == 1024**2  # ingress-nginx's 1m
    [own] = routes_of(ingress("c", {P + "proxy-body-size": "8k"}))
    assert own.max_request_body == 8192 and own.ingress_verdicts == ()
    [unlimited] = routes_of(ingress("d", {P + "proxy-body-size": "0"}))
    assert unlimited.max_request_body == 0


def test_affinity_mode_persistent_is_exact_balanced_a_difference():
    for mode, verdict in (("persistent", None), ("balanced", "honoured-with-difference")):
        [route] = routes_of(ingress("s", {P + "affinity": "cookie", P + "affinity-mode": mode}))
        lines = [line for line in route.ingress_verdicts if line.startswith("affinity-mode")]
        assert (lines[0].split(": ")[1].split(" ")[0] if lines else None) == verdict


def test_rewrite_target_alone_admits_no_regular_expression_path():
    item = ingress(
        "rw", {P + "rewrite-target": "/$1"}, path="/api/(.*)", path_type="ImplementationSpecific"
    )
    assert refusal(routes_of(item), "rw")[0] == "InvalidPath"


# ---------------------------------------------------------------- rate limits


def test_limit_annotations_become_the_routes_rate_limit():
    """internal/ingress/annotations/ratelimit (kubernetes/ingress-nginx): both rates
    apply, the burst is the rate times limit-burst-multiplier (5 by default), the
    allow-list is not limited; the answers are the ConfigMap's."""
    config = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "c", "namespace": "ingress-nginx"},
        "data": {"limit-req-status-code": "429", "limit-conn-status-code": "nope"},
    }
    limited = ingress(
        "limited",
        {
            P + "limit-rps": "10",
            P + "limit-rpm": "300",
            P + "limit-connections": "4",
            P + "limit-allowlist": "10.0.0.0/8, 192.168.1.1",
        },
    )
    routes = routes_of(
        config,
        limited,
        ingress("plain", host="p.example.com"),
        settings=IngressNginx(configmap=("ingress-nginx", "c")),
    )
    [route] = by_ingress(routes, "limited")
    assert route.ingress_refusal is None
    assert route.rate_limit == RateLimit(
        rps=10,
        rpm=300,
        burst_multiplier=5,
        connections=4,
        allow=("10.0.0.0/8", "192.168.1.1"),
        request_status=429,
        connection_status=503,  # not a status: ingress-nginx's default
    )
    assert not any("limit-" in line for line in route.ingress_verdicts)
    [plain] = by_ingress(routes, "plain")
    assert plain.rate_limit is None
    [route] = routes_of(ingress("m", {P + "limit-rpm": "60", P + "limit-burst-multiplier": "2"}))
    assert route.rate_limit == RateLimit(rpm=60, burst_multiplier=2)


def test_limit_rate_and_after_are_route_fields_in_bytes_with_the_configmaps_defaults():
    # ratelimit/main.go: the annotations, else the ConfigMap's limit-rate/-after
    # (defBackend), rendered `limit_rate {N}k` (template.go buildRateLimit).
    [route] = routes_of(ingress("r", {P + "limit-rate": "10", P + "limit-rate-after": "100"}))
    assert (route.limit_rate, route.limit_rate_after) == (10240, 102400)
    assert route.ingress_refusal is None
    config = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "c", "namespace": "ingress-nginx"},
        "data": {"limit-rate": "2", "limit-rate-after": "1"},
    }
    settings = IngressNginx(configmap=("ingress-nginx", "c"))
    by_name = {
        r.origin: r
        for r in routes_of(
            config,
            ingress("global"),
            ingress("off", {P + "limit-rate": "0"}, host="o.example.com"),
            settings=settings,
        )
    }
    assert by_name["Ingress default/global"].limit_rate == 2048
    assert by_name["Ingress default/global"].limit_rate_after == 1024
    assert by_name["Ingress default/off"].limit_rate == 0
    [plain] = routes_of(ingress("plain"))
    assert plain.limit_rate == 0


@pytest.mark.parametrize(
    "annotations",
    [
        {P + "limit-rps": "-1"},
        {P + "limit-rps": "5", P + "limit-rate": "-100"},  # a negative rate
        {P + "limit-rps": "ten"},
    ],
)
def test_a_limit_that_cannot_be_honoured_refuses_the_ingress(annotations):
    routes = routes_of(ingress("guarded", annotations), ingress("other", host="o.example.com"))
    assert refusal(routes, "guarded")[0] in ("UnsupportedAnnotation", "InvalidAnnotation")
    assert served(routes, "other")


# ---------------------------------------------------------------- external auth


def test_external_auth_annotations_become_the_routes_external_auth():
    """internal/ingress/annotations/authreq (kubernetes/ingress-nginx)."""
    headers = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "auth-headers", "namespace": "default"},
        "data": {"X-Tenant": "shop"},
    }
    guarded = ingress(
        "guarded",
        {
            P + "auth-url": "http://auth.default.svc:8080/check",
            P + "auth-method": "post",
            P + "auth-signin": "https://login.example.com/start",
            P + "auth-signin-redirect-param": "next",
            P + "auth-response-headers": "X-User, X-Email",
            P + "auth-request-redirect": "/after",
            P + "auth-proxy-set-headers": "default/auth-headers",
            P + "auth-keepalive": "10",
        },
    )
    routes = routes_of(headers, guarded, ingress("plain", host="p.example.com"))
    [route] = by_ingress(routes, "guarded")
    assert route.ingress_refusal is None
    assert route.external_auth == ExternalAuth(
        url="http://auth.default.svc:8080/check",
        method="POST",
        signin="https://login.example.com/start",
        signin_redirect_param="next",
        response_headers=("X-User", "X-Email"),
        request_redirect="/after",
        proxy_set_headers=(("X-Tenant", "shop"),),
    )
    assert not any(": not-honoured" in line for line in route.ingress_verdicts)
    # http://: exact (its Set-Cookie and WWW-Authenticate passed on as nginx does), so
    # no line (the verdict lines name what is not honoured exactly).
    assert not any(line.startswith("auth-") for line in route.ingress_verdicts)
    [plain] = by_ingress(routes, "plain")
    assert plain.external_auth is None


def test_external_auth_is_told_the_client_address_the_configmap_defines():
    """nginx.tmpl's auth location: X-Real-IP $remote_addr (real_ip with
    use-forwarded-headers through proxy-real-ip-cidr), $full_x_forwarded_for with
    compute-full-forwarded-for; use-proxy-protocol: the header's address is the peer's
    (the proxy's --proxy-protocol), so the auth service is told it as is."""
    item = ingress("guarded", {P + "auth-url": "http://auth/check"})
    data = {"use-forwarded-headers": "true", "proxy-real-ip-cidr": "10.0.0.0/8"}
    [route] = _global(data, item)
    assert route.external_auth is not None
    assert route.external_auth.trusted_proxies == ("10.0.0.0/8",)
    assert not route.external_auth.full_forwarded_for
    [route] = _global({**data, "compute-full-forwarded-for": "true"}, item)
    assert route.external_auth is not None and route.external_auth.full_forwarded_for
    [route] = _global({"use-proxy-protocol": "true"}, item)
    assert route.ingress_refusal is None and route.external_auth is not None
    assert route.external_auth.trusted_proxies == ()
    assert not any("X-Real-IP" in line for line in route.ingress_verdicts)


def test_the_documented_auth_cache_key_example_is_honoured():
    # annotations.md: "e.g. `$remote_user$http_authorization`".
    key = "$remote_user$http_authorization"
    [route] = routes_of(
        ingress("k", {P + "auth-url": "http://auth/check", P + "auth-cache-key": key})
    )
    assert route.ingress_refusal is None and route.external_auth is not None
    assert route.external_auth.cache_key == key


def test_external_auth_to_https_and_always_set_cookie():
    """authreq's auth-always-set-cookie; an https:// auth-url is served with its
    certificate verified (the named, stricter difference)."""
    guarded = ingress(
        "guarded",
        {
            P + "auth-url": "https://auth.example.com/check",
            P + "auth-always-set-cookie": "true",
        },
    )
    [route] = routes_of(guarded)
    assert route.ingress_refusal is None
    assert route.external_auth == ExternalAuth(
        url="https://auth.example.com/check", always_set_cookie=True
    )
    verdicts = "\n".join(route.ingress_verdicts)
    assert "auth-url: honoured-with-difference" in verdicts and "system trust store" in verdicts
    assert "auth-always-set-cookie" not in verdicts  # honoured exactly


@pytest.mark.parametrize(
    "annotations",
    [
        {P + "auth-url": "ftp://auth.example.com/check"},
        {P + "auth-url": "https://invalid..auth.url"},  # auth.go: "invalid url host"
        {P + "auth-url": "http://auth/check", P + "auth-proxy-set-headers": "default/missing"},
        {P + "auth-url": "http://auth/check", P + "auth-cache-key": "$request_body"},
        {P + "auth-url": "http://auth/check", P + "auth-always-set-cookie": "maybe"},
    ],
)
def test_external_auth_that_cannot_be_honoured_refuses_the_ingress(annotations):
    routes = routes_of(ingress("guarded", annotations), ingress("other", host="o.example.com"))
    assert refusal(routes, "guarded")[0] in ("UnsupportedAnnotation", "InvalidAnnotation")
    assert served(routes, "other")


def test_auth_cache_annotations_with_nginxs_defaults():
    auth = {P + "auth-url": "http://auth/check", P + "auth-cache-key": "$http_authorization"}
    [route] = routes_of(ingress("cached", auth))
    assert route.external_auth is not None
    assert route.external_auth.cache_key == "$http_authorization"
    assert route.external_auth.cache_durations == ((200, 300.0), (202, 300.0), (401, 300.0))
    auth[P + "auth-cache-duration"] = "200 10m, 1h"
    [route] = routes_of(ingress("cached", auth))
    assert route.external_auth is not None
    assert route.external_auth.cache_durations == (
        (200, 600.0),
        (200, 3600.0),
        (301, 3600.0),
        (302, 3600.0),
    )


def _global(data: dict[str, str], *items: dict[str, Any]) -> list[Route]:
    config = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "c", "namespace": "ingress-nginx"},
        "data": data,
    }
    return routes_of(config, *items, settings=IngressNginx(configmap=("ingress-nginx", "c")))


def test_global_auth_applies_to_every_ingress_unless_it_opts_out_or_has_its_own():
    """configmap.md global-auth-*: every Ingress, but enable-global-auth "false" and
    those with an auth-url of their own (internal/ingress/controller: globalExternalAuth)."""
    data = {
        "global-auth-url": "http://auth.infra.svc/check",
        "global-auth-signin": "https://login.example.com/",
        "global-auth-response-headers": "X-User",
        "global-auth-cache-key": "$http_authorization",
    }
    routes = _global(
        data,
        ingress("plain"),
        ingress("out", {P + "enable-global-auth": "false"}, host="o.example.com"),
        ingress("own", {P + "auth-url": "http://mine/check"}, host="m.example.com"),
    )
    [plain] = by_ingress(routes, "plain")
    assert plain.ingress_refusal is None
    assert plain.external_auth == ExternalAuth(
        "http://auth.infra.svc/check",
        signin="https://login.example.com/",
        response_headers=("X-User",),
        cache_key="$http_authorization",
        cache_durations=((200, 300.0), (202, 300.0), (401, 300.0)),
    )
    more = {"global-auth-url": "https://a/c", "global-auth-always-set-cookie": "true"}
    [tls] = _global({**data, **more}, ingress("plain"))
    assert tls.ingress_refusal is None and tls.external_auth is not None
    assert tls.external_auth.url == "https://a/c" and tls.external_auth.always_set_cookie
    [out] = by_ingress(routes, "out")
    assert out.ingress_refusal is None and out.external_auth is None
    [own] = by_ingress(routes, "own")
    assert own.external_auth is not None and own.external_auth.url == "http://mine/check"


@pytest.mark.parametrize(
    "data",
    [
        {"global-auth-url": "ftp://auth/check"},
        {"global-auth-url": "http://auth/check", "global-auth-method": "GET;evil"},
        {"global-auth-url": "http://auth/check", "global-auth-snippet": "return 200;"},
        {"global-auth-url": "http://auth/check", "global-auth-always-set-cookie": "maybe"},
    ],
)
def test_global_auth_that_cannot_be_honoured_serves_nothing(data):
    [route] = _global(data, ingress("plain"))
    assert route.ingress_refusal is not None
    assert route.ingress_refusal[0] == "UnsupportedConfiguration"


def test_cors_annotations_become_the_routes_cors():
    annotations = {
        P + "enable-cors": "true",
        P + "cors-allow-origin": "https://a.test, https://*.b.test",
        P + "cors-allow-methods": "POST, GET",
        P + "cors-allow-credentials": "false",
        P + "cors-max-age": "60",
        P + "cors-expose-headers": "X-A",
    }
    [route] = routes_of(ingress("cors", annotations))
    assert route.ingress_refusal is None and route.cors is not None
    assert route.cors.allow_origins == ("https://a.test", "https://*.b.test")
    assert (route.cors.allow_methods, route.cors.allow_credentials) == ("POST, GET", False)
    assert (route.cors.max_age, route.cors.expose_headers) == (60, "X-A")
    assert "Authorization" in route.cors.allow_headers  # ingress-nginx's default list
    # Listed origins: the one difference (the whole Origin must match).
    assert [line.split(":")[0] for line in route.ingress_verdicts] == ["cors-allow-origin"]
    [plain] = routes_of(ingress("plain", {P + "enable-cors": "true"}))
    assert plain.cors is not None and plain.cors.allow_origins == ("*",)
    assert plain.ingress_verdicts == ()
    [off] = routes_of(ingress("off", {P + "enable-cors": "false"}))
    assert off.cors is None


def test_a_cors_route_survives_the_proto():
    from waygate.resolver import convert

    [route] = routes_of(ingress("cors", {P + "enable-cors": "true", P + "cors-max-age": "5"}))
    again = convert.route_from_proto(convert.route_to_proto(route))
    assert again.cors == route.cors and again.max_request_body == route.max_request_body


def test_proxy_next_upstream_becomes_the_routes_redispatch_rule():
    # proxy.go It("should build proxy next upstream"): "error timeout http_502" with
    # -timeout and -tries (888888 is past the proxy's 100: reported, still served).
    [route] = routes_of(
        ingress(
            "next",
            {
                P + "proxy-next-upstream": "error timeout http_502",
                P + "proxy-next-upstream-tries": "5",
                P + "proxy-next-upstream-timeout": "0",
            },
        )
    )
    assert (route.next_upstream, route.next_upstream_tries) == ("error timeout http_502", 5)
    lines = dict(line.split(": ", 1) for line in route.ingress_verdicts)
    assert lines["proxy-next-upstream"].startswith("honoured-with-difference (http_502")
    assert "buffered whole in memory" in lines["proxy-next-upstream"]
    assert "proxy-next-upstream-tries" not in lines
    assert "proxy-next-upstream-timeout" not in lines  # 0: ingress-nginx's default
    [off] = routes_of(ingress("off", {P + "proxy-next-upstream": "off"}))
    assert off.next_upstream == "off"
    [timed] = routes_of(
        ingress(
            "t",
            {
                P + "proxy-next-upstream": "error timeout http_502",
                P + "proxy-next-upstream-timeout": "999999",
                P + "proxy-next-upstream-tries": "888888",
            },
        )
    )
    assert timed.next_upstream_timeout == 999999.0 and timed.ingress_refusal is None
    lines = dict(line.split(": ", 1) for line in timed.ingress_verdicts)
    assert lines["proxy-next-upstream-timeout"].startswith("honoured-with-difference")
    assert lines["proxy-next-upstream-tries"].startswith("not-honoured (outside 0..100")


def test_session_cookie_attributes_go_onto_the_sticky_cookie():
    annotations = {
        P + "affinity": "cookie",
        P + "session-cookie-path": "/app",
        P + "session-cookie-domain": "example.com",
        P + "session-cookie-expires": "100",
        P + "session-cookie-secure": "true",
    }
    [route] = routes_of(ingress("cookie", annotations))
    sticky = route.sticky
    assert (sticky.cookie_path, sticky.cookie_domain) == ("/app", "example.com")
    assert (sticky.cookie_max_age, sticky.cookie_secure) == (100, True)
    lines = dict(line.split(": ", 1) for line in route.ingress_verdicts)
    assert lines["session-cookie-expires"].startswith("honoured-with-difference")
    assert "session-cookie-path" not in lines and "session-cookie-secure" not in lines
    [located] = routes_of(ingress("loc", {P + "affinity": "cookie"}, path="/shop"))
    assert located.sticky.cookie_path == "/shop"  # ingress-nginx: the location's path


def test_the_proxy_cookie_line_carries_the_attributes():
    from waygate.proxy.routing import Defaults, _route_options
    from waygate.resolver.model import StickySessions

    route = Route(
        namespace="d",
        name="r",
        host="a.test",
        sticky=StickySessions(
            cookie_name="S",
            cookie_path="/app",
            cookie_domain="example.com",
            cookie_max_age=60,
            cookie_secure=True,
        ),
    )
    attributes = _route_options(route, Defaults()).cookie_attributes
    assert attributes == (
        b"; Path=/app; HttpOnly; SameSite=Lax; Domain=example.com; Max-Age=60; Secure"
    )


def test_upstream_hash_by_a_request_variable():
    [route] = routes_of(ingress("h", {P + "upstream-hash-by": "$request_uri"}))
    assert (route.balance.value, route.hash_by) == ("source", "$request_uri")
    assert route.ingress_verdicts[0].startswith("upstream-hash-by: honoured-with-difference")
    [other] = routes_of(ingress("o", {P + "upstream-hash-by": "$request_time"}))
    assert other.hash_by == "" and other.ingress_verdicts[0].startswith(
        "upstream-hash-by: not-honoured"
    )


def _hash_verdicts(annotations: dict[str, str]) -> dict[str, tuple[Verdict, str]]:
    item = ingress("h", {P + k: v for k, v in annotations.items()})
    return {f.annotation: (f.verdict, f.note) for f in judge(item, SETTINGS, {})[0].findings}


@pytest.mark.parametrize(
    ("size", "expected"), [(None, 3), ("0", 3), ("2", 2), (" 5 ", 5), ("1000", 1000)]
)
def test_upstream_hash_by_subset_becomes_the_routes_subset_size(size, expected):
    # ingress-nginx: upstreamhashby/main.go (0 or unset: 3), balancer/chashsubset.lua.
    annotations = {"upstream-hash-by": "$request_uri", "upstream-hash-by-subset": "true"}
    if size is not None:
        annotations["upstream-hash-by-subset-size"] = size
    [route] = routes_of(ingress("h", {P + k: v for k, v in annotations.items()}))
    assert (route.balance.value, route.hash_by) == ("source", "$request_uri")
    assert route.hash_subset_size == expected and route.ingress_refusal is None
    verdicts = _hash_verdicts(annotations)
    assert {k: v[0] for k, v in verdicts.items()} == dict.fromkeys(annotations, Verdict.HONOURED)
    assert "at random" in verdicts["upstream-hash-by-subset"][1]
    assert "next subset" in verdicts["upstream-hash-by-subset"][1]  # its failure rule, named


def test_upstream_hash_by_subset_with_the_client_address():
    [route] = routes_of(
        ingress("h", {P + "upstream-hash-by": "$remote_addr", P + "upstream-hash-by-subset": "1"})
    )
    assert (route.balance.value, route.hash_by, route.hash_subset_size) == ("source", "", 3)


@pytest.mark.parametrize(
    ("annotations", "verdict"),
    [
        # Without upstream-hash-by, or without the subset flag: nothing to do.
        ({"upstream-hash-by-subset": "true"}, Verdict.NOOP),
        ({"upstream-hash-by": "$host", "upstream-hash-by-subset-size": "4"}, Verdict.NOOP),
        ({"upstream-hash-by": "$host", "upstream-hash-by-subset": "false"}, Verdict.HONOURED),
        # A variable the proxy cannot compute: the subset is not honoured either.
        ({"upstream-hash-by": "$request_time", "upstream-hash-by-subset": "true"}, None),
    ],
)
def test_upstream_hash_by_subset_without_its_hashing(annotations, verdict):
    [route] = routes_of(ingress("h", {P + k: v for k, v in annotations.items()}))
    assert route.hash_subset_size == 0 and route.ingress_refusal is None
    found = _hash_verdicts(annotations)
    subset = [k for k in annotations if k.startswith("upstream-hash-by-subset")]
    expected = Verdict.NOT_HONOURED if verdict is None else verdict
    assert {found[k][0] for k in subset} == {expected}


@pytest.mark.parametrize("size", ["-1", "three", "3.5", "1234567890"])
def test_an_invalid_subset_size_refuses_the_ingress_alone(size):
    routes = routes_of(
        ingress(
            "bad",
            {
                P + "upstream-hash-by": "$request_uri",
                P + "upstream-hash-by-subset": "true",
                P + "upstream-hash-by-subset-size": size,
            },
        ),
        ingress("good", {P + "upstream-hash-by": "$request_uri"}, host="other.example.com"),
    )
    reason, message = refusal(routes, "bad")
    assert reason == "InvalidAnnotation" and "upstream-hash-by-subset-size" in message
    assert served(routes, "good")


def verdict_of(route: Route, short: str) -> str:
    return next(line for line in route.ingress_verdicts if line.startswith(short + ": "))


def test_opentelemetry_annotations_and_their_configmap_defaults():
    # ingress-nginx: OpenTelemetry is off unless the ConfigMap's enable-opentelemetry
    # or the Ingress's annotation turns it on; trust-incoming-span defaults to true;
    # the operation name's route variables are filled in here, the request's by the proxy.
    [plain] = routes_of(ingress("plain"))
    assert plain.tracing_off and not plain.untrusted_trace_context and plain.span_name == ""
    named = {
        P + "enable-opentelemetry": "true",
        P + "opentelemetry-trust-incoming-span": "false",
        P + "opentelemetry-operation-name": "$ingress_name $service_name $request_method $uri",
    }
    [on] = routes_of(ingress("on", named))
    assert not on.tracing_off and on.untrusted_trace_context
    assert on.span_name == "on web $request_method $uri"
    # (A route's verdict lines name what is not honoured exactly.)
    assert not any("trust-incoming-span" in line for line in on.ingress_verdicts)
    assert "honoured-with-difference" in verdict_of(on, "enable-opentelemetry")
    # The ConfigMap turns it on for every Ingress; an annotation turns it off again.
    data = {"enable-opentelemetry": "true", "opentelemetry-operation-name": "HTTP $host"}
    global_on, off = _global(
        data, ingress("g"), ingress("off", {P + "enable-opentelemetry": "false"}, host="o.test")
    )
    assert not global_on.tracing_off and global_on.span_name == "HTTP $host"
    assert off.tracing_off and off.span_name == ""
    # trust-incoming-span without OpenTelemetry on does nothing.
    [noop] = routes_of(ingress("n", {P + "opentelemetry-trust-incoming-span": "false"}))
    assert noop.tracing_off and not noop.untrusted_trace_context
    # A ConfigMap name with a variable nothing fills in is reported and not used.
    [unknown] = _global(
        {"enable-opentelemetry": "true", "opentelemetry-operation-name": "HTTP $request_id"},
        ingress("u"),
    )
    assert unknown.span_name == "" and not unknown.tracing_off
    # Configuration text never passes the grammar.
    [refused_route] = routes_of(
        ingress("x", {P + "opentelemetry-operation-name": "a;\nload_module /x.so;"})
    )
    assert refused_route.ingress_refusal is not None
