"""The proxy tells the resolver which backend certificates need attention.

What `waygate.proxy.backendcerts.attention` finds in the proxy's record of
served certificates (endpoints out of rotation, and those expiring within the
warning window) goes to every resolver replica on a `ReportBackendCertificates`
stream (`waygate.resolver.client.report_backend_certificates`), the sibling of
the Gateway listener report: the resolver gives those routes a
`BackendCertificate` condition, so `waygate routes get`, `waygate check` and the
Kubernetes status warn days before a client would get a 502.

Invariants:
- each report is the full state (a lost one loses nothing); one goes out when
  the state changes (looked at every `interval`) and at least every `refresh`,
  well within the resolver's TTL, so a live proxy's state never lapses;
- the stream holds one channel per attempt and reconnects with backoff: a
  resolver that is away costs only the report, never the serving.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime
from typing import Any

from waygate.core.backoff import Backoff
from waygate.proxy.backendcerts import BackendCertificates, attention
from waygate.resolver.client import (
    BackendCertificateState,
    keep_reporting,
    report_backend_certificates,
)

#: How often the record is looked at for a change, and the longest between two reports.
INTERVAL = 5.0
REFRESH = 60.0


class BackendCertificateReporter:
    """Keeps one ReportBackendCertificates stream to a resolver open."""

    def __init__(
        self,
        certificates: BackendCertificates,
        channel: Callable[[], Any],
        proxy: str,
        *,
        interval: float = INTERVAL,
        refresh: float = REFRESH,
        backoff: Backoff | None = None,
    ) -> None:
        self.certificates = certificates
        self._channel = channel  # an async context manager holding a channel
        self.proxy = proxy
        self.interval = interval
        self.refresh = refresh
        self._backoff = backoff or Backoff(initial=0.2, maximum=10.0)

    async def run(self) -> None:
        await keep_reporting(
            self._channel,
            lambda channel: report_backend_certificates(channel, self.proxy, self._reports()),
            self._backoff,
            what="backend certificate report",
        )

    async def _reports(self) -> AsyncIterator[tuple[BackendCertificateState, ...]]:
        loop = asyncio.get_running_loop()
        last: tuple[BackendCertificateState, ...] | None = None
        sent_at = 0.0
        while True:
            states = attention(self.certificates, datetime.now(UTC))
            if states != last or loop.time() - sent_at >= self.refresh:
                last, sent_at = states, loop.time()
                self._backoff.reset()
                yield states
            await asyncio.sleep(self.interval)
