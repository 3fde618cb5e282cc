"""The HTTP/2 path's Python work per request, without sockets, beside the minimal relay's.

    python -m bench.h2.hotpath [--requests N] [--body 64|16k] [--profile waygate|minimal|tuned]

The HTTP/2 counterpart of `bench.proxy.hotpath`: one h2c client connection
and one pooled HTTP/1.1 upstream connection, over in-memory transports that
only keep what is written. Each request is one HEADERS frame of a GET (as
h2load sends it, HPACK-encoded by an h2 client beforehand, one new stream
each) handed to the connection's `data_received`, then the upstream's
64-byte answer (as nginx sends it; `--body 16k`: its 16 KiB answer, the
benchmark's other body), then one event-loop turn (the proxy sends
what a turn queued once). Measured the same way for Waygate's
`H2ClientConnection` (every rule on) and for the minimal relay of
`bench.h2.minimal` (the issue's ceiling: same h2 library, same loop, no
rules), so the ratio of the two is the CPU-per-request ratio of the h2c
benchmark without its syscalls and client; and for that relay on the h2
connection Waygate builds (`minimal --tuned`: the library adjustments without
the rules), whose ratio is what the rules and the exchange cost alone.
`--profile` prints cProfile's view of one of them.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import pstats
import time
from typing import Any

import h2.config
import h2.connection
import h2.settings
import uvloop

from bench.h2 import minimal
from bench.proxy.hotpath import HOST, RESPONSE, MemoryTransport
from bench.proxy.hotpath import build as build_h1
from waygate.proxy.h2exchange import start_exchange
from waygate.proxy.http2 import H2ClientConnection, H2Limits

# The upstream's 16 KiB answer (bench.proxy's nginx file "16k"), head and body in one read.
RESPONSE_16K = (
    RESPONSE.split(b"\r\n\r\n")[0].replace(b"Content-Length: 64", b"Content-Length: 16384")
    + b"\r\n\r\n"
    + b"y" * 16383
    + b"\n"
)
RESPONSES = {"64": RESPONSE, "16k": RESPONSE_16K}


def client_bytes(requests: int) -> tuple[bytes, list[bytes]]:
    """The client's preface (with h2load's windows) and one HEADERS frame per request."""
    client = h2.connection.H2Connection(
        h2.config.H2Configuration(client_side=True, header_encoding=None)
    )
    client.local_settings = h2.settings.Settings(
        client=True, initial_values={h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: (1 << 30) - 1}
    )
    client.initiate_connection()
    client.increment_flow_control_window((1 << 31) - 1 - 65535)
    preface = client.data_to_send()
    frames = []
    headers = [
        (b":method", b"GET"),
        (b":scheme", b"http"),
        (b":authority", HOST.encode()),
        (b":path", b"/64"),
        (b"user-agent", b"h2load nghttp2/1.52.0"),
    ]
    for index in range(requests):
        stream_id = 1 + 2 * index
        client.send_headers(stream_id, headers, end_stream=True)
        frames.append(client.data_to_send())
        # The server's answer is never fed back: forget the stream (h2 would
        # otherwise count it as open against the server's concurrency limit).
        client.streams.pop(stream_id, None)
    return preface, frames


async def waygate() -> tuple[Any, Any, Any]:
    client, upstream = await build_h1()
    server = client.server
    conn = H2ClientConnection(server, H2Limits(), secure=False, start_exchange=start_exchange)
    conn.connection_made(MemoryTransport())
    return conn, upstream, conn.transport


async def relay(tuned: bool = False) -> tuple[Any, Any, Any]:
    state = minimal.Relay(8091)
    conn = minimal.Client(state, tuned)
    conn.connection_made(MemoryTransport())
    upstream = minimal.Upstream(state)
    upstream.connection_made(MemoryTransport())
    state.idle.append(upstream)
    return conn, upstream, conn.transport


class Setup:
    """One connection of `kind` ("waygate" or "minimal") and its requests, fed in batches."""

    def __init__(
        self, kind: str, conn: Any, upstream: Any, frames: list[bytes], response: bytes
    ) -> None:
        self.kind = kind
        self.response = response
        self.conn = conn
        self.upstream = upstream
        self.frames = iter(frames)

    async def batch(self, count: int) -> None:
        conn, upstream, frames, response = self.conn, self.upstream, self.frames, self.response
        for _ in range(count):
            conn.data_received(next(frames))
            upstream.data_received(response)
            await asyncio.sleep(0)


async def setup(kind: str, requests: int, body: str = "64") -> Setup:
    preface, frames = client_bytes(requests + 2000)
    conn, upstream, transport = await (waygate() if kind == "waygate" else relay(kind == "tuned"))
    conn.data_received(preface)
    ready = Setup(kind, conn, upstream, frames, RESPONSES[body])
    await ready.batch(2000)
    assert transport.written > 2000 * 64, transport.written
    return ready


KINDS = ("waygate", "minimal", "tuned")


async def compare(requests: int, repeats: int, body: str) -> dict[str, float]:
    """Every setup in one process, batches taking turns (order rotated): best µs of
    CPU per request of each."""
    setups = [await setup(kind, requests * repeats, body) for kind in KINDS]
    best = dict.fromkeys(KINDS, float("inf"))
    for turn in range(repeats):
        for index in range(len(setups)):
            ready = setups[(index + turn) % len(setups)]
            started = time.process_time()
            await ready.batch(requests)
            spent = (time.process_time() - started) / requests
            best[ready.kind] = min(best[ready.kind], spent)
    return {kind: spent * 1e6 for kind, spent in best.items()}


async def profile(kind: str, requests: int, body: str) -> None:
    ready = await setup(kind, requests, body)
    profiler = cProfile.Profile()
    profiler.enable()
    await ready.batch(requests)
    profiler.disable()
    stats = pstats.Stats(profiler)
    print(f"{stats.total_calls / requests:.1f} Python calls per request")  # type: ignore[attr-defined]
    stats.sort_stats("tottime").print_stats(30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2_000)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--body", choices=tuple(RESPONSES), default="64")
    parser.add_argument("--profile", choices=KINDS)
    args = parser.parse_args()
    if args.profile:
        uvloop.run(profile(args.profile, args.requests, args.body))
        return
    spent = uvloop.run(compare(args.requests, args.repeats, args.body))
    ours = spent["waygate"]
    print(
        f"µs of CPU per request ({args.body} B body, best of {args.repeats} x {args.requests}): "
        f"Waygate {ours:.1f}, minimal relay {spent['minimal']:.1f} (minimal / Waygate "
        f"{spent['minimal'] / ours:.2f}), minimal relay on Waygate's h2 set-up "
        f"{spent['tuned']:.1f} (tuned / Waygate {spent['tuned'] / ours:.2f})"
    )


if __name__ == "__main__":
    main()
