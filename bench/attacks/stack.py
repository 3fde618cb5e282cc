"""A proxy under attack and what it costs: the stack, the attacker's process, /proc figures.

`proxy_stack(directory, *proxy_flags)`: the attack backend
(`bench.attacks.backend`), a resolver routing `echo.test` to it and
`waygate proxy serve` (all on port 0, each its own process), yielded as a
`Stack` once a request through the proxy is answered. `run_attack` runs one
attack of `tests.support.h2attack` in its own process for some seconds and
returns its report (the attacker's CPU seconds included). `ProcessFigures`
reads a process's CPU seconds and resident set from /proc.
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

from tests.support.processes import ROOT, RunningService, child_env, start_service

AUTHORITY = "echo.test"

ROUTES = """
services:
  - namespace: demo
    name: echo
    ports:
      - {{name: http, port: 80, targetPort: {port}}}
    endpoints:
      - address: 127.0.0.1
routes:
  - namespace: demo
    name: echo
    host: echo.test
    to: echo
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


async def _ready(port: int, timeout: float = 20.0) -> None:
    """A request through the proxy answered 200: the routes arrived."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        with contextlib.suppress(OSError, TimeoutError):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET /small HTTP/1.1\r\nHost: echo.test\r\n\r\n")
            head = await asyncio.wait_for(reader.read(4096), 5)
            writer.close()
            if head.startswith(b"HTTP/1.1 200"):
                return
        if loop.time() > deadline:
            raise AssertionError("the proxy never routed echo.test to the attack backend")
        await asyncio.sleep(0.1)


@contextlib.asynccontextmanager
async def proxy_stack(directory: Path, *proxy_flags: str) -> AsyncIterator[Stack]:
    backend = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "bench.attacks.backend", cwd=ROOT, env=child_env(),
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    resolver = proxy = None
    try:
        assert backend.stdout is not None
        backend_port = int(await asyncio.wait_for(backend.stdout.readline(), 20))
        routes = directory / "routes.yaml"
        routes.write_text(ROUTES.format(port=backend_port))
        resolver = await start_service(
            ["waygate", "resolver", "serve", "--grpc-port", "0", "--admin-port", "0",
             "--routes-file", str(routes)]
        )  # fmt: skip
        proxy = await start_service(
            ["waygate", "proxy", "serve", "--http-port", "0", "--https-port", "0",
             "--admin-port", "0", "--resolver-address", resolver.grpc_address,
             "--shutdown-grace", "1s", *proxy_flags]
        )  # fmt: skip
        entry = next(
            e for e in proxy.logs if e.get("msg") == "proxy listening" and "http_port" in e
        )
        port = int(entry["http_port"])
        await _ready(port)
        yield Stack(port, proxy)
    finally:
        if proxy is not None:
            await proxy.stop(timeout=30)
        if resolver is not None:
            await resolver.stop()
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
