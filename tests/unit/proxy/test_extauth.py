"""extauth without sockets: the auth subrequest as ingress-nginx renders it (its
nginx.tmpl auth location, internal/ingress/annotations/authreq), the verdict on
its answer, and the gate that marks every request of the route (the protocol
pairs: tests/integration/proxy/test_request_core.py)."""

from __future__ import annotations

import pytest

from tests.unit.proxy.test_decision import Facts, ep, req, rt, view
from waygate.proxy import decision, extauth
from waygate.proxy.decision import Forward, decide
from waygate.proxy.http1 import BadMessage, parse_response_head
from waygate.resolver.model import ExternalAuth, Route

SPEC = ExternalAuth(
    "http://auth.test:8080/check?a=1",
    response_headers=("X-User", "X-Email"),
    proxy_set_headers=(("X-Tenant", "shop"),),
)


def lines(head: bytes) -> list[str]:
    return head.decode().split("\r\n")


def test_the_subrequest_carries_the_request_and_ingress_nginxs_headers():
    plan = extauth.AuthPlan(SPEC)
    original = req(
        "/app/x?y=1",
        extra="Authorization: Bearer t\r\nX-Real-IP: 6.6.6.6\r\nX-Tenant: evil\r\n"
        "Content-Length: 3\r\n",
    )
    head = extauth.subrequest_head(plan, original, True, b"192.0.2.7")
    found = lines(head)
    assert found[0] == "GET /check?a=1 HTTP/1.1"
    assert "Host: auth.test:8080" in found
    assert "Authorization: Bearer t" in found
    assert "X-Original-URL: https://a.test/app/x?y=1" in found
    assert "X-Original-Method: GET" in found
    assert "X-Sent-From: nginx-ingress-controller" in found
    assert "X-Real-IP: 192.0.2.7" in found and "X-Real-IP: 6.6.6.6" not in found
    assert "X-Auth-Request-Redirect: /app/x?y=1" in found
    assert "X-Tenant: shop" in found and "X-Tenant: evil" not in found
    assert not any(line.lower().startswith("content-length") for line in found)
    assert head.endswith(b"Connection: close\r\n\r\n")
    assert not any(line.startswith("X-Original-URI") for line in found)
    # auth-method: that method, and X-Original-URI / X-Scheme (as ingress-nginx).
    posting = extauth.AuthPlan(ExternalAuth("http://auth.test/", method="POST"))
    found = lines(extauth.subrequest_head(posting, original, False, b"192.0.2.7"))
    assert found[0] == "POST / HTTP/1.1" and "Host: auth.test" in found
    assert "X-Original-URI: /app/x?y=1" in found and "X-Scheme: http" in found


def answer(status: int, fields: str = "") -> object:
    return parse_response_head(f"HTTP/1.1 {status} X\r\n{fields}Content-Length: 0\r\n\r\n".encode())


@pytest.mark.parametrize(
    ("status", "expected"),
    [
        (401, extauth.Refused(401, "authentication required")),
        (403, extauth.Refused(403, "forbidden by the authentication service")),
        (404, extauth.Refused(500, "the authentication service answered 404")),
        (500, extauth.Refused(500, "the authentication service answered 500")),
        (302, extauth.Refused(500, "the authentication service answered 302")),
    ],
)
def test_the_answer_decides(status, expected):
    plan = extauth.AuthPlan(SPEC)
    assert extauth.outcome(plan, answer(status), req(), False) == expected  # type: ignore[arg-type]
    missing = extauth.outcome(plan, None, req(), False)
    assert missing == extauth.Refused(500, "the authentication service did not answer")


def test_a_2xx_copies_the_response_headers_and_drops_the_clients_copies():
    plan = extauth.AuthPlan(SPEC)
    copied = extauth.outcome(plan, answer(204, "x-user: alice\r\nX-Other: 1\r\n"), req(), False)  # type: ignore[arg-type]
    assert copied == b"X-User: alice\r\n"
    head = b"GET / HTTP/1.1\r\nHost: a.test\r\nX-User: mallory\r\nx-email: m@x\r\nA: b\r\n\r\n"
    assert extauth.with_auth_headers(head, plan, copied) == (  # type: ignore[arg-type]
        b"GET / HTTP/1.1\r\nHost: a.test\r\nA: b\r\nX-User: alice\r\n\r\n"
    )


def test_a_401_with_signin_redirects_with_rd_unless_it_has_one():
    plan = extauth.AuthPlan(ExternalAuth("http://auth/", signin="https://login.test/s"))
    refused = extauth.outcome(plan, answer(401), req("/p?q=1"), True)  # type: ignore[arg-type]
    assert refused == extauth.Refused(
        302, "sign in first", b"https://login.test/s?rd=https://a.test%2Fp%3Fq%3D1"
    )
    named = extauth.AuthPlan(
        ExternalAuth("http://auth/", signin="https://l.test/?next=/x", signin_redirect_param="next")
    )
    refused = extauth.outcome(named, answer(401), req("/p"), True)  # type: ignore[arg-type]
    assert isinstance(refused, extauth.Refused) and refused.location == b"https://l.test/?next=/x"
    # oauth2-proxy's documented form: the variables filled in, no second rd.
    variables = extauth.AuthPlan(
        ExternalAuth("http://auth/", signin="https://$host/oauth2/start?rd=$escaped_request_uri")
    )
    refused = extauth.outcome(variables, answer(401), req("/p?q=1"), True)  # type: ignore[arg-type]
    assert isinstance(refused, extauth.Refused)
    assert refused.location == b"https://a.test/oauth2/start?rd=%2Fp%3Fq%3D1"


@pytest.mark.parametrize(
    "path", ["/", "/%2e%2e/admin", "/./admin", "//admin", "/a/../admin", "/%61dmin", "/x;y"]
)
def test_every_request_of_the_route_is_marked_cve_2026_24513(path):
    # Refused at the parse (400, before any route), or routed and marked: never past.
    route = Route("demo", "authed", "a.test", backends=rt().backends, external_auth=SPEC)
    try:
        head = req(path)
    except BadMessage as exc:
        assert exc.status == 400
        return
    forward = decide(view([route], [ep()]), head, Facts(), 0.0)
    assert isinstance(forward, Forward) and forward.auth is not None
    assert (forward.auth.target.address, forward.auth.target.port) == ("auth.test", 8080)


def test_a_route_without_external_auth_is_not_marked():
    forward = decide(view([rt()], [ep()]), req(), Facts(), 0.0)
    assert isinstance(forward, Forward) and forward.auth is None
    assert decision.rules_of(forward.entry) is False


def test_the_cache_key_fills_in_its_variables_per_route():
    spec = ExternalAuth(
        "http://auth/", cache_key="k:$http_authorization:$cookie_sid:$remote_addr:$host"
    )
    plan = extauth.AuthPlan(spec)
    head = req(extra="Authorization: Bearer t\r\nCookie: a=1; sid=xyz\r\n")
    assert extauth.cache_key(plan, "ns/r", head, b"192.0.2.7") == (
        b"ns/r\0k:Bearer t:xyz:192.0.2.7:a.test"
    )
    assert extauth.cache_key(extauth.AuthPlan(ExternalAuth("http://auth/")), "r", head, b"") is None


def test_the_cache_keeps_by_status_for_its_duration_and_is_bounded(monkeypatch):
    plan = extauth.AuthPlan(
        ExternalAuth("http://auth/", cache_key="x", cache_durations=((200, 10.0), (401, 1.0)))
    )
    cache = extauth.AnswerCache()
    ok, denied, broken = answer(200), answer(401), answer(500)
    cache.put(plan, b"a", ok, 0.0)  # type: ignore[arg-type]
    cache.put(plan, b"b", denied, 0.0)  # type: ignore[arg-type]
    cache.put(plan, b"c", broken, 0.0)  # type: ignore[arg-type]
    assert cache.get(b"a", 5.0) is ok and cache.get(b"b", 0.5) is denied
    assert cache.get(b"b", 1.0) is None and cache.get(b"c", 0.0) is None
    assert cache.get(b"a", 10.0) is None and cache.size == 0
    monkeypatch.setattr(extauth, "MAX_CACHED", 100)
    for i in range(1_000):
        cache.put(plan, b"key-%d" % i, ok, 0.0)  # type: ignore[arg-type]
    assert len(cache.entries) == 100 and cache.get(b"key-999", 1.0) is ok
    monkeypatch.setattr(extauth, "MAX_CACHED_BYTES", 64 * 200)
    for i in range(1_000):
        cache.put(plan, b"other-%d" % i, ok, 0.0)  # type: ignore[arg-type]
    assert cache.size <= 64 * 200
    assert cache.size == sum(size for _, _, size in cache.entries.values())
