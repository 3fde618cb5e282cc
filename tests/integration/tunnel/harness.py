"""An in-process tunnel for tests: real TLS, real gRPC, real sockets.

`Tunnel` starts a tunnel server's two listeners (mTLS against a `LocalCA`),
an agent for node `edge-1` holding a stream to it, and hands out dial clients
with the identities a test asks for. Everything stops in `close()`.
"""

from __future__ import annotations

import asyncio
import ssl
from pathlib import Path
from typing import Any

import grpc

from tests.support.pki import IdentityFiles, LocalCA
from tests.support.poll import until
from waygate.core.grpcclient import ClientTLS
from waygate.core.grpcserver import GrpcServer, ServiceRegistration
from waygate.core.tls import server_context
from waygate.tunnel import wire
from waygate.tunnel.agent import Agent
from waygate.tunnel.agent_grpc import GrpcConnector
from waygate.tunnel.allow import AllowList
from waygate.tunnel.client import StaticPresence, TunnelClient
from waygate.tunnel.datapath import DataListener
from waygate.tunnel.relay import Link, client_context, open_link
from waygate.tunnel.server import AgentTunnelServicer, Hub, TunnelServicer
from waygate.tunnel.v1 import tunnel_pb2_grpc

DIALER = "spiffe://waygate.test/ns/t/sa/proxy"
NODE = "edge-1"


def credentials(files: IdentityFiles) -> grpc.ChannelCredentials:
    return ClientTLS(files.ca, files.cert, files.key).credentials()


def ssl_context(files: IdentityFiles) -> ssl.SSLContext:
    return client_context(files.ca.read_bytes(), files.cert.read_bytes(), files.key.read_bytes())


class Tunnel:
    def __init__(
        self,
        directory: Path,
        *,
        server_id: str = "replica-a",
        replicas: tuple[str, ...] = (),
        window: int = 1024 * 1024,
        allow: tuple[str, ...] = ("127.0.0.0/8:*",),
        ca: LocalCA | None = None,
        data_path: bool = True,
    ) -> None:
        self.directory = directory
        self.ca = ca or LocalCA()
        self.server_files = self.ca.write_files(
            directory, dns=["tunnel-server"], ips=["127.0.0.1"], prefix=f"{server_id}-"
        )
        # The agent role: a clientAuth-only certificate naming the node (waygate.tunnel.peers).
        self.agent_files = self.ca.write_files(
            directory, dns=[NODE], prefix="agent-", client_only=True
        )
        self.dialer_files = self.ca.write_files(directory, uris=[DIALER], prefix="dialer-")
        self.hub = Hub(server_id, replicas=replicas, window=window, dial_timeout=5.0)
        self.allow = allow
        self.window = window
        self.servers: list[GrpcServer] = []
        self.agents: list[Agent] = []
        self._tasks: list[asyncio.Task[None]] = []
        self.clients: list[TunnelClient] = []
        self.agent_port = 0
        self.dial_port = 0
        self.data_path = data_path  # the data listener and agents' data connections
        self.data: DataListener | None = None
        self.data_port = 0

    async def start_server(self) -> None:
        creds = grpc.ssl_server_credentials(
            [(self.server_files.key.read_bytes(), self.server_files.cert.read_bytes())],
            root_certificates=self.ca.pem,
            require_client_auth=True,
        )
        agents = GrpcServer(
            host="127.0.0.1",
            port=self.agent_port,
            registrations=[
                ServiceRegistration(
                    "waygate.tunnel.v1.AgentTunnel",
                    tunnel_pb2_grpc.add_AgentTunnelServicer_to_server,
                    AgentTunnelServicer(self.hub),
                )
            ],
            credentials=creds,
        )
        dialers = GrpcServer(
            host="127.0.0.1",
            port=self.dial_port,
            registrations=[
                ServiceRegistration(
                    "waygate.tunnel.v1.Tunnel",
                    tunnel_pb2_grpc.add_TunnelServicer_to_server,
                    TunnelServicer(self.hub, dialers=(DIALER,)),
                )
            ],
            credentials=creds,
        )
        self.agent_port = await agents.start()
        self.dial_port = await dialers.start()
        self.servers = [agents, dialers]
        if self.data_path:
            context = server_context(
                chain_pem=self.server_files.cert.read_bytes(),
                key_pem=self.server_files.key.read_bytes(),
                client_ca_pem=self.ca.pem,
                client_auth=True,
            )
            self.data = DataListener(self.hub, context, dialers=(DIALER,))
            self.data_port = await self.data.start("127.0.0.1", self.data_port)
            self.hub.data_address = f"127.0.0.1:{self.data_port}"

    async def data_link(self, files: IdentityFiles | None = None) -> Link:
        """A raw connection to the data port as `files` (the dialer's by default), the
        replica's greeting read: what a test writes next is the client's first line."""
        link = await open_link(
            "127.0.0.1",
            self.data_port,
            ssl_context(files or self.dialer_files),
            server_hostname="tunnel-server",
            timeout=5.0,
        )
        try:
            assert wire.parse_greeting(await link.read_line(5.0)) == self.hub.server_id
        except BaseException:
            link.abort()
            raise
        return link

    async def start_agent(
        self,
        *,
        wait: bool = True,
        window: int | None = None,
        allow: tuple[str, ...] | None = None,
        park: bool = True,
        data_connections: bool = True,
    ) -> Agent:
        # One context per agent, as a process's rotating context is (a new one per data
        # connection cost two milliseconds of PEM parsing a dial).
        context = ssl_context(self.agent_files)
        agent = Agent(
            node=NODE,
            server_address=f"127.0.0.1:{self.agent_port}",
            connector=GrpcConnector(
                f"127.0.0.1:{self.agent_port}",
                lambda: credentials(self.agent_files),
                server_name="tunnel-server",
            ),
            ssl_context=lambda: context,
            allow=AllowList(self.allow if allow is None else allow, own=()),
            window=window or self.window,
            server_name="tunnel-server",
            park=park,
            data_connections=data_connections,
        )
        self.agents.append(agent)
        self._tasks.append(asyncio.ensure_future(agent.run()))
        if wait:
            await until(lambda: NODE in self.hub.sessions, "the agent's stream")
            if self.data_path and data_connections:  # a full pool: a test's baseline stays put
                # Not vacuous: the server registers the stream before the agent has
                # read its SERVER_INFO and added it to `streams`.
                await until(
                    lambda: (
                        bool(agent.streams)
                        and all(
                            s.pool is not None and len(s.pool.idle) >= agent.pool_size
                            for s in agent.streams.values()
                        )
                    ),
                    "the agent's pool of data connections",
                )
                if park:  # and the replica has them parked (its PARK lines read)
                    await until(
                        lambda: all(
                            len(s.parked) >= agent.pool_size
                            for s in self.hub.sessions_all()
                            if s.agent_id == agent.agent_id
                        ),
                        "the agent's data connections parked on the replica",
                    )
        return agent

    async def stop_agent(self, agent: Agent) -> None:
        index = self.agents.index(agent)
        task = self._tasks.pop(index)
        self.agents.pop(index)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    def client(
        self,
        files: IdentityFiles | None = None,
        *,
        data_path: bool | None = None,
        pool_size: int = 0,
        pool_idle: float = 30.0,
        end_to_end: bool = False,
    ) -> TunnelClient:
        """A dial client; raw dials on the data listener when the tunnel has one (or
        `data_path` says so), else Tunnel.Dial streams; `pool_size` warm connections."""
        identity = files or self.dialer_files
        context = ssl_context(identity)  # one context: what a process's client keeps
        client = TunnelClient(
            StaticPresence([f"127.0.0.1:{self.dial_port}"]),
            credentials=lambda: credentials(identity),
            server_name="tunnel-server",
            ssl_context=lambda: context,
            data_path=self.data_path if data_path is None else data_path,
            pool_size=pool_size,
            pool_idle=pool_idle,
            end_to_end=end_to_end,
        )
        self.clients.append(client)
        return client

    async def close(self) -> None:
        for client in self.clients:
            await client.close()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for server in self.servers:
            await server.stop(0)
        if self.data is not None:
            await self.data.stop()


async def echo_once(stream: Any, payload: bytes) -> bytes:
    """Write `payload` on a dialled stream and read back as many bytes (an echo's answer)."""
    await stream.write(payload)
    received = b""
    while len(received) < len(payload):
        more = await stream.read()
        assert more, "the echo ended early"
        received += more
    return received


async def echo_server() -> tuple[asyncio.Server, int]:
    """A TCP echo server that half-closes after echoing everything the peer sent."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
            writer.write_eof()
            await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


async def http_backend() -> tuple[asyncio.Server, int, list[bytes]]:
    """An HTTP/1.1 backend: records each request head, answers 200 `ok`, then closes."""
    heads: list[bytes] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            heads.append(await reader.readuntil(b"\r\n\r\n"))
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
            await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1], heads
