"""Presence and draining, with real tunnel-server, agent and resolver processes.

A tunnel server reports the nodes it holds to a real resolver, and a replica
that dies (SIGKILL: no goodbye) loses its presence within its lease. SIGTERM
drains: the agent is told to move, new dials are refused, open connections
carry on through the grace period.

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

from tests.support.processes import RunningService, http_get, start_service
from waygate.core.grpctls import RotatingChannel
from waygate.resolver.client import Kind, ResolverWatch

pytestmark = pytest.mark.system

LEASE = 3.0


async def start_resolvers(tmp_path: Path, count: int) -> list[RunningService]:
    """`count` resolvers over one (empty) routes file: replicas, as far as a file allows."""
    routes = tmp_path / "routes.yaml"
    routes.write_text("services: []\nroutes: []\n")
    argv = ["waygate", "resolver", "serve", "--grpc-port", "0", "--admin-port", "0",
            "--routes-file", str(routes), "--tunnel-lease-min", "1s"]  # fmt: skip
    return list(await asyncio.gather(*(start_service(argv) for _ in range(count))))


async def start_tunnel_server(resolver_address: str) -> RunningService:
    return await start_service(
        ["waygate", "tunnel", "serve", "--grpc-port", "0", "--dial-port", "0", "--data-port", "0",
         "--front-port", "0", "--admin-port", "0", "--server-id", "replica-a",
         "--resolver-address", resolver_address, "--presence-lease", f"{LEASE}s"]
    )  # fmt: skip


async def start_agent(server: RunningService, node: str) -> RunningService:
    return await start_service(
        ["waygate", "tunnel", "agent", "--admin-port", "0", "--node", node,
         "--server-address", f"127.0.0.1:{server.grpc_ports[0]}"]
    )  # fmt: skip


def tunnels_watch(resolver: RunningService) -> ResolverWatch:
    return ResolverWatch(
        lambda: grpc.aio.insecure_channel(resolver.grpc_address), kinds=(Kind.TUNNELS,)
    )


async def test_presence_follows_the_agent_and_ends_within_the_lease(tmp_path: Path) -> None:
    (resolver,) = await start_resolvers(tmp_path, 1)
    server = agent = None
    watch = tunnels_watch(resolver)
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
        server = await start_tunnel_server(resolver.grpc_address)
        agent = await start_agent(server, "edge-9")
        await wait(lambda: holders("edge-9") == ["replica-a"], "presence of edge-9")

        await agent.stop(signal.SIGKILL)
        agent = None
        await wait(lambda: holders("edge-9") == [], "presence to follow the agent away")

        agent = await start_agent(server, "edge-9")
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


async def test_sigterm_drains_open_connections_finish_new_dials_refused(tmp_path: Path) -> None:
    """SIGTERM: the agent is told to move, new dials are refused, and a connection
    already open keeps carrying bytes through the grace period."""
    from waygate.tunnel.client import DialFailed, StaticPresence, TunnelClient

    server = await start_service(
        ["waygate", "tunnel", "serve", "--grpc-port", "0", "--dial-port", "0", "--data-port", "0",
         "--front-port", "0", "--admin-port", "0", "--server-id", "replica-a",
         "--shutdown-grace", "20s"]
    )  # fmt: skip
    agent = await start_service(
        ["waygate", "tunnel", "agent", "--admin-port", "0", "--node", "edge-9",
         "--allow", "127.0.0.1/32:*", "--server-address", f"127.0.0.1:{server.grpc_ports[0]}"]
    )  # fmt: skip
    echoed: list[bytes] = []

    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(65536):
            echoed.append(data)
            writer.write(data)
        writer.close()

    backend = await asyncio.start_server(echo, "127.0.0.1", 0)
    port = backend.sockets[0].getsockname()[1]
    client = TunnelClient(
        StaticPresence([f"127.0.0.1:{server.grpc_ports[1]}"]), credentials=lambda: None
    )
    try:
        async with asyncio.timeout(20):
            while not server.logged("agent connected"):
                await asyncio.sleep(0.05)
        stream = await client.dial("edge-9", port)
        await stream.write(b"before")
        assert await stream.read() == b"before"
        server.process.send_signal(signal.SIGTERM)
        async with asyncio.timeout(10):
            while not agent.logged("server replica is draining; connecting to the others"):
                await asyncio.sleep(0.05)
        with pytest.raises(DialFailed) as refused:
            await client.dial("edge-9", port)
        assert refused.value.retryable  # another replica could take it
        await stream.write(b"during the grace")
        assert await stream.read() == b"during the grace"
        # Still ready while the draining replica carries a connection. (Once that
        # connection ends the agent leaves the replica, so readiness is only
        # deterministic here, not after the close below.)
        assert (await http_get(agent.admin_port, "/readyz"))[0] == 200
        await stream.write_eof()
        assert await stream.read() == b""
        assert await stream.wait_closed() == grpc.StatusCode.OK
        await server.stop(None)
        async with asyncio.timeout(10):  # no replica left: the agent is not ready
            while (await http_get(agent.admin_port, "/readyz"))[0] != 503:
                await asyncio.sleep(0.1)
    finally:
        await client.close()
        backend.close()
        await agent.stop()
        await server.stop()


async def test_a_replica_reports_to_every_resolver_replica_listed(tmp_path: Path) -> None:
    """Two resolvers over one routes file (replicas): each hears the tunnel server on
    its own stream, so the one left when the other is killed still routes the node."""
    resolvers = await start_resolvers(tmp_path, 2)
    watches = [tunnels_watch(r) for r in resolvers]
    watching = [asyncio.ensure_future(w.run()) for w in watches]

    def holders(watch: ResolverWatch) -> list[str]:
        presence = watch.view.tunnels.get("edge-7") if watch.view is not None else None
        return [s.id for s in presence.servers] if presence is not None else []

    server = agent = None
    try:
        server = await start_tunnel_server(",".join(r.grpc_address for r in resolvers))
        agent = await start_agent(server, "edge-7")
        async with asyncio.timeout(20):
            while [holders(w) for w in watches] != [["replica-a"], ["replica-a"]]:
                await asyncio.sleep(0.05)
        # One resolver replica dies; the other's stream carries on and follows changes.
        await resolvers[0].stop(signal.SIGKILL)
        await agent.stop(signal.SIGKILL)
        agent = None
        async with asyncio.timeout(20):
            while holders(watches[1]) != []:
                await asyncio.sleep(0.05)
        agent = await start_agent(server, "edge-7")
        async with asyncio.timeout(20):
            while holders(watches[1]) != ["replica-a"]:
                await asyncio.sleep(0.05)
    finally:
        for task in watching:
            task.cancel()
        await asyncio.gather(*watching, return_exceptions=True)
        for service in (agent, server, *resolvers):
            if service is not None and service.process.returncode is None:
                await service.stop()


class StandInHub:
    """A STAND-IN for the tunnel hub: a replica id and a fixed node set, all
    `PresenceReporter` reads (the agents are not what this test is about)."""

    server_id = "replica-x"

    def subscribe(self, listener: object) -> None:
        pass

    def nodes(self) -> list[str]:
        return ["edge-5"]


async def test_every_replica_behind_a_name_gets_a_report_as_the_name_changes(
    tmp_path: Path,
) -> None:
    """`EveryReplica` (--resolver-replicas-service): one report stream per address the
    name resolves to, added and ended as the answer changes, kept through a failed
    lookup. The lookup is injected (one host here cannot resolve to two loopbacks)."""
    from waygate.core.grpctls import static_client_channel
    from waygate.tunnel.presence import EveryReplica

    resolvers = await start_resolvers(tmp_path, 2)
    a, b = (r.grpc_address for r in resolvers)
    watches = [tunnels_watch(r) for r in resolvers]
    watching = [asyncio.ensure_future(w.run()) for w in watches]
    answer: set[str] | OSError = {a}
    opened: list[str] = []

    async def resolve(host: str, port: int) -> set[str]:
        assert (host, port) == ("resolvers.example", 7001)
        if isinstance(answer, OSError):
            raise answer
        return set(answer)

    async def open_channel(target: str) -> RotatingChannel:
        opened.append(target)
        return static_client_channel(target, None)

    def seen() -> list[bool]:
        return [w.view is not None and "edge-5" in w.view.tunnels for w in watches]

    async def until_seen(expected: list[bool]) -> None:
        async with asyncio.timeout(20):
            while seen() != expected:
                await asyncio.sleep(0.05)

    every = EveryReplica(
        StandInHub(),  # type: ignore[arg-type]
        open_channel,
        "resolvers.example:7001",
        address="127.0.0.1:7004",
        lease=1.5,
        resolve=resolve,
    )
    running = asyncio.ensure_future(every.run())
    try:
        await until_seen([True, False])
        answer = {a, b}
        await until_seen([True, True])
        # a leaves the answer (its pod went): its stream ends, so does its presence.
        answer = {b}
        await until_seen([False, True])
        # A failed lookup keeps the reports that run.
        answer = OSError("temporary failure in name resolution")
        await asyncio.sleep(1.5)
        assert seen() == [False, True] and set(every.reporters) == {b}
        assert opened == [a, b]
    finally:
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)
        assert every.reporters == {}
        for task in watching:
            task.cancel()
        await asyncio.gather(*watching, return_exceptions=True)
        for service in resolvers:
            await service.stop()
