"""Two tunnel-server replicas behind one address: HAProxy (TCP mode), as a LoadBalancer would be.

The agent knows only HAProxy's address. It keeps connecting until it holds a
stream to every replica the servers report (no guessed count), whichever
replica HAProxy hands it. One replica is then killed (SIGKILL: no drain, no
goodbye); new dials from a caller that knows both replicas succeed through
the other, the caller doing nothing. The killed replica comes back on the
same port and the agent holds both again.
"""

from __future__ import annotations

import asyncio
import shutil
import signal
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from tests.support.poll import until
from tests.support.processes import RunningService, start_service
from tests.support.tunnel_processes import (
    NODE,
    SERVER_NAME,
    TunnelPKI,
    TunnelServer,
    agent_argv,
    start_server,
)
from waygate.core.grpcclient import ClientTLS
from waygate.tunnel.client import StaticPresence, TunnelClient
from waygate.tunnel.v1 import tunnel_pb2 as pb
from waygate.tunnel.v1 import tunnel_pb2_grpc

pytestmark = pytest.mark.system

REPLICAS = ("replica-a", "replica-b")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class HAProxy:
    """HAProxy in TCP mode in front of the replicas' agent ports, on a free port."""

    def __init__(self, directory: Path, backends: list[int]) -> None:
        binary = shutil.which("haproxy")
        if binary is None:
            pytest.skip("haproxy is not installed (Debian: apt-get install haproxy)")
        self.port = free_port()
        config = directory / "haproxy.cfg"
        servers = "\n".join(
            f"    server r{i} 127.0.0.1:{port} check inter 500ms fall 1 rise 1"
            for i, port in enumerate(backends)
        )
        config.write_text(
            f"""global
    maxconn 256
defaults
    mode tcp
    timeout connect 2s
    timeout client 1h
    timeout server 1h
frontend agents
    bind 127.0.0.1:{self.port}
    default_backend replicas
backend replicas
    balance roundrobin
{servers}
"""
        )
        self.log = (directory / "haproxy.log").open("wb")
        self.process = subprocess.Popen(
            [binary, "-db", "-f", str(config)], stdout=self.log, stderr=subprocess.STDOUT
        )

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(5)
        self.log.close()


@pytest.fixture
def pki(tmp_path: Path) -> Iterator[TunnelPKI]:
    yield TunnelPKI.create(tmp_path)


def channel_credentials(pki: TunnelPKI) -> grpc.ChannelCredentials:
    return ClientTLS(pki.ca_file, pki.dialer.cert, pki.dialer.key).credentials()


async def agents_on(pki: TunnelPKI, server: TunnelServer) -> list[pb.Agent]:
    async with grpc.aio.secure_channel(
        f"127.0.0.1:{server.dial_port}",
        channel_credentials(pki),
        options=[("grpc.ssl_target_name_override", SERVER_NAME)],
    ) as channel:
        reply = await tunnel_pb2_grpc.TunnelStub(channel).ListAgents(
            pb.ListAgentsRequest(node=NODE), timeout=5
        )
    return list(reply.agents)


async def holds_agent(pki: TunnelPKI, server: TunnelServer) -> bool:
    try:
        return any(not a.draining for a in await agents_on(pki, server))
    except grpc.aio.AioRpcError:
        return False


async def echo_backend() -> tuple[asyncio.Server, int]:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


async def round_trip(client: TunnelClient, port: int, payload: bytes) -> str:
    """One dial and echo through whichever replica answers; returns that replica's id."""
    stream = await client.dial(NODE, port)
    try:
        await stream.write(payload)
        received = b""
        async with asyncio.timeout(10):
            while len(received) < len(payload):
                chunk = await stream.read()
                assert chunk, "the tunnelled connection ended early"
                received += chunk
        assert received == payload
        return stream.server_id
    finally:
        await stream.aclose()


async def test_the_agent_holds_both_replicas_and_dials_survive_one_dying(
    pki: TunnelPKI, tmp_path: Path
) -> None:
    a, b = REPLICAS
    replica_a = await start_server(pki, server_id=a, replicas=[b])
    replica_b = await start_server(pki, server_id=b, replicas=[a])
    servers = {a: replica_a, b: replica_b}
    haproxy = HAProxy(tmp_path, [replica_a.agent_port, replica_b.agent_port])
    backend, backend_port = await echo_backend()
    agent: RunningService | None = None
    client = TunnelClient(
        StaticPresence([f"127.0.0.1:{replica_a.dial_port}", f"127.0.0.1:{replica_b.dial_port}"]),
        credentials=lambda: channel_credentials(pki),
        server_name=SERVER_NAME,
        dial_timeout=5.0,
    )
    try:
        agent = await start_service(
            agent_argv(pki, f"127.0.0.1:{haproxy.port}", allow=f"127.0.0.1/32:{backend_port}")
        )
        for replica, server in servers.items():
            await until(
                lambda s=server: holds_agent(pki, s),
                f"{replica} holding the agent",
                timeout=30,
                interval=0.2,
            )
        # Both replicas carry dials.
        seen = {await round_trip(client, backend_port, b"ping %d" % i) for i in range(20)}
        assert seen == set(REPLICAS)

        # Replica a dies without a word; the caller changes nothing.
        replica_a.service.process.send_signal(signal.SIGKILL)
        await replica_a.service.stop(sig=None)
        for i in range(20):
            assert await round_trip(client, backend_port, b"after %d" % i) == b

        # a comes back on the same agent port; the agent holds it again.
        servers[a] = replica_a = await start_server(
            pki, server_id=a, replicas=[b], agent_port=replica_a.agent_port
        )
        await until(
            lambda: holds_agent(pki, replica_a),
            "the agent back on replica-a",
            timeout=30,
            interval=0.2,
        )
        assert await holds_agent(pki, replica_b)
        (on_b,) = await agents_on(pki, replica_b)
        assert on_b.node == NODE
    finally:
        await client.close()
        if agent is not None:
            assert await agent.stop() == 0
        for server in servers.values():
            if server.service.process.returncode is None:
                await server.service.stop()
        haproxy.stop()
        backend.close()
