"""No leaks: file descriptors, tasks and memory return to their baseline after
many dial/close cycles, an agent dying mid-stream, and dialers cancelling
mid-transfer. Server, agent and dialer share this process, so the counts
cover all three (real sockets, real mTLS, real gRPC)."""

from __future__ import annotations

import asyncio
import gc
import os

import grpc
import pytest

from tests.integration.tunnel.harness import NODE, Tunnel, echo_server
from tests.support.poll import until
from waygate.tunnel.client import TunnelLost

CYCLES = int(os.environ.get("WAYGATE_TUNNEL_LEAK_CYCLES", "10000"))


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def tasks() -> int:
    return len(asyncio.all_tasks())


def rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


async def settled(baseline_fds: int, baseline_tasks: int, tunnel: Tunnel) -> None:
    def back() -> bool:
        gc.collect()
        return (
            open_fds() <= baseline_fds
            and tasks() <= baseline_tasks
            and not tunnel.hub.sessions[NODE].open_connections()
            and not tunnel.agents[0].open_connections()
        )

    await until(back, "fds, tasks and connections back to their baseline", timeout=15)


async def one_cycle(tunnel: Tunnel, port: int, client: object) -> None:
    stream = await client.dial(NODE, port)  # type: ignore[attr-defined]
    await stream.write(b"ping")
    await stream.write_eof()
    assert await stream.read() == b"ping"
    assert await stream.read() == b""
    await stream.wait_closed()


@pytest.mark.system  # slow: ten thousand dials
@pytest.mark.timeout(900)  # each cycle a new mTLS connection (pooled or not): ~3x the old time
async def test_ten_thousand_dial_close_cycles_leave_nothing_behind(tunnel: Tunnel) -> None:
    server, port = await echo_server()
    async with server:
        # The proxy's way: raw dials from a warm pool (its refills, expiries and
        # resumed sessions must leave nothing behind either).
        client = tunnel.client(pool_size=4)
        for _ in range(200):  # warm up: channels, caches, allocator arenas
            await one_cycle(tunnel, port, client)
        await asyncio.sleep(0.2)
        gc.collect()
        fds, running = open_fds(), tasks()
        # RSS is compared across the second half only: a leak grows with every cycle,
        # in both halves alike, while a one-time growth (allocator arenas, what other
        # tests in this pytest worker left behind) lands in the first.
        half = CYCLES // 2
        for _ in range(half):
            await one_cycle(tunnel, port, client)
        await settled(fds, running, tunnel)
        gc.collect()
        rss = rss_bytes()
        for _ in range(half):
            await one_cycle(tunnel, port, client)
        await settled(fds, running, tunnel)
        gc.collect()
        grown = rss_bytes() - rss
        # A leak of one small object graph per connection would be megabytes here
        # (2.4 KiB a cycle is the bound, as 24 MiB over all cycles was).
        assert grown < 12 * 1024 * 1024, f"RSS grew by {grown} bytes over {half} cycles"


async def test_agent_dying_mid_stream_releases_everything(tunnel: Tunnel) -> None:
    server, port = await echo_server()
    async with server:
        client = tunnel.client()
        await one_cycle(tunnel, port, client)
        await asyncio.sleep(0.1)
        fds, running = open_fds(), tasks()
        streams = [await client.dial(NODE, port) for _ in range(5)]
        for stream in streams:
            await stream.write(b"x" * 100_000)
        await until(lambda: tunnel.hub.sessions[NODE].open_connections() == 5, "five connections")
        old_agent = tunnel.agents[0]
        await tunnel.stop_agent(old_agent)
        for stream in streams:
            # On a data connection the agent's reset ends it (Tunnel.Dial: UNAVAILABLE).
            with pytest.raises(TunnelLost) as ended:
                async with asyncio.timeout(10):
                    while await stream.read():
                        pass
            assert "ended" in str(ended.value)
            assert await stream.wait_closed() == grpc.StatusCode.UNAVAILABLE
        await until(lambda: NODE not in tunnel.hub.sessions, "the server to drop the agent")
        assert not old_agent.streams and not old_agent.open_connections()
        await tunnel.start_agent()
        await one_cycle(tunnel, port, client)
        # The new agent holds one stream (a channel: its own fds and tasks).
        await settled(fds + 8, running + 3, tunnel)


async def test_dialers_cancelling_mid_transfer_release_everything(tunnel: Tunnel) -> None:
    sink_closed = asyncio.Event()
    received = 0

    async def endless(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal received
        try:
            writer.write(b"y" * 4 * 1024 * 1024)  # more than the windows hold
            while data := await reader.read(65536):
                received += len(data)
        except (ConnectionError, OSError):
            pass
        finally:
            writer.close()
            sink_closed.set()

    server = await asyncio.start_server(endless, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        client = tunnel.client()
        echo, echo_port = await echo_server()
        async with echo:
            await one_cycle(tunnel, echo_port, client)
        await asyncio.sleep(0.1)
        fds, running = open_fds(), tasks()
        for _ in range(20):
            sink_closed.clear()
            stream = await client.dial(NODE, port)
            await stream.write(b"z" * 300_000)
            assert await stream.read()  # the transfer is under way both ways
            stream.close()  # the dialer goes away mid-transfer
            await asyncio.wait_for(sink_closed.wait(), 10)  # the destination sees it
        await settled(fds, running, tunnel)
