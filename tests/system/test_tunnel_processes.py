"""The tunnel as separate processes: certs, `waygate tunnel serve`, `waygate tunnel agent`.

Server and agent take short-lived certificates from a real certs process and
renew them while a long transfer runs through the tunnel; a WebSocket session
runs over the dial client's socket bridge; the agent is killed and restarted;
`waygate tunnel dial` is refused a destination outside the agent's
allow-list and a dialer outside the server's policy.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import signal
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import websockets
import yaml

from tests.support.otlp import OtlpReceiver
from tests.support.poll import until
from tests.support.processes import RunningService, child_env, run_cli, start_service
from waygate.certs.client import GrpcIssuer
from waygate.core.grpctls import client_credentials
from waygate.core.rotation import CertificateRotator, TrustBundle, TrustStore, save_certificate
from waygate.tunnel.client import (
    DataStream,
    DialFailed,
    StaticPresence,
    TunnelClient,
    bridged_socket,
)
from waygate.tunnel.relay import rotating_client_context
from waygate.tunnel.v1 import tunnel_pb2 as pb

pytestmark = pytest.mark.system

NODE = "edge-1"
SERVER_ID = "spiffe://waygate.test/ns/t/sa/tunnel-server"
DIALER_ID = "spiffe://waygate.test/ns/t/sa/proxy"
STRANGER_ID = "spiffe://waygate.test/ns/t/sa/stranger"
TOKENS = {
    "tunnel-server": (f"uri:{SERVER_ID}", "ip:127.0.0.1"),
    "tunnel-agent": (f"dns:{NODE}",),
    "dialer": (f"uri:{DIALER_ID}",),
    "stranger": (f"uri:{STRANGER_ID}",),
}


@dataclass
class Stack:
    directory: Path
    certs: RunningService
    server: RunningService
    agent: RunningService | None
    otlp: OtlpReceiver

    @property
    def bundle(self) -> Path:
        return self.directory / "bundle.pem"

    @property
    def agent_port(self) -> int:
        return self.server.grpc_ports[0]

    @property
    def dial_address(self) -> str:
        return f"127.0.0.1:{self.server.grpc_ports[1]}"

    def token(self, name: str) -> Path:
        return self.directory / f"{name}.token"

    async def start_agent(self, *extra: str) -> RunningService:
        self.agent = await start_service(
            [
                "waygate", "tunnel", "agent", "--admin-port", "0",
                "--server-address", f"127.0.0.1:{self.agent_port}",
                "--certs-address", self.certs.grpc_address,
                "--certs-token-file", str(self.token("tunnel-agent")),
                "--certs-ca-file", str(self.bundle),
                "--cert-identity", NODE, "--allow", "127.0.0.1/32:*",
                "--reconnect-max", "1s", "--otlp-endpoint", self.otlp.endpoint, *extra,
            ]
        )  # fmt: skip
        return self.agent

    async def identity(self, name: str, identity: str) -> Path:
        """A certificate for the test itself (key made here), as files under directory/name."""
        trust = TrustStore(TrustBundle.from_pem(self.bundle.read_bytes()))
        rotator = CertificateRotator(
            GrpcIssuer(self.certs.grpc_address, self.token(name), trust), identity
        )
        held = await rotator.obtain()
        folder = self.directory / name
        folder.mkdir(exist_ok=True)
        save_certificate(held, folder / "key.pem", folder / "cert.pem")
        self._rotators[name] = (rotator, trust)
        # Renewed as a process's would be (12 s leaves): new dials present the new one.
        self._renewing.append(asyncio.ensure_future(rotator.run()))
        return folder

    def cli_flags(self, name: str) -> list[str]:
        """Flags for a `waygate tunnel` CLI process as identity `name`: its current
        certificate written out now (leaves live 12 s; a file written when the identity
        was first made can have expired by the time a loaded machine starts the CLI)."""
        rotator, _trust = self._rotators[name]
        folder = self.directory / name
        save_certificate(rotator.current, folder / "key.pem", folder / "cert.pem")
        return [
            "--addr", self.dial_address, "--ca-file", str(self.bundle),
            "--cert-file", str(folder / "cert.pem"), "--key-file", str(folder / "key.pem"),
        ]  # fmt: skip

    def client(self, name: str = "dialer") -> TunnelClient:
        rotator, trust = self._rotators[name]
        client = TunnelClient(
            StaticPresence([self.dial_address]),
            credentials=lambda: client_credentials(rotator, trust),
            # Raw dials on the data listener with the same renewing certificate, from
            # a warm pool as the proxy dials: a transfer rides a data connection on
            # both hops while server, agent and dialer renew.
            ssl_context=rotating_client_context(rotator, trust),
            pool_size=2,
        )
        self._clients.append(client)
        return client

    def __post_init__(self) -> None:
        self._rotators: dict[str, tuple[CertificateRotator, TrustStore]] = {}
        self._clients: list[TunnelClient] = []
        self._renewing: list[asyncio.Task[None]] = []

    async def close(self) -> None:
        for client in self._clients:
            await client.close()
        for task in self._renewing:
            task.cancel()
        await asyncio.gather(*self._renewing, return_exceptions=True)
        for service in (self.agent, self.server, self.certs):
            if service is not None and service.process.returncode is None:
                await service.stop()


@pytest.fixture
async def stack(tmp_path: Path) -> AsyncIterator[Stack]:
    otlp = OtlpReceiver()
    await otlp.start()
    tokens = []
    for name, allowed in TOKENS.items():
        secret = os.urandom(24).hex()
        (tmp_path / f"{name}.token").write_text(secret + "\n")
        (tmp_path / f"{name}.token").chmod(0o600)
        tokens.append({"token": secret, "name": name, "allowed": list(allowed)})
    tokens_file = tmp_path / "tokens.yaml"
    tokens_file.write_text(yaml.safe_dump({"tokens": tokens}))
    tokens_file.chmod(0o600)
    certs = await start_service(
        [
            "waygate", "certs", "serve", "--grpc-port", "0", "--admin-port", "0",
            "--ca-dir", str(tmp_path / "ca"), "--tokens-file", str(tokens_file),
            "--bundle-file", str(tmp_path / "bundle.pem"), "--trust-domain", "waygate.test",
            "--serving-identity", "spiffe://waygate.test/ns/t/sa/certs",
            "--serving-sans", "ip:127.0.0.1",
            # Short leaves, backdated 1 s only: server and agent renew every few seconds.
            # (Not 0: not_before is a whole second and TLS checks it against time(2),
            # up to a kernel tick behind, so an unbackdated leaf presented at once can
            # be "not yet valid"; see tests/support/pki.py.)
            "--leaf-lifetime", "12s", "--clock-skew", "1",
        ]
    )  # fmt: skip
    server = None
    result: Stack | None = None
    try:
        server = await start_service(
            [
                "waygate", "tunnel", "serve", "--grpc-port", "0", "--dial-port", "0", "--data-port", "0",
                "--front-port", "0", "--admin-port", "0", "--server-id", "replica-a",
                "--certs-address", certs.grpc_address,
                "--certs-token-file", str(tmp_path / "tunnel-server.token"),
                "--certs-ca-file", str(tmp_path / "bundle.pem"),
                "--cert-identity", SERVER_ID, "--cert-sans", "ip:127.0.0.1",
                "--dialers", DIALER_ID, "--otlp-endpoint", otlp.endpoint,
            ]
        )  # fmt: skip
        result = Stack(tmp_path, certs, server, None, otlp)
        await result.start_agent()
        await result.identity("dialer", DIALER_ID)
        await until(lambda: result.server.logged("agent connected"), "the agent's stream")
        yield result
    finally:
        if result is not None:
            await result.close()
        else:
            if server is not None:
                await server.stop()
            await certs.stop()
        await otlp.stop()


def renewals(service: RunningService) -> int:
    return sum(1 for entry in service.logs if entry.get("msg") == "new certificate")


async def test_a_long_transfer_completes_across_certificate_renewals(stack: Stack) -> None:
    assert stack.agent is not None
    agent = stack.agent
    server_before, agent_before = renewals(stack.server), renewals(agent)
    dialer_rotator = stack._rotators["dialer"][0]
    dialer_before = dialer_rotator.current
    digest = hashlib.sha256()
    total = 0

    def both_renewed() -> bool:  # server, agent and the dialer
        return (
            renewals(stack.server) > server_before
            and renewals(agent) > agent_before
            and dialer_rotator.current is not dialer_before
        )

    async def slow_source(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # Streams until server and agent have both renewed their certificates
        # (12 s leaves: within about 10 s), and at least 8 MiB.
        nonlocal total
        chunk = os.urandom(64 * 1024)
        async with asyncio.timeout(60):
            while not both_renewed() or total < 8 * 1024 * 1024:
                digest.update(chunk)
                writer.write(chunk)
                total += len(chunk)
                await writer.drain()
                await asyncio.sleep(0.02)
        writer.close()

    source = await asyncio.start_server(slow_source, "127.0.0.1", 0)
    port = source.sockets[0].getsockname()[1]
    async with source:
        client = stack.client()
        stream = await client.dial(NODE, port)
        assert isinstance(stream, DataStream)  # the raw data path on both hops
        opened_with = stream.link.get_extra_info("ssl_object").context
        await stream.write_eof()  # nothing to send: half-close at once, like `nc -N`
        received = hashlib.sha256()
        size = 0
        async with asyncio.timeout(90):
            while data := await stream.read():
                received.update(data)
                size += len(data)
            assert await stream.wait_closed() == grpc.StatusCode.OK
        # The transfer kept the certificate it was opened with; a new dial (from the
        # warm pool, replaced at the renewal) presents the renewed one.
        after = await client.dial(NODE, port)
        assert isinstance(after, DataStream)
        assert after.link.get_extra_info("ssl_object").context is not opened_with
        await after.aclose()
    assert both_renewed()
    assert size == total, (size, total)
    assert received.hexdigest() == digest.hexdigest()


async def test_websocket_session_through_the_tunnel(stack: Stack) -> None:
    async def echo(websocket: websockets.ServerConnection) -> None:
        async for message in websocket:
            await websocket.send(f"echo:{message}")

    async with websockets.serve(echo, "127.0.0.1", 0) as backend:
        port = backend.sockets[0].getsockname()[1]
        stream = await stack.client().dial(NODE, port)
        sock = await bridged_socket(stream)
        async with websockets.connect(f"ws://edge-1:{port}/", sock=sock) as session:
            for i in range(20):
                await session.send(f"message {i}")
                assert await asyncio.wait_for(session.recv(), 10) == f"echo:message {i}"


async def test_agent_killed_and_restarted(stack: Stack) -> None:
    async def hello(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"hello")
        await writer.drain()
        writer.close()

    backend = await asyncio.start_server(hello, "127.0.0.1", 0)
    port = backend.sockets[0].getsockname()[1]
    client = stack.client()

    async def greeting() -> bytes:
        stream = await client.dial(NODE, port)
        await stream.write_eof()
        data = b""
        while chunk := await stream.read():
            data += chunk
        return data

    async with backend:
        assert await greeting() == b"hello"
        assert stack.agent is not None
        await stack.agent.stop(signal.SIGKILL)
        with pytest.raises(DialFailed) as refused:
            async with asyncio.timeout(30):
                while True:  # the server notices the dead stream (keepalive or RST)
                    await greeting()
                    await asyncio.sleep(0.2)
        # NO_AGENT once the server dropped the dead stream; DRAINING ("the agent went
        # away") for a dial that was pending at that moment (raw dials come quickly
        # enough to be caught there). Either way retryable: nothing reached the node.
        assert refused.value.reason in (pb.NO_AGENT, pb.DRAINING), refused.value
        assert refused.value.retryable
        await stack.start_agent()
        async with asyncio.timeout(30):
            while True:
                try:
                    assert await greeting() == b"hello"
                    break
                except DialFailed:
                    await asyncio.sleep(0.2)


async def test_refused_destination_and_dialer_not_allowed_by_policy(stack: Stack) -> None:
    code, _out, err = await run_cli(
        "tunnel", "dial", f"{NODE}/10.0.0.1:22", *stack.cli_flags("dialer")
    )
    assert code == 1
    assert "not in the agent's allow-list" in err, err

    await stack.identity("stranger", STRANGER_ID)
    code, _out, err = await run_cli("tunnel", "dial", f"{NODE}:22", *stack.cli_flags("stranger"))
    assert code == 1, err
    assert "not an allowed dialer" in err and STRANGER_ID in err
    code, out, _err = await run_cli("tunnel", "agents", *stack.cli_flags("stranger"))
    assert code == 1

    code, out, _err = await run_cli("tunnel", "agents", *stack.cli_flags("dialer"))
    assert code == 0 and NODE in out, _err


async def test_one_trace_from_the_dialer_through_server_and_agent(stack: Stack) -> None:
    """`waygate tunnel dial` (its own process) -> tunnel server -> agent: one trace id,
    each span the child of the one before, with node, replica and connection id."""
    server = await asyncio.start_server(lambda _r, w: w.close(), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    trace_id = os.urandom(16).hex()
    parent = os.urandom(8).hex()
    async with server:
        # stdin stays open (like a terminal): the dial ends because the backend closed.
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "waygate", "tunnel", "dial", f"{NODE}:{port}",
            *stack.cli_flags("dialer"), "--otlp-endpoint", stack.otlp.endpoint,
            "--traceparent", f"00-{trace_id}-{parent}-01",
            stdin=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=child_env(),
        )  # fmt: skip
        assert process.stderr is not None
        try:
            code = await asyncio.wait_for(process.wait(), 30)
        finally:
            if process.returncode is None:
                process.kill()
                await process.wait()
        err = (await process.stderr.read()).decode()
    assert code == 0, err

    def complete(spans: list) -> bool:
        mine = [s for s in spans if s.trace_id == trace_id]
        return {s.service for s in mine} >= {
            "waygate-cli",
            "waygate-tunnel-server",
            "waygate-tunnel-agent",
        }

    spans = [s for s in await stack.otlp.wait_for(complete, 30) if s.trace_id == trace_id]
    client = next(s for s in spans if s.service == "waygate-cli" and s.name.endswith("Tunnel/Dial"))
    served = next(
        s for s in spans if s.service == "waygate-tunnel-server" and s.name.endswith("Tunnel/Dial")
    )
    agent = next(s for s in spans if s.service == "waygate-tunnel-agent")
    assert client.parent_span_id == parent
    assert served.parent_span_id == client.span_id
    assert agent.parent_span_id == served.span_id
    # The command dials end to end (its default): the replica only copied ciphertext.
    assert served.attributes["waygate.tunnel.end_to_end"] is True
    for span in (served, agent):
        assert span.attributes["waygate.tunnel.node"] == NODE
        assert span.attributes["waygate.tunnel.replica"] == "replica-a"
    assert (
        served.attributes["waygate.tunnel.connection_id"]
        == agent.attributes["waygate.tunnel.connection_id"]
    )
