"""`--workers N` for a gRPC service: N processes on one port, one admin port for all.

The parent keeps the admin port and reserves the service port: a bound, never
listening SO_REUSEPORT socket, so `--grpc-port 0` gives every worker the same
port, which each worker binds again with SO_REUSEPORT (the kernel spreads
connections over them). It starts N children with the arguments the service
gives (`argv(index)`); each writes one JSON line to stdout per interval:
`{"ready": bool, "metrics": "<Prometheus text>"}`. The parent's /metrics then
shows every family once, its own samples labelled `worker="parent"` and each
worker's `worker="N"`; it is ready once every worker reports ready.

Lifecycle: a worker gets SIGKILL if the parent dies (PR_SET_PDEATHSIG); the
parent's SIGTERM is passed on to every worker, which drains, and the parent
waits for them; a worker that exits on its own stops the parent with an
error, so its supervisor restarts the whole group.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import logging
import os
import signal
import socket
import sys
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import REGISTRY, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from waygate.core.runtime import ServiceProcess

log = logging.getLogger(__name__)

REPORT_INTERVAL = 1.0

_prctl: Callable[..., int] | None
try:
    _prctl = ctypes.CDLL("libc.so.6", use_errno=True).prctl
except (OSError, AttributeError):
    _prctl = None


def _die_with_parent(parent: int) -> Callable[[], None]:
    def arrange() -> None:
        if _prctl is not None:
            _prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
            if os.getppid() != parent:
                os.kill(os.getpid(), signal.SIGKILL)

    return arrange


def reserve_port(host: str, port: int) -> socket.socket:
    """A bound, never listening SO_REUSEPORT socket holding `port` (0: any) for the group."""
    reservation = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    reservation.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    reservation.bind((host, port))
    return reservation


async def report_forever(ready: Callable[[], bool], interval: float = REPORT_INTERVAL) -> None:
    """In a worker: one JSON line with readiness and this process's metrics per interval."""
    out = sys.stdout
    while True:
        line = {"ready": ready(), "metrics": generate_latest(REGISTRY).decode()}
        out.write(json.dumps(line) + "\n")
        out.flush()
        await asyncio.sleep(interval)


class MergedCollector(Collector):
    """Every family once: the parent's collectors' samples and each worker's, by `worker`."""

    def __init__(self, parents: list[Any], snapshots: dict[int, str]) -> None:
        self._parents = parents
        self._snapshots = snapshots

    def collect(self) -> Iterator[Metric]:
        merged: dict[str, Metric] = {}
        sources: list[tuple[str, Iterator[Metric]]] = [
            ("parent", (m for c in self._parents for m in c.collect()))
        ]
        for index, text in sorted(self._snapshots.items()):
            with contextlib.suppress(ValueError):
                sources.append((str(index), iter(list(text_string_to_metric_families(text)))))
        for worker, families in sources:
            for family in families:
                # `_created` timestamps come back from the text format as families of
                # their own; they say nothing summed over workers, so leave them out.
                if family.name.endswith("_created") and family.type == "gauge":
                    continue
                target = merged.get(family.name)
                if target is None:
                    target = merged[family.name] = Metric(
                        family.name, family.documentation, family.type, family.unit
                    )
                elif target.type != family.type:
                    continue
                for sample in family.samples:
                    if sample.name.endswith("_created"):
                        continue
                    target.add_sample(
                        sample.name, {**sample.labels, "worker": worker}, sample.value
                    )
        yield from merged.values()


class WorkerGroup:
    """N worker processes of one service, started and stopped with the parent."""

    def __init__(
        self,
        process: ServiceProcess,
        *,
        name: str,
        count: int,
        argv: Callable[[int], list[str]],
        shutdown_grace: float,
    ) -> None:
        self.process = process
        self.name = name
        self.count = count
        self._argv = argv
        self._grace = shutdown_grace
        self.snapshots: dict[int, str] = {}
        self.ready: dict[int, bool] = {}
        self.children: list[asyncio.subprocess.Process] = []
        self._stopping = False
        self._collector: MergedCollector | None = None
        self._taken: list[Any] = []

    async def start(self) -> None:
        for index in range(self.count):
            child = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "waygate",
                *self._argv(index),
                stdout=asyncio.subprocess.PIPE,
                preexec_fn=_die_with_parent(os.getpid()),
            )
            self.children.append(child)
            self.process.spawn(self._follow(index, child), f"{self.name}-worker-{index}")
        # The parent's own collectors move into the merged one, so no family is
        # exposed twice.
        self._taken = [c for c in list(REGISTRY._collector_to_names)]
        for collector in self._taken:
            REGISTRY.unregister(collector)
        self._collector = MergedCollector(self._taken, self.snapshots)
        REGISTRY.register(self._collector)
        self.process.on_drain(self._signal_children)
        self.process.on_stop(self.stop)
        self.process.spawn(self._ready_when_all_ready(), f"{self.name}-workers-ready")

    async def _follow(self, index: int, child: asyncio.subprocess.Process) -> None:
        assert child.stdout is not None
        async for line in child.stdout:
            with contextlib.suppress(ValueError, TypeError, KeyError):
                report = json.loads(line)
                self.snapshots[index] = str(report["metrics"])
                self.ready[index] = bool(report["ready"])
        code = await child.wait()
        if not self._stopping:
            raise RuntimeError(f"{self.name} worker {index} exited with code {code}")

    async def _ready_when_all_ready(self) -> None:
        while not (len(self.ready) == self.count and all(self.ready.values())):
            await asyncio.sleep(0.1)
        await self.process.mark_ready()

    def _signal_children(self) -> None:
        self._stopping = True
        for child in self.children:
            if child.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    child.send_signal(signal.SIGTERM)

    async def stop(self) -> None:
        self._signal_children()
        for child in self.children:
            try:
                await asyncio.wait_for(child.wait(), self._grace + 5)
            except TimeoutError:
                child.kill()
                await child.wait()
        if self._collector is not None:
            REGISTRY.unregister(self._collector)
            for collector in self._taken:
                with contextlib.suppress(ValueError):
                    REGISTRY.register(collector)
            self._collector = None
