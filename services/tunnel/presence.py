"""Presence: tell the resolver which nodes this tunnel-server replica holds.

One `ReportTunnels` stream to the resolver, fed with the hub's full node set
(a state, not a delta) whenever it changes and at least every third of the
lease, so a replica that dies loses its presence within one lease. The stream
holds its channel across certificate rotations (`RotatingChannel.hold`), and
reconnects with backoff and jitter when it ends. The stream is the resolver's
own client surface (`waygate.resolver.client.report_tunnels`), not its stubs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

import grpc

from waygate.core.backoff import Backoff
from waygate.core.grpctls import RotatingChannel
from waygate.resolver.client import report_tunnels
from waygate.tunnel.server import Hub

log = logging.getLogger(__name__)


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
        while True:
            await self.report_once()
            delay = self._backoff.next_delay()
            await asyncio.sleep(delay)

    async def _reports(self) -> AsyncIterator[tuple[list[str], float]]:
        while True:
            self._changed.clear()
            yield self._hub.nodes(), self._lease
            self.reports += 1
            self._backoff.reset()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), self._lease / 3)

    async def report_once(self) -> None:
        try:
            async with self._channel.hold() as channel:
                await report_tunnels(channel, self._hub.server_id, self._address, self._reports())
        except grpc.aio.AioRpcError as exc:
            log.warning(
                "tunnel presence report failed",
                extra={
                    "resolver": self._channel.address,
                    "error": f"{exc.code().name}: {exc.details()}",
                },
            )
