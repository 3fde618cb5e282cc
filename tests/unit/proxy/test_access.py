"""waygate.proxy.access and waygate.core.htpasswd: the access rules of a route
(ingress-nginx's source ranges, block lists, basic authentication, satisfy),
sans-IO. Through the request core for every protocol pair:
tests/integration/proxy/test_request_core.py; through real processes:
tests/system/test_ingress_nginx_access.py."""

from __future__ import annotations

import base64
import hashlib

import bcrypt
import pytest

from waygate.core import htpasswd
from waygate.proxy import access
from waygate.proxy.access import AccessCheck, client_address, networks
from waygate.proxy.http1 import parse_request_head
from waygate.resolver.model import RouteAccess


def req(*lines: str) -> object:
    extra = "".join(line + "\r\n" for line in lines)
    return parse_request_head(f"GET / HTTP/1.1\r\nHost: a.test\r\n{extra}\r\n".encode())


def basic(user: str, password: str) -> str:
    return "Authorization: Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


def addr(text: str) -> tuple[int, int]:
    found = access._address(text)
    assert found is not None
    return found


# ---------------------------------------------------------------- the client address


def test_the_peer_is_the_client_unless_trusted_and_forwarded():
    head = req("X-Forwarded-For: 203.0.113.9")
    assert client_address(b"192.0.2.7", head, ()) == addr("192.0.2.7")
    # A peer outside proxy-real-ip-cidr: its X-Forwarded-For is not believed.
    assert client_address(b"192.0.2.7", head, networks(["10.0.0.0/8"])) == addr("192.0.2.7")
    assert client_address(b"10.1.1.1", head, networks(["10.0.0.0/8"])) == addr("203.0.113.9")


def test_real_ip_recursive_skips_trusted_hops_from_the_right():
    head = req("X-Forwarded-For: 198.51.100.1, 203.0.113.9", "X-Forwarded-For: 10.2.2.2")
    trusted = networks(["10.0.0.0/8"])
    assert client_address(b"10.1.1.1", head, trusted) == addr("203.0.113.9")
    # Every hop trusted (ingress-nginx's default 0.0.0.0/0): the leftmost.
    assert client_address(b"10.1.1.1", head, networks(["0.0.0.0/0"])) == addr("198.51.100.1")
    # What does not parse stops the walk at the last address read.
    bad = req("X-Forwarded-For: nonsense, 10.3.3.3")
    assert client_address(b"10.1.1.1", bad, trusted) == addr("10.3.3.3")


def test_ipv4_mapped_ipv6_peers_are_ipv4_and_0_0_0_0_0_trusts_no_ipv6():
    assert addr("::ffff:192.0.2.7") == addr("192.0.2.7")
    head = req("X-Forwarded-For: 203.0.113.9")
    assert client_address(b"2001:db8::1", head, networks(["0.0.0.0/0"])) == addr("2001:db8::1")


# ---------------------------------------------------------------- ranges, block lists, satisfy


def test_deny_then_allow_then_deny_all_as_nginx_orders_them():
    check = AccessCheck(RouteAccess(deny=("10.1.0.0/16",), allow=("10.0.0.0/8",)))
    assert check.decide(req(), b"10.2.0.1") is None
    assert check.decide(req(), b"10.1.0.1") == (
        403,
        "the client address is not allowed",
        access.KIND_DENIED,
    )
    assert check.decide(req(), b"192.0.2.1")[0] == 403  # type: ignore[index]
    only_deny = AccessCheck(RouteAccess(deny=("10.1.0.0/16", "2001:db8::/32")))
    assert only_deny.decide(req(), b"192.0.2.1") is None
    assert only_deny.decide(req(), b"2001:db8::5")[0] == 403  # type: ignore[index]


def test_an_address_only_verdict_is_kept_for_the_last_peer_and_no_longer():
    check = AccessCheck(RouteAccess(allow=("10.0.0.0/8",)))
    assert check.address_only
    inside, outside = b"10.1.2.3", b"192.0.2.1"
    for _ in range(2):  # the second time: the kept verdict
        assert check.decide(req(), inside) is None
    assert check.decide(req(), outside) == (
        403,
        "the client address is not allowed",
        "access_denied",
    )
    assert check.decide(req(), outside)[0] == 403  # type: ignore[index]
    assert check.decide(req(), inside) is None
    # Rules that read the request or a forwarded address decide each request anew.
    for rules in (
        RouteAccess(allow=("10.0.0.0/8",), trusted_proxies=("10.0.0.0/8",)),
        RouteAccess(allow=("10.0.0.0/8",), block_user_agents=("bad",)),
        RouteAccess(allow=("10.0.0.0/8",), auth_type="basic"),
    ):
        assert not AccessCheck(rules).address_only
    agents = AccessCheck(RouteAccess(block_user_agents=("bad",)))
    assert agents.decide(req(), inside) is None
    assert agents.decide(req("User-Agent: bad"), inside) is not None


def test_block_lists_answer_403_whatever_else_holds():
    check = AccessCheck(
        RouteAccess(
            block=("198.51.100.0/24",),
            allow=("0.0.0.0/0",),
            block_user_agents=("~*curl", "Exact Bot"),
            block_referers=("~^https://spam\\.",),
        )
    )
    assert check.decide(req(), b"198.51.100.3") == (
        403,
        "the client address is blocked",
        access.KIND_BLOCKED,
    )
    assert check.decide(req("User-Agent: CURL/8.0"), b"192.0.2.1")[0] == 403  # type: ignore[index]
    assert check.decide(req("User-Agent: Exact Bot"), b"192.0.2.1")[0] == 403  # type: ignore[index]
    assert check.decide(req("User-Agent: Exact Bot 2"), b"192.0.2.1") is None
    assert check.decide(req("Referer: https://spam.example/"), b"192.0.2.1")[1] == (  # type: ignore[index]
        "the Referer is blocked"
    )
    # "~" is case-sensitive, as nginx's map.
    assert check.decide(req("Referer: HTTPS://SPAM.example/"), b"192.0.2.1") is None
    assert check.decide(req(), b"192.0.2.1") is None


def test_satisfy_all_and_any():
    creds = ("ann:{PLAIN}secret",)
    both = RouteAccess(allow=("10.0.0.0/8",), auth_type="basic", auth_realm="r", credentials=creds)
    strict = AccessCheck(both)
    assert strict.decide(req(), b"10.0.0.1")[0] == 401  # type: ignore[index]
    assert strict.decide(req(basic("ann", "secret")), b"10.0.0.1") is None
    assert strict.decide(req(basic("ann", "secret")), b"192.0.2.1")[0] == 403  # type: ignore[index]
    lenient = AccessCheck(RouteAccess(**{**both.__dict__, "satisfy_any": True}))
    assert lenient.decide(req(), b"10.0.0.1") is None
    assert lenient.decide(req(basic("ann", "secret")), b"192.0.2.1") is None
    # Both fail: nginx's access phase keeps the 401 (its challenge) over the 403.
    assert lenient.decide(req(), b"192.0.2.1") == (401, 'Basic realm="r"', access.KIND_UNAUTHORIZED)


# ---------------------------------------------------------------- basic authentication


def test_basic_authentication_answers_401_until_the_password_matches():
    check = AccessCheck(
        RouteAccess(auth_type="basic", auth_realm="staff", credentials=("ann:{SHA}" + _sha("pw"),))
    )
    assert check.decide(req(), b"192.0.2.1") == (
        401,
        'Basic realm="staff"',
        access.KIND_UNAUTHORIZED,
    )
    for wrong in (
        basic("ann", "nope"),
        basic("bob", "pw"),
        "Authorization: Basic !!!",
        "Authorization: Bearer abc",
        "Authorization: Basic " + base64.b64encode(b"no-colon").decode(),
    ):
        assert check.decide(req(wrong), b"192.0.2.1")[0] == 401, wrong  # type: ignore[index]
    assert check.decide(req(basic("ann", "pw")), b"192.0.2.1") is None
    assert check.decide(req(basic("ann", "pw").replace("Basic", "basic")), b"192.0.2.1") is None


def test_a_checked_authorization_is_remembered_boundedly(monkeypatch):
    check = AccessCheck(RouteAccess(auth_type="basic", credentials=("ann:{PLAIN}pw",)))
    calls = []
    real = access.verify
    monkeypatch.setattr(access, "verify", lambda p, h: calls.append(p) or real(p, h))
    for _ in range(3):
        assert check.decide(req(basic("ann", "pw")), b"192.0.2.1") is None
    assert calls == [b"pw"]
    for n in range(access.MAX_REMEMBERED + 5):
        check.decide(req(basic("ann", f"guess{n}")), b"192.0.2.1")
    assert len(check.remembered) <= access.MAX_REMEMBERED


def test_withheld_credentials_and_rules_that_do_not_compile_fail_closed():
    withheld = AccessCheck(RouteAccess(auth_type="basic"))
    assert withheld.decide(req(basic("ann", "pw")), b"192.0.2.1") == (
        503,
        "the route's credentials are withheld from this proxy",
        access.KIND_WITHHELD,
    )
    broken = AccessCheck(RouteAccess(allow=("not-a-cidr",)))
    status, reason, kind = broken.decide(req(), b"10.0.0.1")  # type: ignore[misc]
    assert (status, kind) == (503, access.KIND_INVALID) and "do not compile" in reason


def test_the_challenge_response():
    lines = access.challenge_lines('Basic realm="staff"')
    response = access.challenge_response(lines, close=True, head_only=False)
    head, _, body = response.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 401 Unauthorized\r\n")
    assert b'\r\nWWW-Authenticate: Basic realm="staff"\r\n' in head
    assert b"\r\nConnection: close" in head
    assert body == b"401 Authorization Required\n"
    assert b"Content-Length: %d" % len(body) in head
    assert access.challenge_response(lines, close=False, head_only=True).endswith(b"\r\n\r\n")
    # A CORS route's 401 carries its CORS headers (ingress-nginx's more_set_headers).
    cors = access.challenge_lines("Basic", (("Access-Control-Allow-Origin", "*"),))
    assert cors == "WWW-Authenticate: Basic\r\nAccess-Control-Allow-Origin: *\r\n"


# ---------------------------------------------------------------- htpasswd hashes


# A fixed salt: the parameters are the same in every test worker.
SALT = b"$2b$04$" + b"waygateaccesstestsalt."


def _sha(password: str) -> str:
    return base64.b64encode(hashlib.sha1(password.encode()).digest()).decode()


def test_md5_crypt_matches_apaches_and_glibcs_published_values():
    # Apache's documentation (htpasswd -m: "myPassword") and glibc's crypt("secret", "$1$saltsalt$").
    assert htpasswd.verify(b"myPassword", "$apr1$r31.....$HqJZimcKQFAMYayBlzkrA/")
    assert htpasswd.verify(b"secret", "$1$saltsalt$9xy1btjgzLYfb7hivXtC//")
    assert not htpasswd.verify(b"Secret", "$1$saltsalt$9xy1btjgzLYfb7hivXtC//")


@pytest.mark.parametrize(
    ("hashed", "password"),
    [
        ("{PLAIN}pw", "pw"),
        ("{SHA}" + _sha("pw"), "pw"),
        (
            "{SSHA}" + base64.b64encode(hashlib.sha1(b"pwSALT").digest() + b"SALT").decode(),
            "pw",
        ),
        (bcrypt.hashpw(b"pw", SALT).decode(), "pw"),
        (bcrypt.hashpw(b"pw", SALT).decode().replace("$2b$", "$2y$"), "pw"),
    ],
)
def test_each_format_verifies_exactly(hashed, password):
    assert htpasswd.hash_format_problem(hashed) == ""
    assert htpasswd.verify(password.encode(), hashed)
    assert not htpasswd.verify(password.encode() + b"x", hashed)


@pytest.mark.parametrize("hashed", ["abJnggxhB/yWI", "$6$salt$abc", "$5$salt$abc", "$argon2id$x"])
def test_formats_not_verifiable_exactly_are_named(hashed):
    assert "cannot verify exactly" in htpasswd.hash_format_problem(hashed)
    assert not htpasswd.verify(b"anything", hashed)


def test_an_empty_hash_matches_nothing_and_the_file_reads_as_nginx_does():
    assert htpasswd.hash_format_problem("") == "" and not htpasswd.verify(b"", "")
    users = htpasswd.parse_credentials(
        ["# comment", "", "ann:{PLAIN}a", "ann:{PLAIN}b", "nocolon", "bob:"]
    )
    assert users == {b"ann": "{PLAIN}a", b"bob": ""}


def test_an_address_only_verdict_is_kept_per_connection_and_per_route():
    # decision._access_bound keeps an address-only check's verdict on the connection
    # (ForwardedContext.access_check): connections taking turns (as a loaded proxy's
    # do) each keep their own, and another route's check decides afresh.
    from tests.unit.proxy.test_decision import Facts, ep, req, rt, view
    from waygate.proxy.decision import Answer, Forward, decide
    from waygate.proxy.http1 import ForwardedContext

    built = view([rt(access=RouteAccess(allow=("10.0.0.0/8",)))], [ep()])
    outside, inside = Facts(), Facts()
    inside.context = ForwardedContext("10.1.2.3", 8080)
    for _ in range(3):
        refused = decide(built, req(), outside, 0.0)
        assert isinstance(refused, Answer) and refused.status == 403
        assert isinstance(decide(built, req(), inside, 0.0), Forward)
    assert inside.context.access_verdict is None and outside.context.access_verdict is not None
    # The same connections on a route that allows the other network.
    other = view([rt(access=RouteAccess(allow=("192.0.2.0/24",)))], [ep()])
    assert isinstance(decide(other, req(), outside, 0.0), Forward)
    refused = decide(other, req(), inside, 0.0)
    assert isinstance(refused, Answer) and refused.status == 403
