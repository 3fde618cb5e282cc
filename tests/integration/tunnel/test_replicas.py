"""HA by construction: one address in front of two replicas, the agent holds both exactly;
a second stream from the same agent is refused; draining moves agents and refuses dials."""

from __future__ import annotations

import asyncio
import itertools
from pathlib import Path

import grpc
import pytest

from tests.integration.tunnel.harness import NODE, Tunnel, credentials, echo_server
from tests.support.pki import LocalCA
from tests.support.poll import until
from waygate.tunnel import mux
from waygate.tunnel.client import DialFailed, StaticPresence, TunnelClient
from waygate.tunnel.v1 import tunnel_pb2 as pb
from waygate.tunnel.v1 import tunnel_pb2_grpc


async def round_robin(ports: list[int]) -> tuple[asyncio.Server, int, list[int]]:
    """A TCP load balancer on one port sending each new connection to the next backend."""
    turn = itertools.cycle(range(len(ports)))
    accepted = [0] * len(ports)

    async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            writer.close()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        index = next(turn)
        accepted[index] += 1
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", ports[index])
        except OSError:
            writer.close()
            return
        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1], accepted


async def test_agent_holds_every_reported_replica_exactly_through_one_address(
    tmp_path: Path,
) -> None:
    ca = LocalCA()
    a = Tunnel(tmp_path / "a", server_id="replica-a", replicas=("replica-b",), ca=ca)
    b = Tunnel(tmp_path / "b", server_id="replica-b", replicas=("replica-a",), ca=ca)
    await a.start_server()
    await b.start_server()
    balancer, port, accepted = await round_robin([a.agent_port, b.agent_port])
    try:
        a.agent_port = port  # the agent knows only the balancer
        agent = await a.start_agent(wait=False)
        await until(
            lambda: NODE in a.hub.sessions and NODE in b.hub.sessions, "streams to both replicas"
        )
        assert set(agent.streams) == {"replica-a", "replica-b"}
        assert agent.replicas == {"replica-a", "replica-b"}
        await asyncio.sleep(1.0)  # no more attempts once both are held
        attempts = sum(accepted)
        await asyncio.sleep(1.0)
        assert sum(accepted) == attempts
        assert len(a.hub.agents()) == len(b.hub.agents()) == 1

        # Replica b dies: dials through a still work, and the caller does nothing.
        for server in b.servers:
            await server.stop(0)
        echo, echo_port = await echo_server()
        async with echo:
            client = TunnelClient(
                StaticPresence([f"127.0.0.1:{b.dial_port}", f"127.0.0.1:{a.dial_port}"]),
                credentials=lambda: credentials(a.dialer_files),
                server_name="tunnel-server",
            )
            try:
                for _ in range(4):
                    stream = await client.dial(NODE, echo_port)
                    assert stream.server_id == "replica-a"
                    await stream.write(b"hi")
                    await stream.write_eof()
                    assert await stream.read() == b"hi"
            finally:
                await client.close()
    finally:
        balancer.close()
        await a.close()
        await b.close()


async def test_a_second_stream_from_the_same_agent_is_refused(tmp_path: Path) -> None:
    t = Tunnel(tmp_path)
    await t.start_server()
    agent = await t.start_agent()
    try:
        channel = grpc.aio.secure_channel(f"127.0.0.1:{t.agent_port}", credentials(t.agent_files))
        async with channel:
            call = tunnel_pb2_grpc.AgentTunnelStub(channel).Connect(
                metadata=((mux.AGENT_ID_METADATA, agent.agent_id),)
            )
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await call.read()
            assert refused.value.code() == grpc.StatusCode.ALREADY_EXISTS
        assert t.hub.sessions[NODE].agent_id == agent.agent_id
        assert len(t.hub.agents()) == 1
    finally:
        await t.close()


async def test_drain_refuses_new_dials_and_keeps_open_connections(tmp_path: Path) -> None:
    t = Tunnel(tmp_path)
    await t.start_server()
    agent = await t.start_agent()
    try:
        echo, port = await echo_server()
        async with echo:
            client = t.client()
            stream = await client.dial(NODE, port)
            t.hub.drain(30.0)
            await until(lambda: all(s.draining for s in agent.streams.values()), "agent told")
            with pytest.raises(DialFailed) as refused:
                await client.dial(NODE, port)
            assert refused.value.reason == pb.DRAINING
            assert refused.value.retryable
            await stream.write(b"still here")
            await stream.write_eof()
            assert await stream.read() == b"still here"
            assert await stream.read() == b""
    finally:
        await t.close()
