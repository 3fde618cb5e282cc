"""Prometheus gauges of a tunnel-server replica, read live from its hub at scrape time.

The one question they answer that the gRPC server's counters do not: how many
edge agents this replica holds right now (an alert fires when agents are gone).
"""

from __future__ import annotations

from prometheus_client import Gauge

from waygate.tunnel.server import Hub

AGENTS = Gauge(
    "waygate_tunnel_server_agents",
    "Edge nodes whose agent holds a stream to this replica (draining agents excluded).",
)


def observe(hub: Hub) -> None:
    """Point the gauges at this hub (the last call wins: one hub per process)."""
    AGENTS.set_function(lambda: len(hub.nodes()))
