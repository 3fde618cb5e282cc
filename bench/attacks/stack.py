"""A proxy under attack and what it costs: the stack, the attacker's process, /proc figures.

`proxy_stack(directory, *proxy_flags)`: two attack backends
(`bench.attacks.backend`), a resolver routing `echo.test` (the attacks') to
one and `calm.test` (the bystander's) to the other, and `waygate proxy serve` (all on port 0, each its own process, started as the
proxy's system tests start them), yielded as a `Stack` once a request through
the proxy is answered. `run_attack` runs one
attack of `tests.support.h2attack` in its own process for some seconds and
returns its report (the attacker's CPU seconds included). `ProcessFigures`
reads a process's CPU seconds and resident set from /proc (`peak_rss`: its
peak while a block runs).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.support.processes import ROOT, RunningService, child_env
from tests.system.test_proxy_system import start_proxy, start_resolver

AUTHORITY = "echo.test"  # the attacked route's host
BYSTANDER = "calm.test"  # the bystander's: the same proxy, a backend of its own

# Each host its own backend process: what the attack costs its backend (400 large
# bodies filling socket buffers) is not what the bystander measures.
ROUTES = """
services:
  - namespace: demo
    name: echo
    ports:
      - {{name: http, port: 80, targetPort: {echo}}}
    endpoints:
      - address: 127.0.0.1
  - namespace: demo
    name: calm
    ports:
      - {{name: http, port: 80, targetPort: {calm}}}
    endpoints:
      - address: 127.0.0.1
routes:
  - namespace: demo
    name: echo
    host: echo.test
    to: echo
    targetPort: http
  - namespace: demo
    name: calm
    host: calm.test
    to: calm
    targetPort: http
"""


@dataclass
class Stack:
    http_port: int
    proxy: RunningService

    @property
    def pid(self) -> int:
        return self.proxy.process.pid


class ProcessFigures:
    """CPU seconds (user + system) and resident memory of a process, from /proc."""

    TICK = os.sysconf("SC_CLK_TCK")

    def __init__(self, pid: int) -> None:
        self.pid = pid

    def cpu_seconds(self) -> float:
        fields = Path(f"/proc/{self.pid}/stat").read_text().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / self.TICK

    def rss_mib(self) -> float:
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return 0.0

    @contextlib.asynccontextmanager
    async def peak_rss(self, every: float = 0.1) -> AsyncIterator[list[float]]:
        """Sample the resident set while the block runs: [before, peak] MiB."""
        figures = [self.rss_mib()] * 2
        done = asyncio.Event()

        async def sample() -> None:
            while not done.is_set():
                figures[1] = max(figures[1], self.rss_mib())
                await asyncio.sleep(every)

        sampler = asyncio.get_running_loop().create_task(sample())
        try:
            yield figures
        finally:
            done.set()
            await sampler
            figures[1] = max(figures[1], self.rss_mib())


async def _ready(port: int, host: str, timeout: float = 20.0) -> None:
    """A request for `host` through the proxy answered 200: its route arrived."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        with contextlib.suppress(OSError, TimeoutError):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET /small HTTP/1.1\r\nHost: %s\r\n\r\n" % host.encode())
            head = await asyncio.wait_for(reader.read(4096), 5)
            writer.close()
            if head.startswith(b"HTTP/1.1 200"):
                return
        if loop.time() > deadline:
            raise AssertionError(f"the proxy never routed {host} to its backend")
        await asyncio.sleep(0.1)


@contextlib.asynccontextmanager
async def proxy_stack(directory: Path, *proxy_flags: str) -> AsyncIterator[Stack]:
    async with contextlib.AsyncExitStack() as stack:
        echo = await stack.enter_async_context(_backend())
        calm = await stack.enter_async_context(_backend())
        routes = directory / "routes.yaml"
        routes.write_text(ROUTES.format(echo=echo, calm=calm))
        resolver = await start_resolver(routes)
        stack.push_async_callback(resolver.stop)
        proxy, port = await start_proxy(
            resolver.grpc_address, "--shutdown-grace", "1s", *proxy_flags
        )
        stack.push_async_callback(proxy.stop, timeout=30)
        for host in (AUTHORITY, BYSTANDER):
            await _ready(port, host)
        yield Stack(port, proxy)


@contextlib.asynccontextmanager
async def _backend() -> AsyncIterator[int]:
    """A `bench.attacks.backend` process: its port; stopped (stdin closed) afterwards."""
    backend = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "bench.attacks.backend", cwd=ROOT, env=child_env(),
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        assert backend.stdout is not None
        yield int(await asyncio.wait_for(backend.stdout.readline(), 20))
    finally:
        if backend.stdin is not None:
            backend.stdin.close()
        try:
            await asyncio.wait_for(backend.wait(), 10)
        except TimeoutError:
            backend.kill()
            await backend.wait()


async def run_attack(
    kind: str, port: int, seconds: float, connections: int = 1, **options: Any
) -> dict[str, Any]:
    """`python -m bench.attacks attack ...` for `seconds`: the attacker's report."""
    argv = [
        sys.executable, "-m", "bench.attacks", "attack", kind, "--port", str(port),
        "--seconds", str(seconds), "--connections", str(connections),
    ]  # fmt: skip
    for name, value in options.items():
        argv += [f"--{name.replace('_', '-')}", str(value)]
    process = await asyncio.create_subprocess_exec(
        *argv, cwd=ROOT, env=child_env(), stdout=asyncio.subprocess.PIPE
    )
    out, _ = await asyncio.wait_for(process.communicate(), seconds + 60)
    assert process.returncode == 0, f"the attacker failed: {out!r}"
    return json.loads(out.decode().strip().splitlines()[-1])  # type: ignore[no-any-return]
