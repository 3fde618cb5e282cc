"""Every way an upgrade relay ends releases its connections (issue 18 item 6): a relay
both ends closed used to stay counted in waygate_proxy_client_connections with its
sockets held, and a drain then waited the whole grace for it. Real sockets."""

from __future__ import annotations

import asyncio

import pytest
import websockets

from tests.support.poll import until
from tests.support.proxyharness import (
    endpoint,
    route,
    running_proxy,
    scripted_upstream,
    table,
)

UPGRADE = b"GET /relay HTTP/1.1\r\nHost: up.test\r\nConnection: Upgrade\r\nUpgrade: raw\r\n\r\n"


async def switches_then_echoes_until_eof(reader, writer):
    await reader.readuntil(b"\r\n\r\n")
    writer.write(b"HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: raw\r\n\r\n")
    while data := await reader.read(65536):
        writer.write(data)
    writer.write_eof()  # the client's EOF came through: this side ends too
    await writer.drain()


@pytest.mark.parametrize("first", ["client", "upstream"])
async def test_a_relay_half_closed_both_ways_is_released(first):
    async def upstream_script(reader, writer):
        if first == "client":
            await switches_then_echoes_until_eof(reader, writer)
            await asyncio.sleep(30)  # keeps its socket: only the FINs say it is over
        else:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\n"
                         b"Upgrade: raw\r\n\r\nbye")  # fmt: skip
            writer.write_eof()
            await reader.read()  # until the client's EOF arrives through the relay
            await asyncio.sleep(30)

    async with (
        scripted_upstream(upstream_script) as upstream_port,
        running_proxy(table([route("up.test", [("up", 1)])], [endpoint("up", upstream_port)])) as (
            server,
            port,
        ),
    ):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(UPGRADE)
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert head.startswith(b"HTTP/1.1 101 ")
        if first == "client":
            writer.write(b"ping")
            writer.write_eof()
            assert await asyncio.wait_for(reader.read(), 5) == b"ping"
        else:
            assert await asyncio.wait_for(reader.read(), 5) == b"bye"
            writer.write_eof()
        await until(lambda: not server.connections, "the client connection to be released")
        await until(lambda: not server.upstreams, "the upstream connection to be released")
        assert server.metrics.client_connections == 0
        writer.close()


async def test_a_websocket_session_closed_by_the_client_releases_both_connections():
    async def echo(ws):
        async for message in ws:
            await ws.send(message)

    async with websockets.serve(echo, "127.0.0.1", 0) as ws_server:
        ws_port = next(iter(ws_server.sockets)).getsockname()[1]
        routes = table([route("ws.test", [("ws", 1)])], [endpoint("ws", ws_port)])
        async with running_proxy(routes) as (server, port):
            async with websockets.connect("ws://ws.test/", host="127.0.0.1", port=port) as ws:
                await ws.send("hi")
                assert await asyncio.wait_for(ws.recv(), 5) == "hi"
            await until(lambda: not server.connections, "the client connection to be released")
            await until(lambda: not server.upstreams, "the upstream connection to be released")
            assert server.metrics.client_connections == 0
