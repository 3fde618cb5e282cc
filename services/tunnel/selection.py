"""Which of a node's agents takes a dial, and when a dial moves on to the next one.

The replica's registry of agents (`server.Hub`: who is connected for which node, the
replica set, parked connections, dial tokens) holds no opinion on them; this module
does, as konnectivity keeps `BackendStorage` (the registry) apart from the
`BackendManager` that picks a backend (backend_manager.go):

- Order: a node's live agents, newest first (a restarted agent replaces its
  predecessor); those that refused the dial's address lately go behind, and those
  silent lately (a dial they never answered) behind everyone.
- Moving on: a refusal another agent could answer differently (`ANOTHER_AGENT_COULD`:
  its allow-list, its network, it is moving) or silence (`mux.Silent`: no answer at
  all in its time) moves the dial to the next agent; any other refusal is final. A
  refusal is remembered for that address, silence for every address, `MEMORY`
  seconds each; a silent agent is also counted (`waygate_tunnel_server_silent_dials_total`).
- Budget: the dial's timeout bounds the whole dial, plus one `ANSWER_SLACK` (the
  replica waits that long past an agent's time for its answer). Each attempt gets an
  equal share of what is left among the agents still to try that are not silent
  lately (the last of them gets all of it), so an agent that never answers costs a
  dial its share, not the dial; once marked, it gets only what the others left.
- Early data: a refusal sent none of it (the next agent gets the same bytes);
  `early.Unanswered` (the bytes went, no answer came) is never moved; charged when the
  agent said nothing in its time.

Invariants: no I/O of its own and no grpc; memory per agent is bounded (`MAX_REMEMBERED`
addresses) and dies with the agent's session.
"""

from __future__ import annotations

import time
import weakref
from typing import TYPE_CHECKING, Any

from opentelemetry import context as otel_context

from waygate.core import tracing
from waygate.tunnel.early import Unanswered
from waygate.tunnel.metrics import SILENT_DIALS
from waygate.tunnel.mux import Refused, Silent
from waygate.tunnel.v1 import tunnel_pb2 as pb

if TYPE_CHECKING:
    from waygate.tunnel.server import AgentSession, Hub, ServerConnection

# Refusals another agent of the same node could answer differently: its own
# allow-list, its own network, it is moving. The dial moves on to the next agent.
ANOTHER_AGENT_COULD = frozenset({pb.NOT_ALLOWED, pb.UNREACHABLE, pb.DRAINING})
# How long an agent's refusal of an address (its silence: of any) puts it behind the others.
MEMORY = 30.0
MAX_REMEMBERED = 1024
# How long past the time it was given the replica waits for an agent's answer (its
# connect timeout is answered as TIMEOUT; beyond this, the agent is silent).
ANSWER_SLACK = 1.0
# The least an attempt is given while other agents are left to try.
MIN_SHARE = 0.25


class Standing:
    """What the selection remembers of one agent: refusals by address, its last silence."""

    __slots__ = ("refusals", "silent_at")

    def __init__(self) -> None:
        self.refusals: dict[str, float] = {}  # address -> when it last refused it
        self.silent_at = -MEMORY  # when it last left a dial unanswered

    def refused(self, address: str, now: float) -> None:
        if len(self.refusals) >= MAX_REMEMBERED:  # bounded: forget the oldest
            self.refusals.pop(next(iter(self.refusals)))
        self.refusals[address] = now

    def refused_lately(self, address: str, now: float) -> bool:
        at = self.refusals.get(address)
        return at is not None and now - at < MEMORY

    def silent_lately(self, now: float) -> bool:
        return now - self.silent_at < MEMORY


class AgentSelection:
    """The dial rules over one replica's registry (`hub`); one per replica, shared by
    every face that dials (gRPC Dial, the data port, the HTTPS front)."""

    def __init__(self, hub: Hub) -> None:
        self.hub = hub
        self._standing: weakref.WeakKeyDictionary[AgentSession, Standing] = (
            weakref.WeakKeyDictionary()
        )

    def standing(self, session: AgentSession) -> Standing:
        standing = self._standing.get(session)
        if standing is None:
            standing = self._standing[session] = Standing()
        return standing

    def silent_lately(self, session: AgentSession) -> bool:
        standing = self._standing.get(session)
        return standing is not None and standing.silent_lately(time.monotonic())

    def refused_lately(self, session: AgentSession, address: str) -> bool:
        standing = self._standing.get(session)
        return standing is not None and standing.refused_lately(address, time.monotonic())

    def candidates(self, node: str, address: str = "") -> list[AgentSession]:
        """The live agents of `node` that may take a dial, best first (see the module
        docstring). Refused: NO_AGENT without one, DRAINING when this replica drains
        or every agent of the node is moving off it (one moving is skipped)."""
        hub = self.hub
        if hub.draining:
            raise Refused(pb.DRAINING, f"tunnel server {hub.server_id} is draining")
        held = hub.held(node)
        if not held:
            raise Refused(pb.NO_AGENT, f"no agent for node {node} on replica {hub.server_id}")
        ordered = [s for s in held if not s.draining]
        if not ordered:
            raise Refused(
                pb.DRAINING, f"the agent for node {node} is moving off replica {hub.server_id}"
            )
        ordered.reverse()  # newest first (the registry keeps registration order)
        if len(ordered) > 1 and self._standing:
            now = time.monotonic()
            standings = self._standing

            def rank(session: AgentSession) -> tuple[bool, bool]:
                standing = standings.get(session)
                if standing is None:
                    return (False, False)
                return (standing.silent_lately(now), standing.refused_lately(address, now))

            ordered.sort(key=rank)  # stable: newest first within a rank
        return ordered

    async def dial(
        self,
        node: str,
        address: str,
        timeout: float,
        early: bytes = b"",
        replay_safe: bool = False,
        splice_for: str = "",
        *,
        trace_context: otel_context.Context | None = None,
    ) -> ServerConnection:
        """Dial `address` through an agent of `node`, moving on as the module docstring
        says. Returns a `ServerConnection` (or a `DataConnection` shaped as one); raises
        `Refused`. `early` goes with the dial (`AgentSession.dial`); `splice_for` asks for
        TLS end to end; `trace_context`: the context the agent's span continues (the
        current one when None)."""
        carrier: dict[str, str] = {}
        tracing.inject_context(carrier, trace_context)
        deadline = time.monotonic() + timeout
        candidates = self.candidates(node, address)
        last: Refused | None = None
        for index, session in enumerate(candidates):
            now = time.monotonic()
            left = deadline - now
            if left <= 0 and last is not None:
                break
            try:
                return await session.dial(
                    address,
                    max(self._share(candidates, index, left, now), 0.001),
                    carrier,
                    early,
                    replay_safe,
                    splice_for,
                )
            except Silent as silent:
                self._charge(session)
                last = silent
            except Unanswered as unanswered:
                if unanswered.silent:  # (not when its connection ended: its pool's idle time)
                    self._charge(session)
                raise
            except Refused as refused:
                last = refused
                if refused.reason not in ANOTHER_AGENT_COULD:
                    raise
                self.standing(session).refused(address, time.monotonic())
        assert last is not None
        raise last

    def _share(self, candidates: list[Any], index: int, left: float, now: float) -> float:
        """This attempt's part of what is left: an equal share among the `fresh` agents
        from here on that are not silent lately (among all of them when every one is),
        after the answer slack each attempt but the last may add: so `fresh` attempts
        together wait no longer than the dial's timeout plus one slack, as one would.
        Never less than `MIN_SHARE` (nor more than is left)."""
        rest = candidates[index:]
        if len(rest) == 1:
            return left
        standings = self._standing
        fresh = 0
        for session in rest:
            standing = standings.get(session)
            if standing is None or not standing.silent_lately(now):
                fresh += 1
        fresh = fresh or len(rest)
        if fresh == 1:
            return left
        return max((left - (fresh - 1) * ANSWER_SLACK) / fresh, min(left, MIN_SHARE))

    def _charge(self, session: AgentSession) -> None:
        """`session`'s agent left a dial unanswered: behind every other agent for a while."""
        self.standing(session).silent_at = time.monotonic()
        SILENT_DIALS.inc()
