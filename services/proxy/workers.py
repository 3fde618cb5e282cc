"""`--workers N`: N proxy processes on one HTTP port, one admin port for all.

The parent keeps the admin port (/metrics, /readyz) and runs no listener of
its own. It reserves the HTTP port (a bound, never listening SO_REUSEPORT
socket, so `--http-port 0` gives every worker the same port), writes one
sticky-cookie key (0600, so a cookie means the same endpoint in every worker)
and starts N children: `waygate proxy serve` with the parent's own arguments
plus `--worker --workers 1 --http-port P --admin-port 0 --sticky-key-file K`.
Each worker has its own resolver watch and listener (SO_REUSEPORT: the kernel
spreads connections) and writes a JSON snapshot of its metrics to stdout
every second; the parent merges the latest snapshot of each worker into its
/metrics and is ready once every worker reports ready.

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
import secrets
import signal
import socket
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prometheus_client import REGISTRY

from waygate.core.files import write_file_atomically
from waygate.proxy.metrics import ProxyCollector, ProxyMetrics, merge

if TYPE_CHECKING:
    from waygate.core.runtime import ServiceProcess
    from waygate.proxy.app import Settings

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


async def report_forever(metrics: ProxyMetrics, ready: Callable[[], bool]) -> None:
    """In a worker: one JSON line of metrics on stdout per interval."""
    out = sys.stdout
    while True:
        snapshot = metrics.snapshot()
        snapshot["ready"] = ready()
        out.write(json.dumps(snapshot) + "\n")
        out.flush()
        await asyncio.sleep(REPORT_INTERVAL)


class WorkerGroup:
    def __init__(self, process: ServiceProcess, settings: Settings) -> None:
        self.process = process
        self.settings = settings
        self.snapshots: dict[int, dict[str, Any]] = {}
        self.children: list[asyncio.subprocess.Process] = []
        self._reservation: socket.socket | None = None
        self._https_reservation: socket.socket | None = None
        self._key_dir: tempfile.TemporaryDirectory[str] | None = None
        self._stopping = False

    def merged(self) -> dict[str, Any]:
        return merge(list(self.snapshots.values()))

    async def start(self) -> None:
        settings = self.settings
        reservation = socket.socket(
            socket.AF_INET6 if ":" in settings.host else socket.AF_INET, socket.SOCK_STREAM
        )
        reservation.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        reservation.bind((settings.host, settings.http_port))
        self._reservation = reservation
        port = reservation.getsockname()[1]
        https_port = settings.https_port
        if https_port == 0:
            # `--https-port 0` likewise reserved: one port for every worker. (A fixed
            # port is not: the workers bind it only when they have a certificate.)
            https = socket.socket(reservation.family, socket.SOCK_STREAM)
            https.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            https.bind((settings.host, 0))
            self._https_reservation = https
            https_port = https.getsockname()[1]
        key_file = settings.sticky_key_file
        if key_file is None:
            self._key_dir = tempfile.TemporaryDirectory(prefix="waygate-proxy-")
            key_file = Path(self._key_dir.name) / "sticky.key"
            write_file_atomically(key_file, secrets.token_hex(32).encode(), 0o600)
        argv = [
            *sys.argv[1:],
            "--worker",
            "--workers",
            "1",
            "--http-port",
            str(port),
            "--https-port",
            str(https_port),
            "--admin-port",
            "0",
            "--sticky-key-file",
            str(key_file),
        ]
        for index in range(settings.workers):
            child = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "waygate",
                *argv,
                stdout=asyncio.subprocess.PIPE,
                preexec_fn=_die_with_parent(os.getpid()),
            )
            self.children.append(child)
            self.process.spawn(self._follow(index, child), f"proxy-worker-{index}")
        REGISTRY.register(ProxyCollector(self.merged))
        self.process.on_drain(self._signal_children)
        self.process.on_stop(self.stop)
        self.process.spawn(self._ready_when_all_ready(), "proxy-workers-ready")
        log.info("proxy listening", extra={"http_port": port, "workers": settings.workers})

    async def _follow(self, index: int, child: asyncio.subprocess.Process) -> None:
        assert child.stdout is not None
        async for line in child.stdout:
            with contextlib.suppress(ValueError):
                self.snapshots[index] = json.loads(line)
        code = await child.wait()
        if not self._stopping:
            raise RuntimeError(f"proxy worker {index} exited with code {code}")

    async def _ready_when_all_ready(self) -> None:
        while not (
            len(self.snapshots) == len(self.children)
            and all(s.get("ready") for s in self.snapshots.values())
        ):
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
        grace = self.settings.shutdown_grace + 5
        for child in self.children:
            try:
                await asyncio.wait_for(child.wait(), grace)
            except TimeoutError:
                child.kill()
                await child.wait()
        for collector in list(REGISTRY._collector_to_names):
            if isinstance(collector, ProxyCollector):
                REGISTRY.unregister(collector)
        if self._reservation is not None:
            self._reservation.close()
        if self._https_reservation is not None:
            self._https_reservation.close()
        if self._key_dir is not None:
            self._key_dir.cleanup()
