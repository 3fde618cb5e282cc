"""The sans-IO HTTP/1.1 rules, driven without sockets."""

from __future__ import annotations

import pytest

from waygate.proxy import http1
from waygate.proxy.http1 import BadMessage, ChunkedReader, ForwardedContext


def parse(head: bytes) -> http1.RequestHead:
    return http1.parse_request_head(head)


def forwarded_lines(req: http1.RequestHead) -> list[bytes]:
    """The header lines the request forwards as they came, one per entry."""
    return req.fields.split(b"\r\n")[:-1]


def test_request_head_fields_and_hygiene() -> None:
    req = parse(
        b"POST /a?b HTTP/1.1\r\nHost: Example.COM:8080\r\nContent-Length: 3\r\n"
        b"Connection: keep-alive, X-Hop\r\nX-Hop: 1\r\nX-Remote-User: u\r\nX-SSL-Cert: c\r\n"
        b"X-Remote-Extra-Foo: f\r\nX-Kept: k\r\nCookie: a=1\r\nExpect: 100-continue\r\n\r\n"
    )
    assert req.method == b"POST" and req.target == b"/a?b"
    assert req.host == b"example.com"
    assert req.content_length == 3 and not req.chunked and req.keep_alive
    assert req.expect_continue
    names = [line.split(b":", 1)[0].lower() for line in forwarded_lines(req)]
    assert names == [b"host", b"x-kept", b"cookie", b"expect"]


@pytest.mark.parametrize(
    "head",
    [
        b"GET /a HTTP/1.1\r\nHost: a.test\r\n\r\n",
        b"GET /a HTTP/1.0\r\nUser-Agent: x\r\nHost: a.test:81\r\nAccept: */*\r\n\r\n",
    ],
)
def test_the_common_head_sets_every_field_the_constructor_does(head: bytes) -> None:
    # The Host-only head is built without RequestHead() (no __init__ frame): every
    # slot must still be set, to the value the general parse gives.
    fast = parse(head)
    general = parse(head.replace(b"\r\n\r\n", b"\r\nConnection: x-none\r\n\r\n"))
    for name in http1.RequestHead.__slots__:
        if name != "__dict__":
            expected = getattr(general, name)
            if name == "fields":
                expected = expected.replace(b"Connection: x-none\r\n", b"")
            assert getattr(fast, name) == expected, name
    assert fast.host == b"a.test" and fast.keep_alive == (b"1.1" in head)


@pytest.mark.parametrize(
    ("head", "reason"),
    [
        (b"GET / HTTP/1.1\nHost: a\n\n", "bare LF"),
        (b"GET / HTTP/1.1\r\nHost: a\r\nX: a\r\n b\r\n\r\n", "obs-fold"),
        (b"GET / HTTP/1.1\r\nHost : a\r\n\r\n", "whitespace between header name and colon"),
        (b"GET / HTTP/1.1\r\nHost: a\x01\r\n\r\n", "control character"),
        (b"GET / HTTP/1.1\r\n\r\n", "missing Host"),
        (b"GET / HTTP/1.1\r\nHost: a\r\nHost: a\r\n\r\n", "more than one Host"),
        (b"GET / HTTP/2.0\r\nHost: a\r\n\r\n", "unsupported HTTP version"),
        (
            b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 1\r\nContent-Length: 1\r\n\r\n",
            "Content-Length",
        ),
        (b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: gzip\r\n\r\n", "Transfer-Encoding"),
        (b"GET http://a/ HTTP/1.1\r\nHost: a\r\n\r\n", "origin-form"),
    ],
)
def test_refusals_name_their_rule(head: bytes, reason: str) -> None:
    with pytest.raises(BadMessage) as caught:
        parse(head)
    assert reason.lower() in caught.value.reason.lower()


def test_http10_closes_and_upgrade_needs_connection_token() -> None:
    assert not parse(b"GET / HTTP/1.0\r\nHost: a\r\nConnection: keep-alive\r\n\r\n").keep_alive
    assert parse(b"GET / HTTP/1.1\r\nHost: a\r\nUpgrade: websocket\r\n\r\n").upgrade == b""
    upgrade = parse(
        b"GET / HTTP/1.1\r\nHost: a\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n"
    )
    assert upgrade.upgrade == b"websocket"


def test_find_head_end_limits() -> None:
    assert http1.find_head_end(b"GET / HTTP/1.1\r\nHost: a\r\n") == -1
    assert http1.find_head_end(b"GET / HTTP/1.1\r\nHost: a\r\n\r\nrest") == 27
    with pytest.raises(BadMessage, match="request line"):
        http1.find_head_end(b"GET /" + b"a" * 9000)
    with pytest.raises(BadMessage, match="32 KiB"):
        http1.find_head_end(b"GET / HTTP/1.1\r\n" + b"X: y\r\n" * 6000)


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("append", [b"X-Forwarded-For: 9.9.9.9", b"X-Forwarded-For: 10.0.0.1"]),
        ("replace", [b"X-Forwarded-For: 10.0.0.1"]),
        ("if-none", [b"X-Forwarded-For: 9.9.9.9"]),
        ("never", [b"X-Forwarded-For: 9.9.9.9"]),
    ],
)
def test_forwarded_modes(mode: str, expected: list[bytes]) -> None:
    req = parse(b"GET / HTTP/1.1\r\nHost: a.test\r\nX-Forwarded-For: 9.9.9.9\r\n\r\n")
    head = http1.build_upstream_head(req, ForwardedContext("10.0.0.1", 80), mode, b"")
    lines = [line for line in head.split(b"\r\n") if line.startswith(b"X-Forwarded-For")]
    assert lines == expected
    if mode in ("append", "replace", "if-none"):
        assert b"X-Forwarded-Host: a.test" in head
        assert b"Forwarded: for=10.0.0.1;host=a.test;proto=http" in head or mode == "if-none"


def test_forwarded_quotes_ipv6() -> None:
    req = parse(b"GET / HTTP/1.1\r\nHost: a\r\n\r\n")
    head = http1.build_upstream_head(req, ForwardedContext("::1", 80), "append", b"")
    assert b'Forwarded: for="[::1]";host=a;proto=http' in head


def test_chunked_reader_rechunks_drops_extensions_and_trailers() -> None:
    reader = ChunkedReader()
    body = b"4;x=1\r\nwiki\r\n5\r\npedia\r\n0\r\nTrailer: t\r\n\r\nNEXT"
    out: list[bytes] = []
    consumed = 0
    for i in range(len(body)):  # one byte at a time
        if reader.done:
            break
        pieces, used = reader.feed(body[i : i + 1])
        out += pieces
        consumed += used
    assert b"".join(out) == b"4\r\nwiki\r\n5\r\npedia\r\n0\r\n\r\n"
    assert body[consumed:] == b"NEXT"
    plain = ChunkedReader(rechunk=False)
    pieces, _ = plain.feed(b"3\r\nabc\r\n0\r\n\r\n")
    assert b"".join(pieces) == b"abc" and plain.done


@pytest.mark.parametrize(
    "body",
    [b"zz\r\n", b"-1\r\n", b"5 \r\nhello\r\n", b"5\r\nhelloXX", b"5\nhello", b"1" * 2000],
)
def test_chunked_reader_refuses_bad_framing(body: bytes) -> None:
    with pytest.raises(BadMessage):
        ChunkedReader().feed(body)


def test_response_head_rules() -> None:
    ok = http1.parse_response_head(
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\n"
    )
    assert ok.status == 200 and ok.content_length == 2 and not ok.keep_alive
    assert http1.response_framing(b"HEAD", ok) == http1.FRAMING_NONE
    assert http1.response_framing(b"GET", ok) == http1.FRAMING_LENGTH
    for bad in (
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nX : y\r\n\r\n",
        b"HTTP/1.1 2000 OK\r\n\r\n",
        b"HTTP/1.1 200 OK\nX: y\n\n",
    ):
        with pytest.raises(BadMessage) as caught:
            http1.parse_response_head(bad)
        assert caught.value.status == 502
    close = http1.parse_response_head(b"HTTP/1.1 200 OK\r\n\r\n")
    assert http1.response_framing(b"GET", close) == http1.FRAMING_CLOSE
    no_body = http1.parse_response_head(b"HTTP/1.1 304 Not Modified\r\n\r\n")
    assert http1.response_framing(b"GET", no_body) == http1.FRAMING_NONE


def test_error_response_carries_reason() -> None:
    response = http1.error_response(503, "no route for host x")
    assert response.startswith(b"HTTP/1.1 503 Service Unavailable\r\n")
    assert b"X-Waygate-Error: no route for host x\r\n" in response
    assert response.endswith(b"\r\n\r\nno route for host x\n")


def test_response_hop_by_hop_lines_dropped_others_kept_verbatim() -> None:
    response = http1.parse_response_head(
        b"HTTP/1.1 200 OK\r\nServer: x\r\nKeep-Alive: timeout=5\r\nX-Te: 1\r\n"
        b"Connection: keep-alive\r\nTrailer: X\r\nSet-Cookie: a=b;  Path=/\r\n"
        b"Content-Length: 2\r\n\r\n"
    )
    head = http1.build_client_head(response, http1.FRAMING_LENGTH, 2, True)
    assert head == (
        b"HTTP/1.1 200 OK\r\nServer: x\r\nX-Te: 1\r\nSet-Cookie: a=b;  Path=/\r\n"
        b"Content-Length: 2\r\n\r\n"
    )


@pytest.mark.parametrize(
    "name",
    [
        b"X_Remote_User",
        b"X-Remote_User",
        b"x_remote_group",
        b"X_SSL_Client_CN",
        b"X_Remote_Extra_A",
    ],
)
def test_identity_header_lookalikes_with_underscores_are_dropped(name: bytes) -> None:
    # WSGI/CGI backends map '_' and '-' alike (HTTP_X_REMOTE_USER): a lookalike
    # would pass as the identity the proxy strips.
    req = parse(b"GET / HTTP/1.1\r\nHost: a\r\n" + name + b": admin\r\nX_Other: k\r\n\r\n")
    names = [line.split(b":", 1)[0] for line in forwarded_lines(req)]
    assert names == [b"Host", b"X_Other"]


def test_connection_naming_host_is_refused() -> None:
    with pytest.raises(BadMessage) as caught:
        parse(b"GET / HTTP/1.1\r\nHost: a\r\nConnection: keep-alive, Host\r\n\r\n")
    assert "host" in caught.value.reason.lower()
    kept = parse(b"GET / HTTP/1.1\r\nHost: a\r\nConnection: keep-alive\r\nX-A: 1\r\n\r\n")
    assert [line.split(b":", 1)[0] for line in forwarded_lines(kept)] == [b"Host", b"X-A"]


def test_response_headers_named_in_connection_are_dropped() -> None:
    response = http1.parse_response_head(
        b"HTTP/1.1 200 OK\r\nServer: x\r\nConnection: keep-alive, X-Internal, Set-Cookie2\r\n"
        b"X-Internal: secret\r\nset-cookie2: a\r\nX-Kept: 1\r\nContent-Length: 0\r\n\r\n"
    )
    assert response.keep_alive
    head = http1.build_client_head(response, http1.FRAMING_LENGTH, 0, True)
    assert head == b"HTTP/1.1 200 OK\r\nServer: x\r\nX-Kept: 1\r\nContent-Length: 0\r\n\r\n"


def test_a_repeated_response_head_parses_the_same_into_a_copy_of_its_own() -> None:
    head = (
        b"HTTP/1.1 200 OK\r\nServer: x\r\nConnection: keep-alive, X-Internal\r\n"
        b"X-Internal: secret\r\nContent-Length: 5\r\n\r\n"
    )
    first = http1.parse_response_head(head)
    first.fields += b"\r\nX-Added: by a route"  # a response filter changes its own copy
    second = http1.parse_response_head(head)
    assert second is not first
    assert (second.status, second.fields, second.content_length, second.keep_alive) == (
        200,
        b"\r\nServer: x",
        5,
        True,
    )
    assert http1.parse_response_head(head.replace(b"keep-alive,", b"close,")).keep_alive is False
    for index in range(http1._HEADS_ENTRIES + 10):
        http1.parse_response_head(b"HTTP/1.1 200 OK\r\nX: %d\r\n\r\n" % index)
    assert len(http1._HEADS) <= http1._HEADS_ENTRIES
    big = b"HTTP/1.1 200 OK\r\nX: " + b"v" * http1._HEADS_BYTES + b"\r\n\r\n"
    assert http1.parse_response_head(big).fields == b"\r\nX: " + b"v" * http1._HEADS_BYTES
    assert big not in http1._HEADS
    with pytest.raises(BadMessage):  # a refused head is refused every time
        http1.parse_response_head(b"HTTP/1.1 2000 OK\r\n\r\n")
    with pytest.raises(BadMessage):
        http1.parse_response_head(b"HTTP/1.1 2000 OK\r\n\r\n")


def test_find_head_end_walks_pipelined_heads_in_place() -> None:
    head = b"GET / HTTP/1.1\r\nHost: a\r\n\r\n"
    buffer = head * 3 + b"GET /partial HTTP/1.1\r\n"
    assert http1.find_head_end(buffer, start=len(head), origin=len(head)) == 2 * len(head)
    assert http1.find_head_end(buffer, start=3 * len(head), origin=3 * len(head)) == -1
    # The limits count from the head's own start, not the buffer's.
    long_line = b"GET /" + b"a" * (http1.MAX_REQUEST_LINE + 1) + b" HTTP/1.1\r\n\r\n"
    with pytest.raises(BadMessage):
        http1.find_head_end(head + long_line, start=len(head), origin=len(head))
    big = head * (http1.MAX_HEAD_BYTES // len(head))
    assert http1.find_head_end(big + head, start=len(big), origin=len(big)) == len(big) + len(head)


def test_read_headers_are_found_in_any_case_and_the_rest_forwarded_as_sent() -> None:
    req = parse(
        b"POST /u HTTP/1.1\r\nUser-Agent: t  \r\nHOST: A.test  \r\ncontent-LENGTH: 3 \r\n"
        b"CONNECTION: close\r\nAccept: */*\r\n\r\n"
    )
    assert req.host == b"a.test" and req.content_length == 3 and not req.keep_alive
    # Host first (as RFC 9112 asks of a client), then every other line byte for byte.
    assert forwarded_lines(req) == [b"HOST: A.test", b"User-Agent: t  ", b"Accept: */*"]


def test_underscore_spellings_of_forwarded_headers_are_dropped() -> None:
    # WSGI maps X_Forwarded_For to the same HTTP_X_FORWARDED_FOR as the proxy's own.
    req = parse(
        b"GET / HTTP/1.1\r\nHost: a\r\nX_Forwarded_For: 6.6.6.6\r\n"
        b"X-Forwarded_Proto: https\r\nX-Forwarded-For: 9.9.9.9\r\n\r\n"
    )
    assert forwarded_lines(req) == [b"Host: a"]
    assert [name for _, name, _ in req.forwarded] == [b"X-Forwarded-For"]
    head = http1.build_upstream_head(req, ForwardedContext("10.0.0.1", 80), "replace", b"")
    assert b"6.6.6.6" not in head and b"X-Forwarded-Proto: http\r\n" in head


def test_response_close_wins_over_keep_alive_and_case_is_kept() -> None:
    response = http1.parse_response_head(
        b"HTTP/1.1 200 OK\r\nconnection: Keep-Alive\r\nX-Case: MiXeD\r\n"
        b"CONNECTION: close\r\nCONTENT-length: 0 \r\n\r\n"
    )
    assert not response.keep_alive and response.content_length == 0
    head = http1.build_client_head(response, http1.FRAMING_LENGTH, 0, False)
    assert head == (
        b"HTTP/1.1 200 OK\r\nX-Case: MiXeD\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
    )


def test_unlisted_status_keeps_its_reason_phrase() -> None:
    response = http1.parse_response_head(b"HTTP/1.1 418 I'm a teapot\r\nContent-Length: 0\r\n\r\n")
    assert response.status == 418
    head = http1.build_client_head(response, http1.FRAMING_LENGTH, 0, True)
    assert head.startswith(b"HTTP/1.1 418 I'm a teapot\r\n")
