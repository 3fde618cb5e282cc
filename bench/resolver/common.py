"""What the resolver benchmarks share (bench/resolver, bench/resolver_storm).

- `routes_file`: a routes file of N services x M endpoints;
- `snapshot_bytes`: what one full snapshot serializes to (a probe stream);
- `ChangeReporter`: a real ReportTunnels stream making one tunnel-presence
  change per `send` (change I names node PREFIX-I and retires the one before),
  noting when each was sent;
- `fanout`: per change, the time from sending it to the last live watcher
  having it, from the watcher processes' reports (bench.resolver.watchers).
Processes are started and stopped with bench.resolver.__main__'s `start`/`stop`.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc

from waygate.resolver.v1 import resolver_pb2 as pb
from waygate.resolver.v1 import resolver_pb2_grpc

MAX_MESSAGE = 64 * 1024 * 1024


def routes_file(path: Path, namespace: str, services: int, per_service: int) -> None:
    lines = ["services:"]
    for s in range(services):
        lines += [
            f"  - namespace: {namespace}",
            f"    name: svc-{s}",
            "    ports: [{name: http, port: 80, targetPort: 8080}]",
            "    endpoints:",
        ]
        lines += [
            f"      - {{address: 10.{s // 250}.{s % 250}.{e + 1}, zone: z{e % 3}}}"
            for e in range(per_service)
        ]
    path.write_text("\n".join(lines) + "\n")


async def snapshot_bytes(address: str, endpoints: int) -> tuple[int, int]:
    """What one full snapshot serializes to, and in how many events (one probe stream),
    once the resolver has loaded all `endpoints`."""
    options = [("grpc.max_receive_message_length", MAX_MESSAGE)]
    async with grpc.aio.insecure_channel(address, options=options) as channel:
        while True:
            total, events, seen = 0, 0, 0
            call = resolver_pb2_grpc.ResolverStub(channel).Watch(pb.WatchRequest())
            async for event in call:
                total += event.ByteSize()
                events += 1
                seen += len(event.snapshot.endpoints)
                if event.HasField("snapshot") and not event.snapshot.more:
                    call.cancel()
                    break
            if seen == endpoints:
                return total, events
            await asyncio.sleep(0.5)


class ChangeReporter:
    """`async with ChangeReporter(address, prefix) as reporter: reporter.send(i)`."""

    def __init__(self, address: str, prefix: str) -> None:
        self.address = address
        self.prefix = prefix
        self.sent: list[float] = []
        self._queue: asyncio.Queue[pb.TunnelReport | None] = asyncio.Queue()

    async def _reports(self) -> AsyncIterator[pb.TunnelReport]:
        while (report := await self._queue.get()) is not None:
            yield report

    def send(self, index: int) -> None:
        self.sent.append(time.monotonic())
        self._queue.put_nowait(
            pb.TunnelReport(
                server=pb.TunnelServer(id=f"{self.prefix}ts", address="127.0.0.1:7004"),
                nodes=[f"{self.prefix}{index}"],
            )
        )

    async def __aenter__(self) -> ChangeReporter:
        self._channel = grpc.aio.insecure_channel(self.address)
        self._call = resolver_pb2_grpc.ResolverStub(self._channel).ReportTunnels(self._reports())
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._queue.put_nowait(None)
        try:
            await self._call
        finally:
            await self._channel.close()


def fanout(results: list[dict[str, Any]], sent: list[float], live: int) -> dict[str, float]:
    """Per change, the latest arrival over every live watcher minus when it was sent
    (ms), for the changes every live watcher had: p50, p99, max, and how many."""
    delays = []
    for index, when in enumerate(sent):
        arrivals = [r["seen"][str(index)] for r in results if str(index) in r["seen"]]
        if sum(a[1] for a in arrivals) == live:
            delays.append((max(a[0] for a in arrivals) - when) * 1000)
    delays.sort()
    nan = float("nan")
    return {
        "complete": len(delays),
        "p50": statistics.median(delays) if delays else nan,
        "p99": delays[min(len(delays) - 1, int(len(delays) * 0.99))] if delays else nan,
        "max": delays[-1] if delays else nan,
    }
