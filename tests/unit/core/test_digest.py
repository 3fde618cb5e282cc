"""waygate.core.digest: HTTP Digest as ingress-nginx's nginx-http-auth-digest serves it.

The response computation against the published vectors (RFC 7616 section 3.9.1,
RFC 2617 section 3.5); the header grammar, the htdigest lines, the nonce table
(lifetimes, replays, bound) and evasion against the module's rules
(atomx/nginx-http-auth-digest v1.0.0, ngx_http_auth_digest_module.c)."""

from __future__ import annotations

import pytest

from waygate.core import digest
from waygate.core.digest import Credentials, NonceTable


def test_rfc_7616_md5_example():
    # RFC 7616 3.9.1: Mufasa / "Circle of Life", realm http-auth@example.org, MD5.
    ha1 = digest.ha1("Mufasa", "http-auth@example.org", "Circle of Life").encode()
    answer = Credentials(
        username=b"Mufasa",
        realm=b"http-auth@example.org",
        nonce=b"7ypf/xlj9XXwfDPEoM4URrv/xwf94BcCAzFZH4GiTo0v",
        nc=b"00000001",
        uri=b"/dir/index.html",
        qop=b"auth",
        cnonce=b"f2/wE4q74E6zIJEtWaHKaf5wv/H5QzzpXusqGemxURZJ",
        response=b"8ca523f5e9506fed4657c9700eebdbec",
    )
    assert digest.expected_response(ha1, b"GET", answer) == answer.response
    assert digest.password_matches((ha1,), b"GET", answer)
    assert not digest.password_matches((ha1,), b"POST", answer)  # HA2 covers the method
    other = digest.ha1("Mufasa", "http-auth@example.org", "Circle of life").encode()
    assert not digest.password_matches((other,), b"GET", answer)
    # Every HA1 of the user is tried (the module reads on past a mismatching line).
    assert digest.password_matches((other, ha1), b"GET", answer)


def test_rfc_2617_example():
    # RFC 2617 3.5: Mufasa / "Circle Of Life", realm testrealm@host.com.
    ha1 = digest.ha1("Mufasa", "testrealm@host.com", "Circle Of Life").encode()
    answer = Credentials(
        b"Mufasa",
        b"testrealm@host.com",
        b"dcd98b7102dd2f0e8b11d0f600bfb0c093",
        b"00000001",
        b"/dir/index.html",
        b"auth",
        b"0a4f113b",
        b"6629fae49393a05397450978507c4ef1",
    )
    assert digest.expected_response(ha1, b"GET", answer) == answer.response


HEADER = (
    b'Digest username="Mufasa", realm="http-auth@example.org", uri="/dir/index.html", '
    b'algorithm=MD5, nonce="0123456789abcdef", nc=00000001, cnonce="f2/wE4q74E6", '
    b'qop=auth, response="8ca523f5e9506fed4657c9700eebdbec", opaque="FQhe/qaU925kfnzjCev0"'
)


def test_authorization_header_fields():
    found = digest.parse_authorization(HEADER)
    assert found == Credentials(
        b"Mufasa",
        b"http-auth@example.org",
        b"0123456789abcdef",
        b"00000001",
        b"/dir/index.html",
        b"auth",
        b"f2/wE4q74E6",
        b"8ca523f5e9506fed4657c9700eebdbec",
    )
    # The scheme is case-insensitive; quoted pairs are unescaped.
    escaped = HEADER.replace(b"Digest", b"DIGEST").replace(b'"Mufasa"', b'"Mu\\"fasa"')
    assert digest.parse_authorization(escaped).username == b'Mu"fasa'  # type: ignore[union-attr]


@pytest.mark.parametrize(
    "value",
    [
        b"Basic QWxhZGRpbjpvcGVuIHNlc2FtZQ==",
        HEADER.replace(b'nonce="0123456789abcdef"', b'nonce="0123"'),  # not 16 characters
        HEADER.replace(b"qop=auth, ", b""),  # a required field missing
        HEADER.replace(b'cnonce="f2/wE4q74E6"', b'cnonce=""'),  # empty
        HEADER + b", broken",
        HEADER.replace(b'realm="', b'realm="\x01'),  # a control character
        b"Digest",
    ],
)
def test_headers_the_module_declines_get_a_challenge(value):
    assert digest.parse_authorization(value) is None


def test_the_uri_is_the_target_or_its_path_before_the_query():
    assert digest.uri_matches(b"/a/b", b"/a/b")
    assert digest.uri_matches(b"/a/b", b"/a/b?x=1")  # .NET's clients leave the query out
    assert not digest.uri_matches(b"/a", b"/a/b")
    assert not digest.uri_matches(b"/a/b?x=2", b"/a/b?x=1")


def test_htdigest_lines():
    good = "ann:staff:" + digest.ha1("ann", "staff", "pw")
    assert digest.line_problem(good) == ""
    assert "32 hexadecimal" in digest.line_problem("ann:staff:abc")
    assert "user:realm:HA1" in digest.line_problem("ann:{PLAIN}pw")
    assert "#" in digest.line_problem("#ann:staff:" + "0" * 32)
    users = digest.parse_lines(
        [good, "# a comment", "", "bob:other:" + "1" * 32, "ann:staff:" + "2" * 32]
    )
    assert users[(b"ann", b"staff")] == (good[10:].encode(), b"2" * 32)
    assert (b"bob", b"other") in users


def test_challenge_as_the_module_writes_it():
    assert digest.challenge("staff", "0123456789abcdef", False) == (
        'Digest algorithm="MD5", qop="auth", realm="staff", nonce="0123456789abcdef"'
    )
    assert digest.challenge("r", "0123456789abcdef", True).endswith(
        'nonce="0123456789abcdef", stale="true"'
    )


def test_a_nonce_lives_its_timeout_then_expires_after_its_first_use():
    table = NonceTable(16)
    nonce = table.issue(100.0).encode()
    assert len(nonce) == 16 and int(nonce, 16) >= 0
    assert table.use(nonce, b"00000001", 159.0) == digest.NONCE_OK  # within 60 s
    # After the first use: 10 s more, each nc once.
    assert table.use(nonce, b"00000002", 168.0) == digest.NONCE_OK
    assert table.use(nonce, b"00000002", 168.5) == digest.NONCE_REPLAYED
    assert table.use(nonce, b"00000003", 169.0) == digest.NONCE_STALE
    unused = table.issue(100.0).encode()
    assert table.use(unused, b"00000001", 160.0) == digest.NONCE_STALE  # timed out
    assert table.use(b"ffffffffffffffff", b"00000001", 100.0) == digest.NONCE_STALE  # unknown


def test_nc_beyond_the_replays_or_not_hex_is_stale():
    table = NonceTable(16)
    nonce = table.issue(0.0).encode()
    assert table.use(nonce, b"%08x" % 20, 1.0) == digest.NONCE_STALE  # replays: 20
    assert table.use(nonce, b"zz", 1.0) == digest.NONCE_STALE
    assert table.use(nonce, b"%08x" % 19, 1.0) == digest.NONCE_OK


def test_the_nonce_table_is_bounded_expired_first_then_oldest():
    table = NonceTable(3)
    old = table.issue(0.0).encode()
    kept = [table.issue(50.0).encode() for _ in range(2)]
    newest = table.issue(61.0).encode()  # full: the expired one goes
    assert old not in table.entries and len(table.entries) == 3
    table.issue(62.0)  # full, nothing expired: the oldest goes
    assert kept[0] not in table.entries and kept[1] in table.entries
    assert newest in table.entries and len(table.entries) == 3


def test_evasion_after_five_failures_until_the_evasion_time():
    evasion = digest.Evasion(8)
    for n in range(5):
        assert not evasion.evading(b"192.0.2.1", float(n))
        evasion.failed(b"192.0.2.1", float(n))
    assert evasion.evading(b"192.0.2.1", 5.0)
    assert not evasion.evading(b"192.0.2.2", 5.0)  # per address
    assert not evasion.evading(b"192.0.2.1", 304.5)  # 300 s after the last failure
    evasion.failed(b"192.0.2.1", 400.0)  # outside the window: counting starts again
    assert not evasion.evading(b"192.0.2.1", 400.0)
    for n in range(4):
        evasion.failed(b"192.0.2.1", 401.0 + n)
    assert evasion.evading(b"192.0.2.1", 405.0)
    evasion.succeeded(b"192.0.2.1")
    assert not evasion.evading(b"192.0.2.1", 405.0)


def test_the_evasion_table_is_bounded():
    evasion = digest.Evasion(2)
    for n in range(5):
        evasion.failed(n, 0.0)
    assert len(evasion.entries) == 2
