"""Small DATA frames (issue 31, finding 3) are fair, not fatal: a connection sending
them faster than its bucket (`--h2-small-data-rate`, `--h2-small-data-burst`) is
read more slowly, never ended; a legitimate gRPC client stream of small messages
(real grpcio client and backend) gets every message through.

Bounds are checked by counters (`http2.STATS`), never by timing.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest
from hyperframe.frame import DataFrame

from tests.support.h2attack import RawH2, Steady, frame_bytes
from tests.support.h2harness import GrpcBackend, running_h2_proxy, serve_h2_upstreams
from tests.support.poll import until
from tests.support.proxyharness import RecordingUpstream, endpoint, route, table
from waygate.proxy import http2
from waygate.proxy.http2 import H2Limits

AUTHORITY = b"echo.test"
# A read of the proxy's holds at most this many 1-byte DATA frames (10 bytes
# each): what one pause may be past the bucket (the read is processed whole).
READ_FRAMES = 256 * 1024 // 10 + 1


@pytest.fixture
async def backend():
    server = await GrpcBackend().start()
    yield server
    await server.stop()


def _channel(port: int) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(
        f"127.0.0.1:{port}", options=[("grpc.default_authority", "grpc.test")]
    )


async def _client_stream(backend: GrpcBackend, limits: H2Limits, messages, gap: float = 0.0):
    """A grpcio client stream of `messages` through a proxy with `limits`: the reply
    (the backend joins what it got) and what the proxy counted meanwhile."""
    routes = [route("grpc.test", [("echo", 100)], upstream_protocol="grpc")]
    pauses = http2.STATS.small_data_pauses
    floods = http2.STATS.goaway.get("control_flood", 0)

    async def requests():
        for message in messages:
            if gap:
                await asyncio.sleep(gap)
            yield message

    async with running_h2_proxy(table(routes, [endpoint("echo", backend.port)]), limits=limits) as (
        server,
        port,
    ):
        serve_h2_upstreams(server, routes)
        async with _channel(port) as ch:
            reply = await ch.stream_unary("/test.Echo/ClientStream")(requests(), timeout=60)
    return (
        reply,
        http2.STATS.small_data_pauses - pauses,
        http2.STATS.goaway.get("control_flood", 0) - floods,
    )


async def test_grpc_client_stream_of_2000_small_messages_goes_through_unslowed(backend):
    # The regression the GOAWAY rule made: 2,000 five-byte messages, one small
    # DATA frame each. At the defaults they fit the bucket: not even paused.
    messages = [b"%05d" % i for i in range(2000)]
    reply, paused, refused = await _client_stream(backend, H2Limits(), messages)
    assert reply == b"".join(messages)
    assert (paused, refused) == (0, 0)


async def test_grpc_client_stream_of_400_messages_1ms_apart_goes_through(backend):
    messages = [b"%05d" % i for i in range(400)]
    reply, paused, refused = await _client_stream(backend, H2Limits(), messages, gap=0.001)
    assert reply == b"".join(messages)
    assert (paused, refused) == (0, 0)


async def test_grpc_client_stream_past_its_bucket_is_slowed_not_ended(backend):
    # A bucket far smaller than the stream: its reads are paused, and every
    # message still arrives, in order.
    limits = H2Limits(small_data_rate=2000, small_data_burst=50)
    messages = [b"%05d" % i for i in range(2000)]
    reply, paused, refused = await _client_stream(backend, limits, messages)
    assert reply == b"".join(messages)
    assert paused >= 1
    assert refused == 0


@pytest.fixture
async def upstream():
    server = await RecordingUpstream().start()
    yield server
    await server.stop()


LIMITS = H2Limits(small_data_rate=2000, small_data_burst=500)
FLOOD_SECONDS = 3.0


@pytest.fixture
async def proxy(upstream):
    routes = table([route("echo.test", [("echo", 100)])], [endpoint("echo", upstream.port)])
    async with running_h2_proxy(routes, limits=LIMITS) as (server, port):
        yield server, port


def _flooding(server) -> http2.H2ClientConnection | None:
    for conn in server.connections:
        if isinstance(conn, http2.H2ClientConnection) and conn.small_data_wait is not None:
            return conn
    return None


async def test_one_byte_flood_is_slowed_to_its_rate_while_a_bystander_is_served(proxy, upstream):
    server, port = proxy
    loop = asyncio.get_running_loop()
    attacker = await RawH2.connect(port)
    attacker.send(
        attacker.headers(1, RawH2.request(AUTHORITY, b"/sink", b"POST"), end_stream=False)
    )
    tiny = frame_bytes(DataFrame(1, data=b"x")) * 2000
    taken = http2.STATS.small_data
    pauses = http2.STATS.small_data_pauses
    seen: list[http2.H2ClientConnection] = []
    async with Steady(port, AUTHORITY.decode()):
        # As fast as the proxy takes them (never more than 64 KiB queued here).
        start = loop.time()
        while loop.time() - start < FLOOD_SECONDS and not attacker.closed.is_set():
            if attacker.writer.transport.get_write_buffer_size() < 64 * 1024:
                attacker.send(tiny)
            await asyncio.wait([loop.create_task(attacker.writer.drain())], timeout=0.02)
            if not seen and (flooding := _flooding(server)) is not None:
                seen.append(flooding)
        elapsed = loop.time() - start
        taken = http2.STATS.small_data - taken
    # Slowed, not ended: no GOAWAY, paused again and again, and what the proxy
    # took is the bucket's (its burst, its rate, and one read past it at most).
    assert attacker.goaway is None
    assert taken <= LIMITS.small_data_burst + LIMITS.small_data_rate * elapsed + READ_FRAMES, (
        taken,
        elapsed,
    )
    assert http2.STATS.small_data_pauses - pauses >= 2
    # The pause's timer resumes reading (no hang), and a connection closed while
    # paused takes its timer with it (no handle left behind).
    assert seen, "the flooding connection was never seen paused"
    conn = seen[0]
    attacker.send(tiny * 5)  # 10,000 frames: past any bucket of these limits
    await until(lambda: conn.small_data_wait is not None, "a pause", timeout=30)
    paused_at = http2.STATS.small_data
    await until(lambda: http2.STATS.small_data > paused_at, "reading to resume", timeout=30)
    attacker.send(tiny * 5)
    await until(lambda: conn.small_data_wait is not None, "a pause", timeout=30)
    handle = conn.small_data_wait
    # Ended by the proxy while paused (as ProxyServer.drain does once its grace is
    # over): a paused socket is not read, so the client's own close would be seen
    # only once the pause ends.
    conn.abort()
    await until(lambda: conn not in server.connections, "the connection to go", timeout=10)
    assert conn.small_data_wait is None
    assert handle is not None and handle.cancelled()
    await attacker.close()


async def test_empty_data_frames_still_end_the_connection(proxy):
    # Empty DATA frames carry nothing at all: past the control-frame budget, GOAWAY.
    _, port = proxy
    attacker = await RawH2.connect(port)
    try:
        attacker.send(
            attacker.headers(1, RawH2.request(AUTHORITY, b"/sink", b"POST"), end_stream=False)
        )
        await attacker.flood(frame_bytes(DataFrame(1, data=b"")), 50_000, batch=500)
        await attacker.wait_closed()
        assert attacker.goaway == 0xB  # ENHANCE_YOUR_CALM
    finally:
        await attacker.close()
