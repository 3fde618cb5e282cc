"""The two findings of issue 19 item 4.

Several agents for one node: dials go to an agent that can serve them, and move on
when one refuses for a reason another agent could answer, on every way in (the raw
dial endpoint, gRPC `Tunnel.Dial`, the HTTPS front).

Node identity: only a certificate issued for the agent role (clientAuth only, one
DNS name, no URI) registers as a node's agent; a serving certificate from the same
CA naming the node (the proxy's own, say) is refused with PERMISSION_DENIED.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from tests.integration.tunnel.harness import (
    NODE,
    Tunnel,
    credentials,
    echo_once,
    echo_server,
    http_backend,
)
from tests.integration.tunnel.test_front import front  # noqa: F401  (the fixture)
from tests.support.poll import until
from waygate.tunnel import mux
from waygate.tunnel.client import DialFailed
from waygate.tunnel.v1 import tunnel_pb2 as pb
from waygate.tunnel.v1 import tunnel_pb2_grpc

REQUESTS = 200


@pytest.fixture
async def two_agents(tmp_path: Path) -> AsyncIterator[Tunnel]:
    """A node with two agents: the first may dial 127.0.0.0/8; the second, the newest
    (the one every dial went to before: 200 of 200 refused), may dial nothing there."""
    tunnel = Tunnel(tmp_path)
    await tunnel.start_server()
    try:
        await tunnel.start_agent()
        await tunnel.start_agent(allow=("10.0.0.0/8:*",))
        await until(lambda: len(tunnel.hub.agents(NODE)) == 2, "both agents held")
        yield tunnel
    finally:
        await tunnel.close()


def refusing_agent_refused(tunnel: Tunnel, port: int) -> bool:
    """Whether the hub remembers the refusing agent refusing 127.0.0.1:`port`."""
    (session,) = (s for s in tunnel.hub.sessions_all() if s.agent_id == tunnel.agents[1].agent_id)
    return tunnel.hub.selection.refused_lately(session, f"127.0.0.1:{port}")


async def echo_through(
    tunnel: Tunnel, *, data_path: bool, port: int, requests: int = REQUESTS
) -> int:
    client = tunnel.client(data_path=data_path)
    succeeded = 0
    for index in range(requests):
        stream = await client.dial(NODE, port)
        payload = b"ping %d" % index
        await stream.write(payload)
        await stream.write_eof()
        received = b""
        while chunk := await stream.read():
            received += chunk
        succeeded += received == payload
    return succeeded


@pytest.mark.parametrize("data_path", [True, False], ids=["raw-dial", "grpc-dial"])
async def test_an_agent_whose_allow_list_refuses_does_not_fail_the_dials(
    two_agents: Tunnel, data_path: bool
) -> None:
    tunnel = two_agents
    server, port = await echo_server()
    async with server:
        assert await echo_through(tunnel, data_path=data_path, port=port) == REQUESTS
    # The refusing agent was asked (and refused) on the way: the fallback did the work.
    assert refusing_agent_refused(tunnel, port)
    # ListAgents (`waygate tunnel agents`) shows every agent of the node.
    assert {a.agent_id for a in tunnel.hub.agents(NODE)} == {a.agent_id for a in tunnel.agents}


async def test_list_agents_shows_every_agent_of_the_node(two_agents: Tunnel) -> None:
    """What `waygate tunnel agents` asks for, over gRPC with the dialer's certificate."""
    tunnel = two_agents
    async with grpc.aio.secure_channel(
        f"127.0.0.1:{tunnel.dial_port}",
        credentials(tunnel.dialer_files),
        options=[("grpc.ssl_target_name_override", "tunnel-server")],
    ) as channel:
        reply = await tunnel_pb2_grpc.TunnelStub(channel).ListAgents(
            pb.ListAgentsRequest(node=NODE), timeout=10
        )
    assert sorted(a.agent_id for a in reply.agents) == sorted(a.agent_id for a in tunnel.agents)
    assert {a.node for a in reply.agents} == {NODE}


async def test_the_front_moves_to_another_agent_too(front) -> None:  # noqa: F811
    tunnel, _front, front_port, client_context = front
    # The front fixture's agent may dial 127.0.0.0/8; the newer one refuses it.
    await tunnel.start_agent(allow=("10.0.0.0/8:*",))
    await until(lambda: len(tunnel.hub.agents(NODE)) == 2, "both agents held")
    backend, backend_port, _heads = await http_backend()
    statuses: list[bytes] = []
    async with backend:
        for _ in range(REQUESTS):
            reader, writer = await asyncio.open_connection(
                "127.0.0.1", front_port, ssl=client_context
            )
            writer.write(f"GET / HTTP/1.1\r\nHost: 127.0.0.1:{backend_port}\r\n\r\n".encode())
            response = await asyncio.wait_for(reader.read(), 10)
            statuses.append(response.split(b"\r\n", 1)[0])
            writer.close()
    assert statuses == [b"HTTP/1.1 200 OK"] * REQUESTS
    assert refusing_agent_refused(tunnel, backend_port)


async def test_an_agent_moving_off_the_replica_leaves_the_dials_to_the_others(
    two_agents: Tunnel,
) -> None:
    """The newest agent says DRAIN (it is moving off this replica): dials go to the
    other agent, and the replica still reports the node as present."""
    tunnel = two_agents
    (newest,) = (s for s in tunnel.hub.sessions_all() if s.agent_id == tunnel.agents[1].agent_id)
    # What the server does with an agent's DRAIN packet (its read loop).
    newest.draining = True
    tunnel.hub.changed()
    assert tunnel.hub.nodes() == [NODE]
    server, port = await echo_server()
    async with server:
        assert await echo_through(tunnel, data_path=True, port=port, requests=5) == 5
    assert not tunnel.hub.selection.refused_lately(newest, f"127.0.0.1:{port}")  # never asked


async def test_a_refusal_every_agent_gives_is_final(tmp_path: Path) -> None:
    tunnel = Tunnel(tmp_path, allow=("10.0.0.0/8:*",))
    await tunnel.start_server()
    try:
        await tunnel.start_agent()
        await tunnel.start_agent()
        await until(lambda: len(tunnel.hub.agents(NODE)) == 2, "both agents held")
        with pytest.raises(DialFailed) as refused:
            await tunnel.client().dial(NODE, 9)
        assert refused.value.reason == pb.NOT_ALLOWED
        assert not refused.value.retryable
    finally:
        await tunnel.close()


async def connect_as_agent(tunnel: Tunnel, files: object) -> grpc.aio.AioRpcError | None:
    """Open an agent's Connect stream with `files`; the error that ends it, or None when
    the server took the stream (it then sends its ServerInfo)."""
    channel = grpc.aio.secure_channel(
        f"127.0.0.1:{tunnel.agent_port}",
        credentials(files),  # type: ignore[arg-type]
        options=[("grpc.ssl_target_name_override", "tunnel-server")],
    )
    try:
        call = tunnel_pb2_grpc.AgentTunnelStub(channel).Connect(
            metadata=((mux.AGENT_ID_METADATA, "claimant"),)
        )
        try:
            first = await asyncio.wait_for(call.read(), 10)
        except grpc.aio.AioRpcError as refused:
            return refused
        assert first.type == pb.SERVER_INFO
        assert [a.agent_id for a in tunnel.hub.agents(NODE)] == ["claimant"]
        call.cancel()
        return None
    finally:
        await channel.close()


async def test_a_serving_certificate_naming_the_node_does_not_register(tmp_path: Path) -> None:
    tunnel = Tunnel(tmp_path)
    await tunnel.start_server()
    try:
        # The same CA, one DNS name (the node's), no URI: what the proxy's serving
        # certificate looks like. Only its extended key usage (serverAuth too) differs.
        serving = tunnel.ca.write_files(tmp_path / "serving", dns=[NODE])
        refused = await connect_as_agent(tunnel, serving)
        assert refused is not None
        assert refused.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "client authentication only" in (refused.details() or "")
        assert tunnel.hub.agents(NODE) == []
        # The agent-role certificate for the same node registers.
        assert await connect_as_agent(tunnel, tunnel.agent_files) is None
    finally:
        await tunnel.close()


async def test_an_agent_that_never_answers_a_dial_does_not_take_its_node_down(
    tmp_path: Path,
) -> None:
    """Issue 31 finding 10: the newest agent of a node holds its stream and answers no
    dial (0 of 600 dials got through in 30 s: each waited out the whole dial timeout on
    it). Now the silent agent costs a dial its share of the timeout, the dial moves to
    the other agent, and the silent one is put behind it: every dial succeeds, and the
    later ones never reach it."""
    tunnel = Tunnel(tmp_path)
    await tunnel.start_server()
    try:
        await tunnel.start_agent()
        silent = await tunnel.start_agent(park=False, data_connections=False)
        await until(lambda: len(tunnel.hub.agents(NODE)) == 2, "both agents held")
        asked: list[str] = []

        async def never_answer(request: pb.DialRequest) -> None:
            asked.append(request.address)
            await asyncio.Event().wait()  # holds the stream, answers nothing

        for stream in silent.streams.values():
            stream._dial = never_answer  # type: ignore[method-assign]
        (silent_session,) = (s for s in tunnel.hub.sessions_all() if s.agent_id == silent.agent_id)
        client = tunnel.client()
        server, port = await echo_server()

        async def echo(index: int) -> bool:
            # 5 s: the silent agent's share is (5 s - 1 s of answer slack) / 2, which
            # leaves the answering agent 3 s on a loaded machine.
            stream = await client.dial(NODE, port, timeout=5.0)
            try:
                payload = b"ping %d" % index
                return await echo_once(stream, payload) == payload
            finally:
                await stream.aclose()

        async with server:
            first = await asyncio.gather(*(echo(i) for i in range(20)))
            assert first == [True] * 20  # each moved on from the silent agent
            assert asked, "the silent agent was asked first (it is the newest)"
            assert tunnel.hub.selection.silent_lately(silent_session)
            before = len(asked)
            later = await asyncio.gather(*(echo(i) for i in range(20, 60)))
            assert later == [True] * 40
            assert len(asked) == before  # behind the other agent: not asked again
    finally:
        await tunnel.close()
