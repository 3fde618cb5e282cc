"""bench.h2's gRPC client, run in its own process pinned beside the backend.

    python -m bench.h2.grpc_client TARGET AUTHORITY SECONDS

Prints "UNARY_PER_S STREAMED_PER_S": unary calls/s with 32 calls in flight on
one channel, then server-streamed messages/s (1,000 small messages per call,
4 calls in flight). AUTHORITY "-": the channel's own.
"""

from __future__ import annotations

import asyncio
import sys
import time

import grpc


async def rates(target: str, authority: str, seconds: float) -> tuple[float, float]:
    options = [("grpc.default_authority", authority)] if authority != "-" else []
    async with grpc.aio.insecure_channel(target, options=options) as channel:
        unary = channel.unary_unary("/bench.Echo/Unary")
        stream = channel.unary_stream("/bench.Echo/Stream")
        for _ in range(200):  # warm-up
            await unary(b"x", timeout=10)
        calls = 0
        deadline = time.monotonic() + seconds

        async def unary_loop() -> None:
            nonlocal calls
            while time.monotonic() < deadline:
                await unary(b"x" * 64, timeout=10)
                calls += 1

        started = time.monotonic()
        await asyncio.gather(*(unary_loop() for _ in range(32)))
        unary_rate = calls / (time.monotonic() - started)
        messages = 0
        deadline = time.monotonic() + seconds

        async def stream_loop() -> None:
            nonlocal messages
            while time.monotonic() < deadline:
                async for _ in stream(b"1000", timeout=30):
                    messages += 1

        started = time.monotonic()
        await asyncio.gather(*(stream_loop() for _ in range(4)))
        return unary_rate, messages / (time.monotonic() - started)


if __name__ == "__main__":
    unary_rate, stream_rate = asyncio.run(rates(sys.argv[1], sys.argv[2], float(sys.argv[3])))
    print(f"{unary_rate:.1f} {stream_rate:.1f}")
