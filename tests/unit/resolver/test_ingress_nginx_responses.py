"""ingress-nginx's response-side annotations -> route fields, verdicts and ConfigMap defaults.

proxy-redirect-from/-to, proxy-cookie-domain/-path, custom-http-errors (annotation
and ConfigMap key), default-backend, disable-proxy-intercept-errors,
use-port-in-redirects, connection-proxy-header and enable-access-log, as
kubernetes/ingress-nginx reads them (internal/ingress/annotations/proxy/main.go,
customhttperrors, defaultbackend, connection, log; the template's
proxy_redirect forms and test/e2e/annotations/proxy.go's cases), through the
same translation the resolver, `--manifests` and the webhook use.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.unit.resolver.test_ingress_nginx import SETTINGS, P, ingress, routes_of
from tests.unit.resolver.test_ingress_nginx import _global as _with_config
from waygate.resolver import convert
from waygate.resolver.ingress_nginx.annotations import judge
from waygate.resolver.ingress_nginx.config import IngressNginx
from waygate.resolver.manifests import parse_manifests
from waygate.resolver.model import Route


def _finding(obj: dict[str, Any], annotation: str) -> str:
    """The verdict of one annotation in the Ingress's plan (no-ops included)."""
    result, _ = judge(obj, SETTINGS, {})
    (found,) = [f for f in result.findings if f.annotation == annotation]
    return found.verdict.value


def _verdict(route: Route, annotation: str) -> str:
    found = [v for v in route.ingress_verdicts if v.startswith(annotation + ":")]
    return found[0] if found else ""


# ---------------------------------------------------------------- proxy_redirect


@pytest.mark.parametrize(
    ("source", "target", "fields"),
    [
        # test/e2e/annotations/proxy.go: "off", "default" and "hello.com goodbye.com".
        ("off", "goodbye.com", ("", "")),
        ("default", "goodbye.com", ("", "")),
        ("hello.com", "goodbye.com", ("hello.com", "goodbye.com")),
        ("http://internal:8080/", "/", ("http://internal:8080/", "/")),
    ],
)
def test_proxy_redirect_forms(source, target, fields):
    annotations = {P + "proxy-redirect-from": source, P + "proxy-redirect-to": target}
    [route] = routes_of(ingress("a", annotations))
    assert (route.redirect_from, route.redirect_to) == fields
    assert route.ingress_refusal is None
    assert not _verdict(route, "proxy-redirect-from")  # honoured exactly


@pytest.mark.parametrize(
    ("annotations", "why"),
    [
        ({"proxy-redirect-from": "~^http://internal", "proxy-redirect-to": "/"}, "regular"),
        ({"proxy-redirect-from": "http://a/"}, "without proxy-redirect-to"),
        ({"proxy-redirect-from": "http://a/ http://b/", "proxy-redirect-to": "/"}, "one prefix"),
    ],
)
def test_proxy_redirect_not_honoured_is_served_and_reported(annotations, why):
    [route] = routes_of(ingress("a", {P + k: v for k, v in annotations.items()}))
    assert route.ingress_refusal is None  # not an access annotation: served
    assert (route.redirect_from, route.redirect_to) == ("", "")
    assert why in _verdict(route, "proxy-redirect-from")
    assert "not-honoured" in _verdict(route, "proxy-redirect-from")


def test_relative_redirects_with_a_relative_proxy_redirect_is_a_difference():
    annotations = {
        P + "proxy-redirect-from": "http://internal/",
        P + "proxy-redirect-to": "/",
        P + "relative-redirects": "true",
    }
    [route] = routes_of(ingress("a", annotations))
    assert "honoured-with-difference" in _verdict(route, "relative-redirects")
    alone = ingress("b", {P + "relative-redirects": "true"})
    assert _finding(alone, "relative-redirects") == "no-op"


def test_proxy_redirect_to_alone_does_nothing():
    [route] = routes_of(ingress("a", {P + "proxy-redirect-to": "/"}))
    assert route.redirect_from == "" and route.ingress_verdicts == ()
    assert _finding(ingress("a", {P + "proxy-redirect-to": "/"}), "proxy-redirect-to") == "no-op"


def test_proxy_redirect_defaults_from_the_configmap():
    data = {"proxy-redirect-from": "http://internal/", "proxy-redirect-to": "/"}
    plain, own = _with_config(
        data, ingress("a"), ingress("b", {P + "proxy-redirect-from": "off"}, host="b.example.com")
    )
    assert (plain.redirect_from, plain.redirect_to) == ("http://internal/", "/")
    assert own.redirect_from == ""


# ---------------------------------------------------------------- proxy_cookie_*


def test_proxy_cookie_domain_and_path():
    # test/e2e/annotations/proxy.go "should setup proxy cookies".
    annotations = {
        P + "proxy-cookie-domain": "localhost example.org",
        P + "proxy-cookie-path": "/one/ /",
    }
    [route] = routes_of(ingress("a", annotations))
    assert (route.cookie_domain, route.cookie_path) == ("localhost example.org", "/one/ /")
    assert route.ingress_verdicts == ()
    [off] = routes_of(ingress("b", {P + "proxy-cookie-domain": "off"}))
    assert off.cookie_domain == "" and off.ingress_verdicts == ()
    [regex] = routes_of(ingress("c", {P + "proxy-cookie-path": "~*^/app /"}))
    assert regex.cookie_path == "" and "not-honoured" in _verdict(regex, "proxy-cookie-path")
    [configured] = _with_config({"proxy-cookie-path": "/a/ /"}, ingress("d"))
    assert configured.cookie_path == "/a/ /"


# ---------------------------------------------------------------- custom-http-errors


def test_custom_http_errors_and_default_backend():
    # test/e2e/annotations/customhttperrors.go: "404,500", then "503"; "404, 503"
    # (duplicates once); the default-backend annotation names the error backend.
    [route] = routes_of(
        ingress(
            "a",
            {P + "custom-http-errors": "404, 503,404", P + "default-backend": "error-pages"},
        )
    )
    assert route.custom_http_errors == (404, 503)
    assert route.default_backend == "error-pages"
    assert not route.intercept_errors_disabled
    assert "honoured-with-difference" in _verdict(route, "custom-http-errors")
    assert not _verdict(route, "default-backend")  # honoured exactly


def test_custom_http_errors_from_the_configmap_and_the_annotation_wins():
    plain, own = _with_config(
        {"custom-http-errors": "502,504"},
        ingress("a"),
        ingress("b", {P + "custom-http-errors": "404"}, host="b.example.com"),
    )
    assert plain.custom_http_errors == (502, 504) and plain.ingress_verdicts == ()
    assert own.custom_http_errors == (404,)
    [bad] = _with_config({"custom-http-errors": "404,abc"}, ingress("c"))
    assert bad.custom_http_errors == ()
    assert any("custom-http-errors: invalid" in v for v in bad.ingress_verdicts)


def test_disable_proxy_intercept_errors():
    # test/e2e/annotations/disableproxyintercepterrors.go.
    annotations = {
        P + "custom-http-errors": "404",
        P + "disable-proxy-intercept-errors": "true",
        P + "default-backend": "echo",
    }
    [route] = routes_of(ingress("a", annotations))
    assert route.intercept_errors_disabled and route.custom_http_errors == (404,)
    assert not _verdict(route, "disable-proxy-intercept-errors")
    alone = ingress("b", {P + "disable-proxy-intercept-errors": "true"})
    assert _finding(alone, "disable-proxy-intercept-errors") == "no-op"
    [off] = routes_of(ingress("c", {P + "disable-proxy-intercept-errors": "false"}))
    assert not off.intercept_errors_disabled and off.ingress_verdicts == ()


def test_custom_http_errors_of_a_grpc_backend_do_nothing_as_grpc_pass():
    annotations = {P + "custom-http-errors": "404", P + "backend-protocol": "GRPC"}
    [route] = routes_of(ingress("a", annotations))
    assert route.custom_http_errors == ()
    assert _finding(ingress("a", annotations), "custom-http-errors") == "no-op"


def test_an_invalid_status_list_refuses_the_ingress():
    [route] = routes_of(ingress("a", {P + "custom-http-errors": "404;return 200"}))
    assert route.ingress_refusal is not None and route.ingress_refusal[0] == "InvalidAnnotation"


# ---------------------------------------------------------------- the rest


@pytest.mark.parametrize(("value", "field"), [("keep-alive", "keep-alive"), ("Close", "close")])
def test_connection_proxy_header(value, field):
    # test/e2e/annotations/connection.go: "keep-alive".
    [route] = routes_of(ingress("a", {P + "connection-proxy-header": value}))
    assert route.connection_header == field and route.ingress_verdicts == ()


def test_connection_proxy_header_upgrade_is_a_difference():
    [route] = routes_of(ingress("a", {P + "connection-proxy-header": "upgrade"}))
    assert route.connection_header == ""
    assert "honoured-with-difference" in _verdict(route, "connection-proxy-header")


def test_enable_access_log_false_is_honoured():
    [route] = routes_of(ingress("a", {P + "enable-access-log": "false"}))
    assert route.access_log_disabled and route.ingress_verdicts == ()
    [logged] = routes_of(ingress("b", {P + "enable-access-log": "true"}))
    assert not logged.access_log_disabled


@pytest.mark.parametrize("key", ["disable-access-log", "disable-http-access-log"])
def test_the_configmaps_access_log_off_applies_to_every_ingress(key):
    # test/e2e/annotations/disableaccesslog.go: the ConfigMap's disable-access-log and
    # disable-http-access-log set `access_log off` (http level: an Ingress's
    # enable-access-log "true" does not turn it back on).
    plain, own = _with_config(
        {key: "true"},
        ingress("a"),
        ingress("b", {P + "enable-access-log": "true"}, host="b.example.com"),
    )
    assert plain.access_log_disabled and own.access_log_disabled
    assert plain.ingress_verdicts == ()


def test_use_port_in_redirects_from_the_annotation_or_the_configmap():
    [route] = routes_of(ingress("a", {P + "use-port-in-redirects": "true"}))
    assert route.port_in_redirects
    assert "honoured-with-difference" in _verdict(route, "use-port-in-redirects")
    [configured] = _with_config({"use-port-in-redirects": "true"}, ingress("b"))
    assert configured.port_in_redirects and configured.ingress_verdicts == ()


def test_the_fields_survive_the_proto():
    annotations = {
        P + "proxy-redirect-from": "http://internal/",
        P + "proxy-redirect-to": "/",
        P + "proxy-cookie-domain": "internal example.org",
        P + "custom-http-errors": "404,503",
        P + "default-backend": "error-pages",
        P + "connection-proxy-header": "close",
        P + "enable-access-log": "false",
    }
    [route] = routes_of(ingress("a", annotations))
    again = convert.route_from_proto(convert.route_to_proto(route))
    # (The verdicts are the resolver's: reported in the route's status, not its spec.)
    assert again == dataclasses.replace(route, ingress_verdicts=())


def test_in_manifests_mode_the_annotations_become_route_fields(tmp_path: Path):
    documents = [
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": "web", "namespace": "default"},
            "spec": {"ports": [{"port": 80, "targetPort": 8080, "name": "http"}]},
        },
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": "c", "namespace": "ingress-nginx"},
            "data": {"custom-http-errors": "503"},
        },
        ingress("shop", {P + "default-backend": "error-pages", P + "proxy-cookie-path": "/a/ /"}),
    ]
    content = parse_manifests(
        [(tmp_path / "all.yaml", yaml.safe_dump_all(documents))],
        ingress_nginx=IngressNginx(configmap=("ingress-nginx", "c")),
    )
    [route] = [r for r in content.routes if r.origin == "Ingress default/shop"]
    assert route.custom_http_errors == (503,)
    assert (route.default_backend, route.cookie_path) == ("error-pages", "/a/ /")
