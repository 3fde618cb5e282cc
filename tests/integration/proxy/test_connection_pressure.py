"""Idle keep-alive connections cannot lock other clients out (issue 18 item 6): 10,000
idle connections used to fill --max-connections and every newcomer was aborted for
the 300 s keep-alive timeout. Now the oldest idle connection makes room (per source
and in total), and a newcomer is refused, with a 503 that says why, only when every
connection is busy. Real sockets."""

from __future__ import annotations

import asyncio
import ssl

import pytest

from tests.support.pki import LocalCA
from tests.support.poll import until
from tests.support.proxyharness import (
    endpoint,
    read_response,
    route,
    running_proxy,
    table,
)
from waygate.proxy.passthrough import TlsFront
from waygate.proxy.server import Limits
from waygate.proxy.tls import DefaultCertificate, EdgeCertificates

GET = b"GET / HTTP/1.1\r\nHost: echo.test\r\n\r\n"


async def idle_connection(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A client that made one request and keeps its connection open, idle."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(GET)
    assert (await read_response(reader)).startswith(b"HTTP/1.1 200 ")
    return reader, writer


async def closed_by_proxy(reader: asyncio.StreamReader) -> bool:
    try:
        return await asyncio.wait_for(reader.read(), 5) == b""
    except (ConnectionError, TimeoutError):
        return False


@pytest.mark.parametrize(
    "limits",
    [
        {"max_connections": 8},
        {"limits": Limits(max_connections_per_source=8)},
    ],
    ids=["total-cap", "per-source-cap"],
)
async def test_the_oldest_idle_connection_makes_room_for_a_newcomer(upstream, limits):
    routes = table([route("echo.test", [("echo", 1)])], [endpoint("echo", upstream.port)])
    async with running_proxy(routes, **limits) as (server, port):
        idle = [await idle_connection(port) for _ in range(8)]
        # A newcomer is served...
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(GET)
        assert (await read_response(reader)).startswith(b"HTTP/1.1 200 ")
        writer.close()
        # ...because the oldest idle connection was closed, and only as many as needed.
        assert await closed_by_proxy(idle[0][0])
        assert server.metrics.evicted_idle >= 1
        assert not idle[-1][0].at_eof()
        for _, idle_writer in idle:
            idle_writer.close()


async def test_with_every_connection_busy_a_newcomer_gets_a_503_that_says_why(upstream):
    routes = table([route("echo.test", [("echo", 1)])], [endpoint("echo", upstream.port)])
    async with running_proxy(routes, limits=Limits(max_connections_per_source=3)) as (
        server,
        port,
    ):
        busy = []
        for _ in range(3):  # each in the middle of sending its head: not idle
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET / HTTP/1.1\r\nHost: echo.test\r\n")
            busy.append(writer)
        await until(lambda: sum(len(c.buf) > 0 for c in server.connections) == 3, "busy heads")
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        response = await asyncio.wait_for(reader.read(), 5)
        writer.close()
        assert response.startswith(b"HTTP/1.1 503 "), response
        assert b"too many connections from 127.0.0.1" in response
        assert server.metrics.refused.get("source_connection_limit") == 1
        for busy_writer in busy:
            busy_writer.close()


async def test_idle_connections_make_room_on_the_https_port_too(upstream, tmp_path):
    ca = LocalCA()
    files = ca.write_files(tmp_path / "default", dns=["proxy.waygate.local"], prefix="default-")
    certificates = EdgeCertificates(DefaultCertificate.from_files(files.cert, files.key))
    routes = table([route("echo.test", [("echo", 1)])], [endpoint("echo", upstream.port)])
    async with running_proxy(routes, max_connections=4) as (server, port):
        front = TlsFront(server, certificates, "127.0.0.1", 0)
        await front.start()
        try:
            idle = [await idle_connection(port) for _ in range(4)]
            context = ssl.create_default_context(cadata=ca.pem.decode())
            context.check_hostname = False
            reader, writer = await asyncio.open_connection(
                "127.0.0.1", front.bound_port, ssl=context, server_hostname="echo.test"
            )
            writer.write(GET)
            assert (await read_response(reader)).startswith(b"HTTP/1.1 200 ")
            writer.close()
            assert server.metrics.evicted_idle >= 1
            for _, idle_writer in idle:
                idle_writer.close()
        finally:
            await front.drain(1.0)
