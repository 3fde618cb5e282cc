"""The controller ConfigMap's keys that give annotations their defaults, and its
add-headers / proxy-set-headers, as kubernetes/ingress-nginx reads them.

Learned from ingress-nginx v1.15: internal/ingress/annotations/proxy/main.go (the
proxy-next-upstream*, proxy-request-buffering defaults from defaults.Backend),
rewrite/main.go (preserve-trailing-slash), template.go buildNextUpstream
(retry-non-idempotent),
nginx.tmpl (add-headers: http-level more_set_headers; proxy-set-headers:
proxy_set_header in every location; the location's own headers after them) and
upstreamhashby/main.go, which reads no ConfigMap default. Each key: its value onto
the route field, the annotation winning, an invalid value reported with its reason
and not used.
"""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from tests.support.gatewayapi import tls_secret
from tests.unit.resolver.test_ingress_nginx import P, by_ingress, ingress, objects
from tests.unit.resolver.test_ingress_nginx import _global as _with_config
from waygate.resolver.gateway.translate import translate
from waygate.resolver.ingress_nginx.config import IngressNginx, config_from
from waygate.resolver.ingress_nginx.report import check
from waygate.resolver.model import Route

SETTINGS = IngressNginx(configmap=("ingress-nginx", "c"))


def _key(data: dict[str, str], key: str, *others: dict[str, Any]) -> tuple[str, str]:
    """The report's verdict and note for one ConfigMap key."""
    config = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "c", "namespace": "ingress-nginx"},
        "data": data,
    }
    report = check([config, *others], SETTINGS)
    (found,) = [k for k in report.config if k.key == key]
    return found.verdict.value, found.note


def _one(data: dict[str, str], annotations: dict[str, str] | None = None) -> Route:
    [route] = _with_config(data, ingress("a", annotations or {}))
    return route


def _config_map(name: str, data: dict[str, str], namespace: str = "ingress-nginx") -> Any:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": name, "namespace": namespace},
        "data": data,
    }


# ---------------------------------------------------------------- proxy-next-upstream*


def test_proxy_next_upstream_keys_are_the_annotations_defaults():
    data = {
        "proxy-next-upstream": "error timeout http_502",
        "proxy-next-upstream-tries": "5",
        "proxy-next-upstream-timeout": "7",
    }
    route = _one(data)
    assert route.next_upstream == "error timeout http_502"
    assert (route.next_upstream_tries, route.next_upstream_timeout) == (5, 7.0)
    # The Ingress's verdicts are its own: the ConfigMap's keys are judged once, there.
    assert not any(v.startswith("proxy-next-upstream") for v in route.ingress_verdicts)
    own = _one(
        data,
        {P + "proxy-next-upstream": "off", P + "proxy-next-upstream-tries": "2"},
    )
    assert (own.next_upstream, own.next_upstream_tries) == ("off", 2)
    assert own.next_upstream_timeout == 7.0  # not given by the annotation: the ConfigMap's
    assert _key(data, "proxy-next-upstream")[0] == "honoured-with-difference"
    assert _key(data, "proxy-next-upstream-tries") == ("honoured", "")
    assert _key(data, "proxy-next-upstream-timeout")[0] == "honoured-with-difference"
    # The annotation's verdict for the same value (its catalogue note: a failure after
    # the request was sent is a 502).
    assert _key({"proxy-next-upstream": "off"}, "proxy-next-upstream")[0] == (
        "honoured-with-difference"
    )
    assert _key({"proxy-next-upstream-timeout": "0"}, "proxy-next-upstream-timeout") == (
        "honoured",
        "0: no bound, ingress-nginx's default",
    )


@pytest.mark.parametrize(
    ("key", "value", "why"),
    [
        ("proxy-next-upstream", "error; return 200", "';' is not allowed"),
        ("proxy-next-upstream-tries", "three", "must be an integer"),
        ("proxy-next-upstream-timeout", "5s", "must be a number of seconds"),
        ("proxy-request-buffering", "yes", "must be one of on, off"),
    ],
)
def test_an_invalid_default_is_reported_and_not_used(key, value, why):
    route = _one({key: value})
    plain = _one({})
    assert (route.next_upstream, route.next_upstream_tries, route.request_buffering) == (
        plain.next_upstream,
        plain.next_upstream_tries,
        plain.request_buffering,
    )
    assert f"ConfigMap ingress-nginx/c key {key}: not-honoured" in route.ingress_verdicts
    verdict, note = _key({key: value}, key)
    assert verdict == "not-honoured" and why in note and "default applies" in note


def test_a_next_upstream_value_the_proxy_cannot_honour_is_reported_on_the_key():
    assert _key({"proxy-next-upstream": "error bogus"}, "proxy-next-upstream") == (
        "not-honoured",
        "not an nginx proxy_next_upstream value: bogus",
    )
    assert _key({"proxy-next-upstream-tries": "1000"}, "proxy-next-upstream-tries") == (
        "not-honoured",
        "outside 0..100",
    )


def test_retry_non_idempotent_adds_non_idempotent_to_every_location():
    # template.go buildNextUpstream: appended to the location's (annotation or default).
    assert _one({"retry-non-idempotent": "true"}).next_upstream == "error timeout non_idempotent"
    both = _one(
        {"retry-non-idempotent": "true", "proxy-next-upstream": "error http_503"},
        {P + "proxy-next-upstream": "error timeout http_502"},
    )
    assert both.next_upstream == "error timeout http_502 non_idempotent"
    assert _one({"retry-non-idempotent": "true", "proxy-next-upstream": "off"}).next_upstream == (
        "off"
    )
    assert _one({"retry-non-idempotent": "false"}).next_upstream == ""
    assert _key({"retry-non-idempotent": "true"}, "retry-non-idempotent")[0] == (
        "honoured-with-difference"
    )
    assert _key({"retry-non-idempotent": "maybe"}, "retry-non-idempotent")[0] == "not-honoured"


# ---------------------------------------------------------------- other annotation defaults


def test_proxy_request_buffering_key_and_the_annotation_winning():
    assert _one({"proxy-request-buffering": "off"}).request_buffering is False
    assert _one({}).request_buffering is True
    own = _one({"proxy-request-buffering": "off"}, {P + "proxy-request-buffering": "on"})
    assert own.request_buffering is True
    assert _key({"proxy-request-buffering": "off"}, "proxy-request-buffering") == ("honoured", "")


def test_preserve_trailing_slash_key_reaches_the_https_redirect():
    def redirect(annotations: dict[str, str]) -> Any:
        secret = yaml.safe_load(tls_secret("default", "cert", "app.example.com"))
        found = objects(
            _config_map("c", {"preserve-trailing-slash": "true"}),
            ingress("a", annotations, tls=True),
            secrets={("default", "cert"): secret},
        )
        routes = translate(found, ingress_nginx=SETTINGS).routes
        [plain] = [r for r in routes if r.listener_port == 80]
        assert plain.filters and plain.filters.redirect
        return plain.filters.redirect

    assert redirect({}).strip_trailing_slash is False
    assert redirect({P + "preserve-trailing-slash": "false"}).strip_trailing_slash is True


def test_keys_ingress_nginx_reads_but_gives_no_ingress_are_no_ops():
    # upstreamhashby/main.go has no ConfigMap default, nor does rewrite's app-root.
    for key, value in (("upstream-hash-by", "$request_uri"), ("app-root", "/app")):
        assert _key({key: value}, key)[0] == "no-op"
        route = _one({key: value})
        assert route.hash_by == "" and not route.ingress_verdicts


def test_disable_proxy_intercept_errors_key_with_the_configmaps_codes():
    # nginx.tmpl: the http-level proxy_intercept_errors follows the ConfigMap's key for
    # its custom-http-errors; a location with its own codes follows its annotation.
    data = {"custom-http-errors": "404", "disable-proxy-intercept-errors": "true"}
    route = _one(data)
    assert route.custom_http_errors == (404,) and route.intercept_errors_disabled
    own = _one(data, {P + "custom-http-errors": "503"})
    assert own.custom_http_errors == (503,) and not own.intercept_errors_disabled
    assert _key(data, "disable-proxy-intercept-errors") == ("honoured", "")


# ---------------------------------------------------------------- add-headers, proxy-set-headers


def test_add_headers_sets_every_response_and_custom_headers_win():
    headers = _config_map("response-headers", {"X-Frame-Options": "DENY", "X-Team": "edge"})
    mine = _config_map("mine", {"X-Team": "shop"}, namespace="default")
    routes = _with_config(
        {
            "add-headers": "ingress-nginx/response-headers",
            "global-allowed-response-headers": "X-Team",
        },
        headers,
        mine,
        ingress("plain"),
        ingress("own", {P + "custom-headers": "mine"}, host="own.example.com"),
    )
    [plain] = by_ingress(routes, "plain")
    assert plain.filters and plain.filters.response_headers
    assert set(plain.filters.response_headers.set) == {
        ("X-Frame-Options", "DENY"),
        ("X-Team", "edge"),
    }
    [own] = by_ingress(routes, "own")
    assert own.filters and own.filters.response_headers
    assert set(own.filters.response_headers.set) == {
        ("X-Frame-Options", "DENY"),
        ("X-Team", "shop"),
    }
    verdict, note = _key({"add-headers": "ingress-nginx/response-headers"}, "add-headers", headers)
    assert verdict == "honoured-with-difference" and "the proxy's own answers" in note


def test_proxy_set_headers_sets_every_request_and_a_snippets_header_wins():
    headers = _config_map("request-headers", {"X-Using-Waygate": "true", "X-Env": "prod"})
    data = {
        "proxy-set-headers": "ingress-nginx/request-headers",
        "allow-snippet-annotations": "true",
        "annotations-risk-level": "Critical",
    }
    routes = _with_config(
        data,
        headers,
        ingress("plain"),
        ingress(
            "own",
            {P + "configuration-snippet": 'proxy_set_header X-Env "staging";'},
            host="own.example.com",
        ),
    )
    [plain] = by_ingress(routes, "plain")
    assert plain.filters and plain.filters.request_headers
    assert set(plain.filters.request_headers.set) == {
        ("X-Using-Waygate", "true"),
        ("X-Env", "prod"),
    }
    assert _key(data, "proxy-set-headers", headers)[0] == "honoured"
    [own] = by_ingress(routes, "own")
    assert own.filters and own.filters.request_headers
    assert set(own.filters.request_headers.set) == {
        ("X-Using-Waygate", "true"),
        ("X-Env", "staging"),
    }


def test_a_missing_header_configmap_sets_nothing_as_ingress_nginx():
    route = _one({"add-headers": "ingress-nginx/absent"})
    # (only server-tokens' default `more_clear_headers Server` is there)
    headers = route.filters.response_headers if route.filters else None
    assert headers is None or (not headers.set and not headers.add)
    verdict, note = _key({"add-headers": "ingress-nginx/absent"}, "add-headers")
    assert verdict == "no-op" and "not found" in note
    assert _key({"proxy-set-headers": "absent"}, "proxy-set-headers")[0] == "no-op"


def test_a_header_that_is_not_literal_is_refused_and_the_others_kept():
    # The docs' example ConfigMap: X-Request-Start: t=${msec} (an nginx variable).
    headers = _config_map(
        "custom-headers", {"X-Different-Name": "true", "X-Request-Start": "t=${msec}"}
    )
    data = {"proxy-set-headers": "ingress-nginx/custom-headers"}
    [route] = _with_config(data, headers, ingress("a"))
    assert route.filters and route.filters.request_headers
    assert route.filters.request_headers.set == (("X-Different-Name", "true"),)
    assert "ConfigMap ingress-nginx/c key proxy-set-headers: not-honoured" in route.ingress_verdicts
    verdict, note = _key(data, "proxy-set-headers", headers)
    assert verdict == "not-honoured" and "X-Request-Start" in note
    host = _config_map("host", {"Host": "evil.example.com"})
    assert _key({"add-headers": "ingress-nginx/host"}, "add-headers", host)[0] == "not-honoured"


def test_a_change_to_the_header_configmap_applies_on_the_next_translation():
    # Translation reads every ConfigMap afresh (the resolver re-translates on any
    # ConfigMap event): no copy of the headers is kept anywhere else.
    def response_set(value: str) -> tuple[tuple[str, str], ...]:
        [route] = _with_config(
            {"add-headers": "ingress-nginx/h"}, _config_map("h", {"X-V": value}), ingress("a")
        )
        assert route.filters and route.filters.response_headers
        return route.filters.response_headers.set

    assert response_set("1") == (("X-V", "1"),)
    assert response_set("2") == (("X-V", "2"),)


def test_config_verdicts_of_keys_outside_the_defaults_are_unchanged():
    config = config_from(_config_map("c", {"worker-processes": "4", "something-new": "x"}))
    verdicts = {k.key: k.verdict.value for k in config.verdicts()}
    assert verdicts == {"worker-processes": "no-op", "something-new": "not-honoured"}


# ---------------------------------------------------------------- source ranges


def test_source_range_keys_are_the_annotations_defaults():
    # ipallowlist/main.go, ipdenylist/main.go: the ConfigMap's list unless the Ingress
    # has the annotation (which replaces it, not adds to it).
    data = {
        "whitelist-source-range": "10.0.0.0/8, 192.168.0.1",
        "denylist-source-range": "10.1.0.0/16",
    }
    route = _one(data)
    assert route.access is not None
    assert route.access.allow == ("10.0.0.0/8", "192.168.0.1")
    assert route.access.deny == ("10.1.0.0/16",)
    own = _one(
        data,
        {P + "allowlist-source-range": "172.16.0.0/12", P + "denylist-source-range": "172.16.1.1"},
    )
    assert own.access is not None
    assert (own.access.allow, own.access.deny) == (("172.16.0.0/12",), ("172.16.1.1",))
    legacy = _one(data, {P + "whitelist-source-range": "127.0.0.1"})
    assert legacy.access is not None and legacy.access.allow == ("127.0.0.1",)
    assert _key(data, "whitelist-source-range")[0] == "honoured"
    assert _key(data, "denylist-source-range")[0] == "honoured"


@pytest.mark.parametrize(
    ("data", "why"),
    [
        ({"whitelist-source-range": "10.0.0.0/8, nonsense"}, "'nonsense' is not an address"),
        (
            {
                "denylist-source-range": "10.0.0.0/8",
                "use-forwarded-headers": "true",
                "forwarded-for-header": "CF Connecting IP",
            },
            "is not a header name",
        ),
    ],
)
def test_a_default_source_range_that_cannot_be_honoured_refuses_every_ingress(data, why):
    # Fail closed: served without the controller-wide allow-list would be served open.
    routes = _with_config(data, ingress("a"), ingress("b", host="b.example.com"))
    for name in ("a", "b"):
        [route] = by_ingress(routes, name)
        assert route.ingress_refusal is not None
        reason, message = route.ingress_refusal
        assert reason == "UnsupportedConfiguration" and why in message


def test_no_tls_redirect_locations_keep_their_paths_on_plain_http():
    # template.go buildRedirectVars: force_no_ssl_redirect for a location whose path
    # starts with one of no-tls-redirect-locations (default /.well-known/acme-challenge,
    # so cert-manager's HTTP-01 solver Ingress answers over plain HTTP).
    def redirected(path: str, data: dict[str, str]) -> bool:
        secret = yaml.safe_load(tls_secret("default", "cert", "app.example.com"))
        found = objects(
            _config_map("c", data),
            ingress("a", {P + "force-ssl-redirect": "true"}, path=path, tls=True),
            secrets={("default", "cert"): secret},
        )
        routes = translate(found, ingress_nginx=SETTINGS).routes
        [plain] = [r for r in routes if r.listener_port == 80]
        return bool(plain.filters and plain.filters.redirect)

    assert not redirected("/.well-known/acme-challenge/token", {})
    assert redirected("/app", {})
    assert not redirected("/app/open", {"no-tls-redirect-locations": "/other, /app"})
    assert redirected("/.well-known/acme-challenge/token", {"no-tls-redirect-locations": "/x"})
    assert _key({"no-tls-redirect-locations": "/x"}, "no-tls-redirect-locations")[0] == "honoured"


def test_no_auth_locations_skip_external_authentication():
    # nginx.tmpl: no auth_request (auth-url, global-auth-url) in a location whose path
    # starts with one of no-auth-locations (default /.well-known/acme-challenge).
    data = {"global-auth-url": "http://auth.infra.svc/check"}
    routes = _with_config(
        data,
        ingress("solver", path="/.well-known/acme-challenge/token"),
        ingress("app", host="b.example.com"),
        ingress("own", {P + "auth-url": "http://mine/check"}, path="/x", host="c.example.com"),
    )
    [solver] = by_ingress(routes, "solver")
    [app] = by_ingress(routes, "app")
    [own] = by_ingress(routes, "own")
    assert solver.external_auth is None
    assert app.external_auth is not None and own.external_auth is not None
    [moved] = _with_config(
        {**data, "no-auth-locations": "/x"},
        ingress("own", {P + "auth-url": "http://mine/check"}, path="/x/y"),
    )
    assert moved.external_auth is None
