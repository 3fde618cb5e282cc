"""The audit's smaller proxy findings (issue 18 item 6), over real sockets: upstream
failures explained by what actually went wrong, CONNECT 405 as documented, TRACE
refused, `OPTIONS *` answered by the proxy itself, an HTTP/0.9 request line refused
at once, and a zero-padded Content-Length refused."""

from __future__ import annotations

import asyncio

import pytest

from tests.support.proxyharness import (
    RecordingUpstream,
    endpoint,
    exchange,
    route,
    running_proxy,
    scripted_upstream,
    table,
)
from waygate.proxy.routing import Defaults

GET = b"GET / HTTP/1.1\r\nHost: up.test\r\n\r\n"


def answers(data: bytes, *, then_close: bool):  # type: ignore[no-untyped-def]
    async def handler(reader, writer):
        await reader.readuntil(b"\r\n\r\n")
        writer.write(data)
        await writer.drain()
        if not then_close:
            await asyncio.sleep(30)

    return handler


@pytest.mark.parametrize(
    ("upstream_says", "then_close", "reason"),
    [
        (b"HTTP/1.1 200 OK\nContent-Length: 2\n\nok", False, b"upstream sent a bare LF"),
        (b"hello, not HTTP\r\n", False, b"upstream answered without an HTTP/1.x status line"),
        (b"HTTP/1.1 200 OK\r\nX-Half: ", True, b"in the middle of its response head"),
    ],
    ids=["bare-lf", "no-status-line", "closed-mid-head"],
)
async def test_upstream_failures_say_what_went_wrong(upstream_says, then_close, reason):
    async with (
        scripted_upstream(answers(upstream_says, then_close=then_close)) as upstream_port,
        running_proxy(table([route("up.test", [("up", 1)])], [endpoint("up", upstream_port)]))
        as (_, port),
    ):  # fmt: skip
        response = await exchange(port, GET)
    assert response.startswith(b"HTTP/1.1 502 "), response
    assert reason in response


@pytest.fixture
async def recorded():
    upstream = await RecordingUpstream().start()
    # A long head timeout: an answer that comes at once is not the timeout's.
    routes = table([route("up.test", [("up", 1)])], [endpoint("up", upstream.port)])
    try:
        async with running_proxy(routes, defaults=Defaults(http_request_timeout=60)) as (_, port):
            yield upstream, port
    finally:
        await upstream.stop()


@pytest.mark.parametrize(
    ("request_bytes", "status", "reason"),
    [
        (b"CONNECT up.test:443 HTTP/1.1\r\nHost: up.test:443\r\n\r\n", 405, b"CONNECT"),
        (b"TRACE / HTTP/1.1\r\nHost: up.test\r\n\r\n", 405, b"TRACE is not served"),
        (
            b"POST / HTTP/1.1\r\nHost: up.test\r\nContent-Length: 0005\r\n\r\nhello",
            400,
            b"malformed Content-Length",
        ),
    ],
    ids=["connect", "trace", "zero-padded-length"],
)
async def test_refused_requests_never_reach_the_upstream(recorded, request_bytes, status, reason):
    upstream, port = recorded
    response = await exchange(port, request_bytes)
    assert response.startswith(b"HTTP/1.1 %d " % status), response
    assert reason in response
    assert upstream.received == b""


async def test_options_star_is_answered_by_the_proxy(recorded):
    upstream, port = recorded
    response = await exchange(port, b"OPTIONS * HTTP/1.1\r\nHost: up.test\r\n\r\n")
    assert response.startswith(b"HTTP/1.1 200 "), response
    assert b"\r\nAllow: GET, HEAD, POST, PUT, DELETE, PATCH, OPTIONS\r\n" in response
    assert upstream.received == b""


async def test_an_http09_request_line_is_refused_at_once(recorded):
    upstream, port = recorded
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /index.html\r\n")  # HTTP/0.9: no version, no headers, ever
    # Answered and closed at once, well before the 60 s head timeout.
    response = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    assert response.startswith(b"HTTP/1.1 400 "), response
    assert b"HTTP/0.9 is not served" in response
    assert upstream.received == b""


async def test_a_body_of_one_byte_chunks_is_refused(recorded):
    upstream, port = recorded
    body = b"1\r\nx\r\n" * 5000 + b"0\r\n\r\n"
    response = await exchange(
        port,
        b"POST / HTTP/1.1\r\nHost: up.test\r\nTransfer-Encoding: chunked\r\n\r\n" + body,
    )
    assert response.startswith(b"HTTP/1.1 400 "), response[:300]
    assert b"too many small chunks" in response
    assert upstream.requests == []  # nothing complete reached it
