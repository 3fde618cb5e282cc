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
        # The servers register a stream before the agent has read their SERVER_INFO.
        await until(
            lambda: set(agent.streams) == {"replica-a", "replica-b"}, "the agent to hold both"
        )
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


async def test_a_stream_the_agent_holds_is_kept_and_one_it_lost_is_replaced(
    tmp_path: Path,
) -> None:
    """An agent names the replicas it holds (`mux.HELD_METADATA`) when it opens a stream.
    Through a balancer that sent the attempt to one of them: ALREADY_EXISTS, and the
    held stream stays. Naming none: the replica's stream of it is one the agent lost
    before the replica noticed (a balancer restart), and the new stream replaces it at
    once rather than being refused until keepalives expire."""
    t = Tunnel(tmp_path)
    await t.start_server()
    agent = await t.start_agent()
    try:
        old = t.hub.sessions[NODE]
        channel = grpc.aio.secure_channel(f"127.0.0.1:{t.agent_port}", credentials(t.agent_files))
        async with channel:
            stub = tunnel_pb2_grpc.AgentTunnelStub(channel)
            call = stub.Connect(
                metadata=((mux.AGENT_ID_METADATA, agent.agent_id), (mux.HELD_METADATA, "replica-a"))
            )
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await call.read()
            assert refused.value.code() == grpc.StatusCode.ALREADY_EXISTS
            assert t.hub.sessions[NODE] is old and not old.closed

            call = stub.Connect(
                metadata=((mux.AGENT_ID_METADATA, agent.agent_id), (mux.HELD_METADATA, ""))
            )
            first = await asyncio.wait_for(call.read(), 10)
            assert first.type == pb.SERVER_INFO
            assert old.closed  # the stale stream ended, its connections with it
            new = t.hub.sessions[NODE]
            assert new is not old and new.agent_id == agent.agent_id
            assert [a.agent_id for a in t.hub.agents()] == [agent.agent_id]
            call.cancel()
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


class CountingListener:
    """A TCP port that accepts and counts connections and never answers: a blackholed replica."""

    def __init__(self) -> None:
        self.accepted = 0
        self.writers: list[asyncio.StreamWriter] = []

    async def start(self) -> int:
        async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            self.accepted += 1
            self.writers.append(writer)

        self.server = await asyncio.start_server(hold, "127.0.0.1", 0)
        return int(self.server.sockets[0].getsockname()[1])

    async def close(self) -> None:
        for writer in self.writers:
            writer.close()
        self.server.close()
        await self.server.wait_closed()


@pytest.fixture
def replicas_in_order(monkeypatch: pytest.MonkeyPatch) -> None:
    # The client shuffles replicas; these tests need to know which one comes first.
    monkeypatch.setattr("waygate.tunnel.client.random.shuffle", lambda servers: None)


@pytest.mark.usefixtures("replicas_in_order")
async def test_a_refusal_another_replica_would_repeat_is_not_retried(tmp_path: Path) -> None:
    tunnel = Tunnel(tmp_path)
    await tunnel.start_server()
    await tunnel.start_agent()
    other = CountingListener()
    other_port = await other.start()
    stranger = tunnel.ca.write_files(
        tmp_path, uris=["spiffe://waygate.test/ns/t/sa/stranger"], prefix="stranger-"
    )
    try:
        for files, reason in ((tunnel.dialer_files, pb.UNREACHABLE), (stranger, pb.NOT_ALLOWED)):
            client = TunnelClient(
                StaticPresence([f"127.0.0.1:{tunnel.dial_port}", f"127.0.0.1:{other_port}"]),
                credentials=lambda files=files: credentials(files),  # type: ignore[misc]
                server_name="tunnel-server",
            )
            tunnel.clients.append(client)
            closed = socket_port()
            with pytest.raises(DialFailed) as failed:
                await client.dial(NODE, closed, timeout=2.0)
            assert failed.value.reason == reason
            assert not failed.value.retryable
        assert other.accepted == 0  # the second replica was never tried
    finally:
        await tunnel.close()
        await other.close()


@pytest.mark.usefixtures("replicas_in_order")
async def test_a_blackholed_replica_is_passed_over_for_a_live_one(tmp_path: Path) -> None:
    tunnel = Tunnel(tmp_path)
    await tunnel.start_server()
    await tunnel.start_agent()
    blackhole = CountingListener()
    blackhole_port = await blackhole.start()
    server, port = await echo_server()
    try:
        async with server:
            client = TunnelClient(
                StaticPresence([f"127.0.0.1:{blackhole_port}", f"127.0.0.1:{tunnel.dial_port}"]),
                credentials=lambda: credentials(tunnel.dialer_files),
                server_name="tunnel-server",
            )
            tunnel.clients.append(client)
            stream = await asyncio.wait_for(client.dial(NODE, port, timeout=1.0), 20)
            assert stream.server_id == "replica-a"
            await stream.write(b"ping")
            await stream.write_eof()
            assert await asyncio.wait_for(stream.read(), 5) == b"ping"
            await stream.aclose()
        assert blackhole.accepted >= 1  # it was tried first
    finally:
        await tunnel.close()
        await blackhole.close()


def socket_port() -> int:
    """A port nothing listens on (bound, then released)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def test_the_agent_leaves_a_replica_that_left_the_set(tmp_path: Path) -> None:
    ca = LocalCA()
    a = Tunnel(tmp_path / "a", server_id="replica-a", replicas=("replica-b",), ca=ca)
    b = Tunnel(tmp_path / "b", server_id="replica-b", replicas=("replica-a",), ca=ca)
    await a.start_server()
    await b.start_server()
    balancer, port, _accepted = await round_robin([a.agent_port, b.agent_port])
    try:
        a.agent_port = port
        agent = await a.start_agent(wait=False)
        await until(
            lambda: NODE in a.hub.sessions and NODE in b.hub.sessions, "streams to both replicas"
        )
        await until(lambda: len(agent.streams) == 2, "the agent to hold both")
        a.hub.set_replicas(())  # replica-b is no longer part of the set
        await until(lambda: agent.replicas == {"replica-a"}, "the agent to learn the new set")
        await until(lambda: NODE not in b.hub.sessions, "the stream to replica-b to end")
        await until(lambda: set(agent.streams) == {"replica-a"}, "the agent to forget it")
        assert NODE in a.hub.sessions
    finally:
        balancer.close()
        await a.close()
        await b.close()
