"""Hub.dial's timeout bounds the whole dial across a node's agents: an agent that
refuses late leaves the next one only what is left, so falling back through several
agents never outlasts the caller's deadline."""

from __future__ import annotations

import asyncio

from waygate.tunnel.server import Hub, Refused
from waygate.tunnel.v1 import tunnel_pb2 as pb


class SlowRefusal:
    """An agent session that refuses (for a reason another agent could answer) after
    `delay` seconds, recording the timeout it was given."""

    def __init__(self, delay: float) -> None:
        self.delay = delay
        self.given: list[float] = []
        self.refusals: list[str] = []

    async def dial(
        self,
        address: str,
        timeout: float,
        carrier: dict[str, str],
        early: bytes = b"",
        replay_safe: bool = False,
        splice_for: str = "",
    ) -> None:
        self.given.append(timeout)
        await asyncio.sleep(min(self.delay, timeout))
        raise Refused(pb.UNREACHABLE, "no route to the destination from here")

    def remember_refusal(self, address: str) -> None:
        self.refusals.append(address)


async def test_each_next_agent_gets_only_what_the_ones_before_left() -> None:
    hub = Hub("replica-a")
    agents = [SlowRefusal(0.4), SlowRefusal(0.4), SlowRefusal(0.4)]
    hub.sessions_for = lambda node, address="": agents  # type: ignore[method-assign,assignment,return-value]
    try:
        await hub.dial("edge-1", "10.0.0.9:10250", timeout=1.0)
    except Refused as refused:
        assert refused.reason == pb.UNREACHABLE
    else:
        raise AssertionError("every agent refused: the dial must be refused")
    assert 0.9 < agents[0].given[0] <= 1.0
    # The second agent got the 1 s minus the first's 0.4 s (never the full second again).
    assert agents[1].given and agents[1].given[0] < 0.7
    # The third got at most what the first two left (or was not tried once none was
    # left): with a full timeout per agent the three would have slept 1.2 s, not 1.0 s.
    assert not agents[2].given or agents[2].given[0] <= 0.2 + 1e-6
    assert [len(a.refusals) for a in agents if a.given] == [1] * sum(1 for a in agents if a.given)
