"""Informational (1xx) responses are bounded per request (issue 18 item 6): an upstream
streaming 103 Early Hints heads used to cost seconds of proxy CPU per request while
every other route waited; now the count and the bytes of 1xx heads are capped and
the request is answered 502 with the reason, over real sockets."""

from __future__ import annotations

import asyncio

from tests.support.proxyharness import (
    endpoint,
    exchange,
    read_response,
    route,
    running_proxy,
    scripted_upstream,
    table,
)
from waygate.proxy.server import Limits

EARLY_HINTS = b"HTTP/1.1 103 Early Hints\r\nLink: </style.css>; rel=preload\r\n\r\n"
OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"


def hints_then_ok(count: int):  # type: ignore[no-untyped-def]
    async def handler(reader, writer):
        while True:  # keep-alive: one answer per request
            await reader.readuntil(b"\r\n\r\n")
            writer.write(EARLY_HINTS * count + OK)
            await writer.drain()

    return handler


def routes(port: int):  # type: ignore[no-untyped-def]
    return table([route("hints.test", [("hints", 1)])], [endpoint("hints", port)])


async def test_a_flood_of_informational_responses_is_a_502_with_the_reason():
    async with (
        scripted_upstream(hints_then_ok(10_000)) as upstream_port,
        running_proxy(routes(upstream_port)) as (server, port),
    ):
        response = await exchange(port, b"GET / HTTP/1.1\r\nHost: hints.test\r\n\r\n")
        assert server.metrics.refused.get("bad_response") == 1
    assert response.startswith(b"HTTP/1.1 502 "), response[:200]
    assert b"more than 16 informational (1xx) responses" in response


async def test_informational_bytes_are_bounded_too():
    async with (
        scripted_upstream(hints_then_ok(10)) as upstream_port,
        running_proxy(routes(upstream_port), limits=Limits(max_informational_bytes=256)) as (
            _,
            port,
        ),
    ):
        response = await exchange(port, b"GET / HTTP/1.1\r\nHost: hints.test\r\n\r\n")
    assert response.startswith(b"HTTP/1.1 502 "), response[:200]


async def test_a_few_informational_responses_are_fine_and_the_count_is_per_request():
    async with (
        scripted_upstream(hints_then_ok(16)) as upstream_port,
        running_proxy(routes(upstream_port)) as (_, port),
    ):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        for _ in range(3):  # one keep-alive connection both ways: the count restarts
            writer.write(b"GET / HTTP/1.1\r\nHost: hints.test\r\n\r\n")
            response = await read_response(reader)
            assert response.startswith(b"HTTP/1.1 200 "), response[:200]
            assert response.endswith(b"ok")
        writer.close()
