"""Dials handed straight to the agent's parked data connections (issue 19, dial latency).

Real server replica, agent and dial client in one process, mTLS on every hop. The
agent parks its pooled data connections on the replica ("PARK <key>"); the replica
writes a dial on one ("DIAL <address> <timeout-ms> <traceparent>") and the agent
answers on it ("OK <id>" or "REFUSED <REASON> <message>"), with no packet on the
Connect stream. What is checked here is observed on the replica's objects: which
packets went to the agent, which connections are parked.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.integration.tunnel.harness import NODE, Tunnel, echo_once, echo_server
from tests.support.poll import until
from waygate.tunnel import wire
from waygate.tunnel.client import DataStream, DialFailed
from waygate.tunnel.relay import LinkClosed
from waygate.tunnel.server import AgentSession
from waygate.tunnel.v1 import tunnel_pb2 as pb


def packets_to_agent(session: AgentSession, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The type of every packet the replica queues for this agent from now on."""
    sent: list[int] = []
    original = session.send

    def recording(packet: pb.Packet) -> None:
        sent.append(packet.type)
        original(packet)

    monkeypatch.setattr(session, "send", recording)
    return sent


async def test_a_dial_takes_a_parked_connection_with_no_packet_on_the_stream(
    tunnel: Tunnel, monkeypatch: pytest.MonkeyPatch
) -> None:
    session = tunnel.hub.sessions[NODE]
    pool_size = tunnel.agents[0].pool_size
    assert len(session.parked) == pool_size  # the whole pool is parked on the replica
    sent = packets_to_agent(session, monkeypatch)
    listener = tunnel.data
    assert listener is not None
    echo, port = await echo_server()
    async with echo:
        for client in (tunnel.client(), tunnel.client(data_path=False)):  # raw, gRPC Dial
            stream = await client.dial(NODE, port)
            assert await echo_once(stream, b"parked") == b"parked"
            assert len(session.data) == 1  # carried on a data connection of its own
            # While it is open, the connection it took no longer counts as idle (the
            # listener bounds those per identity): only the parked ones do.
            await until(
                lambda: sum(listener._idle.values()) == len(session.parked),
                "the taken connection to leave the idle count",
            )
            await stream.aclose()
            await until(lambda: not session.data, "the connection to end")
        await until(lambda: len(session.parked) == pool_size, "the pool to park new ones")
    assert pb.DIAL_REQ not in sent
    assert pb.WINDOW_UPDATE not in sent and pb.DATA not in sent


async def test_a_parked_dial_keeps_the_refusal_reasons(tunnel: Tunnel) -> None:
    client = tunnel.client()
    with pytest.raises(DialFailed) as refused:
        await client.dial(NODE, 9, host="192.0.2.1")  # outside the agent's allow-list
    assert refused.value.reason == pb.NOT_ALLOWED
    assert "allow-list" in str(refused.value)
    with pytest.raises(DialFailed) as refused:
        await client.dial(NODE, 1)  # nothing listens on port 1
    assert refused.value.reason == pb.UNREACHABLE
    assert not tunnel.hub.sessions[NODE].data


async def test_an_agent_that_parks_nothing_dials_through_its_stream(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An agent from before parking (or a replica without a park key): DIAL_REQ with a
    token, the agent's answer on a data connection of its own, as before."""
    tunnel = Tunnel(tmp_path)
    await tunnel.start_server()
    try:
        await tunnel.start_agent(park=False)
        session = tunnel.hub.sessions[NODE]
        assert not session.parked
        sent = packets_to_agent(session, monkeypatch)
        echo, port = await echo_server()
        async with echo:
            stream = await tunnel.client().dial(NODE, port)
            assert isinstance(stream, DataStream)
            assert await echo_once(stream, b"token path") == b"token path"
            await stream.aclose()
        assert sent.count(pb.DIAL_REQ) == 1
    finally:
        await tunnel.close()


async def test_parked_connections_that_go_as_the_dial_arrives_cost_only_a_retry(
    tunnel: Tunnel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The agent closes a parked connection when its idle time is up; a dial the replica
    wrote on it just then is never answered. The replica tries the next parked one:
    the dial still succeeds, with no packet on the stream."""
    session = tunnel.hub.sessions[NODE]
    first, second = session.parked[0][0], session.parked[1][0]
    write_line = type(first).write_line

    def dial_then_the_link_goes(link: Any, line: bytes) -> None:
        write_line(link, line)
        if line.startswith(b"DIAL ") and link in (first, second):
            link.abort()  # the agent's close crossed the dial on the wire

    monkeypatch.setattr(type(first), "write_line", dial_then_the_link_goes)
    sent = packets_to_agent(session, monkeypatch)
    echo, port = await echo_server()
    async with echo:
        stream = await tunnel.client().dial(NODE, port)
        assert await echo_once(stream, b"third time") == b"third time"
        await stream.aclose()
    assert first.is_closing() and second.is_closing()
    assert pb.DIAL_REQ not in sent


async def test_a_park_key_works_only_for_the_node_it_was_issued_to(tunnel: Tunnel) -> None:
    """Another node's agent certificate presenting this node's park key is refused: the
    connection is closed, never parked."""
    session = tunnel.hub.sessions[NODE]
    parked = len(session.parked)
    other = tunnel.ca.write_files(
        tunnel.directory, dns=["edge-2"], prefix="other-", client_only=True
    )
    link = await tunnel.data_link(other)
    try:
        link.write_line(wire.park(session.park_key))
        with pytest.raises(LinkClosed):
            await link.read_line(5.0)
        assert len(session.parked) == parked
    finally:
        link.abort()
