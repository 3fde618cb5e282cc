"""What a proxy reports about its Gateway listeners (waygate.proxy.listeners): mapped
ports, the proxy's own ports, protocol mismatches, unmapped HTTPS (no socket bound); and
an own plain port bound and closed (a real socket)."""

from __future__ import annotations

import asyncio
import logging
import socket
from typing import Any

import pytest

from waygate.proxy.listeners import GatewayListeners
from waygate.proxy.routing import ListenerSide
from waygate.resolver.model import Route


def route(port: int, protocol: str, gateway: str = "ns/gw") -> Route:
    return Route(
        namespace="ns",
        name=f"r{port}{protocol}",
        host="h.test",
        listener_port=port,
        listener_protocol=protocol,
        gateway=gateway,
    )


@pytest.mark.asyncio
async def test_states_say_where_each_listener_is_served_or_why_not() -> None:
    listeners = GatewayListeners(
        server=None,
        host="127.0.0.1",
        mapped={80: False, 443: True},
        local_ports=lambda: (8080, 8443),
    )
    sides: Any = listeners.sides(
        [
            route(80, "HTTP"),
            route(443, "HTTPS"),
            route(8080, "HTTP"),  # the proxy's own HTTP port: served there
            route(80, "HTTPS", gateway="ns/other"),
            route(9443, "HTTPS"),
            route(1, "HTTP", gateway=""),  # not a Gateway route: not a listener
        ]
    )
    assert sides == {80: False, 443: True, 8080: False, 8443: True}
    states = {(s.gateway, s.port, s.protocol): s for s in listeners.states()}
    assert states[("ns/gw", 80, "HTTP")].local_port == 8080
    assert states[("ns/gw", 443, "HTTPS")].local_port == 8443
    assert states[("ns/gw", 8080, "HTTP")].local_port == 8080
    mismatch = states[("ns/other", 80, "HTTPS")]
    assert mismatch.reason == "PortUnavailable" and mismatch.local_port == 0
    assert "an HTTPS listener is not served there (--listener-ports 80=8443)" in mismatch.message
    unmapped = states[("ns/gw", 9443, "HTTPS")]
    assert "--listener-ports 9443=8443" in unmapped.message
    assert len(states) == 5
    assert listeners.changed.is_set()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.mark.asyncio
async def test_a_port_closed_before_it_serves_is_closed_quietly(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Bound, then closed by the next view before the serving task ran: the task is
    cancelled (no "failed to serve" on a closed socket) and the port is free again."""
    listeners = GatewayListeners(
        server=None, host="127.0.0.1", mapped={}, local_ports=lambda: (0, 0)
    )
    port = free_port()
    assert listeners.sides([route(port, "HTTP")]) == {port: ListenerSide(port)}
    (bound,) = listeners._bound.values()
    task = bound.task
    assert task is not None and not task.done()
    listeners.sides([])
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    with socket.socket() as again:
        again.bind(("127.0.0.1", port))  # fails if the socket was left open

    # Served, then closed: the server closes the port.
    listeners.sides([route(port, "HTTP")])
    (bound,) = listeners._bound.values()
    assert bound.task is not None
    await bound.task
    assert bound.server is not None and bound.server.is_serving()
    listeners.close()
    assert not bound.server.is_serving()
    await bound.server.wait_closed()
    with socket.socket() as again:
        again.bind(("127.0.0.1", port))
