"""Presence: tell the resolver which nodes this tunnel-server replica holds.

One `ReportTunnels` stream to the resolver, fed with the hub's full node set
(a state, not a delta) whenever it changes and at least every third of the
lease, so a replica that dies loses its presence within one lease. The stream
holds its channel across certificate rotations (`RotatingChannel.hold`), and
reconnects with backoff and jitter when it ends. Both the stream and the
reconnect loop are the resolver's own client surface
(`waygate.resolver.client.report_tunnels`, `keep_reporting`, the loop the
proxy's listener reports use too), not its stubs: no grpc here.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from waygate.core.backoff import Backoff
from waygate.core.grpctls import RotatingChannel
from waygate.resolver.client import keep_reporting, report_tunnels
from waygate.tunnel.server import Hub


class PresenceReporter:
    def __init__(
        self,
        hub: Hub,
        channel: RotatingChannel,
        *,
        address: str,
        lease: float = 15.0,
        backoff: Backoff | None = None,
    ) -> None:
        self._hub = hub
        self._channel = channel
        self._address = address
        self._lease = lease
        self._backoff = backoff or Backoff(initial=0.2, maximum=10.0)
        self._changed = asyncio.Event()
        hub.subscribe(self._changed.set)
        self.reports = 0  # reports sent, for tests

    async def run(self) -> None:
        await keep_reporting(
            self._channel.hold,
            lambda channel: report_tunnels(
                channel, self._hub.server_id, self._address, self._reports()
            ),
            self._backoff,
            what="tunnel presence report",
            extra={"resolver": self._channel.address},
        )

    async def _reports(self) -> AsyncIterator[tuple[list[str], float]]:
        while True:
            self._changed.clear()
            yield self._hub.nodes(), self._lease
            self.reports += 1
            self._backoff.reset()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), self._lease / 3)
