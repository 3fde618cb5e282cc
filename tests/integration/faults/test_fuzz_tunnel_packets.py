"""Malformed `Packet` streams fed to the tunnel server and to the agent (issue 18 item 4).

Property-based, over real mTLS gRPC:
- the server: a fake agent (a real agent certificate for node edge-1) opens
  AgentTunnel.Connect and sends a hypothesis-built sequence of packets - every
  type, wrong payloads for the type, unknown and reused connect ids, dial
  responses nobody asked for, huge or zero window increments, data after
  close - while a real dialer dials edge-1 through it. The dial ends (success
  or a clear failure) within the bound, the server drops the fake agent's
  session when its stream ends, and a real agent for node edge-2 is served
  all along (a round trip after every example);
- the agent: a fake tunnel server accepts the real agent's stream and sends it
  such a sequence, then ends the stream. The agent never crashes: it
  reconnects for the next example and, at the end, holds no connection.
Example counts are bounded so `make test` stays fast (`WAYGATE_FUZZ_EXAMPLES`
raises them).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field

import grpc
import pytest
from google.protobuf import duration_pb2
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.integration.tunnel.harness import NODE, Tunnel, credentials, echo_server
from tests.support.poll import until
from waygate.core.backoff import Backoff
from waygate.core.grpcserver import GrpcServer, ServiceRegistration
from waygate.tunnel import mux
from waygate.tunnel.agent import Agent
from waygate.tunnel.agent_grpc import GrpcConnector
from waygate.tunnel.allow import AllowList
from waygate.tunnel.client import DialFailed, TunnelLost
from waygate.tunnel.v1 import tunnel_pb2 as pb
from waygate.tunnel.v1 import tunnel_pb2_grpc

EXAMPLES = int(os.environ.get("WAYGATE_FUZZ_EXAMPLES", "30"))
WITHIN = 15.0
OTHER_NODE = "edge-2"

# ------------------------------------------------------------ the grammar

ids = st.sampled_from([0, 1, 2, 3, 2**63, 2**64 - 1])
randoms = st.sampled_from([0, 1, -1, 2**62])
durations = st.builds(
    duration_pb2.Duration, seconds=st.sampled_from([0, 1, -5, 10**9]), nanos=st.just(0)
)
payloads = st.one_of(
    st.builds(
        lambda a, r, t, w: ("dial_request", pb.DialRequest(
            protocol="tcp", address=a, random=r, timeout=t, initial_window=w)),
        st.sampled_from(["127.0.0.1:1", "127.0.0.1:99999", "", "x" * 600, "[::1]:80", "a:b:c"]),
        randoms, durations, st.sampled_from([0, 1, 2**32 - 1]),
    ),
    st.builds(
        lambda r, c, e, w, why: ("dial_response", pb.DialResponse(
            random=r, connect_id=c, error=e, initial_window=w, reason=why)),
        randoms, ids, st.sampled_from(["", "no"]), st.sampled_from([0, 1, 2**32 - 1]),
        st.sampled_from([0, 1, 6, 99]),
    ),
    st.builds(
        lambda c, d, eof: ("data", pb.Data(connect_id=c, data=d, eof=eof)),
        ids, st.binary(max_size=2048) | st.just(b"z" * 70_000), st.booleans(),
    ),
    st.builds(lambda c: ("close_request", pb.CloseRequest(connect_id=c, reason="r")), ids),
    st.builds(lambda c: ("close_response", pb.CloseResponse(connect_id=c, error="e")), ids),
    st.builds(lambda g: ("drain", pb.Drain(reason="fuzz", grace=g)), durations),
    st.builds(
        lambda c, i: ("window_update", pb.WindowUpdate(connect_id=c, increment=i)),
        ids, st.sampled_from([0, 1, 2**31, 2**32 - 1]),
    ),
    st.builds(
        lambda s, r: ("server_info", pb.ServerInfo(server_id=s, replica_ids=r)),
        st.sampled_from(["", "replica-a", "x" * 300]), st.lists(st.sampled_from(["a", ""]), max_size=3),
    ),
    st.just(("none", None)),
)  # fmt: skip
types = st.sampled_from([*pb.PacketType.values(), 99])


@st.composite
def packet(draw: st.DrawFn) -> pb.Packet:
    kind, payload = draw(payloads)
    message = pb.Packet(type=draw(types))  # the type need not match the payload
    if payload is not None:
        getattr(message, kind).CopyFrom(payload)
    return message


packets = st.lists(packet(), max_size=12)


class Loop:
    """A loop of its own for every example (hypothesis drives sync tests)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()

    def run(self, coroutine):  # type: ignore[no-untyped-def]
        return self.loop.run_until_complete(asyncio.wait_for(coroutine, WITHIN * 3))


# ------------------------------------------------------------ the server


@dataclass
class ServerSide:
    loop: Loop
    tunnel: Tunnel
    channel: grpc.aio.Channel
    echo_port: int
    closers: list = field(default_factory=list)
    dials_seen: int = 0  # dial requests the fake agents received, over every example


@pytest.fixture(scope="module")
def server_side(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerSide]:
    loop = Loop()

    async def start() -> ServerSide:
        directory = tmp_path_factory.mktemp("fuzz-server")
        tunnel = Tunnel(directory)
        await tunnel.start_server()
        other = tunnel.ca.write_files(
            directory, dns=[OTHER_NODE], prefix="other-", client_only=True
        )
        agent = Agent(
            node=OTHER_NODE,
            server_address=f"127.0.0.1:{tunnel.agent_port}",
            connector=GrpcConnector(f"127.0.0.1:{tunnel.agent_port}", lambda: credentials(other)),
            # Everything on the stream (through the relay / the fuzzed stream); the
            # data connections of the new data path are not under test here.
            data_connections=False,
            allow=AllowList(tunnel.allow, own=()),
        )
        tunnel.agents.append(agent)
        tunnel._tasks.append(asyncio.ensure_future(agent.run()))
        await until(lambda: OTHER_NODE in tunnel.hub.sessions, "the real agent")
        echo, echo_port = await echo_server()
        channel = grpc.aio.secure_channel(
            f"127.0.0.1:{tunnel.agent_port}", credentials(tunnel.agent_files)
        )
        side = ServerSide(loop, tunnel, channel, echo_port)
        side.closers = [echo.close, channel.close, tunnel.close]
        return side

    side = loop.run(start())
    try:
        yield side
        assert NODE not in side.tunnel.hub.sessions, "the fake agent's session is gone"
        # Some fake agents lived long enough to be sent a dial (the garbage met a
        # dial in progress); a fuzzer whose agents all die first proves less.
        assert side.dials_seen > 0
        session = side.tunnel.hub.sessions[OTHER_NODE]
        loop.run(until(lambda: not session.open_connections(), "no connection left"))
    finally:

        async def stop() -> None:
            for close in side.closers:
                result = close()
                if asyncio.iscoroutine(result):
                    await result

        loop.loop.run_until_complete(stop())
        loop.loop.close()


async def fake_agent(side: ServerSide, sequence: list[pb.Packet]) -> None:
    """One fake agent stream: the sequence, racing a real dial to its node."""

    # Set once the real dial's DIAL_REQ reached this agent, or the dial ended without
    # (the agent was gone first). Not when the dial starts: a raw dial (Describe, then
    # a TLS connection to the data listener) takes longer than the rest of a sequence,
    # so the stream would end, and the session with it, before the dial got here.
    dialled = asyncio.Event()
    half = len(sequence) // 2

    async def requests() -> AsyncIterator[pb.Packet]:
        # Half the sequence, then the real dial reaches this agent, then the rest:
        # the garbage lands before, around and after a dial in progress.
        for index, message in enumerate(sequence):
            if index == half:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(WITHIN / 3):
                        await dialled.wait()
            yield message
            await asyncio.sleep(0)

    call = tunnel_pb2_grpc.AgentTunnelStub(side.channel).Connect(
        requests(), metadata=((mux.AGENT_ID_METADATA, "fuzz"),)
    )
    client = side.tunnel.client()

    async def dial() -> None:
        # Once the fake agent is registered (or its stream already ended).
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(2.0):
                while NODE not in side.tunnel.hub.sessions and not listening.done():
                    await asyncio.sleep(0.01)
        # A clear end either way: refused (DialFailed), or a connection that broke
        # (AioRpcError on a Tunnel.Dial stream, TunnelLost on a raw dial's).
        try:
            with contextlib.suppress(DialFailed, grpc.aio.AioRpcError, TunnelLost):
                stream = await client.dial(NODE, side.echo_port, timeout=0.5)
                await stream.write(b"hello")
                await stream.write_eof()
                while await stream.read():
                    pass
        finally:
            dialled.set()

    async def listen() -> None:
        with contextlib.suppress(grpc.aio.AioRpcError):
            async for message in call:
                if message.HasField("dial_request"):
                    side.dials_seen += 1
                    dialled.set()

    listening = asyncio.ensure_future(listen())
    dialing = asyncio.ensure_future(dial())
    try:
        async with asyncio.timeout(WITHIN):
            await dialing  # the dial ended, one way or the other: no hang
    finally:
        call.cancel()
        await asyncio.gather(listening, return_exceptions=True)
    await until(lambda: NODE not in side.tunnel.hub.sessions, "the fake session dropped")
    # Another agent's node is served all along.
    stream = await client.dial(OTHER_NODE, side.echo_port, timeout=WITHIN)
    await stream.write(b"still served")
    await stream.write_eof()
    received = b""
    while data := await stream.read():
        received += data
    assert received == b"still served"
    await client.close()
    side.tunnel.clients.remove(client)


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(sequence=packets)
@pytest.mark.timeout(300)
def test_the_server_survives_any_packet_stream_from_an_agent(
    server_side: ServerSide, sequence: list[pb.Packet]
) -> None:
    server_side.loop.run(fake_agent(server_side, sequence))


# ------------------------------------------------------------ the agent


class FakeServer(tunnel_pb2_grpc.AgentTunnelServicer):
    """Sends each connecting agent the next queued sequence, then ends the stream."""

    def __init__(self) -> None:
        self.sequences: asyncio.Queue[list[pb.Packet]] = asyncio.Queue()
        self.served = 0
        self.received = 0

    async def Connect(
        self, request_iterator: AsyncIterator[pb.Packet], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.Packet]:
        sequence = await self.sequences.get()

        async def drain() -> None:
            with contextlib.suppress(Exception):
                async for _ in request_iterator:
                    self.received += 1

        reading = asyncio.ensure_future(drain())
        try:
            for message in sequence:
                yield message
                await asyncio.sleep(0)
            await asyncio.sleep(0.05)  # let the agent act on the last one
        finally:
            reading.cancel()
            self.served += 1


@dataclass
class AgentSide:
    loop: Loop
    fake: FakeServer
    agent: Agent
    task: asyncio.Task[None]
    server: GrpcServer
    echo: asyncio.Server
    echo_port: int


@pytest.fixture(scope="module")
def agent_side(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AgentSide]:
    loop = Loop()

    async def start() -> AgentSide:
        tunnel = Tunnel(tmp_path_factory.mktemp("fuzz-agent"))  # for its certificates only
        fake = FakeServer()
        creds = grpc.ssl_server_credentials(
            [(tunnel.server_files.key.read_bytes(), tunnel.server_files.cert.read_bytes())],
            root_certificates=tunnel.ca.pem,
            require_client_auth=True,
        )
        server = GrpcServer(
            host="127.0.0.1",
            port=0,
            registrations=[
                ServiceRegistration(
                    "waygate.tunnel.v1.AgentTunnel",
                    tunnel_pb2_grpc.add_AgentTunnelServicer_to_server,
                    fake,
                )
            ],
            credentials=creds,
        )
        port = await server.start()
        echo, echo_port = await echo_server()
        agent = Agent(
            node=NODE,
            server_address=f"127.0.0.1:{port}",
            connector=GrpcConnector(f"127.0.0.1:{port}", lambda: credentials(tunnel.agent_files)),
            # Everything on the stream (through the relay / the fuzzed stream); the
            # data connections of the new data path are not under test here.
            data_connections=False,
            allow=AllowList(("127.0.0.0/8:*",), own=()),
            backoff=Backoff(initial=0.01, maximum=0.05),
            dial_timeout=2.0,
        )
        task = asyncio.ensure_future(agent.run())
        return AgentSide(loop, fake, agent, task, server, echo, echo_port)

    side = loop.run(start())
    try:
        yield side
        # Whatever it was sent, the agent is still running and holds nothing.
        assert not side.task.done(), side.task
        loop.run(until(lambda: side.agent.open_connections() == 0, "no connection left"))
    finally:

        async def stop() -> None:
            side.task.cancel()
            await asyncio.gather(side.task, return_exceptions=True)
            side.echo.close()
            await side.server.stop(0)

        loop.loop.run_until_complete(stop())
        loop.loop.close()


def with_echo(sequence: list[pb.Packet], port: int) -> list[pb.Packet]:
    """Dial requests aimed at the echo server, so some connections really open."""
    out = []
    for message in sequence:
        if message.HasField("dial_request") and message.dial_request.address == "127.0.0.1:1":
            message.dial_request.address = f"127.0.0.1:{port}"
        out.append(message)
    return out


async def feed_agent(side: AgentSide, sequence: list[pb.Packet]) -> None:
    served = side.fake.served
    await side.fake.sequences.put(with_echo(sequence, side.echo_port))
    await until(lambda: side.fake.served > served, "the agent took the stream", timeout=WITHIN)
    assert not side.task.done(), side.task


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(sequence=packets)
@pytest.mark.timeout(300)
def test_the_agent_survives_any_packet_stream_from_a_server(
    agent_side: AgentSide, sequence: list[pb.Packet]
) -> None:
    agent_side.loop.run(feed_agent(agent_side, sequence))
