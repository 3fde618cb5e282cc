"""proxy-http-version and the redirect annotations as route fields and verdicts.

proxy-http-version "1.0" (nginx's proxy_http_version 1.0) becomes the route's
`upstream_http10`; permanent-redirect / temporal-redirect (ingress-nginx renders
`return CODE URL;`) become `redirect_location`, the target exactly as written, with
the code ingress-nginx's redirect.go accepts (300-308, temporal 300-307, else the
default). The proxy's side: tests/integration/proxy/test_ingress_http10_redirects.py.
"""

from __future__ import annotations

import pytest
import yaml

from tests.unit.resolver.test_ingress_nginx import (
    SETTINGS,
    P,
    ingress,
    objects,
    routes_of,
    tls_secret,
    translate,
)
from tests.unit.resolver.test_ingress_nginx import _global as _with_config
from tests.unit.resolver.test_ingress_nginx_responses import _finding, _verdict
from waygate.resolver import convert
from waygate.resolver.ingress_nginx.annotations import judge

# ---------------------------------------------------------------- proxy-http-version


def test_http_version_1_0_is_honoured_as_a_route_field():
    item = ingress("old", {P + "proxy-http-version": "1.0"})
    [route] = routes_of(item)
    assert route.upstream_http10 is True
    assert _finding(item, "proxy-http-version") == "honoured"
    assert not _verdict(route, "proxy-http-version")  # no difference reported
    # Through the wire format the proxy gets.
    assert convert.route_from_proto(convert.route_to_proto(route)).upstream_http10 is True


def test_http_version_1_1_and_none_keep_http_1_1():
    [route] = routes_of(ingress("new", {P + "proxy-http-version": "1.1"}))
    assert route.upstream_http10 is False
    [route] = routes_of(ingress("plain", {}))
    assert route.upstream_http10 is False


def test_http_version_from_the_configmap_and_the_annotation_over_it():
    config = {"proxy-http-version": "1.0"}
    [route] = _with_config(config, ingress("c", {}))
    assert route.upstream_http10 is True
    assert not [v for v in route.ingress_verdicts if "proxy-http-version" in v]
    [route] = _with_config(config, ingress("c", {P + "proxy-http-version": "1.1"}))
    assert route.upstream_http10 is False


def test_http_version_with_a_grpc_backend_does_nothing():
    annotations = {P + "proxy-http-version": "1.0", P + "backend-protocol": "GRPC"}
    item = ingress("grpc", annotations)
    assert _finding(item, "proxy-http-version") == "no-op"
    result, _ = judge(item, SETTINGS, {})
    (found,) = [f for f in result.findings if f.annotation == "proxy-http-version"]
    assert "gRPC backend speaks HTTP/2" in found.note


def test_http_version_invalid_is_refused_by_its_grammar():
    [route] = routes_of(ingress("bad", {P + "proxy-http-version": "2.0"}))
    assert route.upstream_http10 is False
    assert "must be one of 1.0, 1.1" in _verdict(route, "proxy-http-version")


def test_connection_proxy_header_with_http_1_0_is_a_named_difference():
    annotations = {P + "proxy-http-version": "1.0", P + "connection-proxy-header": "keep-alive"}
    [route] = routes_of(ingress("conn", annotations))
    assert "Connection: close" in _verdict(route, "connection-proxy-header")


# ---------------------------------------------------------------- redirects


@pytest.mark.parametrize(
    "target",
    [
        "https://new.example.com/landing?from=old&x=1",
        "http://redirect.example.com",
        "https://new.example.com:8443/a/b/",
        "/relative/path",
    ],
)
def test_redirect_target_is_the_location_as_written(target):
    for annotation, status in (("permanent-redirect", 301), ("temporal-redirect", 302)):
        item = ingress("r", {P + annotation: target})
        [route] = routes_of(item)
        assert route.redirect_location == target
        assert route.filters and route.filters.redirect
        assert route.filters.redirect.status == status
        assert _finding(item, annotation) == "honoured"
        back = convert.route_from_proto(convert.route_to_proto(route))
        assert back.redirect_location == target
        assert back.filters and back.filters.redirect and back.filters.redirect.status == status


@pytest.mark.parametrize(
    "annotation,code,status,verdict",
    [
        ("permanent-redirect", "300", 300, "honoured"),
        ("permanent-redirect", "308", 308, "honoured"),
        ("permanent-redirect", "305", 305, "honoured"),
        ("permanent-redirect", "309", 301, "no-op"),
        ("permanent-redirect", "200", 301, "no-op"),
        ("permanent-redirect", "-1", 301, "no-op"),
        ("temporal-redirect", "300", 300, "honoured"),
        ("temporal-redirect", "307", 307, "honoured"),
        ("temporal-redirect", "308", 302, "no-op"),
    ],
)
def test_redirect_codes_as_redirect_go_validates_them(annotation, code, status, verdict):
    item = ingress("c", {P + annotation: "https://x.example.com/", P + annotation + "-code": code})
    [route] = routes_of(item)
    assert route.filters and route.filters.redirect
    assert route.filters.redirect.status == status
    assert _finding(item, annotation + "-code") == verdict


def test_temporal_redirect_wins_and_the_permanent_code_is_a_no_op():
    annotations = {
        P + "temporal-redirect": "https://t.example.com/?a=1",
        P + "permanent-redirect": "https://p.example.com/",
        P + "permanent-redirect-code": "308",
    }
    item = ingress("both", annotations)
    [route] = routes_of(item)
    assert route.redirect_location == "https://t.example.com/?a=1"
    assert route.filters and route.filters.redirect and route.filters.redirect.status == 302
    assert _finding(item, "permanent-redirect") == "no-op"
    assert _finding(item, "permanent-redirect-code") == "no-op"


@pytest.mark.parametrize("force", [False, True])
def test_the_literal_redirect_answers_plain_http_before_the_https_redirect(force):
    # nginx.tmpl: `return CODE URL;` in the location runs in the rewrite phase, and
    # ingress-nginx's ssl-redirect / force-ssl-redirect is lua_ingress.rewrite in
    # rewrite_by_lua, which lua-nginx-module runs at the end of that phase: the client
    # on http:// gets the literal redirect at once, not a 308 to https:// first.
    secret = yaml.safe_load(tls_secret("default", "cert", "app.example.com"))
    annotations = {P + "permanent-redirect": "https://x.example.com/?q=1"}
    if force:
        annotations[P + "force-ssl-redirect"] = "true"
    item = ingress("tls", annotations, tls=True)
    found = objects(item, secrets={("default", "cert"): secret})
    routes = translate(found, ingress_nginx=SETTINGS).routes
    for port in (80, 443):
        [route] = [r for r in routes if r.listener_port == port and r.host]
        assert route.filters and route.filters.redirect
        assert route.filters.redirect.status == 301 and route.filters.redirect.scheme == ""
        assert route.redirect_location == "https://x.example.com/?q=1"


def test_www_and_app_root_routes_do_not_inherit_the_literal_location():
    annotations = {
        P + "permanent-redirect": "https://x.example.com/?q=1",
        P + "from-to-www-redirect": "true",
        P + "app-root": "/app",
    }
    routes = routes_of(ingress("extra", annotations))
    for route in routes:
        if ":www:" in route.name or ":app-root:" in route.name:
            assert route.redirect_location == ""
        else:
            assert route.redirect_location == "https://x.example.com/?q=1"
