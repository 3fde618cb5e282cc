"""Presence: a tunnel server reports the nodes it holds to a real resolver, and a
replica that dies (SIGKILL: no goodbye) loses its presence within its lease.

Plaintext on loopback (development mode: the agent names its node in metadata,
the resolver takes reports from anyone), which keeps this about presence alone;
test_tunnel_processes.py covers the mTLS identities.
"""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

import grpc
import pytest

from tests.support.processes import start_service
from waygate.resolver.client import Kind, ResolverWatch

pytestmark = pytest.mark.system

LEASE = 3.0


async def test_presence_follows_the_agent_and_ends_within_the_lease(tmp_path: Path) -> None:
    routes = tmp_path / "routes.yaml"
    routes.write_text("services: []\nroutes: []\n")
    resolver = await start_service(
        ["waygate", "resolver", "serve", "--grpc-port", "0", "--admin-port", "0",
         "--routes-file", str(routes), "--tunnel-lease-min", "1s"]
    )  # fmt: skip
    server = agent = None
    watch = ResolverWatch(
        lambda: grpc.aio.insecure_channel(resolver.grpc_address), kinds=(Kind.TUNNELS,)
    )
    watching = asyncio.ensure_future(watch.run())

    def holders(node: str) -> list[str]:
        view = watch.view
        presence = view.tunnels.get(node) if view is not None else None
        return [s.id for s in presence.servers] if presence is not None else []

    async def wait(predicate: object, what: str, timeout: float = 20) -> None:
        async with asyncio.timeout(timeout):
            while not predicate():  # type: ignore[operator]
                await asyncio.sleep(0.05)

    try:
        server = await start_service(
            ["waygate", "tunnel", "serve", "--grpc-port", "0", "--dial-port", "0",
             "--front-port", "0", "--admin-port", "0", "--server-id", "replica-a",
             "--resolver-address", resolver.grpc_address,
             "--presence-lease", f"{LEASE}s"]
        )  # fmt: skip
        agent = await start_service(
            ["waygate", "tunnel", "agent", "--admin-port", "0", "--node", "edge-9",
             "--server-address", f"127.0.0.1:{server.grpc_ports[0]}"]
        )  # fmt: skip
        await wait(lambda: holders("edge-9") == ["replica-a"], "presence of edge-9")

        await agent.stop(signal.SIGKILL)
        agent = None
        await wait(lambda: holders("edge-9") == [], "presence to follow the agent away")

        agent = await start_service(
            ["waygate", "tunnel", "agent", "--admin-port", "0", "--node", "edge-9",
             "--server-address", f"127.0.0.1:{server.grpc_ports[0]}"]
        )  # fmt: skip
        await wait(lambda: holders("edge-9") == ["replica-a"], "presence back")
        killed = time.monotonic()
        await server.stop(signal.SIGKILL)
        server = None
        await wait(lambda: holders("edge-9") == [], "presence of the dead replica to end")
        # Within the lease at the latest (on loopback the kernel ends the stream at once;
        # a silent partition is what the lease itself is for, tested with the resolver).
        assert time.monotonic() - killed < LEASE + 2.0
    finally:
        watching.cancel()
        await asyncio.gather(watching, return_exceptions=True)
        for service in (agent, server, resolver):
            if service is not None:
                await service.stop()
