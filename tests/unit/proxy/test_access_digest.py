"""waygate.proxy.access with `auth-type: digest` (waygate.core.digest's rules per
request): the challenge, a good answer, replays, stale nonces, evasion, satisfy.
Through the request core for every protocol pair:
tests/integration/proxy/test_auth_digest.py."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterator

import pytest

from waygate.core import digest
from waygate.proxy import access
from waygate.proxy.access import AccessCheck
from waygate.proxy.http1 import RequestHead, parse_request_head
from waygate.resolver.model import RouteAccess

REALM = "staff area"
RULES = RouteAccess(
    auth_type="digest",
    auth_realm=REALM,
    credentials=(f"ann:{REALM}:{digest.ha1('ann', REALM, 'pw')}",),
)
_NONCE = re.compile(r'nonce="([0-9a-f]{16})"')


@pytest.fixture(autouse=True)
def _fresh_tables() -> Iterator[None]:
    access.configure_digest(1024)
    yield
    access.configure_digest(digest.DEFAULT_ENTRIES)


def req(target: str = "/", *lines: str, method: str = "GET") -> RequestHead:
    extra = "".join(line + "\r\n" for line in lines)
    return parse_request_head(f"{method} {target} HTTP/1.1\r\nHost: a.test\r\n{extra}\r\n".encode())


def answer(
    challenge: str,
    *,
    user: str = "ann",
    password: str = "pw",
    realm: str = REALM,
    uri: str = "/",
    nc: int = 1,
    method: str = "GET",
) -> str:
    """The Authorization line a client sends for a challenge (RFC 7616 3.4)."""
    nonce = _NONCE.search(challenge).group(1)  # type: ignore[union-attr]
    ha1 = hashlib.md5(f"{user}:{realm}:{password}".encode()).hexdigest()
    ha2 = hashlib.md5(f"{method}:{uri}".encode()).hexdigest()
    cnonce = "0a4f113b"
    response = hashlib.md5(f"{ha1}:{nonce}:{nc:08x}:{cnonce}:auth:{ha2}".encode()).hexdigest()
    return (
        f'Authorization: Digest username="{user}", realm="{realm}", nonce="{nonce}", '
        f'uri="{uri}", qop=auth, nc={nc:08x}, cnonce="{cnonce}", response="{response}"'
    )


def challenged(check: AccessCheck, head: RequestHead, peer: bytes = b"192.0.2.1") -> str:
    refused = check.decide(head, peer)
    assert refused is not None and refused[0] == 401, refused
    assert refused[2] == access.KIND_UNAUTHORIZED
    return refused[1]


def test_a_request_without_credentials_is_challenged_with_a_fresh_nonce():
    check = AccessCheck(RULES)
    first = challenged(check, req())
    assert first.startswith(f'Digest algorithm="MD5", qop="auth", realm="{REALM}", nonce="')
    assert "stale" not in first
    assert _NONCE.search(first).group(1) != _NONCE.search(challenged(check, req())).group(1)  # type: ignore[union-attr]


def test_the_right_answer_passes_and_each_nc_once():
    check = AccessCheck(RULES)
    challenge = challenged(check, req("/app?x=1"))
    assert check.decide(req("/app?x=1", answer(challenge, uri="/app?x=1")), b"192.0.2.1") is None
    # The module's Authentication-Info, for the response (rspauth: HA2 = MD5(":" uri)).
    nonce = _NONCE.search(challenge).group(1)  # type: ignore[union-attr]
    ha1 = digest.ha1("ann", REALM, "pw")
    ha2 = hashlib.md5(b":/app?x=1").hexdigest()
    rspauth = hashlib.md5(f"{ha1}:{nonce}:00000001:0a4f113b:auth:{ha2}".encode()).hexdigest()
    assert check.info == f'qop="auth", rspauth="{rspauth}", cnonce="0a4f113b", nc=00000001'
    # A replay of the same nc: a plain challenge (not stale).
    again = challenged(check, req("/app?x=1", answer(challenge, uri="/app?x=1")))
    assert "stale" not in again
    # The next nc on the same nonce passes (a browser's next request).
    second = req("/app?x=1", answer(challenge, uri="/app?x=1", nc=2))
    assert check.decide(second, b"192.0.2.1") is None
    # The uri without the query is accepted too (the module's allowance).
    assert check.decide(req("/app?x=1", answer(challenge, uri="/app", nc=3)), b"p") is None


@pytest.mark.parametrize(
    "wrong",
    [
        {"password": "nope"},
        {"user": "bob"},
        {"realm": "another"},
        {"uri": "/elsewhere"},
        {"method": "POST"},
    ],
)
def test_a_wrong_answer_is_challenged_again(wrong):
    check = AccessCheck(RULES)
    challenge = challenged(check, req())
    again = challenged(check, req("/", answer(challenge, **wrong)))
    assert "stale" not in again


def test_an_answer_to_a_nonce_this_process_does_not_hold_is_stale():
    # Another worker's nonce (or one forgotten): the right password gets a stale
    # challenge, which a browser answers without asking its user again.
    check = AccessCheck(RULES)
    made_up = 'nonce="00112233445566aa"'
    assert 'stale="true"' in challenged(check, req("/", answer(made_up)))
    assert 'stale="true"' not in challenged(check, req("/", answer(made_up, password="x")))


def test_five_failures_hold_the_client_off_without_a_challenge():
    check = AccessCheck(RULES)
    challenge = challenged(check, req())
    for _ in range(5):
        challenged(check, req("/", answer(challenge, password="guess")))
    assert challenged(check, req("/", answer(challenge))) == ""  # no WWW-Authenticate
    assert challenged(check, req(), b"192.0.2.2") != ""  # another address is not
    page = access.challenge_response(access.challenge_lines(""), close=False, head_only=False)
    assert page.startswith(b"HTTP/1.1 401 ") and b"WWW-Authenticate" not in page


def test_credentials_withheld_answer_503():
    check = AccessCheck(RouteAccess(auth_type="digest", auth_realm=REALM))
    assert check.decide(req(), b"p") == (
        503,
        "the route's credentials are withheld from this proxy",
        access.KIND_WITHHELD,
    )


def test_satisfy_any_lets_an_allowed_address_through_without_credentials():
    rules = RouteAccess(
        allow=("10.0.0.0/8",),
        auth_type="digest",
        auth_realm=REALM,
        credentials=RULES.credentials,
        satisfy_any=True,
    )
    check = AccessCheck(rules)
    assert check.decide(req(), b"10.1.2.3") is None
    challenged(check, req(), b"192.0.2.1")


def test_the_qop_the_client_names_is_hashed_as_the_module_does():
    check = AccessCheck(RULES)
    challenge = challenged(check, req())
    line = answer(challenge).replace("qop=auth,", "qop=auth-int,")
    # The response made with "auth" fails against "auth-int"...
    assert "stale" not in challenged(check, req("/", line))
    # ...one made with the qop named passes (the module hashes whatever qop is sent).
    nonce = _NONCE.search(challenge).group(1)  # type: ignore[union-attr]
    ha1 = digest.ha1("ann", REALM, "pw")
    ha2 = hashlib.md5(b"GET:/").hexdigest()
    good = hashlib.md5(f"{ha1}:{nonce}:00000002:c:auth-int:{ha2}".encode()).hexdigest()
    header = (
        f'Authorization: Digest username="ann", realm="{REALM}", nonce="{nonce}", uri="/", '
        f'qop=auth-int, nc=00000002, cnonce="c", response="{good}"'
    )
    assert check.decide(req("/", header), b"192.0.2.1") is None


def test_the_authentication_info_joins_a_cors_answer_and_the_routes_own_lines():
    # The request core's digest_info shaper adds Authentication-Info to whatever
    # response modifier the route's filters and CORS made (filters.SetFields ones
    # included: a route's own lines are kept as filters.remembered).
    from tests.unit.proxy.test_decision import Facts, ep, rt, view
    from waygate.proxy import filters
    from waygate.proxy.decision import Answer, Forward, decide
    from waygate.resolver.model import Cors, HeaderModifier, RouteFilters

    route = rt(
        access=RULES,
        cors=Cors(),
        filters=RouteFilters(response_headers=HeaderModifier(set=(("X-Route", "r"),))),
    )
    built = view([route], [ep()])
    refused = decide(built, req(), Facts(), 0.0)
    assert isinstance(refused, Answer) and refused.status == 401
    forward = decide(built, req("/", answer(refused.reason.split("\r\n")[0])), Facts(), 0.0)
    assert isinstance(forward, Forward) and forward.response_modifier is not None
    out = filters.modify_response_fields(b"\r\nServer: x", forward.response_modifier)
    assert b"Authentication-Info: qop=" in out
    assert b"X-Route: r" in out and b"Access-Control-Allow-Origin: *" in out
