"""Issue 8: the admin port keeps answering probes while a slowloris holds connections.

A reconnecting slow-headers attacker (100 connections from 127.0.0.2, as
another pod would be, each sending its request head one header line at a time
and reconnecting the moment it is dropped) kept /healthz at 503 for the whole
attack, which would make Kubernetes restart the pod again and again. Against
a real process, the probe from 127.0.0.1 must get 200 every time it asks.

From the probe's own address the defence is best effort: under a flood of new
connections from that address the probe's may be the oldest pending head when
the loop is slow, so that case is not asserted here (tests/integration/core/
test_admin_limits.py shows the newcomer from a full source being answered).
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
from pathlib import Path

import pytest

from tests.support.processes import start_service
from waygate.resolver.filesource import EXAMPLE_ROUTES

pytestmark = pytest.mark.system

ATTACKERS = 100
ATTACKER_SOURCE = "127.0.0.2"  # loopback too, but not the probe's address
PROBES = 20


async def slow_headers(port: int, source: str, stop: asyncio.Event, connections: list[int]) -> None:
    """Open a connection, dribble header lines, never finish; reconnect when dropped."""
    while not stop.is_set():
        writer = None
        try:
            reader, writer = await asyncio.open_connection(
                "127.0.0.1", port, local_addr=(source, 0)
            )
            connections[0] += 1
            writer.write(b"GET /healthz HTTP/1.1\r\n")
            while not stop.is_set() and not reader.at_eof():
                writer.write(b"X-Slow: 1\r\n")
                await writer.drain()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), 0.5)
        except OSError:
            pass
        finally:
            if writer is not None:
                writer.close()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.1)


async def probe(port: int, path: str) -> int:
    """The status code a probe got; 0 when the connection closed without an answer."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())
        status_line = await reader.readline()
        return int(status_line.split(b" ", 2)[1]) if status_line else 0  # 0: closed unanswered
    finally:
        writer.close()


async def test_probes_get_200_through_a_reconnecting_slowloris(tmp_path: Path) -> None:
    routes = tmp_path / "routes.yaml"
    shutil.copyfile(EXAMPLE_ROUTES, routes)
    service = await start_service(
        ["waygate", "resolver", "serve", "--grpc-port", "0", "--admin-port", "0",
         "--routes-file", str(routes)]
    )  # fmt: skip
    stop = asyncio.Event()
    connections = [0]
    attack = [
        asyncio.create_task(slow_headers(service.admin_port, ATTACKER_SOURCE, stop, connections))
        for _ in range(ATTACKERS)
    ]
    try:
        await asyncio.sleep(2.0)  # the attack is in full swing: above the 64 connections
        assert connections[0] >= ATTACKERS
        statuses = []
        for index in range(PROBES):
            path = "/healthz" if index % 2 == 0 else "/readyz"
            statuses.append(await asyncio.wait_for(probe(service.admin_port, path), 5.0))
            await asyncio.sleep(0.2)
        assert statuses == [200] * PROBES
        assert all(not task.done() for task in attack)  # the attacker kept at it throughout
    finally:
        stop.set()
        await asyncio.wait_for(asyncio.gather(*attack), 10)
        assert await service.stop() == 0
