"""The tunnel against a sick network between agent and server (issue 18 item 3).

A `FaultRelay` sits between the agent and the tunnel server's agent port (real
mTLS and gRPC through it). Latency slows transfers but loses nothing; a reset
mid-transfer ends the dialers' streams with a clear error (UNAVAILABLE with a
reason on a Tunnel.Dial stream, TunnelLost on a raw dial's), the server drops
the agent, the agent comes back by itself and new dials succeed, and
every task and file descriptor is released; while the way to the server is a
black hole, dials fail at once with NO_AGENT rather than hang, and the agent
recovers once the way is clear.
"""

from __future__ import annotations

import asyncio
import gc
import os
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from tests.integration.tunnel.harness import NODE, Tunnel, credentials, echo_server
from tests.support.faultrelay import NONE, Fault, FaultRelay
from tests.support.poll import until
from waygate.core.backoff import Backoff
from waygate.tunnel.agent import Agent
from waygate.tunnel.agent_grpc import GrpcConnector
from waygate.tunnel.allow import AllowList
from waygate.tunnel.client import DialFailed, TunnelLost
from waygate.tunnel.v1 import tunnel_pb2 as pb

#: However the network misbehaves, a dialer hears within this (a wait bound).
WITHIN = 20.0


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


class Faulty:
    """A tunnel whose agent reaches the server through a fault relay."""

    def __init__(self, tunnel: Tunnel, relay: FaultRelay) -> None:
        self.tunnel = tunnel
        self.relay = relay
        self.agent: Agent | None = None
        self._task: asyncio.Task[None] | None = None

    async def start_agent(self) -> None:
        self.agent = Agent(
            node=NODE,
            server_address=self.relay.address,
            connector=GrpcConnector(
                self.relay.address, lambda: credentials(self.tunnel.agent_files)
            ),
            # Everything on the stream (through the relay / the fuzzed stream); the
            # data connections of the new data path are not under test here.
            data_connections=False,
            allow=AllowList(self.tunnel.allow, own=()),
            backoff=Backoff(initial=0.05, maximum=0.5),
        )
        self._task = asyncio.ensure_future(self.agent.run())
        await until(lambda: NODE in self.tunnel.hub.sessions, "the agent's stream", timeout=WITHIN)

    async def stop_agent(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)


@pytest.fixture
async def faulty(tmp_path: Path) -> AsyncIterator[Faulty]:
    tunnel = Tunnel(tmp_path)
    await tunnel.start_server()
    relay = await FaultRelay(tunnel.agent_port).start()
    setup = Faulty(tunnel, relay)
    try:
        await setup.start_agent()
        yield setup
    finally:
        await setup.stop_agent()
        await relay.close()
        await tunnel.close()


async def round_trip(client: object, port: int, payload: bytes) -> bytes:
    stream = await client.dial(NODE, port, timeout=WITHIN)  # type: ignore[attr-defined]
    await stream.write(payload)
    await stream.write_eof()
    received = bytearray()
    async with asyncio.timeout(WITHIN):
        while data := await stream.read():
            received += data
    await stream.wait_closed()
    return bytes(received)


async def test_latency_slows_a_transfer_but_loses_nothing(faulty: Faulty) -> None:
    server, port = await echo_server()
    async with server:
        client = faulty.tunnel.client()
        faulty.relay.fault = Fault(latency=0.02)
        faulty.relay.cut()  # the agent reconnects through the slow path
        await until(lambda: faulty.relay.accepted >= 2 and NODE in faulty.tunnel.hub.sessions)
        payload = os.urandom(1024 * 1024)
        assert await round_trip(client, port, payload) == payload


async def test_a_reset_mid_transfer_ends_streams_clearly_and_the_agent_comes_back(
    faulty: Faulty,
) -> None:
    server, port = await echo_server()
    async with server:
        client = faulty.tunnel.client()
        assert await round_trip(client, port, b"warm") == b"warm"
        await asyncio.sleep(0.1)
        gc.collect()
        fds, tasks = open_fds(), len(asyncio.all_tasks())
        streams = [await client.dial(NODE, port, timeout=WITHIN) for _ in range(3)]
        for stream in streams:
            await stream.write(b"x" * 200_000)
        await until(
            lambda: len(faulty.tunnel.hub.sessions[NODE].connections) == 3, "three connections"
        )
        faulty.relay.cut()  # RST both ways, mid-transfer
        for stream in streams:
            # The client dials on the data listener (a DataStream: TunnelLost) where
            # the replica has one, else on Tunnel.Dial (a TunnelStream: AioRpcError).
            with pytest.raises((grpc.aio.AioRpcError, TunnelLost)) as ended:
                async with asyncio.timeout(WITHIN):
                    while await stream.read():
                        pass
            if isinstance(ended.value, grpc.aio.AioRpcError):
                assert ended.value.code() == grpc.StatusCode.UNAVAILABLE
                assert ended.value.details()  # says why, never a bare status
            else:
                assert str(ended.value)  # says why, never a bare exception
            async with asyncio.timeout(WITHIN):  # and the stream ended as lost, not clean
                assert await stream.wait_closed() == grpc.StatusCode.UNAVAILABLE
        # The agent reconnects by itself through the relay; dials work again.
        await until(lambda: faulty.relay.accepted >= 2, "the agent reconnecting", timeout=WITHIN)
        await until(lambda: NODE in faulty.tunnel.hub.sessions, "the agent back", timeout=WITHIN)
        assert await round_trip(client, port, b"again") == b"again"
        await asyncio.sleep(0.1)

        def back() -> bool:
            gc.collect()
            session = faulty.tunnel.hub.sessions.get(NODE)
            return (
                session is not None
                and not session.connections
                and faulty.agent is not None
                and not faulty.agent.open_connections()
                and open_fds() <= fds + 2  # the agent's new connection through the relay
                and len(asyncio.all_tasks()) <= tasks
            )

        await until(back, f"fds {fds} and tasks {tasks} back", timeout=WITHIN)


async def test_a_black_hole_to_the_server_fails_dials_at_once_and_heals(faulty: Faulty) -> None:
    server, port = await echo_server()
    async with server:
        client = faulty.tunnel.client()
        faulty.relay.fault = Fault(blackhole=True)
        faulty.relay.cut()  # the agent's reconnects now go into the black hole
        await until(lambda: NODE not in faulty.tunnel.hub.sessions, "the server dropping it")
        with pytest.raises(DialFailed) as refused:
            async with asyncio.timeout(WITHIN):
                await client.dial(NODE, port, timeout=WITHIN)
        assert refused.value.reason == pb.NO_AGENT
        assert NODE in str(refused.value)
        await until(lambda: faulty.relay.accepted >= 3, "the agent still trying", timeout=WITHIN)
        faulty.relay.fault = NONE
        faulty.relay.cut()  # half-open attempts end; the next one gets through
        await until(
            lambda: NODE in faulty.tunnel.hub.sessions, "the agent back", timeout=WITHIN * 2
        )
        assert await round_trip(client, port, b"healed") == b"healed"
