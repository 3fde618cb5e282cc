"""ingress-nginx's external authentication (auth-url and friends) through a real
resolver (--manifests --ingress-nginx) and proxy.

Ported from kubernetes/ingress-nginx test/e2e/annotations/auth.go (controller
v1.15.1), Context "when external authentication is configured" and "... with a
custom redirect param": its httpbin /basic-auth/user/password is
tests/support/authservice.AuthService (a real HTTP server in this process, the
stand-in for httpbin), reached by the proxy process over TCP. And CVE-2026-24513
(auth-url bypass): every request of the authenticated Ingress is checked,
encoded and dot-segment paths included.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from urllib.parse import quote

import pytest
import pytest_asyncio
import yaml

from tests.support.authservice import BASIC_USER_PASSWORD, AuthService
from tests.support.gatewayapi import Conformance
from tests.system.test_ingress_nginx import CONTROLLER, P, single_ingress
from tests.system.test_ingress_nginx import suite as suite  # the same real processes, per module

pytestmark = [pytest.mark.system, pytest.mark.asyncio(loop_scope="module")]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def auth() -> AsyncIterator[AuthService]:
    service = await AuthService(slow_seconds=1).start()
    yield service
    await service.stop()


async def apply(suite: Conformance, *ingresses: dict) -> None:
    await suite.apply(extra=yaml.safe_dump_all([CONTROLLER, *ingresses]))


async def test_external_auth_signed_in_and_redirected(suite: Conformance, auth: AuthService):
    # auth.go, "when external authentication is configured": It("should return status
    # code 200 when signed in"), It("should redirect to signin url when not signed in"),
    # It("should overwrite Foo header with auth response").
    host = "auth"
    annotations = {
        P + "auth-url": auth.url("/basic-auth/user/password"),
        P + "auth-signin": "http://$host/auth/start",
        P + "auth-response-headers": "Foo",
    }
    await apply(suite, single_ingress(host, "/", host, annotations))
    signed_in = await suite.request(
        "/", host=host, headers={"Authorization": BASIC_USER_PASSWORD, "Foo": "bar"}
    )
    assert signed_in.status == 200
    assert signed_in.request_header("Foo") is None  # the auth answer had none: not the client's
    redirected = await suite.request("/?a=b&c=d", host=host)
    assert redirected.status == 302
    assert redirected.header("Location") == (
        f"http://{host}/auth/start?rd=http://{host}{quote('/?a=b&c=d', safe='')}"
    )


async def test_external_auth_custom_redirect_param(suite: Conformance, auth: AuthService):
    # auth.go, "when external authentication is configured with a custom redirect
    # param": It("should redirect to signin url when not signed in") with orig=.
    host = "auth-orig"
    annotations = {
        P + "auth-url": auth.url("/basic-auth/user/password"),
        P + "auth-signin": "http://$host/auth/start",
        P + "auth-signin-redirect-param": "orig",
    }
    await apply(suite, single_ingress(host, "/", host, annotations))
    signed_in = await suite.request("/", host=host, headers={"Authorization": BASIC_USER_PASSWORD})
    assert signed_in.status == 200
    redirected = await suite.request("/?a=b&c=d", host=host)
    assert redirected.status == 302
    assert redirected.header("Location") == (
        f"http://{host}/auth/start?orig=http://{host}{quote('/?a=b&c=d', safe='')}"
    )


async def test_external_auth_misconfigured_ingress_does_not_stop_others(
    suite: Conformance, auth: AuthService
):
    # auth.go: It("keeps processing new ingresses even if one of the existing ingresses
    # is misconfigured"): basic auth with a missing secret next to auth-url.
    annotations = {
        P + "auth-url": auth.url("/basic-auth/user/password"),
        P + "auth-type": "basic",
        P + "auth-secret": "something",
        P + "auth-realm": "test auth",
    }
    broken = single_ingress("auth-broken", "/", "auth-broken", annotations)
    other = single_ingress("different", "/", "different")
    await apply(suite, broken, other)
    assert (await suite.request("/", host="different")).status == 200
    assert (await suite.request("/", host="auth-broken")).status != 200


async def test_external_auth_checks_every_path_cve_2026_24513(
    suite: Conformance, auth: AuthService
):
    host = "auth-bypass"
    annotations = {P + "auth-url": auth.url("/basic-auth/user/password")}
    await apply(suite, single_ingress(host, "/", host, annotations))
    before = len(suite.backends[("gateway-conformance-infra", "infra-backend-v1")].requests)
    paths = ["/admin", "/%2e%2e/admin", "/./admin", "//admin", "/a/../admin", "/%61dmin"]
    statuses = await asyncio.gather(*(suite.request(p, host=host) for p in paths))
    assert all(s.status in (400, 401) for s in statuses), [s.status for s in statuses]
    after = len(suite.backends[("gateway-conformance-infra", "infra-backend-v1")].requests)
    assert after == before  # the backend never saw one


async def test_external_auth_cache_survives_the_auth_service_per_location(
    suite: Conformance,
) -> None:
    # auth.go, "when external authentication with caching is configured": It("should
    # return status code 200 when signed in after auth backend is deleted"), It("should
    # deny login for different location on same server") (auth-cache-key "fixed",
    # auth-cache-duration "200 201 401 30m"; httpbun deleted: here the service stopped).
    service = await AuthService().start()
    host = "auth-cached"
    annotations = {
        P + "auth-url": service.url("/basic-auth/user/password"),
        P + "auth-signin": "http://$host/auth/start",
        P + "auth-cache-key": "fixed",
        P + "auth-cache-duration": "200 201 401 30m",
    }
    foo = single_ingress("foo-auth-cached", "/foo", host, annotations)
    bar = single_ingress("bar-auth-cached", "/bar", host, annotations)
    await apply(suite, foo, bar)
    signed_in = {"Authorization": BASIC_USER_PASSWORD}
    assert (await suite.request("/foo", host=host, headers=signed_in)).status == 200
    await service.stop()
    # The service is gone: /foo's answer is cached; /bar (another location) has none.
    assert (await suite.request("/foo", host=host, headers=signed_in)).status == 200
    assert (await suite.request("/bar", host=host, headers=signed_in)).status == 500


async def test_cookie_set_by_external_authentication_server(
    suite: Conformance, auth: AuthService
) -> None:
    # auth.go, Context "cookie set by external authentication server": its auth
    # service answers /cookies/set/alma/armud with Set-Cookie alma=armud (here
    # tests/support/authservice), its backend / with 200 and /error with 503 (here
    # the backend's /status/503). It("user retains cookie by default"), It("user does
    # not retain cookie if upstream returns error status code"), It("user with
    # annotated ingress retains cookie if upstream returns error status code").
    host = "auth-check-cookies"
    annotations = {
        P + "auth-url": auth.url("/cookies/set/alma/armud"),
        P + "auth-signin": "http://$host/auth/start",
    }
    ing1 = single_ingress(host, "/", host, annotations)
    ing2 = single_ingress(host + "-error", "/status/503", host, annotations)
    await apply(suite, ing1, ing2)
    ok = await suite.request("/?a=b&c=d", host=host)
    assert ok.status == 200 and ok.response_header("Set-Cookie") == "alma=armud"
    failed = await suite.request("/status/503?a=b&c=d", host=host)
    assert failed.status == 503 and failed.response_header("Set-Cookie") is None
    always = {**annotations, P + "auth-always-set-cookie": "true"}
    await apply(
        suite,
        single_ingress(host, "/", host, always),
        single_ingress(host + "-error", "/status/503", host, always),
    )
    failed = await suite.request("/status/503?a=b&c=d", host=host)
    assert failed.status == 503 and failed.response_header("Set-Cookie") == "alma=armud"


async def test_invalid_auth_url_denies_the_whole_location(suite: Conformance) -> None:
    # auth.go, Context "with invalid auth-url should deny whole location":
    # auth-url "https://invalid..auth.url" (parser.StringToURL: "invalid url host").
    # ingress-nginx denies the location (503); Waygate does not serve the Ingress
    # (Admitted False, InvalidAnnotation: no route, 404) and serves the others.
    annotations = {P + "auth-url": "https://invalid..auth.url"}
    denied = single_ingress("auth-denied", "/denied-auth", "auth-denied", annotations)
    await apply(suite, denied, single_ingress("different", "/", "different"))
    assert (await suite.request("/", host="different")).status == 200
    assert (await suite.request("/denied-auth", host="auth-denied")).status == 404
