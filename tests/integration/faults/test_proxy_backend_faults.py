"""The proxy against a sick network between it and a backend (issue 18 item 3).

A `FaultRelay` sits between the proxy and a real upstream and injects latency,
resets, half-open connections, a backend that stops reading and a backend that
trickles. Whatever the fault, the client gets an answer (or a clean close)
within the proxy's own timeouts, the failure is counted under a reason, and
afterwards the proxy holds no client or upstream connection, no task and no
file descriptor more than before. Server timeout 0.5 s, connect timeout 1 s.
"""

from __future__ import annotations

import asyncio
import gc
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest

from tests.support.faultrelay import Fault, FaultRelay
from tests.support.poll import until
from tests.support.proxyharness import (
    RecordingUpstream,
    endpoint,
    read_response,
    route,
    running_proxy,
    table,
)
from waygate.proxy.routing import Defaults
from waygate.proxy.server import ProxyServer
from waygate.resolver.model import RouteTimeouts

SERVER_TIMEOUT = 0.5
HOST = b"faulty.test"
#: However the backend misbehaves, the client hears within this (a wait bound).
ANSWER_WITHIN = 15.0


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@dataclass
class Setup:
    proxy: ProxyServer
    port: int
    relay: FaultRelay
    upstream: RecordingUpstream


@pytest.fixture
async def setup() -> AsyncIterator[Setup]:
    upstream = await RecordingUpstream().start()
    relay = await FaultRelay(upstream.port).start()
    routes = table(
        [route(HOST.decode(), [("faulty", 1)], timeouts=RouteTimeouts(server=SERVER_TIMEOUT))],
        [endpoint("faulty", relay.port)],
    )
    try:
        async with running_proxy(
            routes, defaults=Defaults(connect_timeout=1.0, server_timeout=SERVER_TIMEOUT)
        ) as (proxy, port):
            yield Setup(proxy, port, relay, upstream)
    finally:
        await relay.close()
        await upstream.stop()


@pytest.fixture
async def baseline(setup: Setup) -> AsyncIterator[tuple[int, int]]:
    """(fds, tasks) with the proxy, relay and upstream running and idle."""
    gc.collect()
    yield open_fds(), len(asyncio.all_tasks())


async def ask(port: int, data: bytes) -> bytes:
    """One request on a new connection; the response, or b"" if the proxy closed."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        await writer.drain()
        try:
            return await read_response(reader, timeout=ANSWER_WITHIN)
        except (asyncio.IncompleteReadError, ConnectionError):
            return b""
    finally:
        writer.close()


async def clean(setup: Setup, baseline: tuple[int, int]) -> None:
    """Nothing held: no connection either side, tasks and fds back to the baseline."""
    metrics = setup.proxy.metrics
    await until(
        lambda: metrics.client_connections == 0, "no client connection", timeout=ANSWER_WITHIN
    )
    # Pooled keep-alive upstream connections are the proxy's to keep; drop them.
    setup.relay.cut()
    await until(
        lambda: metrics.upstream_connections == 0 and setup.relay.open_connections == 0,
        "no upstream connection left",
    )

    def back() -> bool:
        gc.collect()
        return open_fds() <= baseline[0] and len(asyncio.all_tasks()) <= baseline[1]

    await until(back, f"fds and tasks back to {baseline}", timeout=ANSWER_WITHIN)


GET = b"GET /x HTTP/1.1\r\nHost: " + HOST + b"\r\n\r\n"


async def test_latency_slows_but_never_fails(setup: Setup, baseline: tuple[int, int]) -> None:
    setup.relay.fault = Fault(latency=0.1)  # well inside the server timeout
    for _ in range(3):
        response = await ask(setup.port, GET)
        assert response.startswith(b"HTTP/1.1 200 "), response
    await clean(setup, baseline)


async def test_a_reset_mid_response_is_a_502_and_leaves_nothing(
    setup: Setup, baseline: tuple[int, int]
) -> None:
    setup.relay.fault = Fault(reset_after=20)  # inside the response head
    response = await ask(setup.port, GET)
    assert response.startswith(b"HTTP/1.1 502 "), response
    assert b"\r\nX-Waygate-Error: " in response  # the reason, said to the client
    await clean(setup, baseline)


async def test_a_half_open_backend_is_a_504_after_the_server_timeout(
    setup: Setup, baseline: tuple[int, int]
) -> None:
    setup.relay.fault = Fault(blackhole=True)  # connects, then silence forever
    response = await ask(setup.port, GET)
    assert response.startswith(b"HTTP/1.1 504 "), response
    assert b"X-Waygate-Error: upstream did not answer within 0.5s" in response
    assert setup.proxy.metrics.refused.get("server_timeout") == 1
    assert setup.upstream.requests == []
    await clean(setup, baseline)


async def test_a_backend_that_stops_reading_an_upload_does_not_hold_the_client(
    setup: Setup, baseline: tuple[int, int]
) -> None:
    setup.relay.fault = Fault(stop_reading=True, stop_reading_after=100_000)
    size = 32 * 1024 * 1024  # far more than every buffer on the way
    reader, writer = await asyncio.open_connection("127.0.0.1", setup.port)
    writer.write(b"POST /up HTTP/1.1\r\nHost: " + HOST + b"\r\nContent-Length: %d\r\n\r\n" % size)

    async def upload() -> None:
        block = b"u" * 65536
        for _ in range(size // len(block)):
            writer.write(block)
            await writer.drain()

    sending = asyncio.ensure_future(upload())
    try:
        try:
            response = await read_response(reader, timeout=ANSWER_WITHIN)
        except (asyncio.IncompleteReadError, ConnectionError):
            response = b""  # closed without an answer: also not a hang
        assert response == b"" or response.startswith((b"HTTP/1.1 504 ", b"HTTP/1.1 502 ")), (
            response
        )
        assert sum(setup.proxy.metrics.refused.values()) == 1  # counted under its reason
    finally:
        sending.cancel()
        await asyncio.gather(sending, return_exceptions=True)
        writer.close()
    await clean(setup, baseline)


async def test_a_trickled_response_head_is_a_504_not_a_wait(
    setup: Setup, baseline: tuple[int, int]
) -> None:
    setup.relay.fault = Fault(trickle=0.05)  # 20 bytes/s: the head takes seconds
    response = await ask(setup.port, GET)
    assert response.startswith(b"HTTP/1.1 504 "), response
    assert setup.proxy.metrics.refused.get("server_timeout") == 1
    await clean(setup, baseline)


async def test_a_pooled_connection_reset_while_idle_is_not_the_next_requests_failure(
    setup: Setup, baseline: tuple[int, int]
) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", setup.port)
    try:
        writer.write(GET)
        assert (await read_response(reader)).startswith(b"HTTP/1.1 200 ")
        await until(lambda: setup.proxy.metrics.upstream_connections == 1, "one pooled upstream")
        setup.relay.cut()  # the idle upstream connection dies under the pool
        await asyncio.sleep(0.1)
        writer.write(GET)
        response = await read_response(reader, timeout=ANSWER_WITHIN)
        assert response.startswith(b"HTTP/1.1 200 "), response
    finally:
        writer.close()
    await clean(setup, baseline)
