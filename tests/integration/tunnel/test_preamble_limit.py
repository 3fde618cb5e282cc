"""The data port's preamble bound holds however a line arrives (issue 31, finding 10:
a 65 KB DIAL line that arrived in one read was processed, and its dial reached the
agent). A line longer than `wire.PREAMBLE_LIMIT` is refused (REFUSED INVALID, then the
connection closes) before anything is dialled; real replica, agent and mTLS."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tests.integration.tunnel.harness import NODE, Tunnel
from tests.integration.tunnel.test_early_data import link_pair  # noqa: F401  (the fixture)
from tests.integration.tunnel.test_parked_dials import packets_to_agent
from waygate.tunnel import wire
from waygate.tunnel.agent import AgentStream
from waygate.tunnel.relay import LineTooLong, Link, LinkClosed
from waygate.tunnel.v1 import tunnel_pb2 as pb

LONG_DIAL = b"DIAL " + NODE.encode() + b" " + b"h" * 65_000 + b" 80 1000 -\n"


async def test_a_long_line_that_arrives_in_one_read_is_refused(
    link_pair: tuple[Link, Link],  # noqa: F811
) -> None:
    client, served = link_pair
    client.write(LONG_DIAL)  # one write on loopback: one read of up to 256 KiB
    await asyncio.sleep(0.1)
    with pytest.raises(LineTooLong, match="at most 4096 bytes"):
        await served.read_line(5.0)


async def test_the_longest_line_allowed_still_reads(link_pair: tuple[Link, Link]) -> None:  # noqa: F811
    client, served = link_pair
    line = b"DIAL " + b"x" * (wire.PREAMBLE_LIMIT - 6)
    client.write(line + b"\n" + b"early")
    assert await served.read_line(5.0) == line
    assert await served.read_exact(5, 5.0) == b"early"


async def test_a_65_kb_dial_line_is_refused_and_dials_nothing(
    tunnel: Tunnel, monkeypatch: pytest.MonkeyPatch
) -> None:
    session = tunnel.hub.sessions[NODE]
    sent = packets_to_agent(session, monkeypatch)
    answered: list[bytes] = []
    answer_parked = AgentStream._answer_parked

    async def recording(self: Any, link: Link, line: bytes) -> None:
        answered.append(line[:40])
        await answer_parked(self, link, line)

    monkeypatch.setattr(AgentStream, "_answer_parked", recording)
    link = await tunnel.data_link()
    try:
        link.write(LONG_DIAL)  # one write: the replica's reads hold the line and its LF
        try:
            answer = await link.read_line(5.0)
        except LinkClosed:
            answer = b""  # (a reset for the bytes it never read may overtake the answer)
        assert answer in (wire.TOO_LONG_LINE[:-1], b""), answer
        with pytest.raises(LinkClosed):  # and the replica closed the connection
            await link.read_line(5.0)
    finally:
        link.abort()
    await asyncio.sleep(0.2)  # what a dial would have reached by now (the agent is local)
    assert answered == []
    assert pb.DIAL_REQ not in sent
    assert not session.data and not session.connections
