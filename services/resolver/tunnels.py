"""Tunnel presence from `ReportTunnels` streams: which server replica holds which node.

Each tunnel-server replica keeps one report stream open and sends the full set
of nodes it holds (a state, not a delta). A node's presence in the store is
the union, over live streams, of the replicas that hold it.

Invariants:
- A stream's contribution disappears when the stream ends (any way: clean
  end, error, cancellation) or when no report arrives within its lease; a
  later report on the same stream brings it back.
- Leases are clamped to [min_lease, max_lease]; unset means default_lease.
- Every report on a stream names the same replica; ids, addresses and node
  names are validated before anything reaches the store.
- Lease timers live on the event loop (call_later), so expiry needs no
  polling task, and closing a stream cancels its timer: nothing leaks.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import re
from collections.abc import Iterable
from dataclasses import dataclass, field

from waygate.core.errors import InvalidArgument, excerpt
from waygate.resolver.model import TunnelServer
from waygate.resolver.store import Store

log = logging.getLogger(__name__)

MAX_NODES_PER_REPORT = 100_000
_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_HOST = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9.]*[A-Za-z0-9])?$")


def validate_server(server: TunnelServer) -> None:
    if not server.id or len(server.id) > 253 or not _SUBDOMAIN.match(server.id):
        raise InvalidArgument(
            f"server.id: {excerpt(server.id)} is not a DNS-1123 subdomain (e.g. the pod name)"
        )
    if len(server.address) > 300:
        raise InvalidArgument(f"server.address: {excerpt(server.address)} is not host:port")
    host, sep, port = server.address.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
        host_ok = ":" in host
    else:
        host_ok = bool(_HOST.match(host))
    port_ok = port.isascii() and port.isdigit() and 1 <= int(port) <= 65535
    if not sep or not host_ok or not port_ok:
        raise InvalidArgument(f"server.address: {excerpt(server.address)} is not host:port")


def validate_nodes(nodes: Iterable[str]) -> frozenset[str]:
    result = frozenset(nodes)
    if len(result) > MAX_NODES_PER_REPORT:
        raise InvalidArgument(f"nodes: more than {MAX_NODES_PER_REPORT} in one report")
    for node in result:
        if not node or len(node) > 253 or not _SUBDOMAIN.match(node):
            raise InvalidArgument(f"nodes: {excerpt(node)} is not a DNS-1123 subdomain")
    return result


@dataclass
class ReportStream:
    """One open ReportTunnels stream."""

    id: int
    server: TunnelServer | None = None
    nodes: frozenset[str] = frozenset()
    lease: float = 0.0
    expired: bool = False
    timer: asyncio.TimerHandle | None = field(default=None, repr=False)


class TunnelRegistry:
    def __init__(
        self,
        store: Store,
        *,
        default_lease: float = 30.0,
        min_lease: float = 5.0,
        max_lease: float = 300.0,
    ) -> None:
        if not 0 < min_lease <= default_lease <= max_lease:
            raise ValueError("need 0 < min_lease <= default_lease <= max_lease")
        self._store = store
        self.default_lease, self.min_lease, self.max_lease = default_lease, min_lease, max_lease
        self._streams: dict[int, ReportStream] = {}
        self._ids = itertools.count(1)
        # Set when the process drains: report streams end so the stop need not
        # wait out its grace period for them (tunnel servers reconnect elsewhere).
        self.ending = asyncio.Event()

    def open(self) -> ReportStream:
        stream = ReportStream(next(self._ids))
        self._streams[stream.id] = stream
        return stream

    def clamp(self, lease: float | None) -> float:
        if lease is None or lease <= 0:
            return self.default_lease
        return min(max(lease, self.min_lease), self.max_lease)

    def report(
        self, stream: ReportStream, server: TunnelServer, nodes: Iterable[str], lease: float | None
    ) -> float:
        """Apply one report; returns the lease in force for the stream."""
        if stream.id not in self._streams:
            raise InvalidArgument("report on a closed stream")
        validate_server(server)
        if stream.server is not None and server.id != stream.server.id:
            raise InvalidArgument(
                f"server.id: this stream reports for {excerpt(stream.server.id)}; "
                f"open another stream for {excerpt(server.id)}"
            )
        wanted = validate_nodes(nodes)
        touched = stream.nodes | wanted
        stream.server, stream.nodes, stream.expired = server, wanted, False
        stream.lease = self.clamp(lease)
        self._arm(stream)
        self._refresh(touched)
        return stream.lease

    def close(self, stream: ReportStream) -> None:
        """The stream ended: its presence goes at once."""
        if self._streams.pop(stream.id, None) is None:
            return
        if stream.timer is not None:
            stream.timer.cancel()
            stream.timer = None
        self._refresh(stream.nodes)

    def end_streams(self) -> None:
        self.ending.set()

    def close_all(self) -> None:
        for stream in list(self._streams.values()):
            self.close(stream)

    @property
    def open_streams(self) -> int:
        return len(self._streams)

    def _arm(self, stream: ReportStream) -> None:
        if stream.timer is not None:
            stream.timer.cancel()
        stream.timer = asyncio.get_running_loop().call_later(stream.lease, self._lapse, stream)

    def _lapse(self, stream: ReportStream) -> None:
        stream.timer = None
        if stream.id not in self._streams or stream.expired:
            return
        log.warning(
            "tunnel report lease lapsed; dropping its presence",
            extra={
                "server": stream.server.id if stream.server else None,
                "nodes": len(stream.nodes),
                "lease_seconds": stream.lease,
            },
        )
        stream.expired = True
        self._refresh(stream.nodes)

    def _refresh(self, nodes: Iterable[str]) -> None:
        live = [s for s in self._streams.values() if not s.expired and s.server is not None]
        self._store.set_tunnel_presences(
            {
                node: [s.server for s in live if node in s.nodes and s.server is not None]
                for node in nodes
            }
        )
