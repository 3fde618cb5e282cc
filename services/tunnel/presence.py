"""Presence: tell the resolver which nodes this tunnel-server replica holds.

One `ReportTunnels` stream to the resolver, fed with the hub's full node set
(a state, not a delta) whenever it changes and at least every third of the
lease, so a replica that dies loses its presence within one lease. The stream
holds its channel across certificate rotations (`RotatingChannel.hold`), and
reconnects with backoff and jitter when it ends. Both the stream and the
reconnect loop are the resolver's own client surface
(`waygate.resolver.client.report_tunnels`, `keep_reporting`, the loop the
proxy's listener reports use too), not its stubs: no grpc here.

A resolver replica knows only the presence reported to it, so a tunnel
server reports to every replica: to each address listed, or (`EveryReplica`)
to every address a headless Service resolves to, followed as pods come and go.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import AsyncIterator, Awaitable, Callable

from waygate.core.backoff import Backoff
from waygate.core.grpctls import RotatingChannel
from waygate.resolver.client import keep_reporting, report_tunnels
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


class EveryReplica:
    """Presence to every resolver replica behind one name (a headless Service).

    A resolver replica knows only the presence reported to it, so a report
    through a load-balanced Service reaches one of several. The name is
    resolved every `interval` seconds (a third of the lease): every address it
    yields gets its own `PresenceReporter` over its own channel, verified
    against `server_name` (the replicas' certificate names the Service, not
    the pod address); an address gone from the answer has its reporter
    cancelled and its channel closed. A failed lookup keeps the reporters
    running: a DNS hiccup must not end presence.
    """

    def __init__(
        self,
        hub: Hub,
        open_channel: Callable[[str], Awaitable[RotatingChannel]],
        target: str,
        *,
        address: str,
        lease: float = 15.0,
        resolve: Callable[[str, int], Awaitable[set[str]]] | None = None,
    ) -> None:
        host, _, port = target.rpartition(":")
        if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
            raise ValueError(f"{target!r} is not host:port")
        self._hub = hub
        self._open_channel = open_channel
        self._host, self._port = host.strip("[]"), int(port)
        self._address = address
        self._lease = lease
        self._resolve = resolve or _resolve
        # Resolved address -> its reporter task and channel.
        self.reporters: dict[str, tuple[asyncio.Task[None], RotatingChannel]] = {}

    async def run(self) -> None:
        try:
            while True:
                try:
                    found = await self._resolve(self._host, self._port)
                except OSError as exc:
                    log.warning(
                        "cannot resolve the resolver replicas; keeping the reports open",
                        extra={"service": self._host, "error": str(exc)},
                    )
                else:
                    await self._follow(found)
                await asyncio.sleep(self._lease / 3)
        finally:
            await self._end(set(self.reporters))

    async def _follow(self, found: set[str]) -> None:
        await self._end(set(self.reporters) - found)
        for target in sorted(found - set(self.reporters)):
            channel = await self._open_channel(target)
            reporter = PresenceReporter(
                self._hub, channel, address=self._address, lease=self._lease
            )
            task = asyncio.get_running_loop().create_task(
                reporter.run(), name=f"tunnel-presence {target}"
            )
            self.reporters[target] = (task, channel)

    async def _end(self, targets: set[str]) -> None:
        for target in targets:
            task, channel = self.reporters.pop(target)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await channel.close()


async def _resolve(host: str, port: int) -> set[str]:
    """Every address `host` resolves to, as host:port (IPv6 in brackets)."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return {
        f"[{info[4][0]}]:{port}" if info[0] == socket.AF_INET6 else f"{info[4][0]}:{port}"
        for info in infos
    }
