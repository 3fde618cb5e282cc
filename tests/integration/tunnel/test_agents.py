"""Several agents for one node (issue 19 item 4): dials go to an agent that can serve
them, and move on when one refuses for a reason another agent could answer."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.tunnel.harness import NODE, Tunnel, echo_server
from tests.support.poll import until
from waygate.tunnel.client import DialFailed
from waygate.tunnel.v1 import tunnel_pb2 as pb


async def test_an_agent_whose_allow_list_refuses_does_not_fail_the_dials(tmp_path: Path) -> None:
    tunnel = Tunnel(tmp_path)
    await tunnel.start_server()
    try:
        server, port = await echo_server()
        async with server:
            await tunnel.start_agent()  # may dial 127.0.0.0/8
            # A second agent for the same node that may dial nothing there; being the
            # newest, it was the one every dial went to (200 of 200 refused).
            await tunnel.start_agent(allow=("10.0.0.0/8:*",))
            await until(lambda: len(tunnel.hub.agents(NODE)) == 2, "both agents held")
            client = tunnel.client()
            for _ in range(20):
                stream = await client.dial(NODE, port)
                await stream.write(b"ping")
                await stream.write_eof()
                assert await stream.read() == b"ping"
                assert await stream.read() == b""
            # ListAgents (`waygate tunnel agents`) shows every agent of the node.
            assert {a.agent_id for a in tunnel.hub.agents(NODE)} == {
                a.agent_id for a in tunnel.agents
            }
    finally:
        await tunnel.close()


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
