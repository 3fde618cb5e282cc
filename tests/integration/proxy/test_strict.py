"""Strict HTTP/1.1 over raw sockets: every refused request gets its 4xx, the
connection is closed by the proxy, and the upstream receives NOTHING."""

from __future__ import annotations

import pytest

from tests.support.proxyharness import (
    RecordingUpstream,
    endpoint,
    exchange,
    route,
    running_proxy,
    table,
)

H = b"Host: echo.test\r\n"

MALFORMED = {
    "cl_and_te": b"POST / HTTP/1.1\r\n"
    + H
    + b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    "te_and_cl": b"POST / HTTP/1.1\r\n"
    + H
    + b"Transfer-Encoding: chunked\r\nContent-Length: 5\r\n\r\n0\r\n\r\n",
    "two_cl_differing": b"POST / HTTP/1.1\r\n"
    + H
    + b"Content-Length: 5\r\nContent-Length: 6\r\n\r\nhello!",
    "two_cl_same": b"POST / HTTP/1.1\r\n"
    + H
    + b"Content-Length: 5\r\nContent-Length: 5\r\n\r\nhello",
    "cl_list": b"POST / HTTP/1.1\r\n" + H + b"Content-Length: 5, 5\r\n\r\nhello",
    "cl_negative": b"POST / HTTP/1.1\r\n" + H + b"Content-Length: -1\r\n\r\n",
    "cl_plus": b"POST / HTTP/1.1\r\n" + H + b"Content-Length: +5\r\n\r\nhello",
    "cl_hex": b"POST / HTTP/1.1\r\n" + H + b"Content-Length: 0x5\r\n\r\nhello",
    "cl_space_inside": b"POST / HTTP/1.1\r\n" + H + b"Content-Length: 1 2\r\n\r\n",
    "te_gzip_chunked": b"POST / HTTP/1.1\r\n"
    + H
    + b"Transfer-Encoding: gzip, chunked\r\n\r\n0\r\n\r\n",
    "te_chunked_twice": b"POST / HTTP/1.1\r\n"
    + H
    + b"Transfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    "te_identity": b"POST / HTTP/1.1\r\n" + H + b"Transfer-Encoding: identity\r\n\r\n",
    "te_chunked_not_last": b"POST / HTTP/1.1\r\n"
    + H
    + b"Transfer-Encoding: chunked, gzip\r\n\r\n0\r\n\r\n",
    "te_xchunked": b"POST / HTTP/1.1\r\n" + H + b"Transfer-Encoding: xchunked\r\n\r\n0\r\n\r\n",
    "te_in_http10": b"POST / HTTP/1.0\r\n" + H + b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    "bad_chunk_size": b"POST / HTTP/1.1\r\n"
    + H
    + b"Transfer-Encoding: chunked\r\n\r\nzz\r\nhello\r\n0\r\n\r\n",
    "chunk_size_overflow": b"POST / HTTP/1.1\r\n"
    + H
    + b"Transfer-Encoding: chunked\r\n\r\n10000000000000000\r\nx\r\n",
    "chunk_size_negative": b"POST / HTTP/1.1\r\n"
    + H
    + b"Transfer-Encoding: chunked\r\n\r\n-5\r\nhello\r\n0\r\n\r\n",
    "chunk_size_space": b"POST / HTTP/1.1\r\n"
    + H
    + b"Transfer-Encoding: chunked\r\n\r\n5 \r\nhello\r\n0\r\n\r\n",
    "chunk_missing_crlf": b"POST / HTTP/1.1\r\n"
    + H
    + b"Transfer-Encoding: chunked\r\n\r\n5\r\nhelloXX0\r\n\r\n",
    "chunk_bare_lf": b"POST / HTTP/1.1\r\n"
    + H
    + b"Transfer-Encoding: chunked\r\n\r\n5\nhello\n0\n\n",
    "obs_fold": b"GET / HTTP/1.1\r\n" + H + b"X-Long: a\r\n b\r\n\r\n",
    "obs_fold_tab": b"GET / HTTP/1.1\r\n" + H + b"X-Long: a\r\n\tb\r\n\r\n",
    "space_before_colon": b"GET / HTTP/1.1\r\nHost : echo.test\r\n\r\n",
    "tab_before_colon": b"GET / HTTP/1.1\r\n" + H + b"X-A\t: 1\r\n\r\n",
    "bare_lf_everywhere": b"GET / HTTP/1.1\nHost: echo.test\n\n",
    "bare_lf_in_header": b"GET / HTTP/1.1\r\n" + H + b"X-A: 1\nX-B: 2\r\n\r\n",
    "bare_cr_in_value": b"GET / HTTP/1.1\r\n" + H + b"X-A: 1\rX-B: 2\r\n\r\n",
    "nul_in_value": b"GET / HTTP/1.1\r\n" + H + b"X-A: a\x00b\r\n\r\n",
    "ctl_in_value": b"GET / HTTP/1.1\r\n" + H + b"X-A: a\x01b\r\n\r\n",
    "del_in_target": b"GET /a\x7fb HTTP/1.1\r\n" + H + b"\r\n",
    "space_in_target": b"GET /a b HTTP/1.1\r\n" + H + b"\r\n",
    "missing_host": b"GET / HTTP/1.1\r\n\r\n",
    "two_hosts": b"GET / HTTP/1.1\r\n" + H + H + b"\r\n",
    "empty_host": b"GET / HTTP/1.1\r\nHost: \r\n\r\n",
    "bad_host": b"GET / HTTP/1.1\r\nHost: a b\r\n\r\n",
    "host_with_slash": b"GET / HTTP/1.1\r\nHost: echo.test/x\r\n\r\n",
    "absolute_form": b"GET http://echo.test/ HTTP/1.1\r\n" + H + b"\r\n",
    "connect": b"CONNECT echo.test:443 HTTP/1.1\r\n" + H + b"\r\n",
    "http09": b"GET /\r\n\r\n",
    "http2_version": b"GET / HTTP/2.0\r\n" + H + b"\r\n",
    "http12_version": b"GET / HTTP/1.2\r\n" + H + b"\r\n",
    "lowercase_version": b"GET / http/1.1\r\n" + H + b"\r\n",
    "double_space_request_line": b"GET  / HTTP/1.1\r\n" + H + b"\r\n",
    "method_with_slash": b"G/T / HTTP/1.1\r\n" + H + b"\r\n",
    "header_without_colon": b"GET / HTTP/1.1\r\n" + H + b"NoColon\r\n\r\n",
    "empty_header_name": b"GET / HTTP/1.1\r\n" + H + b": x\r\n\r\n",
    "leading_space_first_header": b"GET / HTTP/1.1\r\n Host: echo.test\r\n\r\n",
    "expect_unknown": b"GET / HTTP/1.1\r\n" + H + b"Expect: 200-ok\r\n\r\n",
    "request_line_too_long": b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\n" + H + b"\r\n",
    "header_block_too_large": b"GET / HTTP/1.1\r\n" + H + b"X-Big: " + b"b" * 33000 + b"\r\n\r\n",
    "many_headers_too_large": b"GET / HTTP/1.1\r\n" + H + b"X-A: aaaaaaaaaa\r\n" * 2200 + b"\r\n",
    # Dot segments would pass a "/" or "/public" route and reach /admin at the backend.
    "dot_dot_segment": b"GET /public/../admin HTTP/1.1\r\n" + H + b"\r\n",
    "dot_segment": b"GET /./admin HTTP/1.1\r\n" + H + b"\r\n",
    "encoded_dot_dot": b"GET /%2e%2e/admin HTTP/1.1\r\n" + H + b"\r\n",
    "encoded_dot_dot_upper": b"GET /public/%2E./admin HTTP/1.1\r\n" + H + b"\r\n",
    "dot_dot_semicolon": b"GET /public/..;/admin HTTP/1.1\r\n" + H + b"\r\n",
    "dot_dot_encoded_slash": b"GET /public%2f..%2fadmin HTTP/1.1\r\n" + H + b"\r\n",
    "trailing_dot_dot": b"GET /public/.. HTTP/1.1\r\n" + H + b"\r\n",
}


@pytest.fixture
async def proxy_and_upstream():
    upstream = await RecordingUpstream().start()
    routes = table([route("echo.test", [("echo", 100)])], [endpoint("echo", upstream.port)])
    async with running_proxy(routes) as (_, port):
        yield port, upstream
    await upstream.stop()


@pytest.mark.parametrize("name", sorted(MALFORMED))
async def test_malformed_request_is_refused_and_never_forwarded(name, proxy_and_upstream):
    port, upstream = proxy_and_upstream
    # No half-close: the proxy itself must close the connection after its answer.
    response = await exchange(port, MALFORMED[name], half_close=False, timeout=5)
    status = response.split(b" ", 2)[1] if response else b""
    assert status in (b"400", b"405", b"414", b"417", b"431"), response[:200]
    assert b"Connection: close" in response
    assert b"X-Waygate-Error: " in response
    assert upstream.received == b""
    assert upstream.connections == 0


async def test_smuggled_second_request_after_refusal_is_not_forwarded(proxy_and_upstream):
    port, upstream = proxy_and_upstream
    attack = (
        b"POST / HTTP/1.1\r\n" + H + b"Content-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"0\r\n\r\nGET /admin HTTP/1.1\r\n" + H + b"\r\n"
    )
    response = await exchange(port, attack, half_close=False)
    assert response.startswith(b"HTTP/1.1 400 ")
    assert response.count(b"HTTP/1.1") == 1
    assert upstream.received == b""


@pytest.mark.parametrize(
    "target", [b"/a.b/c", b"/.well-known/x", b"/a/...", b"/a..b", b"/x?p=/../y", b"/%2e%2e.txt"]
)
async def test_dots_that_are_not_dot_segments_pass(target, proxy_and_upstream):
    port, upstream = proxy_and_upstream
    request = b"GET " + target + b" HTTP/1.1\r\n" + H + b"Connection: close\r\n\r\n"
    response = await exchange(port, request)
    assert response.startswith(b"HTTP/1.1 200 "), response[:200]
    assert upstream.received.startswith(b"GET " + target + b" HTTP/1.1\r\n")


async def test_a_good_request_still_passes(proxy_and_upstream):
    port, upstream = proxy_and_upstream
    response = await exchange(port, b"GET / HTTP/1.1\r\n" + H + b"Connection: close\r\n\r\n")
    assert response.startswith(b"HTTP/1.1 200 ")
    assert upstream.received.startswith(b"GET / HTTP/1.1\r\n")
