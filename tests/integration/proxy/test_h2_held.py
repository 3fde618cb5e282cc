"""Response bytes the proxy holds for HTTP/2 clients that do not take them, bounded
per connection and for the whole process (issue 31, findings 2 and 10), while a
bystander's requests keep succeeding (tests.support.h2attack.Steady).

A real ProxyServer on port 0; the clients ask for large bodies with their
windows shut (INITIAL_WINDOW_SIZE 0) and never open them. Bounds are checked
by the proxy's own count (`http2.STATS.held_bytes`), sampled while it holds.
"""

from __future__ import annotations

import asyncio
from typing import Any

from tests.support.h2attack import RawH2, Steady
from tests.support.h2client import H2Client
from tests.support.h2harness import running_h2_proxy
from tests.support.poll import until
from tests.support.proxyharness import endpoint, route, table
from waygate.proxy import http2
from waygate.proxy.http2 import H2Limits
from waygate.proxy.routing import Defaults

AUTHORITY = b"echo.test"
ENHANCE_YOUR_CALM = 0xB
KIB = 1024


async def _held_max(seconds: float) -> int:
    held = 0
    for _ in range(int(seconds / 0.02)):
        held = max(held, http2.STATS.held_bytes)
        await asyncio.sleep(0.02)
    return held


def _h2_connection(server: Any) -> Any:
    return next((c for c in server.connections if isinstance(c, http2.H2ClientConnection)), None)


async def _shut_window_client(port: int, streams: int) -> RawH2:
    client = await RawH2.connect(port, settings={4: 0})  # INITIAL_WINDOW_SIZE 0
    for index in range(streams):
        client.send(client.headers(2 * index + 1, RawH2.request(AUTHORITY, b"/big?n=50000000")))
    return client


async def test_a_connection_holds_its_budget_not_a_stream_buffer_per_stream(upstream):
    limits = H2Limits(stream_buffer=256 * KIB, connection_buffer=512 * KIB)
    routes = table(
        [route("echo.test", [("echo", 100)])],
        [endpoint("echo", upstream.port)],
        server_timeout=3.0,
    )
    defaults = Defaults(server_timeout=3.0)
    async with running_h2_proxy(routes, limits=limits, defaults=defaults) as (_, port):
        client = await _shut_window_client(port, 20)
        try:
            async with Steady(port, AUTHORITY.decode()):
                await until(lambda: http2.STATS.held_bytes > 0, "the proxy to hold", timeout=10)
                held = await _held_max(1.0)
        finally:
            await client.close()
        await until(lambda: http2.STATS.held_bytes == 0, "the held bytes freed", timeout=10)
    # Twenty streams of 256 KiB each would be 5 MiB: the connection's budget
    # bounds them all, each stream's read in flight (64 KiB) aside.
    assert held <= limits.connection_buffer + 20 * 64 * KIB, held


async def test_the_process_holds_at_most_its_total_and_resets_past_it(upstream):
    limits = H2Limits(stream_buffer=256 * KIB, connection_buffer=1024 * KIB, held_total=768 * KIB)
    routes = table(
        [route("echo.test", [("echo", 100)])],
        [endpoint("echo", upstream.port)],
        server_timeout=5.0,
    )
    before = http2.STATS.held_refused
    async with running_h2_proxy(routes, limits=limits) as (_, port):
        clients = [await _shut_window_client(port, 4) for _ in range(3)]
        try:
            async with Steady(port, AUTHORITY.decode()):
                await until(lambda: http2.STATS.held_refused > before, "a stream reset", timeout=10)
                held = await _held_max(1.0)
        finally:
            for client in clients:
                await client.close()
        await until(lambda: http2.STATS.held_bytes == 0, "the held bytes freed", timeout=10)
    # Twelve streams of 256 KiB (3 MiB) asked for: the process holds at most its
    # total; the streams that would pass it were reset.
    assert held <= limits.held_total, held
    codes = [code for client in clients for code in client.resets.values()]
    assert ENHANCE_YOUR_CALM in codes, codes


async def test_a_client_that_stops_reading_pauses_every_source_then_gets_everything(upstream):
    # Finding 2 on a real server: the client's windows are open (2^31-1), its
    # socket is not read. The socket's backpressure pauses every stream's source,
    # whatever the windows say; once the client reads, every body arrives whole.
    limits = H2Limits(connection_buffer=512 * KIB)
    routes = table([route("echo.test", [("echo", 100)])], [endpoint("echo", upstream.port)])
    size = 2_000_000
    async with running_h2_proxy(routes, limits=limits) as (server, port):
        client = await H2Client.connect(port, settings={4: 2**31 - 1})
        try:
            client.h2.increment_flow_control_window(2**31 - 1 - 65535)  # the connection's too
            client.flush()
            client.writer.transport.pause_reading()
            ids = [client.start("GET", f"/big?n={size}", "echo.test") for _ in range(20)]
            await until(
                lambda: _h2_connection(server) is not None and _h2_connection(server).write_paused,
                "the client's socket to back up",
                timeout=10,
            )
            conn = _h2_connection(server)
            queued = 0
            for _ in range(50):
                queued = max(queued, conn.held + conn.transport.get_write_buffer_size())
                await asyncio.sleep(0.02)
            assert conn.sources_paused
            client.writer.transport.resume_reading()
            answers = await asyncio.gather(*(client.wait(i, timeout=30) for i in ids))
        finally:
            await client.close()
        await until(lambda: http2.STATS.held_bytes == 0, "the held bytes freed", timeout=10)
    assert [(a.status, len(a.body)) for a in answers] == [(200, size)] * 20
    # 40 MB asked for (before the fix: 36 MB queued on the socket): the
    # connection's budget, its socket's high water mark and a read in flight per
    # stream (what arrived before the pause took effect; 3.3 MB measured).
    assert queued <= limits.connection_buffer + http2.HIGH_WATER + 20 * 256 * KIB, queued
