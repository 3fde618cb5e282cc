"""The server timeout's rules (issue 18 item 6), over real sockets:

- it runs from the last byte moved either way, so a steady upload longer than
  the timeout is not answered 504 while it still flows;
- it bounds the whole response head: neither 1xx heads nor a head trickled
  byte by byte keep a client waiting past it.
"""

from __future__ import annotations

import asyncio

from tests.support.proxyharness import (
    endpoint,
    read_response,
    route,
    running_proxy,
    scripted_upstream,
    table,
)
from waygate.resolver.model import RouteTimeouts

SERVER_TIMEOUT = 0.5


def routes(port: int):  # type: ignore[no-untyped-def]
    return table(
        [route("slow.test", [("slow", 1)], timeouts=RouteTimeouts(server=SERVER_TIMEOUT))],
        [endpoint("slow", port)],
    )


async def get_through_proxy(upstream_script) -> bytes:  # type: ignore[no-untyped-def]
    """One GET through a proxy to an upstream running `upstream_script`."""
    async with (
        scripted_upstream(upstream_script) as upstream_port,
        running_proxy(routes(upstream_port)) as (_, port),
    ):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET / HTTP/1.1\r\nHost: slow.test\r\n\r\n")
        response = await read_response(reader, timeout=10)
        writer.close()
    return response


async def test_an_upload_longer_than_the_server_timeout_is_not_cut_while_it_flows():
    pieces = 8

    async def reads_the_body_then_answers(reader, writer):
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
        body = await reader.readexactly(length)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        await writer.drain()
        await reader.read()

    async with (
        scripted_upstream(reads_the_body_then_answers) as upstream_port,
        running_proxy(routes(upstream_port)) as (_, port),
    ):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /up HTTP/1.1\r\nHost: slow.test\r\nContent-Length: %d\r\n\r\n" % pieces)
        # The body takes about three server timeouts, a byte at a time.
        for _ in range(pieces):
            await asyncio.sleep(SERVER_TIMEOUT * 3 / pieces)
            writer.write(b"x")
        response = await read_response(reader, timeout=10)
        writer.close()
    assert response.startswith(b"HTTP/1.1 200 "), response
    assert b"Content-Length: %d" % pieces in response


async def test_informational_heads_do_not_extend_the_server_timeout():
    async def processing_forever(reader, writer):
        await reader.readuntil(b"\r\n\r\n")
        while True:
            writer.write(b"HTTP/1.1 102 Processing\r\n\r\n")
            await writer.drain()
            await asyncio.sleep(SERVER_TIMEOUT / 5)

    response = await get_through_proxy(processing_forever)
    assert response.startswith(b"HTTP/1.1 504 "), response


async def test_a_trickled_response_head_is_bounded_by_the_server_timeout():
    async def trickles(reader, writer):
        await reader.readuntil(b"\r\n\r\n")
        for byte in b"HTTP/1.1 200 OK\r\nX-Slow: " + b"y" * 1000:
            writer.write(bytes([byte]))
            await writer.drain()
            await asyncio.sleep(SERVER_TIMEOUT / 5)

    response = await get_through_proxy(trickles)
    assert response.startswith(b"HTTP/1.1 504 "), response
