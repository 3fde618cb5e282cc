"""The HTTP/2 attacks of recent years against the proxy, each while another client's
requests keep succeeding (tests.support.h2attack.Steady).

Bounds are checked by counters and limits, never by timing: how many frames
the proxy answered before its GOAWAY, how many requests reached the backend,
how many response bytes it holds for a shut window (`http2.STATS.held_bytes`).
"""

from __future__ import annotations

import asyncio

import hpack
import pytest
from hyperframe.frame import (
    ContinuationFrame,
    DataFrame,
    HeadersFrame,
    PingFrame,
    PriorityFrame,
    RstStreamFrame,
    SettingsFrame,
)

from tests.support.h2attack import (
    CONTINUATION,
    HEADERS,
    PING,
    RawH2,
    Steady,
    frame_bytes,
    raw_frame,
)
from tests.support.h2harness import running_h2_proxy
from tests.support.poll import until
from tests.support.proxyharness import RecordingUpstream, endpoint, route, table
from waygate.proxy import http2
from waygate.proxy.http2 import H2Limits
from waygate.proxy.routing import Defaults

ENHANCE_YOUR_CALM = 0xB
PROTOCOL_ERROR = 0x1
LIMITS = H2Limits(max_concurrent_streams=20, control_frames=200, premature_resets=50)
AUTHORITY = b"echo.test"


@pytest.fixture
async def upstream():
    server = await RecordingUpstream().start()
    yield server
    await server.stop()


@pytest.fixture
async def proxy(upstream):
    routes = table(
        [route("echo.test", [("echo", 100)])],
        [endpoint("echo", upstream.port)],
        server_timeout=2.0,
        client_timeout=2.0,
    )
    defaults = Defaults(server_timeout=2.0, client_timeout=2.0)
    async with running_h2_proxy(routes, limits=LIMITS, defaults=defaults) as (server, port):
        yield server, port


@pytest.fixture
async def attacker(proxy):
    _, port = proxy
    client = await RawH2.connect(port)
    yield client
    await client.close()


def steady(proxy) -> Steady:
    return Steady(proxy[1], AUTHORITY.decode())


def attacked(upstream: RecordingUpstream) -> int:
    return sum(1 for r in upstream.requests if r["target"] != "/steady")


async def test_rapid_reset(proxy, attacker, upstream):
    # CVE-2023-44487: streams opened and cancelled at once, without end.
    before = http2.STATS.goaway.get("rapid_reset", 0)
    async with steady(proxy):
        pairs = b"".join(
            attacker.headers(stream_id, RawH2.request(AUTHORITY, b"/reset"))
            + frame_bytes(RstStreamFrame(stream_id, error_code=8))
            for stream_id in range(1, 20001, 2)
        )
        attacker.send(pairs)
        await attacker.wait_closed()
    assert attacker.goaway == ENHANCE_YOUR_CALM
    assert http2.STATS.goaway["rapid_reset"] == before + 1
    # The connection was refused more work after about premature_resets streams,
    # not 10,000: the streams that started an exchange are bounded by the limit.
    assert attacker.goaway_last_stream is not None
    assert attacker.goaway_last_stream <= 2 * (2 * LIMITS.premature_resets + 2)
    assert attacked(upstream) <= 2 * LIMITS.premature_resets + 2


async def test_continuation_flood(proxy, attacker, upstream):
    # CVE-2024-27316 family: a header block that never ends, in big frames...
    before = http2.STATS.goaway.get("denial_of_service", 0)
    async with steady(proxy):
        start = HeadersFrame(1, data=attacker.block(RawH2.request(AUTHORITY)))
        attacker.send(frame_bytes(start))
        piece = frame_bytes(ContinuationFrame(1, data=b"\x00" * 16000))
        written = await attacker.flood(piece, 10_000, batch=20)
        await attacker.wait_closed()
    assert attacker.goaway is not None
    assert http2.STATS.goaway["denial_of_service"] == before + 1
    # ...cut off past the header-block bound: about 3 frames of 16 KB, not 10,000.
    assert written < 10_000
    assert attacked(upstream) == 0


async def test_continuation_flood_of_empty_frames(proxy, upstream):
    _, port = proxy
    attacker = await RawH2.connect(port)
    try:
        async with steady(proxy):
            attacker.send(
                frame_bytes(HeadersFrame(1, data=attacker.block(RawH2.request(AUTHORITY))))
            )
            written = await attacker.flood(raw_frame(CONTINUATION, 0, 1), 100_000, batch=500)
            await attacker.wait_closed()
        assert attacker.goaway is not None
        assert written < 100_000
        assert attacked(upstream) == 0
    finally:
        await attacker.close()


async def test_hpack_bomb(proxy, attacker, upstream):
    # One 4 KB field into the dynamic table, then 2,000 one-byte references to it:
    # a 6 KB block that decodes to 8 MB.
    encoder = hpack.Encoder()
    big = (b"x-bomb", b"a" * 4000)
    block = encoder.encode([*RawH2.request(AUTHORITY), big]) + encoder.encode([big] * 2000)
    assert len(block) < 16_000
    async with steady(proxy):
        frame = HeadersFrame(1, data=bytes(block))
        frame.flags.add("END_HEADERS")
        frame.flags.add("END_STREAM")
        attacker.send(frame_bytes(frame))
        await attacker.wait_closed()
    assert attacker.goaway is not None
    assert HEADERS not in attacker.frames  # never answered: never decoded past the bound
    assert attacked(upstream) == 0


@pytest.mark.parametrize(
    "name",
    ["settings", "ping", "priority", "empty_data", "window_update"],
)
async def test_control_frame_floods(proxy, attacker, upstream, name):
    before = http2.STATS.goaway.get("control_flood", 0)
    if name == "empty_data":
        attacker.send(
            attacker.headers(1, RawH2.request(AUTHORITY, b"/up", b"POST"), end_stream=False)
        )
    frames = {
        "settings": frame_bytes(SettingsFrame(0)),
        "ping": frame_bytes(PingFrame(0, opaque_data=b"12345678")),
        "priority": frame_bytes(PriorityFrame(3, depends_on=0, stream_weight=16)),
        "empty_data": frame_bytes(DataFrame(1, data=b"")),
        "window_update": raw_frame(8, 0, 0, (1).to_bytes(4, "big")),
    }
    async with steady(proxy):
        written = await attacker.flood(frames[name], 50_000, batch=500)
        await attacker.wait_closed()
    assert attacker.goaway == ENHANCE_YOUR_CALM
    assert http2.STATS.goaway["control_flood"] == before + 1
    assert written < 50_000
    # What the proxy answered (PING and SETTINGS acknowledgements) stays within the budget.
    assert attacker.frames.get(PING, 0) <= LIMITS.control_frames + 2
    assert attacked(upstream) <= 1


async def test_zero_window_forever(proxy, upstream):
    # A client that asks for a large answer and never opens its window (slow read):
    # the proxy holds at most stream_buffer for it and pauses the backend; the
    # exchange ends at the server timeout.
    _, port = proxy
    attacker = await RawH2.connect(port, settings={4: 0})  # INITIAL_WINDOW_SIZE 0
    try:
        async with steady(proxy):
            for stream_id in (1, 3, 5):
                attacker.send(
                    attacker.headers(stream_id, RawH2.request(AUTHORITY, b"/big?n=50000000"))
                )
            await until(lambda: http2.STATS.held_bytes > 0, "the proxy to hold answers", timeout=10)
            held_max = 0
            for _ in range(20):
                held_max = max(held_max, http2.STATS.held_bytes)
                await asyncio.sleep(0.05)
            # Three streams, each bounded by the stream buffer (+ one read in flight).
            assert held_max <= 3 * (LIMITS.stream_buffer + 256 * 1024)
            await until(
                lambda: len(attacker.resets) == 3, "the server timeout to end them", timeout=15
            )
        assert http2.STATS.held_bytes == 0
    finally:
        await attacker.close()


async def test_stream_id_exhaustion(proxy, attacker, upstream):
    # The highest stream id a client may use, answered; a lower one after it is a
    # connection error, and the client must open a new connection.
    top = 2**31 - 1
    async with steady(proxy):
        attacker.send(attacker.headers(top, RawH2.request(AUTHORITY, b"/top")))
        await until(lambda: top in attacker.headers_on, "the top stream's answer", timeout=10)
        attacker.send(attacker.headers(1, RawH2.request(AUTHORITY, b"/again")))
        await attacker.wait_closed()
    assert attacker.goaway == PROTOCOL_ERROR
    assert [r["target"] for r in upstream.requests if r["target"] != "/steady"] == ["/top"]


async def test_max_concurrent_streams_exceeded(proxy, attacker, upstream):
    async with steady(proxy):
        opened = LIMITS.max_concurrent_streams + 5
        attacker.send(
            *(
                attacker.headers(2 * i + 1, RawH2.request(AUTHORITY, b"/slow?s=1"))
                for i in range(opened)
            )
        )
        await until(
            lambda: attacker.closed.is_set() or attacker.resets,
            "the streams past the limit to be refused",
            timeout=10,
        )
    refused = attacker.goaway is not None or any(
        code in (PROTOCOL_ERROR, 0x7) for code in attacker.resets.values()
    )
    assert refused
    assert attacked(upstream) <= LIMITS.max_concurrent_streams


async def test_oversized_header_list(proxy, attacker, upstream):
    fields = [*RawH2.request(AUTHORITY), *((b"x-big-%d" % i, b"v" * 4000) for i in range(10))]
    async with steady(proxy):
        frames = []
        block = attacker.block(fields)
        first, rest = block[:16000], block[16000:]
        frames.append(raw_frame(HEADERS, 0x1, 1, first))  # END_STREAM, not END_HEADERS
        while rest:
            piece, rest = rest[:16000], rest[16000:]
            frames.append(raw_frame(CONTINUATION, 0x4 if not rest else 0, 1, piece))
        attacker.send(*frames)
        await attacker.wait_closed()
    assert attacker.goaway is not None
    assert attacked(upstream) == 0


@pytest.mark.parametrize(
    "fields",
    [
        [
            (b":method", b"GET"),
            (b":scheme", b"http"),
            (b":authority", AUTHORITY),
            (b":foo", b"x"),
            (b":path", b"/"),
        ],
        [
            (b":method", b"GET"),
            (b"x-a", b"1"),
            (b":scheme", b"http"),
            (b":authority", AUTHORITY),
            (b":path", b"/"),
        ],
        [
            (b":method", b"GET"),
            (b":method", b"POST"),
            (b":scheme", b"http"),
            (b":authority", AUTHORITY),
            (b":path", b"/"),
        ],
        [(b":method", b"GET"), (b":scheme", b"http"), (b":authority", AUTHORITY), (b":path", b"")],
        [
            (b":status", b"200"),
            (b":method", b"GET"),
            (b":scheme", b"http"),
            (b":authority", AUTHORITY),
            (b":path", b"/"),
        ],
    ],
    ids=["unknown", "after_regular", "duplicated", "empty_path", "response_pseudo"],
)
async def test_invalid_pseudo_headers(proxy, attacker, upstream, fields):
    async with steady(proxy):
        attacker.send(attacker.headers(1, fields))
        await until(
            lambda: attacker.closed.is_set() or 1 in attacker.resets,
            "the malformed request to be refused",
            timeout=10,
        )
    assert attacker.goaway == PROTOCOL_ERROR or attacker.resets.get(1) == PROTOCOL_ERROR
    assert attacked(upstream) == 0


async def test_body_larger_than_content_length(proxy, attacker, upstream):
    fields = [*RawH2.request(AUTHORITY, b"/post", b"POST"), (b"content-length", b"5")]
    smuggled = b"hello" + b"GET /admin HTTP/1.1\r\nHost: echo.test\r\n\r\n"
    async with steady(proxy):
        attacker.send(
            attacker.headers(1, fields, end_stream=False),
            frame_bytes(DataFrame(1, data=smuggled, flags=["END_STREAM"])),
        )
        await until(
            lambda: attacker.closed.is_set() or 1 in attacker.resets,
            "the oversized body to be refused",
            timeout=10,
        )
    assert attacker.goaway == PROTOCOL_ERROR or attacker.resets.get(1) == PROTOCOL_ERROR
    assert b"/admin" not in upstream.received
    assert all(r["target"] != "/admin" for r in upstream.requests)


async def test_attacks_leave_no_exchange_behind(proxy):
    # After the attack tests' connections close, nothing of theirs is held.
    server, _ = proxy
    await until(lambda: not server.connections, "connections to close", timeout=10)
    assert http2.STATS.held_bytes == 0
