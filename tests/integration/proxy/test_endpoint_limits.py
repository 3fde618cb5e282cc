"""Slow clients cannot take every connection a backend accepts (issue 18 item 6): 300
clients trickling a body at 1 byte / 5 s held the demo backend's 256 connections and
794 of 800 other requests got 502. Now a request body must keep a minimum average rate
(408 otherwise), and connections per endpoint are bounded with a bounded queue in
front (503 past it). Real sockets."""

from __future__ import annotations

import asyncio

from tests.support.poll import until
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

H = b"Host: echo.test\r\n"


def routes(upstream):  # type: ignore[no-untyped-def]
    return table([route("echo.test", [("echo", 1)])], [endpoint("echo", upstream.port)])


async def test_a_trickled_request_body_is_cut_with_408(upstream):
    limits = Limits(min_request_body_rate=100, request_body_grace=0.5)
    async with running_proxy(routes(upstream), limits=limits) as (server, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /upload HTTP/1.1\r\n" + H + b"Content-Length: 1000\r\n\r\n")

        async def trickle() -> None:
            for _ in range(100):
                writer.write(b"x")
                await asyncio.sleep(0.2)

        trickler = asyncio.ensure_future(trickle())
        try:
            response = await read_response(reader, timeout=10)
        finally:
            trickler.cancel()
            writer.close()
        assert response.startswith(b"HTTP/1.1 408 "), response
        assert b"request body slower than 100 bytes/s" in response
        # The upstream connection it held is let go.
        await until(lambda: not server.upstreams, "the upstream connection to close")


async def test_a_steady_body_above_the_rate_goes_through(upstream):
    limits = Limits(min_request_body_rate=100, request_body_grace=0.3)
    async with running_proxy(routes(upstream), limits=limits) as (_, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /upload HTTP/1.1\r\n" + H + b"Content-Length: 800\r\n\r\n")
        for _ in range(8):  # 100 bytes every 0.1 s: 1000 bytes/s
            writer.write(b"y" * 100)
            await asyncio.sleep(0.1)
        response = await read_response(reader, timeout=10)
        writer.close()
    assert response.startswith(b"HTTP/1.1 200 "), response


async def test_connections_per_endpoint_are_bounded_with_a_bounded_queue(upstream):
    limits = Limits(max_connections_per_endpoint=2, endpoint_queue=1)
    async with running_proxy(routes(upstream), limits=limits) as (server, port):
        slow = [
            asyncio.ensure_future(exchange(port, b"GET /slow?s=1 HTTP/1.1\r\n" + H + b"\r\n"))
            for _ in range(2)
        ]
        await until(lambda: upstream.connections == 2, "two upstream connections")
        queued = asyncio.ensure_future(exchange(port, b"GET /q HTTP/1.1\r\n" + H + b"\r\n"))
        await until(lambda: server.pool.waiting, "a request waiting for the endpoint")
        refused = await exchange(port, b"GET /r HTTP/1.1\r\n" + H + b"\r\n")
        assert refused.startswith(b"HTTP/1.1 503 "), refused
        assert b"is at its limit of 2 connections and 1 requests wait for it" in refused
        for response in await asyncio.gather(*slow, queued):
            assert response.startswith(b"HTTP/1.1 200 "), response
        # Never more than two connections to the endpoint: the queued one reused one.
        assert upstream.connections <= 2
        assert not server.pool.waiting


async def test_the_body_rate_waits_for_the_upstreams_100_continue():
    async def continues_late(reader, writer):
        head = await reader.readuntil(b"\r\n\r\n")
        await asyncio.sleep(1.0)  # thinks before inviting the body
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
        await reader.readexactly(length)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()
        await reader.read()

    limits = Limits(min_request_body_rate=100, request_body_grace=0.3)
    async with (
        scripted_upstream(continues_late) as upstream_port,
        running_proxy(
            table([route("echo.test", [("echo", 1)])], [endpoint("echo", upstream_port)]),
            limits=limits,
        ) as (_, port),
    ):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(
            b"POST / HTTP/1.1\r\n" + H + b"Expect: 100-continue\r\nContent-Length: 500\r\n\r\n"
        )
        assert (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)).startswith(
            b"HTTP/1.1 100 "
        )
        writer.write(b"z" * 500)
        response = await read_response(reader, timeout=10)
        writer.close()
    assert response.startswith(b"HTTP/1.1 200 "), response


async def test_the_keep_alive_race_retry_is_counted_in_the_endpoint_bound():
    connections = []

    async def closes_its_first_connection_after_one_answer(reader, writer):
        connections.append(writer)
        answered = 0
        while True:
            await reader.readuntil(b"\r\n\r\n")
            if len(connections) == 1 and answered == 1:
                return  # the keep-alive race: closed as the second request arrives
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
            await writer.drain()
            answered += 1

    limits = Limits(max_connections_per_endpoint=4)
    async with (
        scripted_upstream(closes_its_first_connection_after_one_answer) as upstream_port,
        running_proxy(
            table([route("echo.test", [("echo", 1)])], [endpoint("echo", upstream_port)]),
            limits=limits,
        ) as (server, port),
    ):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        for _ in range(2):  # the second goes out on the pooled connection, then again
            writer.write(b"GET / HTTP/1.1\r\n" + H + b"\r\n")
            assert (await read_response(reader)).startswith(b"HTTP/1.1 200 ")
        writer.close()
        assert len(connections) == 2
        await until(lambda: len(server.upstreams) == 1, "the raced connection to be gone")
        # Every open connection is counted, nothing else.
        assert sum(server.pool.opened.values()) == len(server.upstreams)
