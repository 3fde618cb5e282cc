"""Per-stream and per-byte costs of the tunnel's own code, in one process (not in `make bench`).

    .venv/bin/python -m bench.tunnel_stream_costs

Server, agent and dial client run in this process over real mTLS sockets (the
test harness of tests/integration/tunnel), under uvloop:
1. dial + 4-byte echo + close, on the dial client's own channels (no tracing
   interceptor) against channels from `waygate.core.grpcclient.open_channel`
   (with the interceptors), and the asyncio tasks 50 open streams hold;
2. CPU seconds per GiB through the tunnel (all three ends together) with the
   agent-stream chunk at 64 KiB and at 256 KiB.
"""

from __future__ import annotations

import asyncio
import resource
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import uvloop

from tests.integration.tunnel.harness import NODE, Tunnel, credentials, echo_server
from waygate.core import tracing
from waygate.core.grpcclient import open_channel
from waygate.tunnel import agent, client, mux, server


async def _cycles(dialer: Any, port: int, count: int) -> float:
    started = time.perf_counter()
    for _ in range(count):
        stream = await dialer.dial(NODE, port)
        await stream.write(b"ping")
        await stream.write_eof()
        assert await stream.read() == b"ping"
        assert await stream.read() == b""
        await stream.wait_closed()
    return (time.perf_counter() - started) / count


async def interceptor_cost(directory: Path) -> None:
    tracing.configure_tracing("bench", None)
    tunnel = Tunnel(directory)
    await tunnel.start_server()
    await tunnel.start_agent()
    echo, port = await echo_server()
    plain, intercepted = tunnel.client(), tunnel.client()

    def with_interceptors(address: str) -> Any:
        channel = intercepted._channels.get(address)
        if channel is None:
            channel = intercepted._channels[address] = open_channel(
                address,
                credentials=credentials(tunnel.dialer_files),
                server_name="tunnel-server",
                retry=False,
            )
        return channel

    intercepted.channel = with_interceptors  # type: ignore[method-assign]
    for dialer in (plain, intercepted):
        await _cycles(dialer, port, 200)
    best = {"without": 1e9, "with": 1e9}
    for _ in range(3):
        best["without"] = min(best["without"], await _cycles(plain, port, 1000))
        best["with"] = min(best["with"], await _cycles(intercepted, port, 1000))
    base = len(asyncio.all_tasks())
    opened = [await plain.dial(NODE, port) for _ in range(50)]
    middle = len(asyncio.all_tasks())
    opened += [await intercepted.dial(NODE, port) for _ in range(50)]
    end = len(asyncio.all_tasks())
    for stream in opened:
        stream.close()
    print(f"dial+echo+close, best of 3 x 1000: without interceptors {best['without'] * 1e3:.2f} ms, "
          f"with {best['with'] * 1e3:.2f} ms")  # fmt: skip
    print(f"tasks held by 50 open streams (server+agent+client): without {middle - base}, "
          f"with {end - middle}")  # fmt: skip
    echo.close()
    await tunnel.close()


async def chunk_cpu(directory: Path, chunk: int, total: int = 256 << 20) -> None:
    for module in (mux, server, agent, client):
        module.MAX_CHUNK = chunk  # type: ignore[attr-defined]
    tunnel = Tunnel(directory, window=max(1 << 20, 4 * chunk))
    await tunnel.start_server()
    await tunnel.start_agent()

    async def source(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        block = b"\0" * (1 << 20)
        for _ in range(total >> 20):
            writer.write(block)
            await writer.drain()
        writer.close()

    listener = await asyncio.start_server(source, "127.0.0.1", 0)
    port = listener.sockets[0].getsockname()[1]
    dialer = tunnel.client()
    best = 1e9
    for _ in range(2):
        before = resource.getrusage(resource.RUSAGE_SELF)
        stream = await dialer.dial(NODE, port)
        await stream.write_eof()
        size = 0
        while data := await stream.read():
            size += len(data)
        assert size == total, (size, total)
        after = resource.getrusage(resource.RUSAGE_SELF)
        cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
        best = min(best, cpu * (1 << 30) / total)
    print(f"chunk {chunk >> 10} KiB: {best:.2f} CPU s per GiB (server, agent and dialer together)")
    listener.close()
    await tunnel.close()


async def main() -> None:
    with tempfile.TemporaryDirectory() as directory:
        await interceptor_cost(Path(directory) / "a")
        for chunk in (64 * 1024, 256 * 1024):
            await chunk_cpu(Path(directory) / f"c{chunk}", chunk)


if __name__ == "__main__":
    sys.exit(uvloop.run(main()))
