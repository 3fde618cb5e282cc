"""What a tunnel-server replica shows of its hub, read live at scrape or page time.

The Prometheus gauge answers what the gRPC server's counters do not: how many
edge agents this replica holds right now (an alert fires when agents are gone);
the status page's section lists them, with this replica's id.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from prometheus_client import Counter, Gauge

from waygate.core.statuspage import Section, cell, duration_text

if TYPE_CHECKING:
    from waygate.tunnel.agent import Agent
    from waygate.tunnel.server import Hub

AGENTS = Gauge(
    "waygate_tunnel_server_agents",
    "Edge nodes whose agent holds a stream to this replica (draining agents excluded).",
)
RAW_DIALS = Counter(
    "waygate_tunnel_server_raw_dials",
    "Dials on the data port this replica answered OK, by how it carries them: end_to_end "
    "(the dialer's TLS runs to the agent, the sockets spliced), data (relayed between two "
    "data connections), stream (relayed to the agent's Connect stream). A dialer that "
    "asked for end to end and got data or stream was relayed: see the README.",
    ["carried"],
)
SILENT_DIALS = Counter(
    "waygate_tunnel_server_silent_dials",
    "Dials an agent left unanswered within its time (no OK, no refusal): each moves the "
    "dial to another agent of the node, if any, and puts the silent one behind the others "
    "for 30 s (waygate.tunnel.selection).",
)
# Bound once: a dial pays one increment, not a label lookup.
DIALS_END_TO_END = RAW_DIALS.labels("end_to_end")
DIALS_DATA = RAW_DIALS.labels("data")
DIALS_STREAM = RAW_DIALS.labels("stream")


def observe(hub: Hub) -> None:
    """Point the gauges at this hub (the last call wins: one hub per process)."""
    AGENTS.set_function(lambda: len(hub.nodes()))


def status_provider(hub: Hub) -> Callable[[], list[Section]]:
    def sections() -> list[Section]:
        now = datetime.now(UTC)
        rows = []
        for agent in sorted(hub.agents(), key=lambda a: (a.node, a.agent_id)):
            since = agent.connected_since.ToDatetime(tzinfo=UTC)
            rows.append(
                [
                    agent.node,
                    agent.agent_id,
                    hub.server_id,
                    agent.remote_address,
                    duration_text((now - since).total_seconds()),
                    agent.open_connections,
                    cell("draining", "warn") if agent.draining else cell("serving", "ok"),
                ]
            )
        note = f"replica {hub.server_id} of {', '.join(hub.replicas)}"
        return [
            Section(
                "Tunnel agents",
                ["node", "agent", "replica", "from", "connected for", "connections", "state"],
                rows,
                note=note + ("; draining" if hub.draining else ""),
                empty="no agent holds a stream to this replica",
            )
        ]

    return sections


def agent_status_provider(agent: Agent) -> Callable[[], list[Section]]:
    """The agent's streams: which tunnel-server replicas hold this node."""

    def sections() -> list[Section]:
        rows = []
        for server_id in sorted(agent.replicas | agent.streams.keys()):
            stream = agent.streams.get(server_id)
            if stream is None:
                state = cell("not connected", "bad")
            elif stream.draining:
                state = cell("draining", "warn")
            else:
                state = cell("held", "ok")
            connections = len(stream.connections) if stream is not None else 0
            rows.append([server_id, state, connections])
        return [
            Section(
                "Tunnel streams",
                ["replica", "stream", "connections"],
                rows,
                note=f"node {agent.node}, agent {agent.agent_id}, servers at {agent.server_address}",
                empty="no replica known yet",
            )
        ]

    return sections
