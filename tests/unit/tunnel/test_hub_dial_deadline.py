"""The dial selection's budget (`waygate.tunnel.selection`): a dial's timeout bounds the
whole dial across a node's agents. An agent that refuses late leaves the next one only
what is left; an agent that never answers costs the dial its share, not the dial, and
is put behind the others (issue 31 finding 10: 0 of 600 dials got through such an agent).

The sessions here are stand-ins with the one method the selection calls (`dial`): the
real sessions, agents and dials are in tests/integration/tunnel/test_agents.py."""

from __future__ import annotations

import asyncio

import pytest

from waygate.tunnel import selection
from waygate.tunnel.early import Unanswered
from waygate.tunnel.mux import Refused, Silent
from waygate.tunnel.server import Hub
from waygate.tunnel.v1 import tunnel_pb2 as pb

ADDRESS = "10.0.0.9:10250"


class Agent:
    """A stand-in agent session: refuses for a reason another agent could answer after
    `delay` seconds (`answer`: "refuse"), never answers ("silent": the session raises
    Silent once its time is up), answers ("serve"), or went quiet after early data
    ("unanswered"); records the timeout each dial was given."""

    def __init__(self, answer: str, delay: float = 0.0) -> None:
        self.answer = answer
        self.delay = delay
        self.given: list[float] = []
        self.draining = False
        self.closed = False

    async def dial(
        self,
        address: str,
        timeout: float,
        carrier: dict[str, str],
        early: bytes = b"",
        replay_safe: bool = False,
        splice_for: str = "",
    ) -> str:
        self.given.append(timeout)
        if self.answer == "serve":
            return "connection"
        if self.answer == "refuse":
            await asyncio.sleep(min(self.delay, timeout))
            raise Refused(pb.UNREACHABLE, "no route to the destination from here")
        await asyncio.sleep(timeout)
        if self.answer == "unanswered":
            raise Unanswered("no answer after the early data went", silent=True)
        if self.answer == "let go":  # its parked connection ended (its pool's idle time)
            raise Unanswered("the connection ended after the early data went")
        raise Silent(pb.TIMEOUT, "the agent did not answer")


@pytest.fixture(autouse=True)
def short_slack(monkeypatch: pytest.MonkeyPatch) -> None:
    # The answer slack (1 s) scaled down with the timeouts here.
    monkeypatch.setattr(selection, "ANSWER_SLACK", 0.1)


def hub_of(*agents: Agent) -> Hub:
    """A registry holding `agents`, oldest first (the last one is the newest)."""
    hub = Hub("replica-a")
    hub.held = lambda node: list(agents)  # type: ignore[method-assign,assignment,return-value]
    return hub


async def test_each_next_agent_gets_only_what_the_ones_before_left() -> None:
    agents = [Agent("refuse", 0.4), Agent("refuse", 0.4), Agent("refuse", 0.4)]
    hub = hub_of(*agents)
    hub.selection.candidates = lambda node, address="": agents  # type: ignore[method-assign,assignment,return-value]
    with pytest.raises(Refused) as refused:
        await hub.selection.dial("edge-1", ADDRESS, timeout=1.2)
    assert refused.value.reason == pb.UNREACHABLE
    # An equal share each of what was left, less the slack of the attempts after it:
    # (1.2 - 2 x 0.1) / 3, then (0.87 - 0.1) / 2, then all that is left.
    assert 0.3 < agents[0].given[0] <= 0.34
    assert agents[1].given and 0.33 < agents[1].given[0] <= 0.39
    # Never the full timeout again: together no more than the dial's 1.2 s.
    assert sum(agent.given[0] for agent in agents if agent.given) <= 1.2 + 1e-3
    for agent in agents:
        if agent.given:
            assert hub.selection.refused_lately(agent, ADDRESS)  # type: ignore[arg-type]


async def test_a_silent_agent_costs_its_share_and_the_dial_moves_on() -> None:
    serving, silent = Agent("serve"), Agent("silent")
    hub = hub_of(serving, silent)  # the silent one is the newest: asked first
    assert await hub.selection.dial("edge-1", ADDRESS, timeout=1.0) == "connection"
    # Half of the second less one slack (one other agent was left to try), then the rest.
    assert 0.44 < silent.given[0] <= 0.45 + 1e-6
    assert 0.5 < serving.given[0] <= 0.56
    assert hub.selection.silent_lately(silent)  # type: ignore[arg-type]
    assert not hub.selection.silent_lately(serving)  # type: ignore[arg-type]


async def test_an_agent_marked_silent_goes_last_and_the_others_get_the_whole_budget() -> None:
    serving, silent = Agent("serve"), Agent("silent")
    hub = hub_of(serving, silent)
    await hub.selection.dial("edge-1", ADDRESS, timeout=1.0)
    assert hub.selection.candidates("edge-1", ADDRESS) == [serving, silent]
    serving.given.clear()
    silent.given.clear()
    assert await hub.selection.dial("edge-1", ADDRESS, timeout=1.0) == "connection"
    assert serving.given and serving.given[0] > 0.95  # not shared with the silent agent
    assert not silent.given


async def test_an_agent_silent_after_early_data_is_charged_and_the_dial_not_moved() -> None:
    serving, silent = Agent("serve"), Agent("unanswered")
    hub = hub_of(serving, silent)
    with pytest.raises(Unanswered):
        await hub.selection.dial("edge-1", ADDRESS, timeout=0.2, early=b"GET / HTTP/1.1\r\n")
    assert not serving.given  # the bytes may have arrived: not sent again
    assert hub.selection.silent_lately(silent)  # type: ignore[arg-type]


async def test_a_lone_silent_agent_gets_the_whole_budget() -> None:
    silent = Agent("silent")
    hub = hub_of(silent)
    with pytest.raises(Silent) as refused:
        await hub.selection.dial("edge-1", ADDRESS, timeout=0.2)
    assert refused.value.reason == pb.TIMEOUT
    assert silent.given[0] > 0.19


async def test_an_agent_whose_connection_ended_after_early_data_is_not_charged() -> None:
    """Its pool let the parked connection go as the dial arrived: not silence."""
    serving, letting_go = Agent("serve"), Agent("let go")
    hub = hub_of(serving, letting_go)
    with pytest.raises(Unanswered):
        await hub.selection.dial("edge-1", ADDRESS, timeout=0.2, early=b"GET / HTTP/1.1\r\n")
    assert not serving.given
    assert not hub.selection.silent_lately(letting_go)  # type: ignore[arg-type]
