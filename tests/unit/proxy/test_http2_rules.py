"""HTTP/2 requests as the HTTP/1.1 heads they mean, and gRPC statuses (sans-IO)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from waygate.proxy import grpcstatus, http1, http2
from waygate.proxy.http2 import (
    BadRequest,
    Malformed,
    check_trailers,
    read_request,
    request_head,
)

BASE = [(b":method", b"GET"), (b":scheme", b"https"), (b":path", b"/a?b=1")]


def test_authority_becomes_host_and_cookies_are_joined():
    request = read_request(
        [*BASE, (b":authority", b"Echo.Test:8443"), (b"cookie", b"a=1"), (b"cookie", b"b=2")],
        True,
    )
    parsed = request_head(request, chunked=False)
    assert parsed.host == b"echo.test"
    assert parsed.target == b"/a?b=1"
    assert list(parsed.cookie) == [b"a=1; b=2"]
    assert parsed.fields == b"Host: Echo.Test:8443\r\ncookie: a=1; b=2\r\n"
    assert parsed.keep_alive and not parsed.upgrade


def test_host_alone_serves_as_authority_and_both_must_agree():
    assert read_request([*BASE, (b"host", b"echo.test")], True).authority == b"echo.test"
    with pytest.raises(BadRequest, match="disagree"):
        read_request([*BASE, (b":authority", b"a.test"), (b"host", b"b.test")], True)
    with pytest.raises(BadRequest, match="missing :authority and Host"):
        read_request(BASE, True)


def test_connect_and_connection_specific_fields_are_refused():
    with pytest.raises(BadRequest) as refused:
        read_request([(b":method", b"CONNECT"), (b":authority", b"a:443")], True)
    assert refused.value.status == 405
    with pytest.raises(BadRequest, match="connection-specific"):
        read_request([*BASE, (b":authority", b"a"), (b"upgrade", b"h2c")], True)


@pytest.mark.parametrize("value", [b"1\r\nx-remote-user: admin", b"a\nb", b"a\x00b"])
def test_line_breaks_and_nul_in_values_never_become_lines(value):
    with pytest.raises(Malformed):
        read_request([*BASE, (b":authority", b"a"), (b"x-a", value)], True)
    # And were one to get past read_request, the head built from it is refused.
    request = read_request([*BASE, (b":authority", b"a")], True)._replace(
        headers=((b"x-a", value),)
    )
    with pytest.raises(http1.BadMessage):
        request_head(request, chunked=False)


# What h2's inbound checks refused before they were turned off on the listeners
# (read_request keeps them: each is a malformed request, RFC 9113 sections 8.2, 8.3).
AUTH = (b":authority", b"a")


@pytest.mark.parametrize(
    "fields",
    [
        [*BASE, AUTH, (b"X-Upper", b"1")],  # upper case in a name
        [*BASE, AUTH, (b"x a", b"1")],  # space in a name
        [*BASE, AUTH, (b"x:a", b"1")],  # colon in a regular name
        [*BASE, AUTH, (b"", b"1")],  # empty name
        [*BASE, AUTH, (b"x-a", b" 1")],  # leading whitespace in a value
        [*BASE, AUTH, (b"x-a", b"1\t")],  # trailing whitespace in a value
        [*BASE, AUTH, (b"connection", b"keep-alive")],
        [*BASE, AUTH, (b"transfer-encoding", b"chunked")],
        [*BASE, AUTH, (b"te", b"gzip")],
        [*BASE, AUTH, (b":status", b"200")],  # a response pseudo-header
        [*BASE, AUTH, (b":protocol", b"websocket")],  # extended CONNECT is not served
        [*BASE, AUTH, (b":method", b"POST")],  # repeated
        [*BASE, (b"x-a", b"1"), AUTH],  # pseudo-header after a regular field
        [(b":scheme", b"https"), (b":path", b"/"), AUTH],  # no :method
        [(b":method", b"GET"), (b":path", b"/"), AUTH],  # no :scheme
        [(b":method", b"GET"), (b":scheme", b"https"), AUTH],  # no :path
        [(b":method", b"GET"), (b":scheme", b"https"), (b":path", b""), AUTH],  # empty :path
    ],
)
def test_malformed_requests_are_refused(fields):
    with pytest.raises(Malformed):
        read_request(fields, True)


def test_te_trailers_is_taken_and_not_copied():
    request = read_request([*BASE, AUTH, (b"te", b"trailers"), (b"x-a", b"")], True)
    assert request.headers == ((b"x-a", b""),)


def test_a_name_that_is_no_token_is_a_bad_request_not_malformed():
    with pytest.raises(BadRequest) as refused:
        read_request([*BASE, AUTH, (b"x(a)", b"1")], True)
    assert not isinstance(refused.value, Malformed)
    assert refused.value.status == 400


@pytest.mark.parametrize(
    "trailers",
    [
        [(b":path", b"/")],
        [(b"X-A", b"1")],
        [(b"x-a", b"1\r\nx-b: 2")],
        [(b"connection", b"close")],
        [(b"te", b"trailers")],
    ],
)
def test_malformed_trailers(trailers):
    with pytest.raises(Malformed):
        check_trailers(trailers)
    check_trailers([(b"grpc-status", b"0"), (b"x-checksum", b"abc")])


def test_body_framing_chosen_once():
    streamed = read_request([*BASE, (b":authority", b"a")], False)
    assert request_head(streamed, chunked=True).chunked
    sized = read_request([*BASE, (b":authority", b"a"), (b"content-length", b"5")], False)
    assert request_head(sized, chunked=True).content_length == 5
    assert not request_head(sized, chunked=True).chunked
    with pytest.raises(BadRequest):
        read_request([*BASE, (b":authority", b"a"), (b"content-length", b"5")], True)


def test_identity_headers_go_through_the_rule_book():
    request = read_request([*BASE, (b":authority", b"a"), (b"impersonate-user", b"root")], True)
    parsed = request_head(request, chunked=False)
    assert b"impersonate" not in parsed.fields.lower()


# The one rule book: an HTTP/2 request's head (`request_head`, built from its
# fields) is what `http1.parse_request_head` makes of the HTTP/1.1 head the
# request means, or both refuse it with the same status.
_NAMES = st.sampled_from(
    [
        b"user-agent",
        b"accept",
        b"x-a",
        b"cookie",
        b"expect",
        b"traceparent",
        b"x-forwarded-for",
        b"x-forwarded-host",
        b"forwarded",
        b"proxy-authorization",
        b"trailer",
        b"proxy",
        b"x-remote-user",
        b"x_remote_group",
        b"impersonate-uid",
        b"x-ssl-client-s-dn",
        b"x-forwarded-client-cert",
        b"x-waygate-route",
        b"x_forwarded_for",
    ]
)
_VALUES = st.one_of(
    st.sampled_from([b"1", b"100-continue", b"a=1", b"", b"a\tb", b"caf\xc3\xa9"]),
    st.binary(max_size=6).filter(lambda v: v.strip(b" \t") == v),
)
_METHODS = st.sampled_from([b"GET", b"POST", b"PATCH", b"PURGE", b"FOO", b"get", b"TRACE", b"G(T"])
_TARGETS = st.sampled_from([b"/", b"/a?b=1", b"*", b"/a/../b", b"/%2e%2e/x", b"/a b", b"/\x80"])
_AUTHORITIES = st.sampled_from([b"echo.test", b"Echo.Test:8443", b"[::1]:80", b"a b", b"a/b"])


def _as_http1(method, target, authority, fields, content_length, chunked) -> bytes:
    lines = [b"%s %s HTTP/1.1\r\nHost: %s\r\n" % (method, target, authority)]
    lines += [b"%s: %s\r\n" % field for field in fields]
    if content_length >= 0:
        lines.append(b"Content-Length: %d\r\n" % content_length)
    elif chunked:
        lines.append(b"Transfer-Encoding: chunked\r\n")
    return b"".join(lines) + b"\r\n"


def _outcome(parse):
    try:
        head = parse()
    except http1.BadMessage as exc:
        return ("refused", exc.status)
    return (
        head.method,
        head.target,
        head.host,
        head.fields,
        list(head.forwarded),
        list(head.cookie),
        head.traceparent,
        head.expect_continue,
        head.content_length,
        head.chunked,
        head.keep_alive,
        head.upgrade,
    )


@settings(max_examples=300, deadline=None)
@given(
    method=_METHODS,
    target=_TARGETS,
    authority=_AUTHORITIES,
    fields=st.lists(st.tuples(_NAMES, _VALUES), max_size=6),
    content_length=st.sampled_from([-1, 0, 7]),
    chunked=st.booleans(),
)
def test_request_head_is_the_http1_parse_of_the_head_it_means(
    method, target, authority, fields, content_length, chunked
):
    if any(b"\r" in v or b"\n" in v for _, v in fields):
        # A line break would split the HTTP/1.1 rendering itself; read_request
        # refuses it (Malformed) and request_head refuses it too (above).
        return
    ours = _outcome(
        lambda: http1.request_from_fields(
            method, target, authority, fields, content_length, chunked
        )
    )
    head = _as_http1(method, target, authority, fields, content_length, chunked)
    theirs = _outcome(lambda: http1.parse_request_head(head))
    if ours[0] == "refused" or theirs[0] == "refused":
        assert ours[0] == theirs[0] == "refused", (ours, theirs)
        assert ours[1] == theirs[1], (ours, theirs)
    else:
        assert ours == theirs


def test_grpc_status_of_local_answers():
    assert grpcstatus.code_for(503) == grpcstatus.UNAVAILABLE
    assert grpcstatus.code_for(502) == grpcstatus.UNAVAILABLE
    assert grpcstatus.code_for(504) == grpcstatus.DEADLINE_EXCEEDED
    assert grpcstatus.code_for(408) == grpcstatus.DEADLINE_EXCEEDED
    assert grpcstatus.code_for(400) == grpcstatus.INTERNAL
    fields = dict(grpcstatus.trailers_only(503, "no route for host a 100%"))
    assert fields[b"grpc-status"] == b"14"
    assert fields[b"grpc-message"] == b"no route for host a 100%25"


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        (b"1S", 1.0),
        (b"250m", 0.25),
        (b"2M", 120.0),
        (b"100000u", 0.1),
        (b"x", None),
        (b"123456789S", None),
        (b"1s", None),
    ],
)
def test_grpc_timeout(value, seconds):
    parsed = grpcstatus.parse_timeout(value)
    assert parsed == (pytest.approx(seconds) if seconds is not None else None)


@pytest.mark.parametrize("value", [b"h2c", b"H2C", b"websocket, h2c"])
def test_upgrade_to_h2c_is_never_an_upgrade(value):
    head = b"GET / HTTP/1.1\r\nHost: a\r\nConnection: Upgrade\r\nUpgrade: " + value + b"\r\n\r\n"
    assert http1.parse_request_head(head).upgrade == b""
    websocket = head.replace(value, b"websocket")
    assert http1.parse_request_head(websocket).upgrade == b"websocket"


def test_response_head_fields_are_remembered_as_copies_and_bounded():
    from waygate.proxy import h2exchange

    head = (
        b"HTTP/1.1 200 OK\r\nServer: nginx\r\nDate:  Mon, 23 Nov 2026 04:00:00 GMT \r\n"
        b"Connection: keep-alive\r\nContent-Length: 2\r\nX-A: b\r\n\r\n"
    )
    parsed = http1.parse_response_head(head)
    expected = [
        (b":status", b"200"),
        (b"server", b"nginx"),
        (b"date", b"Mon, 23 Nov 2026 04:00:00 GMT"),
        (b"x-a", b"b"),
    ]
    first = h2exchange._head_fields(parsed)
    assert first == expected
    first.append((b"content-length", b"2"))  # the caller adds to its list...
    assert h2exchange._head_fields(parsed) == expected  # ...not to what is remembered
    assert h2exchange._head_fields(
        http1.parse_response_head(head.replace(b"200 OK", b"404 Not Found"))
    ) == [
        (b":status", b"404"),
        *expected[1:],
    ]
    extra = b"Set-Cookie: a=1; Path=/\r\nStrict-Transport-Security: max-age=1\r\n"
    assert h2exchange._lines_fields(extra, 0, len(extra) - 2) == (
        (b"set-cookie", b"a=1; Path=/"),
        (b"strict-transport-security", b"max-age=1"),
    )
    # Connection-specific lines added after the parse never become fields.
    assert h2exchange._lines_fields(b"Upgrade: x\r\nA: 1\r\n", 0, 16) == ((b"a", b"1"),)
    for index in range(h2exchange._FIELDS_ENTRIES + 10):
        h2exchange._lines_fields(b"X: %d\r\n" % index, 0, -2)
    assert len(h2exchange._FIELDS) <= h2exchange._FIELDS_ENTRIES
    big = b"\r\nX: " + b"v" * h2exchange._FIELDS_BYTES
    assert h2exchange._lines_fields(big, 2, len(big)) == ((b"x", b"v" * h2exchange._FIELDS_BYTES),)
    assert big not in h2exchange._FIELDS


def test_a_remembered_block_means_the_same_and_a_refused_one_is_refused_again():
    block = [*BASE, AUTH, (b"content-length", b"3"), (b"x-a", b"1")]
    first = read_request(list(block), False)
    assert read_request(list(block), False) is first  # remembered
    assert first.content_length == 3 and first.headers == ((b"x-a", b"1"),)
    # The end of the stream is part of what the block means: no body but a length.
    with pytest.raises(BadRequest, match="content-length without a body"):
        read_request(list(block), True)
    with pytest.raises(BadRequest, match="content-length without a body"):
        read_request(list(block), True)
    assert read_request(list(block), False) is first


def test_the_remembered_blocks_are_bounded():
    for index in range(http2._REQUESTS_ENTRIES * 2):
        read_request([*BASE, AUTH, (b"x-n", b"%d" % index)], True)
    assert 0 < len(http2._REQUESTS) <= http2._REQUESTS_ENTRIES
    many = [*BASE, AUTH, *[(b"x-%d" % i, b"1") for i in range(http2._REQUESTS_FIELDS)]]
    before = len(http2._REQUESTS)
    assert len(read_request(many, True).headers) == http2._REQUESTS_FIELDS
    assert len(http2._REQUESTS) == before  # a long block is read, not kept


def test_a_large_block_is_read_but_not_remembered():
    big = [*BASE, AUTH, (b"x-big", b"a" * http2._REQUESTS_BYTES)]
    before = dict(http2._REQUESTS)
    assert read_request(big, True).headers == ((b"x-big", b"a" * http2._REQUESTS_BYTES),)
    assert before == http2._REQUESTS


def test_a_remembered_request_head_is_a_copy_of_its_own_each_time():
    request = read_request([*BASE, AUTH, (b"cookie", b"a=1"), (b"x-a", b"1")], True)
    first = request_head(request, chunked=False)
    first.host = b"changed.test"
    first.cookie = ()
    second = request_head(request, chunked=False)
    assert second is not first
    assert second.host == b"a" and list(second.cookie) == [b"a=1"]
    assert second.fields == b"Host: a\r\nx-a: 1\r\ncookie: a=1\r\n"
    # chunked is part of what the request means.
    assert request_head(request, chunked=True).chunked and not second.chunked
    refused = request._replace(headers=((b"x-a", b"a\x01b"),))
    for _ in range(2):
        with pytest.raises(http1.BadMessage):
            request_head(refused, chunked=False)
