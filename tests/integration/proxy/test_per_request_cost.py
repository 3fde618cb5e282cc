"""Work the proxy does once instead of per request or per tick: the auth-proxy
identity per connection and route, the HSTS line per route entry, no access-log
record built while that logger is off, and the timer sweep walking every
connection once a second (ticks in between look only at timers due soon)."""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from typing import Any

import pytest

from tests.integration.proxy.harness import (
    RecordingUpstream,
    endpoint,
    read_response,
    route,
    running_proxy,
    table,
)


@pytest.fixture
async def upstream():
    up = await RecordingUpstream().start()
    yield up
    await up.stop()


async def _tls_requests(port: int, context: ssl.SSLContext, host: str, count: int) -> list[bytes]:
    reader, writer = await asyncio.open_connection(
        "127.0.0.1", port, ssl=context, server_hostname=host
    )
    try:
        out = []
        for _ in range(count):
            writer.write(f"GET / HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
            out.append(await read_response(reader))
        return out
    finally:
        writer.close()
        with contextlib.suppress(Exception):
            await writer.wait_closed()


class CountingSet(set):  # type: ignore[type-arg]
    walks = 0

    def __iter__(self) -> Any:
        CountingSet.walks += 1
        return super().__iter__()


async def test_the_sweep_walks_every_connection_once_a_second_not_every_tick(
    upstream: RecordingUpstream,
) -> None:
    routes = table([route("echo.test", [("echo", 100)])], [endpoint("echo", upstream.port)])
    async with running_proxy(routes) as (server, port):
        server.connections = CountingSet(server.connections)
        clients = []
        for _ in range(20):  # idle keep-alive connections
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET / HTTP/1.1\r\nHost: echo.test\r\n\r\n")
            await read_response(reader)
            clients.append(writer)
        CountingSet.walks = 0
        await asyncio.sleep(2.05)
        walks = CountingSet.walks
        for writer in clients:
            writer.close()
    # Ten ticks a second: a walk per tick would be about 20 here.
    assert 1 <= walks <= 4, walks


async def test_a_short_timeout_armed_between_full_sweeps_still_fires_on_time(
    upstream: RecordingUpstream,
) -> None:
    from waygate.proxy.routing import Defaults

    routes = table([route("echo.test", [("echo", 100)])], [endpoint("echo", upstream.port)])
    async with running_proxy(routes, defaults=Defaults(http_request_timeout=0.3)) as (_, port):
        loop = asyncio.get_running_loop()
        for _ in range(3):
            await asyncio.sleep(0.37)  # somewhere between two full sweeps
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET / HTTP/1.1\r\n")  # a head that never completes
            started = loop.time()
            async with asyncio.timeout(5):
                response = await reader.read()
            assert response.startswith(b"HTTP/1.1 408 "), response[:80]
            # 0.3 s and at most a tick or two late (generous: a loaded machine).
            assert loop.time() - started < 1.0
            writer.close()
