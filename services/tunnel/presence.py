"""Presence: tell the resolver which nodes this tunnel-server replica holds.

One `ReportTunnels` stream to the resolver, fed with the hub's full node set
(a state, not a delta) whenever it changes and at least every third of the
lease, so a replica that dies loses its presence within one lease. The stream
holds its channel across certificate rotations (`RotatingChannel.hold`), and
reconnects with backoff and jitter when it ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

import grpc
from google.protobuf import duration_pb2

from waygate.core.backoff import Backoff
from waygate.core.grpctls import RotatingChannel
from waygate.resolver.v1 import resolver_pb2, resolver_pb2_grpc
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
        self._server = resolver_pb2.TunnelServer(id=hub.server_id, address=address)
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

    async def _reports(self) -> AsyncIterator[resolver_pb2.TunnelReport]:
        lease = duration_pb2.Duration(seconds=int(self._lease), nanos=int(self._lease % 1 * 1e9))
        while True:
            self._changed.clear()
            yield resolver_pb2.TunnelReport(
                server=self._server, nodes=self._hub.nodes(), lease=lease
            )
            self.reports += 1
            self._backoff.reset()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), self._lease / 3)

    async def report_once(self) -> None:
        try:
            async with self._channel.hold() as channel:
                await resolver_pb2_grpc.ResolverStub(channel).ReportTunnels(self._reports())
        except grpc.aio.AioRpcError as exc:
            log.warning(
                "tunnel presence report failed",
                extra={
                    "resolver": self._channel.address,
                    "error": f"{exc.code().name}: {exc.details()}",
                },
            )
