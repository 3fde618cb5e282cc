"""extauth's handling of the auth service's answer beyond its status, without
sockets: the Set-Cookie nginx passes on (add_header's statuses, `always`), a
401's WWW-Authenticate, the refusal pages, and what the answers' cache keeps
(nginx's proxy_cache rules). Through real sockets:
tests/integration/proxy/test_auth_cookies.py."""

from __future__ import annotations

import base64
import re
import types

import pytest

from tests.unit.proxy.test_decision import req
from tests.unit.proxy.test_extauth import answer
from waygate.proxy import extauth, filters, responserewrite
from waygate.resolver.model import ExternalAuth, HeaderModifier

COOKIES = "Set-Cookie: a=1; Path=/\r\nSet-Cookie: b=2\r\n"


def test_nginx_joins_the_answers_cookies_into_one_field():
    # $upstream_http_set_cookie (nginx 1.23+): every value, joined with ", ".
    assert extauth.auth_cookie(answer(200, COOKIES)) == b"a=1; Path=/, b=2"  # type: ignore[arg-type]
    assert extauth.auth_cookie(answer(200)) == b""  # type: ignore[arg-type]
    assert extauth.auth_cookie(None) == b""


@pytest.mark.parametrize("always", [False, True])
def test_a_2xx_answer_keeps_its_cookie_for_the_backends_answer(always):
    plan = extauth.AuthPlan(ExternalAuth("http://auth/", always_set_cookie=always))
    forward = types.SimpleNamespace(response_modifier=HeaderModifier(add=(("X-A", "1"),)))
    assert extauth.outcome(plan, answer(200, COOKIES), req(), False, forward) == b""  # type: ignore[arg-type]
    modifier = forward.response_modifier
    for status, kept in (
        (200, True),
        (204, True),
        (302, True),
        (304, True),
        (404, always),
        (503, always),
    ):
        fields = filters.modify_response_fields(b"\r\nX-B: 2", modifier, status)
        assert (b"Set-Cookie: a=1; Path=/, b=2" in fields) is kept, (status, fields)
        assert b"X-A: 1" in fields and b"X-B: 2" in fields  # the route's own lines stay


def test_a_401_passes_its_challenge_and_with_always_its_cookie():
    plan = extauth.AuthPlan(ExternalAuth("http://auth/"))
    denied = answer(401, 'WWW-Authenticate: Bearer realm="x"\r\n' + COOKIES)
    result = extauth.outcome(plan, denied, req(), False)  # type: ignore[arg-type]
    assert isinstance(result, extauth.Refused) and result.status == 401
    assert result.lines == b'WWW-Authenticate: Bearer realm="x"\r\n'
    page = extauth.refusal_page(result, close=True, head_only=False)
    assert page.startswith(b'HTTP/1.1 401 Unauthorized\r\nWWW-Authenticate: Bearer realm="x"\r\n')
    assert page.endswith(b"authentication required\n") and b"Connection: close" in page
    always = extauth.AuthPlan(ExternalAuth("http://auth/", always_set_cookie=True))
    for status in (401, 403, 500):
        result = extauth.outcome(always, answer(status, COOKIES), req(), False)  # type: ignore[arg-type]
        assert isinstance(result, extauth.Refused)
        assert b"Set-Cookie: a=1; Path=/, b=2\r\n" in result.lines
    assert extauth.field_pairs(result.lines) == [(b"set-cookie", b"a=1; Path=/, b=2")]


def test_the_signin_redirect_carries_the_cookie():
    plan = extauth.AuthPlan(ExternalAuth("http://auth/", signin="https://login/"))
    result = extauth.outcome(plan, answer(401, COOKIES), req("/p"), True)  # type: ignore[arg-type]
    assert isinstance(result, extauth.Refused) and result.status == 302
    page = extauth.refusal_page(result, close=False, head_only=False)
    assert page.startswith(b"HTTP/1.1 302 Found\r\nSet-Cookie: a=1; Path=/, b=2\r\nLocation: ")


def test_an_https_url_is_reached_over_tls_on_443():
    plan = extauth.AuthPlan(ExternalAuth("https://auth.example.com/check"))
    assert plan.tls and plan.target.port == 443 and plan.server_name == "auth.example.com"
    assert not extauth.AuthPlan(ExternalAuth("http://auth/")).tls


PLAN = extauth.AuthPlan(ExternalAuth("http://auth/", cache_key="k", cache_durations=((200, 60.0),)))


@pytest.mark.parametrize(
    ("fields", "seconds"),
    [
        ("", 60.0),  # auth-cache-duration's
        ("Set-Cookie: s=1\r\n", 0.0),  # never kept
        ("Vary: *\r\n", 0.0),
        ("Cache-Control: private\r\n", 0.0),
        ("Cache-Control: no-store\r\n", 0.0),
        ("Cache-Control: public, max-age=5\r\n", 5.0),
        ("Cache-Control: max-age=5, s-maxage=7\r\n", 7.0),
        ("X-Accel-Expires: 3\r\nCache-Control: max-age=5\r\n", 3.0),  # first in priority
        ("X-Accel-Expires: 0\r\n", 0.0),
        ("X-Accel-Expires: @1000030\r\n", 30.0),
        ("Expires: Mon, 12 Jan 1970 13:47:00 GMT\r\n", 20.0),  # 1000020 - now
        ("Expires: not a date\r\n", 0.0),
    ],
)
def test_the_cache_keeps_what_nginxs_proxy_cache_would(fields, seconds):
    found = extauth.cache_seconds(PLAN, answer(200, fields), 1_000_000.0)  # type: ignore[arg-type]
    assert found == pytest.approx(seconds)


def test_a_header_given_lifetime_keeps_any_status_and_only_get_and_head_are_cached():
    # nginx: the answer's own lifetime first, auth-cache-duration's for its status after.
    assert extauth.cache_seconds(PLAN, answer(403, "Cache-Control: max-age=9\r\n"), 0.0) == 9.0  # type: ignore[arg-type]
    assert extauth.cache_seconds(PLAN, answer(403), 0.0) == 0.0  # type: ignore[arg-type]
    head = req("/x")
    assert extauth.cache_key(PLAN, "r", head, b"") is not None
    post = extauth.AuthPlan(ExternalAuth("http://auth/", method="POST", cache_key="k"))
    assert extauth.cache_key(post, "r", head, b"") is None  # proxy_cache_methods GET HEAD


def test_the_subrequest_drops_x_forwarded_proto_and_carries_a_request_id():
    # nginx.tmpl's auth location: proxy_set_header X-Forwarded-Proto ""; X-Request-ID
    # $req_id (the client's X-Request-ID, else nginx's $request_id: 32 hex digits).
    plan = extauth.AuthPlan(ExternalAuth("http://auth/"))
    given = req("/", extra="X-Forwarded-Proto: https\r\nX-Request-ID: abc\r\n")
    head = extauth.subrequest_head(plan, given, False, b"192.0.2.1").decode()
    assert "X-Forwarded-Proto" not in head
    assert head.count("X-Request-ID") == 1 and "X-Request-ID: abc\r\n" in head
    fresh = [
        extauth.subrequest_head(plan, req("/"), False, b"192.0.2.1").decode() for _ in range(2)
    ]
    ids = [re.search(r"X-Request-ID: ([0-9a-f]{32})\r\n", h).group(1) for h in fresh]  # type: ignore[union-attr]
    assert ids[0] != ids[1]


def test_the_client_address_with_use_forwarded_headers_and_compute_full_forwarded_for():
    # nginx.tmpl's auth location: X-Real-IP $remote_addr (real_ip through
    # proxy-real-ip-cidr), X-Forwarded-For $remote_addr, or $full_x_forwarded_for
    # ("$http_x_forwarded_for, $realip_remote_addr") with compute-full-forwarded-for.
    given = req("/", extra="X-Forwarded-For: 203.0.113.9, 10.0.0.7\r\n")
    plain = extauth.AuthPlan(ExternalAuth("http://auth/", cache_key="$remote_addr"))
    head = extauth.subrequest_head(plain, given, False, b"10.0.0.2").decode()
    assert "X-Real-IP: 10.0.0.2\r\nX-Forwarded-For: 10.0.0.2\r\n" in head
    trusted = extauth.AuthPlan(
        ExternalAuth("http://auth/", cache_key="$remote_addr", trusted_proxies=("10.0.0.0/8",))
    )
    head = extauth.subrequest_head(trusted, given, False, b"10.0.0.2").decode()
    assert "X-Real-IP: 203.0.113.9\r\nX-Forwarded-For: 203.0.113.9\r\n" in head
    assert extauth.cache_key(trusted, "r", given, b"10.0.0.2") == b"r\x00203.0.113.9"
    full = extauth.AuthPlan(
        ExternalAuth("http://auth/", trusted_proxies=("10.0.0.0/8",), full_forwarded_for=True)
    )
    head = extauth.subrequest_head(full, given, False, b"10.0.0.2").decode()
    assert "X-Real-IP: 203.0.113.9\r\nX-Forwarded-For: 203.0.113.9, 10.0.0.7, 10.0.0.2\r\n" in head
    alone = extauth.subrequest_head(full, req("/"), False, b"10.0.0.2").decode()
    assert "X-Forwarded-For: 10.0.0.2\r\n" in alone


def test_remote_user_in_the_cache_key():
    # annotations.md's own example: auth-cache-key "$remote_user$http_authorization".
    plan = extauth.AuthPlan(
        ExternalAuth("http://auth/", cache_key="$remote_user$http_authorization")
    )
    token = "Basic " + base64.b64encode(b"ann:pw").decode()
    head = req("/", extra=f"Authorization: {token}\r\n")
    assert extauth.cache_key(plan, "r", head, b"") == b"r\x00ann" + token.encode()
    assert extauth.remote_user(req("/", extra="Authorization: Bearer x\r\n")) == b""
    assert extauth.remote_user(req("/")) == b""


def test_the_auth_cookie_keeps_a_routes_response_rules_whole():
    # proxy-cookie-path and custom-http-errors (responserewrite.ResponseRules) on the
    # same route as auth-url: the auth service's cookie is added, the backend's own
    # Set-Cookie still rewritten, the error pages still readable by errorpages.
    rules = responserewrite.ResponseRules(add=(("X-A", "1"),), cookie_path=(b"/one", b"/two"))
    for always in (False, True):
        plan = extauth.AuthPlan(ExternalAuth("http://auth/", always_set_cookie=always))
        forward = types.SimpleNamespace(response_modifier=rules)
        extauth.outcome(plan, answer(200, "Set-Cookie: s=1\r\n"), req(), False, forward)  # type: ignore[arg-type]
        modifier = forward.response_modifier
        assert modifier.errors is None and modifier.cookie_path == (b"/one", b"/two")
        fields = filters.modify_response_fields(b"\r\nSet-Cookie: b=2; Path=/one/x", modifier, 200)
        assert b"Set-Cookie: b=2; Path=/two/x" in fields  # the backend's, rewritten
        assert b"Set-Cookie: s=1" in fields and b"X-A: 1" in fields
        fields = filters.modify_response_fields(b"", modifier, 503)
        assert (b"Set-Cookie: s=1" in fields) is always
    info = filters.with_added(rules, (("Authentication-Info", "x"),))
    assert type(info) is responserewrite.ResponseRules and info.cookie_path == rules.cookie_path
