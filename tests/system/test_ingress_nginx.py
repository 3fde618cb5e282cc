"""ingress-nginx Ingresses through a real resolver (--manifests --ingress-nginx) and proxy.

The harness of the Gateway API conformance cases (tests/support/gatewayapi): real
processes, RecordingUpstream backends that echo what they received. Each test
ports the assertions of one of ingress-nginx's own end-to-end annotation tests
(kubernetes/ingress-nginx, test/e2e/annotations/*.go, controller v1.15.1), cited
by file and `It`; where Waygate's answer differs by a catalogued difference, the
test says so and asserts Waygate's documented behaviour. The fail-closed tests
check that an Ingress guarded by an annotation Waygate cannot honour, or carrying
an injection payload, is not served while every other Ingress is.
"""

from __future__ import annotations

import asyncio
import json
import socket
import ssl
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio
import yaml

from tests.support.gatewayapi import (
    INFRA,
    TLS_SECRET,
    Conformance,
    Response,
    local_slice,
    parse_response,
    tls_client_context,
    tls_secret,
)
from tests.support.poll import until
from tests.support.processes import run_cli
from tests.support.proxyharness import RecordingUpstream, read_response

pytestmark = [pytest.mark.system, pytest.mark.asyncio(loop_scope="module")]

P = "nginx.ingress.kubernetes.io/"
V1 = f"{INFRA}/infra-backend-v1"
V2 = f"{INFRA}/infra-backend-v2"
CONTROLLER = {
    "apiVersion": "v1",
    "kind": "ConfigMap",
    "metadata": {"name": "ingress-nginx-controller", "namespace": "ingress-nginx"},
    "data": {
        "allow-snippet-annotations": "true",
        "annotations-risk-level": "Critical",
        # customheaders.go lists its headers (customheaders/main.go denies others).
        "global-allowed-response-headers": "My-Custom-Header,X-Second",
    },
}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def suite(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Conformance]:
    conformance = Conformance(
        tmp_path_factory.mktemp("manifests"),
        resolver_args=(
            "--ingress-nginx",
            "--ingress-nginx-configmap",
            "ingress-nginx/ingress-nginx-controller",
        ),
    )
    await conformance.start()
    try:
        yield conformance
    finally:
        await conformance.stop()


def single_ingress(
    name: str,
    path: str,
    host: str,
    annotations: dict[str, str] | None = None,
    service: str = "infra-backend-v1",
) -> dict[str, Any]:
    """framework.NewSingleIngress: one host, one Prefix path, to the echo backend."""
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "Ingress",
        "metadata": {"name": name, "namespace": INFRA, "annotations": annotations or {}},
        "spec": {
            "ingressClassName": "nginx",
            "rules": [
                {
                    "host": host,
                    "http": {
                        "paths": [
                            {
                                "path": path,
                                "pathType": "Prefix",
                                "backend": {
                                    "service": {
                                        "name": service,
                                        "port": {"number": 8080},
                                    }
                                },
                            }
                        ]
                    },
                }
            ],
        },
    }


async def apply(suite: Conformance, *ingresses: dict[str, Any]) -> None:
    await suite.apply(extra=yaml.safe_dump_all([CONTROLLER, *ingresses]))


async def test_approot_should_redirect_to_foo(suite: Conformance) -> None:
    # approot.go: It("should redirect to /foo")
    host = "approot.bar.com"
    await apply(suite, single_ingress(host, "/", host, {P + "app-root": "/foo"}))
    response = await suite.eventually("/", host=host, status=302)
    assert response.header("Location") == "http://approot.bar.com/foo"


async def test_redirect_standard_and_custom_code(suite: Conformance) -> None:
    # redirect.go: It("should respond with a standard redirect code"),
    # It("should respond with a custom redirect code")
    url = "http://redirect.example.com"
    standard = single_ingress(
        "std", "/something", "redirect.bar.com", {P + "permanent-redirect": url}
    )
    custom = single_ingress(
        "custom",
        "/something",
        "redirect2.bar.com",
        {P + "permanent-redirect": url, P + "permanent-redirect-code": "302"},
    )
    await apply(suite, standard, custom)
    response = await suite.eventually("/something", host="redirect.bar.com", status=301)
    assert response.header("Location") == url
    response = await suite.eventually("/something", host="redirect2.bar.com", status=302)
    assert response.header("Location") == url


async def test_redirect_target_with_a_query_and_code_300(suite: Conformance) -> None:
    # redirect.go's assertions (Status(code), Header("Location").Equal(redirectURL)) for a
    # target with a query string, asked with and without one of the client's own:
    # ingress-nginx renders `return CODE URL;`, which appends no $args. And
    # permanent-redirect-code 300, inside redirect.go's range: nginx's `return 300 URL`
    # answers the URL as the body, without a Location.
    url = "https://new.example.com/landing?from=old&x=1"
    query = single_ingress("query", "/", "redirect-query.bar.com", {P + "permanent-redirect": url})
    choices = single_ingress(
        "choices",
        "/",
        "redirect-300.bar.com",
        {P + "permanent-redirect": url, P + "permanent-redirect-code": "300"},
    )
    await apply(suite, query, choices)
    for path in ("/something", "/something?client=1"):
        response = await suite.eventually(path, host="redirect-query.bar.com", status=301)
        assert response.header("Location") == url
    response = await suite.eventually("/x?y=1", host="redirect-300.bar.com", status=300)
    assert response.header("Location") is None
    assert response.body == url.encode()


async def test_proxy_http_version_1_0(suite: Conformance) -> None:
    # proxy.go: It("should change the default proxy HTTP version") (its assertion:
    # `proxy_http_version 1.0;` in the configuration), asserted on what the echo backend
    # receives: an HTTP/1.0 request with Connection: close; a chunked body whole, with
    # its Content-Length (nginx sends no chunked coding to an HTTP/1.0 backend).
    host = "proxy-version.foo.com"
    await apply(suite, single_ingress(host, "/", host, {P + "proxy-http-version": "1.0"}))
    response = await suite.eventually("/version-marker", host=host, backend=V1)
    assert response.request_header("Connection") == "close"
    received = bytes(suite.backends[(INFRA, "infra-backend-v1")].received)
    assert b"GET /version-marker HTTP/1.0\r\n" in received
    reader, writer = await asyncio.open_connection("127.0.0.1", suite.port)
    try:
        writer.write(
            b"POST /upload-marker HTTP/1.1\r\nHost: %s\r\nTransfer-Encoding: chunked\r\n\r\n"
            b"5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n" % host.encode()
        )
        response = parse_response(await read_response(reader, timeout=10))
    finally:
        writer.close()
    assert response.status == 200
    assert response.request_header("Content-Length") == "11"
    assert response.request_header("Transfer-Encoding") is None
    assert response.echo["body_length"] == 11
    assert b"POST /upload-marker HTTP/1.0\r\n" in bytes(
        suite.backends[(INFRA, "infra-backend-v1")].received
    )


async def test_xforwardedprefix_sets_the_header_to_the_annotation_value(suite: Conformance) -> None:
    # xforwardedprefix.go: It("should set the X-Forwarded-Prefix to the annotation value")
    host = "xfp.bar.com"
    annotations = {P + "x-forwarded-prefix": "/test/value", P + "rewrite-target": "/foo"}
    await apply(suite, single_ingress(host, "/", host, annotations))
    response = await suite.eventually("/", host=host, backend=V1)
    assert response.request_header("X-Forwarded-Prefix") == "/test/value"
    assert response.echo["target"] == "/foo"


async def test_upstreamvhost_sets_the_host(suite: Conformance) -> None:
    # upstreamvhost.go: It("set host to upstreamvhost.bar.com")
    host = "upstreamvhost.bar.com.test"
    annotations = {P + "upstream-vhost": "upstreamvhost.bar.com"}
    await apply(suite, single_ingress(host, "/", host, annotations))
    response = await suite.eventually("/", host=host, backend=V1)
    assert response.request_header("Host") == "upstreamvhost.bar.com"


async def test_alias_serves_the_host_and_its_alias_and_nothing_else(suite: Conformance) -> None:
    # alias.go: It("should return status code 200 for host 'foo' and 404 for 'bar'"),
    # It("should return status code 200 for host 'foo' and 'bar'")
    await apply(
        suite,
        single_ingress("plain", "/", "foo"),
        single_ingress("aliased", "/", "foo2", {P + "server-alias": "bar2"}),
    )
    await suite.eventually("/", host="foo", backend=V1)
    assert (await suite.request("/", host="bar")).status == 404
    await suite.eventually("/", host="foo2", backend=V1)
    await suite.eventually("/", host="bar2", backend=V1)


async def test_fromtowwwredirect_from_www_http_to_http(suite: Conformance) -> None:
    # fromtowwwredirect.go: It("should redirect from www HTTP to HTTP"). ingress-nginx's
    # Location names the port (http://fromtowwwredirect.bar.com:80/foo); Waygate leaves
    # the scheme's well-known port out (the catalogued redirect behaviour).
    host = "fromtowwwredirect.bar.com"
    await apply(suite, single_ingress(host, "/", host, {P + "from-to-www-redirect": "true"}))
    response = await suite.eventually("/foo", host=f"www.{host}", status=308)
    assert response.header("Location") == "http://fromtowwwredirect.bar.com/foo"


async def test_forcesslredirect_should_redirect_to_https(suite: Conformance) -> None:
    # forcesslredirect.go: It("should redirect to https"). ingress-nginx strips the
    # trailing slash (https://forcesslredirect.bar.com) unless preserve-trailing-slash;
    # Waygate keeps the path as it is (the catalogued difference).
    host = "forcesslredirect.bar.com"
    await apply(suite, single_ingress(host, "/", host, {P + "force-ssl-redirect": "true"}))
    response = await suite.eventually("/", host=host, status=308)
    assert response.header("Location") == "https://forcesslredirect.bar.com/"


async def test_snippet_literal_headers_with_the_configmap_allowing_snippets(
    suite: Conformance,
) -> None:
    # snippet.go: It("set snippet more_set_headers in all locations") -- the response
    # carries the header the snippet sets.
    host = "configurationsnippet.foo.com"
    snippet = {P + "configuration-snippet": 'more_set_headers "Foo1: Bar1";'}
    await apply(suite, single_ingress(host, "/", host, snippet))
    response = await suite.eventually("/", host=host, backend=V1)
    assert response.response_header("Foo1") == "Bar1"


async def test_fail_closed_and_injection_refused_alone(suite: Conformance) -> None:
    guarded = single_ingress("guarded", "/", "guarded.bar.com", {P + "enable-modsecurity": "true"})
    auth = single_ingress(
        "auth", "/", "auth.bar.com", {P + "auth-url": "http://auth.example.com/check"}
    )
    # CVE-2025-24514's published payload.
    injected = single_ingress(
        "injected",
        "/",
        "injected.bar.com",
        {P + "auth-url": "http://example.com/#;\ninjection_point"},
    )
    lua = single_ingress(
        "lua", "/", "lua.bar.com", {P + "configuration-snippet": "content_by_lua_block { }"}
    )
    served = single_ingress("served", "/", "served.bar.com")
    await apply(suite, guarded, auth, injected, lua, served)
    await suite.eventually("/", host="served.bar.com", backend=V1)
    for host in ("guarded.bar.com", "injected.bar.com", "lua.bar.com"):
        assert (await suite.request("/", host=host)).status == 404, host
    # CVE-2026-24513 (auth-url bypassed by encoded and dot-segment paths): every path
    # is asked of the auth service, here one that does not answer: 500, never served.
    for path in ("/", "/%2e%2e/admin", "/./admin", "/admin/..%2f", "//admin", "/%61dmin"):
        response = await suite.request(path, host="auth.bar.com")
        assert response.status in (400, 500), (path, response.status)
    assert suite.resolver is not None
    code, out, err = await run_cli("routes", "--addr", suite.resolver.grpc_address, "-o", "json")
    assert code == 0, err
    routes = json.loads(out)
    text = json.dumps(routes)
    assert "UnsupportedAnnotation" in text and "InvalidAnnotation" in text
    assert "enable-modsecurity" in text
    # `waygate check` names each refused Ingress and what to do.
    code, out, err = await run_cli("check", "--resolver", suite.resolver.grpc_address)
    assert code != 0
    assert "ingress:guarded:" in out and "UnsupportedAnnotation" in out
    assert "`waygate ingress-nginx check` names it" in out


def canary(host: str, annotations: dict[str, str]) -> dict[str, Any]:
    return single_ingress(
        f"{host}-canary",
        "/",
        host,
        {P + "canary": "true", **annotations},
        service="infra-backend-v2",
    )


async def test_canary_by_header_with_no_value(suite: Conformance) -> None:
    # canary.go: Context("when canaried by header with no value") It("should route
    # requests to the correct upstream"); and It("should return 404 status for requests
    # to the canary if no matching ingress is found").
    host = "foo"
    await apply(
        suite,
        single_ingress(host, "/", host),
        canary(host, {P + "canary-by-header": "CanaryByHeader"}),
        canary("nomain", {P + "canary-by-header": "CanaryByHeader"}),
    )
    await suite.eventually("/", host=host, backend=V2, headers={"CanaryByHeader": "always"})
    for value in ("never", "badheadervalue"):
        response = await suite.request("/", host=host, headers={"CanaryByHeader": value})
        assert response.backend == V1, value
    response = await suite.request("/", host="nomain", headers={"CanaryByHeader": "always"})
    assert response.status == 404


async def test_canary_by_header_with_value(suite: Conformance) -> None:
    # canary.go: Context("when canaried by header with value") It("should route requests
    # to the correct upstream")
    host = "foo"
    annotations = {
        P + "canary-by-header": "CanaryByHeader",
        P + "canary-by-header-value": "DoCanary",
    }
    await apply(suite, single_ingress(host, "/", host), canary(host, annotations))
    await suite.eventually("/", host=host, backend=V2, headers={"CanaryByHeader": "DoCanary"})
    for value in ("always", "never", "otherheadervalue"):
        response = await suite.request("/", host=host, headers={"CanaryByHeader": value})
        assert response.backend == V1, value


async def test_canary_by_weight(suite: Conformance) -> None:
    # canary.go: Context("when canaried by weight") It("should route requests only to
    # mainline if canary weight is 0"), It("should route requests only to canary if canary
    # weight is 100"), It("should route requests split between mainline and canary if
    # canary weight is 100 and weight total is 200")
    await apply(
        suite,
        single_ingress("zero", "/", "zero"),
        canary("zero", {P + "canary-weight": "0"}),
        single_ingress("all", "/", "all"),
        canary("all", {P + "canary-weight": "100"}),
        single_ingress("half", "/", "half"),
        canary("half", {P + "canary-weight": "100", P + "canary-weight-total": "200"}),
    )
    await suite.eventually("/", host="all", backend=V2)
    for _ in range(10):
        assert (await suite.request("/", host="zero")).backend == V1
        assert (await suite.request("/", host="all")).backend == V2
    seen = {(await suite.request("/", host="half")).backend for _ in range(40)}
    assert seen == {V1, V2}


async def test_canary_by_cookie(suite: Conformance) -> None:
    # canary.go: Context("when canaried by cookie") It("respects always and never
    # values"); Context("when canaried by header with value and cookie") It("should
    # route requests to the correct upstream") (a header value that does not match
    # leaves the cookie to decide).
    host, both = "cookie.foo", "both.foo"
    await apply(
        suite,
        single_ingress(host, "/", host),
        canary(host, {P + "canary-by-cookie": "Canary-By-Cookie"}),
        single_ingress(both, "/", both),
        canary(
            both,
            {
                P + "canary-by-header": "CanaryByHeader",
                P + "canary-by-header-value": "DoCanary",
                P + "canary-by-cookie": "CanaryByCookie",
            },
        ),
    )
    await suite.eventually(
        "/", host=host, backend=V2, headers={"Cookie": "Canary-By-Cookie=always"}
    )
    for _ in range(5):
        for value, backend in (("always", V2), ("never", V1), ("badcookievalue", V1)):
            cookie = {"Cookie": f"Canary-By-Cookie={value}"}
            assert (await suite.request("/", host=host, headers=cookie)).backend == backend
    headers = {"CanaryByHeader": "otherheadervalue", "Cookie": "CanaryByCookie=always"}
    assert (await suite.eventually("/", host=both, backend=V2, headers=headers)).backend == V2


async def test_canary_affinity_behavior(suite: Conformance) -> None:
    # canary.go: Context("canary affinity behavior") It("always routes traffic to canary
    # if first request was affinitized to canary (default behavior)"), It("... (explicit
    # sticky behavior)"), It("routes traffic to either mainline or canary backend (legacy
    # behavior)"): the canary's answer sets no affinity cookie, and both sides get
    # requests (generous bounds: the test's 40% of 200 is not asserted exactly).
    affinity = {P + "affinity": "cookie", P + "session-cookie-name": "aff"}
    forced = {
        P + "canary-by-header": "ForceCanary",
        P + "canary-by-header-value": "yes",
    }
    await apply(
        suite,
        single_ingress("default.foo", "/", "default.foo", affinity),
        canary("default.foo", {**forced, P + "canary-weight": "1"}),
        single_ingress("sticky.foo", "/", "sticky.foo", affinity),
        canary(
            "sticky.foo",
            {**forced, P + "canary-weight": "1", P + "affinity-canary-behavior": "sticky"},
        ),
        single_ingress("legacy.foo", "/", "legacy.foo", affinity),
        canary(
            "legacy.foo",
            {**forced, P + "canary-weight": "50", P + "affinity-canary-behavior": "legacy"},
        ),
    )
    for host in ("default.foo", "sticky.foo"):
        first = await suite.eventually("/", host=host, backend=V2, headers={"ForceCanary": "yes"})
        cookie = (first.header("Set-Cookie") or "").split(";")[0]
        assert cookie.startswith("aff="), first.headers
        for _ in range(20):
            again = await suite.request("/", host=host, headers={"Cookie": cookie})
            assert again.backend == V2, host
    legacy = await suite.eventually(
        "/", host="legacy.foo", backend=V2, headers={"ForceCanary": "yes"}
    )
    assert not (legacy.header("Set-Cookie") or "").startswith("aff=")
    seen = [(await suite.request("/", host="legacy.foo")).backend for _ in range(40)]
    assert seen.count(V1) >= 5 and seen.count(V2) >= 5


async def test_mirror_target_and_request_body(suite: Conformance) -> None:
    # mirror.go: It("should set mirror-target to https://test.env.com/$request_uri"),
    # It("should disable mirror-request-body"): here the copies themselves, to a URL
    # (the suite's second backend), Host the mirror-host; the answer is the backend's.
    from tests.support.poll import until

    copies = suite.backends[(INFRA, "infra-backend-v2")]
    before = len(copies.requests)
    target = f"http://127.0.0.1:{copies.port}/$request_uri"
    await apply(
        suite,
        single_ingress(
            "mirror.foo.com",
            "/",
            "mirror.foo.com",
            {
                P + "mirror-target": target,
                P + "mirror-host": "test.env.com",
                P + "mirror-request-body": "off",
            },
        ),
    )
    response = await suite.eventually("/m?x=1", host="mirror.foo.com", backend=V1)
    assert response.status == 200
    await until(lambda: len(copies.requests) > before, "the copy reached the mirror", timeout=10)
    copy = copies.requests[-1]
    assert copy["target"] == "//m?x=1"  # nginx's proxy_pass of "/$request_uri", as written
    assert dict((k.lower(), v) for k, v in copy["headers"])["host"] == "test.env.com"  # type: ignore[attr-defined]


async def test_ssl_passthrough_relays_tls_by_sni(suite: Conformance) -> None:
    # ssl-passthrough (docs/user-guide/tls.md#ssl-passthrough; no e2e file of its own in
    # test/e2e/annotations): the client sees the backend's own certificate.
    from tests.system.test_gateway_tls_ingress import common_name, peer_certificate, tls_backend

    host = "passthrough.bar.com"
    async with tls_backend(host) as port:
        backend = f"""apiVersion: v1
kind: Service
metadata: {{name: nginx-tls-backend, namespace: {INFRA}}}
spec: {{ports: [{{name: https, port: 443, targetPort: {port}}}]}}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: nginx-tls-backend-local
  namespace: {INFRA}
  labels: {{kubernetes.io/service-name: nginx-tls-backend}}
addressType: IPv4
ports: [{{name: https, port: {port}}}]
endpoints: [{{addresses: [127.0.0.1]}}]
"""
        item = single_ingress(host, "/", host, {P + "ssl-passthrough": "true"})
        item["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"] = {
            "name": "nginx-tls-backend",
            "port": {"number": 443},
        }
        await suite.apply(extra=yaml.safe_dump_all([CONTROLLER, item]) + "\n---\n" + backend)
        served = await peer_certificate(suite.https_port, host)
        assert common_name(served) == host
        response = await suite.request("/", host=host, tls=True)
        assert (response.status, response.body) == (200, b"passthrough")


async def test_rewrite_should_use_correct_longest_path_match(suite: Conformance) -> None:
    # rewrite.go: It("should use correct longest path match")
    host = "rewrite.bar.com"
    await apply(
        suite,
        single_ingress("kube-lego", "/.well-known/acme/challenge", host),
        single_ingress("rewrite-index", "/", host, {P + "rewrite-target": "/new/backend"}),
    )
    response = await suite.eventually("/.well-known/acme/challenge", host=host, backend=V1)
    assert response.echo["target"] == "/.well-known/acme/challenge"
    response = await suite.request("/anything", host=host)
    assert response.echo["target"] == "/new/backend"


async def test_rewrite_should_use_the_case_insensitive_regex_location_modifier(
    suite: Conformance,
) -> None:
    # rewrite.go: It("should use ~* location modifier if regex annotation is present")
    host = "rewrite2.bar.com"
    annotations = {P + "use-regex": "true", P + "rewrite-target": "/new/backend"}
    item = single_ingress("regex", "/foo.+", host, annotations)
    item["spec"]["rules"][0]["http"]["paths"][0]["pathType"] = "ImplementationSpecific"
    await apply(suite, single_ingress("foo", "/foo", host), item)
    response = await suite.eventually("/foo/bar", host=host, backend=V1)
    assert response.echo["target"] == "/new/backend"
    response = await suite.request("/foo", host=host)
    assert response.echo["target"] == "/foo"
    # ~*: case-insensitive.
    assert (await suite.request("/FOO/bar", host=host)).echo["target"] == "/new/backend"


async def test_rewrite_should_fail_to_use_longest_match_for_documented_warning(
    suite: Conformance,
) -> None:
    # rewrite.go: It("should fail to use longest match for documented warning")
    host = "rewrite3.bar.com"
    annotations = {P + "use-regex": "true", P + "rewrite-target": "/new/backend"}
    item = single_ingress("regex", "/foo/bar/[a-z]{3}", host, annotations)
    item["spec"]["rules"][0]["http"]["paths"][0]["pathType"] = "ImplementationSpecific"
    await apply(suite, single_ingress("foo", "/foo/bar/bar", host), item)
    response = await suite.eventually("/foo/bar/bar", host=host, backend=V1)
    assert response.echo["target"] == "/new/backend"


async def test_rewrite_should_allow_for_custom_rewrite_parameters(suite: Conformance) -> None:
    # rewrite.go: It("should allow for custom rewrite parameters")
    host = "rewrite4.bar.com"
    annotations = {P + "use-regex": "true", P + "rewrite-target": "/new/backend/$1"}
    item = single_ingress("regex", "/foo/bar/(.+)", host, annotations)
    item["spec"]["rules"][0]["http"]["paths"][0]["pathType"] = "ImplementationSpecific"
    await apply(suite, item)
    response = await suite.eventually("/foo/bar/bar", host=host, backend=V1)
    assert response.echo["target"] == "/new/backend/bar"


async def test_affinity_sets_and_renames_the_sticky_cookie(suite: Conformance) -> None:
    # affinity.go: It("should set sticky cookie SERVERID"), It("should change cookie name
    # on ingress definition change")
    host = "sticky.foo.com"
    annotations = {P + "affinity": "cookie", P + "session-cookie-name": "SERVERID"}
    await apply(suite, single_ingress(host, "/", host, annotations))
    response = await suite.eventually("/", host=host, backend=V1)
    assert "SERVERID=" in (response.response_header("Set-Cookie") or "")
    annotations[P + "session-cookie-name"] = "OTHERCOOKIENAME"
    await apply(suite, single_ingress(host, "/", host, annotations))
    response = await suite.eventually("/", host=host, backend=V1)
    assert "OTHERCOOKIENAME=" in (response.response_header("Set-Cookie") or "")


async def test_server_snippet_adds_valid_directives(suite: Conformance) -> None:
    # serversnippet.go: It(`add valid directives to server via server snippet`) (the
    # ConfigMap allows snippets: allow-snippet-annotations, annotations-risk-level Critical)
    host = "serversnippet.foo.com"
    snippet = 'more_set_headers "Foo: Bar";\nmore_set_headers "Xpto: Lalala";\n'
    await apply(suite, single_ingress(host, "/", host, {P + "server-snippet": snippet}))
    response = await suite.eventually("/", host=host, backend=V1)
    assert response.response_header("Foo") == "Bar"
    assert response.response_header("Xpto") == "Lalala"


async def test_custom_headers_from_a_configmap(suite: Conformance) -> None:
    # customheaders.go: It(`should set "more_set_headers 'My-Custom-Header' '42';" when
    # custom-headers are set`), It("should return status code 503 when custom-headers is
    # configured with an invalid secret") -- here the Ingress is not served (404, no
    # route) rather than answered 503: the catalogued fail-closed refusal.
    headers = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "custom-headers", "namespace": INFRA},
        "data": {"My-Custom-Header": "42"},
    }
    annotations = {P + "custom-headers": f"{INFRA}/custom-headers"}
    await apply(
        suite,
        headers,
        single_ingress("custom-headers", "/", "custom-headers", annotations),
        single_ingress(
            "missing", "/", "missing-headers", {P + "custom-headers": f"{INFRA}/nothing"}
        ),
    )
    response = await suite.eventually("/", host="custom-headers", backend=V1)
    assert response.response_header("My-Custom-Header") == "42"
    assert (await suite.request("/", host="missing-headers")).status == 404


async def test_configmap_add_headers_and_proxy_set_headers(suite: Conformance) -> None:
    # test/e2e/settings/custom_header.go (DescribeSetting "add-headers"): It("Add
    # multiple custom headers") -- the ConfigMap's add-headers names a ConfigMap whose
    # entries every response carries; and the proxy-set-headers key of
    # docs/examples/customization/custom-headers (no e2e test of its own): its
    # ConfigMap's entries reach the backend on every request. An Ingress's own
    # custom-headers header of the same name wins (nginx runs the http-level
    # more_set_headers first).
    def config_map(name: str, data: dict[str, str]) -> dict[str, Any]:
        return {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": name, "namespace": INFRA},
            "data": data,
        }

    controller = {
        **CONTROLLER,
        "data": {
            **CONTROLLER["data"],
            "add-headers": f"{INFRA}/add-headers-configmap-two",
            "proxy-set-headers": f"{INFRA}/custom-headers-request",
        },
    }
    add = {"X-First": "Prepare for trouble!", "X-Second": "And make it double!"}
    own = single_ingress(
        "own-headers", "/", "own-headers", {P + "custom-headers": f"{INFRA}/own-headers"}
    )
    await suite.apply(
        extra=yaml.safe_dump_all(
            [
                controller,
                config_map("add-headers-configmap-two", add),
                config_map("custom-headers-request", {"X-Using-Nginx-Controller": "true"}),
                config_map("own-headers", {"X-Second": "mine"}),
                single_ingress("custom-header", "/", "custom-header"),
                own,
            ]
        )
    )
    last: list[Any] = []

    async def headed() -> bool:
        response = await suite.request("/", host="custom-header")
        last[:] = [response]
        return response.status == 200 and response.response_header("X-First") is not None

    await until(headed, f"add-headers on custom-header (last: {last})", timeout=20)
    response = last[0]
    assert response.response_header("X-First") == "Prepare for trouble!"
    assert response.response_header("X-Second") == "And make it double!"
    assert response.request_header("X-Using-Nginx-Controller") == "true"
    mine = await suite.eventually("/", host="own-headers", backend=V1)
    assert mine.response_header("X-First") == "Prepare for trouble!"
    assert mine.response_header("X-Second") == "mine"


async def test_preserve_trailing_slash_on_the_https_redirect(suite: Conformance) -> None:
    # preservetrailingslash.go: It("should allow preservation of trailing slashes")
    from tests.support.gatewayapi import tls_secret

    host = "forcesslredirect.bar.com"
    annotations = {P + "ssl-redirect": "true", P + "preserve-trailing-slash": "true"}
    item = single_ingress("trailing", "/", host, annotations)
    item["spec"]["tls"] = [{"hosts": [host], "secretName": "trailing-tls"}]
    await suite.apply(
        extra=yaml.safe_dump_all([CONTROLLER, item])
        + "\n---\n"
        + tls_secret(INFRA, "trailing-tls", host)
    )
    response = await suite.eventually("/", host=host, status=308)
    assert response.header("Location") == "https://forcesslredirect.bar.com/"


async def test_xforwardedprefix_not_added_when_the_annotation_is_empty(suite: Conformance) -> None:
    # xforwardedprefix.go: It("should not add X-Forwarded-Prefix if the annotation value
    # is empty")
    host = "xfp2.bar.com"
    annotations = {P + "x-forwarded-prefix": "", P + "rewrite-target": "/foo"}
    await apply(suite, single_ingress(host, "/", host, annotations))
    response = await suite.eventually("/", host=host, backend=V1)
    assert response.request_header("X-Forwarded-Prefix") is None


async def test_the_resolver_process_answers_admission_reviews(tmp_path) -> None:
    """`waygate resolver serve --kubernetes --ingress-nginx --admission-webhook-port`
    (a real process, against the STAND-IN API server, tests/support/kubeapi.py): the
    webhook listens with the process's certificate and denies what it would not serve."""
    import asyncio
    import http.client
    import json
    import socket
    import ssl

    from tests.integration.resolver.test_ingress_nginx_webhook import admission_review
    from tests.support.kubeapi import KubeAPI
    from tests.support.pki import self_signed
    from tests.support.processes import start_service

    cert, key = self_signed("waygate-resolver.waygate.svc")
    (tmp_path / "tls.crt").write_text(cert)
    (tmp_path / "tls.key").write_text(key)
    (tmp_path / "tls.key").chmod(0o600)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with KubeAPI() as api:
        api.bearer_token = "resolver-token"
        api.register("waygate.io/v1", "Route", "routes", namespaced=True)
        kubeconfig = tmp_path / "kubeconfig"
        kubeconfig.write_text(
            f"""
apiVersion: v1
kind: Config
clusters: [{{name: stand-in, cluster: {{server: "{api.url}"}}}}]
users: [{{name: resolver, user: {{token: resolver-token}}}}]
contexts: [{{name: test, context: {{cluster: stand-in, user: resolver}}}}]
current-context: test
"""
        )
        resolver = await start_service(
            [
                "waygate",
                "resolver",
                "serve",
                "--grpc-port",
                "0",
                "--admin-port",
                "0",
                "--kubernetes",
                "--kubeconfig",
                str(kubeconfig),
                "--ingress-nginx",
                "--admission-webhook-port",
                str(port),
                "--tls-cert-file",
                str(tmp_path / "tls.crt"),
                "--tls-key-file",
                str(tmp_path / "tls.key"),
                # Its gRPC clients' CA (none call here): static TLS asks for one.
                "--tls-client-ca-file",
                str(tmp_path / "tls.crt"),
            ]
        )
        try:
            context = ssl.create_default_context(cafile=str(tmp_path / "tls.crt"))
            context.check_hostname = False

            def post(body: bytes) -> tuple[int, bytes]:
                connection = http.client.HTTPSConnection(
                    "127.0.0.1", port, context=context, timeout=5
                )
                try:
                    connection.request("POST", "/validate", body=body)
                    response = connection.getresponse()
                    return response.status, response.read()
                finally:
                    connection.close()

            review = admission_review({P + "enable-modsecurity": "true"})
            async with asyncio.timeout(20):
                while True:
                    try:
                        status, data = await asyncio.to_thread(post, json.dumps(review).encode())
                        break
                    except OSError:
                        await asyncio.sleep(0.1)
            assert status == 200
            response = json.loads(data)["response"]
            assert response["allowed"] is False
            assert "UnsupportedAnnotation" in response["status"]["message"]
        finally:
            await resolver.stop()


# ---------------------------------------------------------------- responses: CORS


async def test_cors_should_enable_cors(suite: Conformance) -> None:
    # cors.go: It("should enable cors"): the default headers, and OPTIONS answered 204
    host = "cors.foo.com"
    await apply(suite, single_ingress(host, "/", host, {P + "enable-cors": "true"}))
    response = await suite.eventually("/", host=host, method="OPTIONS", status=204)
    assert response.header("Access-Control-Allow-Methods") == (
        "GET, PUT, POST, DELETE, PATCH, OPTIONS"
    )
    assert response.header("Access-Control-Allow-Origin") == "*"
    assert response.header("Access-Control-Allow-Headers") == (
        "DNT,Keep-Alive,User-Agent,X-Requested-With,If-Modified-Since,"
        "Cache-Control,Content-Type,Range,Authorization"
    )
    assert response.header("Access-Control-Max-Age") == "1728000"
    assert response.header("Access-Control-Allow-Credentials") == "true"
    # The backend's answers carry them too (`more_set_headers` in the location).
    answer = await suite.request("/", host=host)
    assert answer.backend == V1 and answer.header("Access-Control-Allow-Origin") == "*"


async def test_cors_methods_max_age_credentials_headers_expose(suite: Conformance) -> None:
    # cors.go: It("should set cors methods to only allow POST, GET"),
    # It("should set cors max-age"), It("should disable cors allow credentials"),
    # It("should allow headers for cors"), It("should expose headers for cors")
    host = "cors2.foo.com"
    annotations = {
        P + "enable-cors": "true",
        P + "cors-allow-methods": "POST, GET",
        P + "cors-max-age": "200",
        P + "cors-allow-credentials": "false",
        P + "cors-allow-headers": "DNT, User-Agent",
        P + "cors-expose-headers": "X-CustomResponseHeader, X-CustomSecondHeader",
    }
    await apply(suite, single_ingress(host, "/", host, annotations))
    response = await suite.eventually("/", host=host, method="OPTIONS", status=204)
    assert response.header("Access-Control-Allow-Methods") == "POST, GET"
    assert response.header("Access-Control-Max-Age") == "200"
    assert response.header("Access-Control-Allow-Credentials") is None
    assert response.header("Access-Control-Allow-Headers") == "DNT, User-Agent"
    assert response.header("Access-Control-Expose-Headers") == (
        "X-CustomResponseHeader, X-CustomSecondHeader"
    )


async def test_cors_origins_single_multiple_wildcard_and_port(suite: Conformance) -> None:
    # cors.go: It("should allow origin for cors"), It("should allow - single origin for
    # multiple cors values"), It("should not allow - single origin for multiple cors
    # values"), It("should allow - origins with wildcard"), It("should not allow -
    # portions of origin"), It("should allow - single origin with required port"),
    # It("should not allow - single origin with port and origin without port")
    host = "cors3.foo.com"
    origins = "https://origin.cors.com:8080, https://*.origin.com, http://origin2.cors.com"
    annotations = {P + "enable-cors": "true", P + "cors-allow-origin": origins}
    await apply(suite, single_ingress(host, "/", host, annotations))
    allowed = (
        "https://origin.cors.com:8080",
        "https://foo.origin.com",
        "http://origin2.cors.com",
    )
    for origin in allowed:
        response = await suite.eventually(
            "/", host=host, method="OPTIONS", status=204, headers={"Origin": origin}
        )
        assert response.header("Access-Control-Allow-Origin") == origin
        answer = await suite.request("/", host=host, headers={"Origin": origin})
        assert answer.header("Access-Control-Allow-Origin") == origin
    refused = (
        "https://origin.cors.com",  # the listed origin needs its port
        "http://origin.cors.com:8080",
        "https://origin.com",  # a wildcard needs its label
        "https://foo.bar.origin.com",
        "http://origin2.cors.com.evil.com",  # portions of an origin
        "https://evil.com/http://origin2.cors.com",  # a named difference: refused here
    )
    for origin in refused:
        answer = await suite.request("/", host=host, method="OPTIONS", headers={"Origin": origin})
        assert answer.status == 200 and answer.backend == V1, origin  # the backend's
        assert answer.header("Access-Control-Allow-Origin") is None, origin


# ---------------------------------------------------------------- responses: body size


async def test_proxy_body_size_8m_and_the_1m_default(suite: Conformance) -> None:
    # proxy.go: It("should set proxy client-max-body-size to 8m"): nginx's
    # client_max_body_size 8m, asserted by its answer (413) rather than the config
    # text; without the annotation ingress-nginx's ConfigMap default, 1m.
    limited, default = "proxy.foo.com", "proxy-default.foo.com"
    await apply(
        suite,
        single_ingress(limited, "/", limited, {P + "proxy-body-size": "8m"}),
        single_ingress(default, "/", default),
    )
    await suite.eventually("/", host=limited, backend=V1)
    await suite.eventually("/", host=default, backend=V1)
    over = {"Content-Length": str(8 * 1024 * 1024 + 1)}
    response = await suite.request("/", host=limited, method="POST", headers=over)
    assert response.status == 413
    assert "proxy-body-size" in (response.header("X-Waygate-Error") or "")
    # 2 MiB: within this Ingress's 8m, beyond the other's default 1m.
    two = {"Content-Length": str(2 * 1024 * 1024)}
    response = await suite.request("/", host=default, method="POST", headers=two)
    assert response.status == 413


async def test_rewrite_with_capture_groups_reordered(suite: Conformance) -> None:
    # rewrite.go: It("should allow for custom rewrite parameters") with two groups
    # beyond the `PREFIX(/|$)(.*)` idiom (Waygate's own case: the e2e's is the idiom):
    # nginx's `rewrite "(?i)PATH" TARGET break;`, the query appended.
    host = "rewrite5.bar.com"
    annotations = {P + "use-regex": "true", P + "rewrite-target": "/v/$2/$1"}
    item = single_ingress("groups", "/api/(v[0-9]+)/(.*)", host, annotations)
    item["spec"]["rules"][0]["http"]["paths"][0]["pathType"] = "ImplementationSpecific"
    await apply(suite, item)
    response = await suite.eventually("/API/v2/users/7?q=1", host=host, backend=V1)
    assert response.echo["target"] == "/v/users/7/v2?q=1"


async def test_default_backend_is_used_when_the_service_has_no_endpoint(suite: Conformance) -> None:
    # default_backend.go: It("should use a custom default backend as upstream"): the
    # Ingress's Service has no endpoint; the annotation's Service answers.
    host = "default-backend.foo.com"
    annotations = {P + "default-backend": "infra-backend-v2"}
    await apply(suite, single_ingress(host, "/", host, annotations, service="no-such-service"))
    response = await suite.eventually("/", host=host, backend=V2)
    assert response.echo["target"] == "/"
    # ... with x-code=503, x-ingress-name, x-service-name=invalid (here no-such-service)
    # and the client's x-request-id (the template's custom-default-backend- headers).
    response = await suite.eventually(
        "/alma/armud", host=host, backend=V2, headers={"X-Request-ID": "something-unique"}
    )
    assert response.echo["target"] == "/alma/armud"
    assert response.request_header("X-Code") == "503"
    assert response.request_header("X-Ingress-Name") == host
    assert response.request_header("X-Service-Name") == "no-such-service"
    assert response.request_header("X-Request-ID") == "something-unique"


async def test_affinity_cookie_attributes(suite: Conformance) -> None:
    # affinity.go: It("should set cookie with expires") (Max-Age=259200; its Expires
    # date is a named difference: the lifetime goes as Max-Age only), It("should work
    # with use-regex annotation and session-cookie-path"), It("should not set affinity
    # across all server locations when using separate ingresses"), It("should set
    # secure in cookie with provided true annotation on http"), It("should not set
    # secure in cookie with provided false annotation on http")
    sticky = {P + "affinity": "cookie", P + "session-cookie-name": "SERVERID"}
    expires = single_ingress(
        "expires",
        "/",
        "cookie-expires.foo.com",
        {
            **sticky,
            P + "session-cookie-expires": "172800",
            P + "session-cookie-max-age": "259200",
        },
    )
    regex = single_ingress(
        "useregex",
        "/foo/.*",
        "useregex.foo.com",
        {**sticky, P + "use-regex": "true", P + "session-cookie-path": "/foo/bar"},
    )
    regex["spec"]["rules"][0]["http"]["paths"][0]["pathType"] = "ImplementationSpecific"
    first = single_ingress("ingress1", "/foo/bar", "separate.foo.com", {P + "affinity": "cookie"})
    second = single_ingress("ingress2", "/foo", "separate.foo.com")
    secure = single_ingress(
        "secure", "/bar", "secure.foo.com", {**sticky, P + "session-cookie-secure": "true"}
    )
    insecure = single_ingress(
        "insecure", "/bar", "insecure.foo.com", {**sticky, P + "session-cookie-secure": "false"}
    )
    await apply(suite, expires, regex, first, second, secure, insecure)
    response = await suite.eventually("/", host="cookie-expires.foo.com", backend=V1)
    assert "Max-Age=259200" in (response.response_header("Set-Cookie") or "")
    response = await suite.eventually("/foo/bar", host="useregex.foo.com", backend=V1)
    cookie = response.response_header("Set-Cookie") or ""
    assert "Path=/foo/bar" in cookie and "SERVERID=" in cookie
    response = await suite.eventually("/foo", host="separate.foo.com", backend=V1)
    assert response.response_header("Set-Cookie") is None
    response = await suite.eventually("/foo/bar", host="separate.foo.com", backend=V1)
    assert "Path=/foo/bar" in (response.response_header("Set-Cookie") or "")
    response = await suite.eventually("/bar", host="secure.foo.com", backend=V1)
    assert "; Secure" in (response.response_header("Set-Cookie") or "")
    response = await suite.eventually("/bar", host="insecure.foo.com", backend=V1)
    assert "; Secure" not in (response.response_header("Set-Cookie") or "x")


async def test_trailing_slash_dropped_or_kept_on_the_https_redirect(suite: Conformance) -> None:
    # preservetrailingslash.go: It("should allow preservation of trailing slashes"),
    # and ingress-nginx's default (preserve-trailing-slash "false"): the slash dropped.
    from tests.support.gatewayapi import tls_secret

    kept, dropped = "kept.bar.com", "dropped.bar.com"
    keep = single_ingress("keep", "/", kept, {P + "preserve-trailing-slash": "true"})
    keep["spec"]["tls"] = [{"hosts": [kept], "secretName": "kept-tls"}]
    drop = single_ingress("drop", "/", dropped)
    drop["spec"]["tls"] = [{"hosts": [dropped], "secretName": "dropped-tls"}]
    await suite.apply(
        extra=yaml.safe_dump_all([CONTROLLER, keep, drop])
        + "\n---\n"
        + tls_secret(INFRA, "kept-tls", kept)
        + "\n---\n"
        + tls_secret(INFRA, "dropped-tls", dropped)
    )
    response = await suite.eventually("/something/", host=kept, status=308)
    assert response.header("Location") == "https://kept.bar.com/something/"
    response = await suite.eventually("/something/", host=dropped, status=308)
    assert response.header("Location") == "https://dropped.bar.com/something"
    response = await suite.eventually("/", host=dropped, status=308)
    assert response.header("Location") == "https://dropped.bar.com/"


async def test_custom_http_errors_and_disable_proxy_intercept_errors(suite: Conformance) -> None:
    # disableproxyintercepterrors.go: It("configures Nginx correctly"): custom-http-errors
    # 404 with default-backend the echo service; with disable-proxy-intercept-errors
    # "true" GET /status/404 is the backend's 404, with "false" the echo service's 200
    # naming x-code=404, x-ingress-name, x-service-name and x-request-id.
    # customhttperrors.go: It("configures Nginx correctly when enabled"): "404, 503"
    # and the default-backend annotation's Service as the error backend.
    annotations = {
        P + "custom-http-errors": "404, 503",
        P + "default-backend": "infra-backend-v2",
    }
    intercepted = single_ingress("pie.foo.com", "/", "pie.foo.com", annotations)
    passed = single_ingress(
        "pie-off.foo.com",
        "/",
        "pie-off.foo.com",
        {**annotations, P + "disable-proxy-intercept-errors": "true"},
    )
    await apply(suite, intercepted, passed)
    request_id = {"X-Request-ID": "proxy_intercept_errors"}
    response = await suite.eventually(
        "/status/404", host="pie-off.foo.com", status=404, headers=request_id
    )
    assert response.body == b"status 404"  # the backend's own answer
    response = await suite.eventually(
        "/status/404", host="pie.foo.com", backend=V2, headers=request_id
    )
    assert response.request_header("X-Code") == "404"
    assert response.request_header("X-Ingress-Name") == "pie.foo.com"
    assert response.request_header("X-Service-Name") == "infra-backend-v1"
    assert response.request_header("X-Request-ID") == "proxy_intercept_errors"
    assert response.request_header("X-Original-URI") == "/status/404"
    assert response.echo["target"] == "/"
    # A status not listed is the backend's.
    response = await suite.request("/status/500", host="pie.foo.com")
    assert (response.status, response.body) == (500, b"status 500")


async def test_proxy_redirect_and_proxy_cookies(suite: Conformance) -> None:
    # proxy.go: It("should set proxy_redirect to hello.com goodbye.com"),
    # It("should setup proxy cookies") (proxy-cookie-domain "localhost example.org",
    # proxy-cookie-path "/one/ /"): nginx's directives, asserted on what the client gets.
    host = "proxy.foo.com"
    annotations = {
        P + "proxy-redirect-from": "http://hello.com/",
        P + "proxy-redirect-to": "http://goodbye.com/",
        P + "proxy-cookie-domain": "localhost example.org",
        P + "proxy-cookie-path": "/one/ /",
    }
    await apply(suite, single_ingress(host, "/", host, annotations))
    sent = "Location:http://hello.com/x,Set-Cookie:a=1; Domain=localhost; Path=/one/b"
    response = await suite.eventually(
        "/", host=host, backend=V1, headers={"X-Echo-Set-Header": sent}
    )
    assert response.header("Location") == "http://goodbye.com/x"
    assert response.header("Set-Cookie") == "a=1; Domain=example.org; Path=/b"


async def test_connection_header_and_access_log_off(suite: Conformance) -> None:
    # connection.go: It("set connection header to keep-alive"): the echo backend sees
    # connection=keep-alive. The annotation enable-access-log "false" (nginx's
    # location-level `access_log off`, as disableaccesslog.go's ConfigMap keys at the
    # http level): no access-log line for the Ingress's requests, others still logged.
    keep = single_ingress(
        "connection.foo.com",
        "/",
        "connection.foo.com",
        {P + "connection-proxy-header": "keep-alive", P + "enable-access-log": "false"},
    )
    await apply(suite, keep)
    response = await suite.eventually("/quiet", host="connection.foo.com", backend=V1)
    assert response.request_header("Connection") == "keep-alive"
    assert suite.proxy is not None
    proxy = suite.proxy

    async def logged() -> bool:
        await suite.request("/loud", host=f"apply-{suite.applied}.marker.test")
        return any(e.get("msg") == "request" and e.get("path") == "/loud" for e in proxy.logs)

    await until(logged, "an access-log line for another route", timeout=20)
    assert not [e for e in proxy.logs if e.get("msg") == "request" and e.get("path") == "/quiet"]


def _proxy_ssl_objects(backend_port: int, ca: Any, hosts: list[str]) -> str:
    """framework.CreateIngressMASecret's Secret `proxyssl` (tls.crt, tls.key of a
    certificate for the hosts, ca.crt of its CA), `proxyssl-ca` with ca.crt alone, and
    a Service `nginx-dual-backend` with its EndpointSlice at `backend_port`."""
    import base64

    cert, key = ca.issue(dns=hosts)
    secrets = [
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": name, "namespace": INFRA},
            "data": {k: base64.b64encode(v).decode() for k, v in data.items()},
        }
        for name, data in (
            ("proxyssl", {"tls.crt": cert, "tls.key": key, "ca.crt": ca.pem}),
            ("proxyssl-ca", {"ca.crt": ca.pem}),
        )
    ]
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "nginx-dual-backend", "namespace": INFRA},
        "spec": {"ports": [{"name": "https", "port": 443, "targetPort": backend_port}]},
    }
    endpoints = {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": "nginx-dual-backend-local",
            "namespace": INFRA,
            "labels": {"kubernetes.io/service-name": "nginx-dual-backend"},
        },
        "addressType": "IPv4",
        "ports": [{"name": "https", "port": backend_port}],
        "endpoints": [{"addresses": ["127.0.0.1"]}],
    }
    return yaml.safe_dump_all([*secrets, service, endpoints])


def _with_tls(item: dict[str, Any], host: str, service: str = "") -> dict[str, Any]:
    """framework.NewSingleIngressWithTLS: the host's TLS from the Secret `proxyssl`."""
    item["spec"]["tls"] = [{"hosts": [host], "secretName": "proxyssl"}]
    if service:
        item["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"] = {
            "name": service,
            "port": {"number": 443},
        }
    return item


async def test_proxyssl_secret_and_backend_protocol_auto_http(suite: Conformance) -> None:
    # proxyssl.go: It("should set valid proxy-ssl-secret") and It("should set valid
    # proxy-ssl-secret, proxy-ssl-verify to on, proxy-ssl-verify-depth to 2, and
    # proxy-ssl-server-name to on"): the Secret of CreateIngressMASecret is the host's
    # certificate and proxy-ssl-secret; the echo backend speaks HTTP, so the Ingress
    # is served as it is: plain HTTP -> 308, HTTPS -> 200. (assertProxySSL's nginx.conf
    # lines have no counterpart here; what they mean is asserted on the wire, and with
    # a real client certificate in tests/integration/proxy/test_backend_client_tls.py.)
    # backendprotocol.go: It("should set backend protocol to $scheme:// and use
    # proxy_pass"): AUTO_HTTP reaches one Service port over TLS from an HTTPS client
    # and in plain HTTP from a plain one (the backend says which scheme arrived),
    # verified against a ca.crt-only proxy-ssl-secret.
    # This suite's proxy is not a route reader (no mTLS to the resolver): the key of
    # proxy-ssl-secret never reaches it, and an HTTPS backend that would get the
    # client certificate is a 502 that says so, never a handshake without it.
    from tests.support.dualscheme import DualBackend
    from tests.support.pki import LocalCA
    from waygate.core.tls import server_context

    ca = LocalCA(name="proxyssl.foo.com CA")
    backend_cert, backend_key = ca.issue(dns=["backend.internal"])
    context = server_context(
        chain_pem=backend_cert, key_pem=backend_key, client_ca_pem=ca.pem, client_auth="optional"
    )
    plain_host, verify_host = "proxyssl.foo.com", "proxyssl-verify.foo.com"
    https_host, auto_host, broken_host = "https.foo.com", "auto.foo.com", "broken.foo.com"
    secret = f"{INFRA}/proxyssl"
    name = {P + "proxy-ssl-verify": "on", P + "proxy-ssl-name": "backend.internal"}
    with DualBackend(context) as backend:
        ingresses = [
            _with_tls(
                single_ingress("proxyssl", "/", plain_host, {P + "proxy-ssl-secret": secret}),
                plain_host,
            ),
            _with_tls(
                single_ingress(
                    "proxyssl-verify",
                    "/",
                    verify_host,
                    {
                        P + "proxy-ssl-secret": secret,
                        P + "proxy-ssl-verify": "on",
                        P + "proxy-ssl-verify-depth": "2",
                        P + "proxy-ssl-server-name": "on",
                    },
                ),
                verify_host,
            ),
            _with_tls(
                single_ingress(
                    "proxyssl-https",
                    "/",
                    https_host,
                    {P + "backend-protocol": "HTTPS", P + "proxy-ssl-secret": secret, **name},
                ),
                https_host,
                "nginx-dual-backend",
            ),
            _with_tls(
                single_ingress(
                    "auto-http",
                    "/",
                    auto_host,
                    {
                        P + "backend-protocol": "AUTO_HTTP",
                        P + "proxy-ssl-secret": f"{INFRA}/proxyssl-ca",
                        P + "ssl-redirect": "false",
                        **name,
                    },
                ),
                auto_host,
                "nginx-dual-backend",
            ),
            single_ingress(
                "proxyssl-missing",
                "/",
                broken_host,
                {P + "backend-protocol": "HTTPS", P + "proxy-ssl-secret": f"{INFRA}/missing"},
            ),
        ]
        objects = _proxy_ssl_objects(backend.port, ca, [plain_host, verify_host, https_host])
        await suite.apply(extra=yaml.safe_dump_all([CONTROLLER, *ingresses]) + "---\n" + objects)
        for host in (plain_host, verify_host):
            await suite.eventually("/", host=host, status=308)
            response = await suite.request("/", host=host, tls=True)
            assert (response.status, response.backend) == (200, V1), response
        response = await suite.eventually("/", host=auto_host, tls=True)
        assert response.echo == {"scheme": "https", "client": ""}, response.echo
        response = await suite.eventually("/", host=auto_host)
        assert response.echo == {"scheme": "http", "client": ""}, response.echo
        assert sorted(backend.connections) == ["http", "https"]
        response = await suite.request("/", host=https_host, tls=True)
        assert response.status == 502, response
        assert "withheld" in (response.header("X-Waygate-Error") or ""), response
        # A proxy-ssl-secret that cannot be read: that Ingress alone is not served
        # (ingress-nginx denies its location: 503); the others above still are.
        assert (await suite.request("/", host=broken_host)).status == 404
    assert suite.resolver is not None
    code, out, err = await run_cli("routes", "--addr", suite.resolver.grpc_address, "-o", "json")
    assert code == 0, err
    assert f"proxy-ssl-secret: Secret {INFRA}/missing not found" in json.dumps(json.loads(out))
    # Not a route reader, `waygate routes` gets no key either.
    assert "PRIVATE KEY" not in out


def echo_pods(pods: list[RecordingUpstream]) -> str:
    """framework.NewEchoDeployment(WithDeploymentReplicas(len(pods))): a Service
    `echo` whose endpoints are these RecordingUpstreams (each on its own loopback
    address, as pods have their own), one EndpointSlice each (their ports differ)."""
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "echo", "namespace": INFRA},
        "spec": {"ports": [{"name": "http", "port": 80, "targetPort": 8080}]},
    }
    slices = [
        {
            "apiVersion": "discovery.k8s.io/v1",
            "kind": "EndpointSlice",
            "metadata": {
                "name": f"echo-{index}",
                "namespace": INFRA,
                "labels": {"kubernetes.io/service-name": "echo"},
            },
            "addressType": "IPv4",
            "ports": [{"name": "http", "port": pod.port, "protocol": "TCP"}],
            "endpoints": [{"addresses": [pod.host], "conditions": {"ready": True}}],
        }
        for index, pod in enumerate(pods)
    ]
    return yaml.safe_dump_all([service, *slices])


async def test_upstream_hash_by_connects_to_the_same_pod_or_subset_of_pods(
    suite: Conformance,
) -> None:
    # upstreamhashby.go (six echo replicas, 100 requests for "/"): It("should connect
    # to the same pod") -- one pod; It("should connect to the same subset of pods")
    # with upstream-hash-by-subset "true" and -size "3" -- three pods.
    host = "upstream-hash-by.foo.com"
    pods = [await RecordingUpstream(f"echo-{i}", f"127.0.0.{10 + i}").start() for i in range(6)]
    try:
        objects = echo_pods(pods)

        async def pods_serving(path: str, requests: int) -> set[str]:
            seen = set()
            for _ in range(requests):
                response = await suite.request(path, host=host)
                assert response.status == 200, response
                seen.add(response.backend)
            return seen

        async def apply_hashing(annotations: dict[str, str]) -> None:
            item = single_ingress(host, "/", host, annotations, service="echo")
            item["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"]["port"] = {
                "number": 80
            }
            await suite.apply(extra=yaml.safe_dump_all([CONTROLLER, item]) + "\n---\n" + objects)
            await suite.eventually("/", host=host, status=200)

        await apply_hashing({P + "upstream-hash-by": "$request_uri"})
        assert len(await pods_serving("/", 100)) == 1

        await apply_hashing(
            {
                P + "upstream-hash-by": "$request_uri",
                P + "upstream-hash-by-subset": "true",
                P + "upstream-hash-by-subset-size": "3",
            }
        )
        assert len(await pods_serving("/", 100)) == 3
        # Beyond the e2e test: every key stays within one subset of three, and the
        # keys together reach both subsets (six pods, two disjoint subsets).
        subsets = {frozenset(await pods_serving(f"/{key}", 40)) for key in range(8)}
        assert all(len(subset) <= 3 for subset in subsets)
        assert set().union(*subsets) == {f"echo-{i}" for i in range(6)}
        assert all(a == b or not a & b for a in subsets for b in subsets)
    finally:
        for pod in pods:
            await pod.stop()


async def test_service_upstream_uses_the_service_cluster_ip_and_port(suite: Conformance) -> None:
    # serviceupstream.go: It("should use the Service Cluster IP and Port ") with the
    # annotation, then with the ConfigMap's service-upstream; It("should not use the
    # Service Cluster IP and Port") with the ConfigMap on and the annotation "false".
    # Each checks the backend answers and that the controller's backends (its
    # `/dbg backends all`; here the proxy's status page, /status.json's Endpoints)
    # hold the Service's cluster IP, or not. No kube-proxy runs here, so the STAND-IN
    # for one is the address itself: the Service's clusterIP is 127.0.0.1 and its
    # port the port backend v1 listens on, while its EndpointSlice names backend v2:
    # v1 answering means the proxy dialled ClusterIP:port, not the endpoints.
    assert suite.proxy is not None
    proxy = suite.proxy
    cluster_port = suite.backends[(INFRA, "infra-backend-v1")].port
    endpoint_port = suite.backends[(INFRA, "infra-backend-v2")].port
    host = "serviceupstream"
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "service-upstream", "namespace": INFRA},
        "spec": {
            "clusterIP": "127.0.0.1",
            "ports": [{"name": "http", "port": cluster_port, "targetPort": 80}],
        },
    }

    async def addresses() -> set[str]:
        """The addresses the proxy's routes of the Service balance over."""
        status, body = await admin_get(proxy.admin_port, "/status.json")
        assert status == 200
        sections = (s for p in json.loads(body)["services"] for s in p["sections"])
        rows = next(s["rows"] for s in sections if s["title"] == "Endpoints")
        return {_text(row[2]) for row in rows if _text(row[1]) == "service-upstream"}

    async def check(annotations: dict[str, str], configmap: dict[str, str], cluster: bool) -> None:
        item = single_ingress(host, "/", host, annotations, service="service-upstream")
        item["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"]["port"] = {
            "number": cluster_port
        }
        controller = {**CONTROLLER, "data": {**CONTROLLER["data"], **configmap}}
        manifests = [controller, item, service, local_slice(service, endpoint_port)]
        await suite.apply(extra=yaml.safe_dump_all(manifests))
        # "checking if the service is reached"
        response = await suite.eventually("/", host=host, backend=V1 if cluster else V2)
        assert response.status == 200
        # "checking if the Service Cluster IP and Port are (not) used"
        used = await addresses()
        if cluster:
            assert used == {f"127.0.0.1:{cluster_port}"}
        else:
            assert used == {f"127.0.0.1:{endpoint_port}"}

    await check({P + "service-upstream": "true"}, {}, cluster=True)
    await check({}, {"service-upstream": "true"}, cluster=True)
    await check({P + "service-upstream": "false"}, {"service-upstream": "true"}, cluster=False)


def _text(cell: Any) -> str:
    """A status-page cell: a plain value or {"text": ..., "state": ...}."""
    return str(cell["text"] if isinstance(cell, dict) else cell)


async def admin_get(port: int, path: str) -> tuple[int, bytes]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())
        head, _, body = (await read_response(reader, timeout=10)).partition(b"\r\n\r\n")
        return int(head.split(b" ", 2)[1]), body
    finally:
        writer.close()


async def test_server_tokens_and_ssl_protocols_from_the_configmap(suite: Conformance) -> None:
    # test/e2e/settings/server_tokens.go: It("should not exists Server header in the
    # response") with server-tokens "false" and It("should exists Server header in the
    # response when is enabled") -- there the rendered config is checked (`server_tokens
    # off` + `more_clear_headers Server;`, `server_tokens on`); here the answers, with the
    # backend sending a Server of its own. Then test/e2e/settings/tls.go's protocol
    # setting, narrowed to TLSv1.3 (Waygate's floor is TLS 1.2 either way): a TLS 1.2
    # client is refused on the host, a TLS 1.3 one served. Each ConfigMap change applies
    # live, without a restart.
    host = "server-tokens"
    item = single_ingress(host, "/", host)
    item["spec"]["tls"] = [{"hosts": [host], "secretName": "server-tokens-tls"}]
    secret = yaml.safe_load(tls_secret(INFRA, "server-tokens-tls", host))
    backend_server = {"X-Echo-Set-Header": "Server:backend/1.2.3"}

    async def configure(**data: str) -> None:
        controller = {**CONTROLLER, "data": {**CONTROLLER["data"], **data}}
        await suite.apply(extra=yaml.safe_dump_all([controller, secret, item]))

    await configure(**{"server-tokens": "false"})
    secure = await suite.eventually("/", host=host, backend=V1, headers=backend_server, tls=True)
    assert secure.response_header("Server") is None
    # The proxy's own answer (ssl-redirect's 308 on plain HTTP) advertises nothing.
    redirect = await suite.request("/", host=host, headers=backend_server)
    assert redirect.status == 308 and redirect.response_header("Server") is None

    await configure(**{"server-tokens": "true", "ssl-protocols": "TLSv1.3"})

    async def advertised() -> bool:
        answer = await suite.request("/", host=host, headers=backend_server, tls=True)
        return answer.response_header("Server") == "waygate"

    await until(advertised, "Server: waygate with server-tokens true", timeout=20)
    tls12 = tls_client_context()
    tls12.maximum_version = ssl.TLSVersion.TLSv1_2

    async def refused() -> bool:
        try:
            await suite.request("/", host=host, tls=tls12)
        except (ssl.SSLError, ConnectionError):
            return True
        return False

    await until(refused, "a TLS 1.2 client refused on a TLSv1.3-only host", timeout=20)
    secure = await suite.request("/", host=host, tls=True)
    assert secure.status == 200
    # (other tests apply CONTROLLER again: the ConfigMap's defaults come back live)


# ---------------------------------------------------------------- use-proxy-protocol

PROXY_HOST = "proxy-protocol"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def proxied(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Conformance]:
    """A resolver and a proxy started with --proxy-protocol (every connection to its
    HTTP and HTTPS ports begins with a PROXY header), the ConfigMap's
    use-proxy-protocol "true", and an Ingress as framework.NewSingleIngressWithTLS
    plus one with an allow-list."""
    conformance = Conformance(
        tmp_path_factory.mktemp("proxied"),
        resolver_args=(
            "--ingress-nginx",
            "--ingress-nginx-configmap",
            "ingress-nginx/ingress-nginx-controller",
        ),
    )
    await conformance.start("--proxy-protocol")
    try:
        served = single_ingress(PROXY_HOST, "/", PROXY_HOST)
        served["spec"]["tls"] = [{"hosts": [PROXY_HOST], "secretName": TLS_SECRET}]
        allowed = single_ingress(
            "allowed", "/", "allowed.foo.com", {P + "whitelist-source-range": "192.168.0.0/24"}
        )
        config = {**CONTROLLER, "data": {"use-proxy-protocol": "true", "ssl-redirect": "false"}}
        await conformance.apply(extra=yaml.safe_dump_all([config, served, allowed]), wait=False)

        async def ready() -> bool:
            response = await proxied_request(conformance.port, V1_HEADER, PROXY_HOST)
            return response is not None and response.status == 200

        await until(ready, "the proxy to serve the Ingress behind a PROXY header", timeout=20)
        yield conformance
    finally:
        await conformance.stop()


V1_HEADER = b"PROXY TCP4 192.168.0.1 192.168.0.11 56324 1234\r\n"


async def proxied_request(
    port: int, header: bytes, host: str, *, tls: bool = False
) -> Response | None:
    """GET / on a connection that starts with `header` (then TLS, with `tls`); None
    when the proxy closes it without an answer."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(header)
    sock.setblocking(False)
    context = tls_client_context() if tls else None
    reader, writer = await asyncio.wait_for(
        asyncio.open_connection(sock=sock, ssl=context, server_hostname=host if tls else None),
        10,
    )
    try:
        writer.write(f"GET / HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
        return parse_response(await read_response(reader, timeout=10))
    except (asyncio.IncompleteReadError, ConnectionError):
        return None
    finally:
        writer.close()


async def test_use_proxy_protocol_the_client_is_the_headers(proxied: Conformance) -> None:
    # settings/proxy_protocol.go (kubernetes/ingress-nginx): It("should respect port
    # passed by the PROXY Protocol"), It("should respect proto passed by the PROXY
    # Protocol server port"), It("should enable PROXY Protocol for HTTPS"): the
    # backend is told the header's source address, destination port, and https for
    # TLS or a destination port of 443. ingress-nginx checks `listen 80 proxy_protocol`
    # in nginx.conf; Waygate's proxy takes it from --proxy-protocol (the key's
    # verdict names the setting). Beyond the Go test: an allow-list judges the
    # header's address, and a connection without a header is closed.
    response = await proxied_request(proxied.port, V1_HEADER, PROXY_HOST)
    assert response is not None and response.status == 200
    assert response.request_header("Host") == PROXY_HOST
    assert response.request_header("X-Forwarded-Port") == "1234"
    assert response.request_header("X-Forwarded-Proto") == "http"
    assert response.request_header("X-Forwarded-For") == "192.168.0.1"

    offloaded = b"PROXY TCP4 192.168.0.1 192.168.0.11 56324 443\r\n"
    response = await proxied_request(proxied.port, offloaded, PROXY_HOST)
    assert response is not None and response.status == 200
    assert response.request_header("X-Forwarded-Port") == "443"
    assert response.request_header("X-Forwarded-Proto") == "https"
    assert response.request_header("X-Forwarded-For") == "192.168.0.1"

    response = await proxied_request(proxied.https_port, V1_HEADER, PROXY_HOST, tls=True)
    assert response is not None and response.status == 200
    assert response.request_header("X-Forwarded-Port") == "1234"
    assert response.request_header("X-Forwarded-Proto") == "https"
    assert response.request_header("X-Forwarded-For") == "192.168.0.1"

    response = await proxied_request(proxied.port, V1_HEADER, "allowed.foo.com")
    assert response is not None and response.status == 200
    outside = b"PROXY TCP4 10.9.9.9 192.168.0.11 56324 80\r\n"
    response = await proxied_request(proxied.port, outside, "allowed.foo.com")
    assert response is not None and response.status == 403

    # No header: a client that went around the load balancer gets no answer.
    assert await proxied_request(proxied.port, b"", PROXY_HOST) is None


async def test_use_proxy_protocol_on_a_proxy_without_the_setting_is_reported(
    suite: Conformance,
) -> None:
    # The mismatch ingress-nginx cannot have (its ConfigMap sets the listener itself):
    # the ConfigMap says the load balancer sends the PROXY protocol, this proxy was
    # started without --proxy-protocol. It serves (the peer's address is the
    # client's) and its status page names each route (`waygate check` lists them).
    controller = {**CONTROLLER, "data": {**CONTROLLER["data"], "use-proxy-protocol": "true"}}
    item = single_ingress("unproxied", "/", "unproxied.foo.com")
    await suite.apply(extra=yaml.safe_dump_all([controller, item]))
    await suite.eventually("/", host="unproxied.foo.com", backend=V1)
    assert suite.proxy is not None
    status, body = await admin_get(suite.proxy.admin_port, "/status.json")
    assert status == 200
    sections = [s for p in json.loads(body)["services"] for s in p["sections"]]
    [section] = [s for s in sections if s["title"] == "PROXY protocol not read"]
    assert section["state"] == "bad"
    assert any("unproxied" in _text(row[0]) for row in section["rows"])
    assert all("--proxy-protocol" in _text(row[1]) for row in section["rows"])
