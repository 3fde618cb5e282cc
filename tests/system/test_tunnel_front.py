"""The tunnel server's HTTPS front with real processes: server and agent, mTLS everywhere.

A client with a certificate from the front's CA sends HTTP requests naming
NODE-ADDRESS:PORT (as the kube-apiserver does for a kubelet) to the front;
they reach a backend behind the agent, upgrades included. Everything the
front refuses gets a status and a reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import ssl
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from websockets.asyncio.client import connect as ws_connect
from websockets.asyncio.server import serve as ws_serve

from tests.support.pki import IdentityFiles, LocalCA
from tests.support.poll import until
from tests.support.processes import RunningService, http_get, start_service
from tests.support.tunnel_processes import NODE, SERVER_NAME, TunnelPKI, agent_argv, start_server

pytestmark = pytest.mark.system


async def head_echo_backend() -> tuple[asyncio.Server, int, list[bytes]]:
    """Answers each request with the head it received as the body (after reading the body)."""
    heads: list[bytes] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            heads.append(head)
            length = 0
            for line in head.split(b"\r\n"):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":")[1])
            body = await reader.readexactly(length) if length else b""
            payload = head + b"body-bytes:" + str(len(body)).encode()
            writer.write(
                b"HTTP/1.1 200 OK\r\nContent-Length: "
                + str(len(payload)).encode()
                + b"\r\nConnection: close\r\n\r\n"
                + payload
            )
            await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1], heads


def client_context(pki_ca: Path, client: IdentityFiles | None) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(pki_ca))
    context.check_hostname = True
    if client is not None:
        context.load_cert_chain(client.cert, client.key)
    return context


async def https_request(
    front_port: int, context: ssl.SSLContext, request: bytes, timeout: float = 10
) -> bytes:
    reader, writer = await asyncio.open_connection(
        "127.0.0.1", front_port, ssl=context, server_hostname=SERVER_NAME
    )
    try:
        writer.write(request)
        return await asyncio.wait_for(reader.read(), timeout)
    finally:
        writer.close()
        with contextlib.suppress(Exception):
            await writer.wait_closed()


class Setup:
    def __init__(self, tmp_path: Path) -> None:
        self.pki = TunnelPKI.create(tmp_path)
        # The front's clients come from another CA (the cluster CA, in Kubernetes).
        self.front_ca = LocalCA()
        self.front_client = self.front_ca.write_files(
            tmp_path / "apiserver", uris=["spiffe://waygate.test/ns/kube-system/sa/apiserver"]
        )
        self.wrong_client = self.pki.dialer  # from the tunnel's CA, not the front's
        (tmp_path / "front-ca.pem").write_bytes(self.front_ca.pem)
        self.front_ca_file = tmp_path / "front-ca.pem"
        self.context = client_context(self.pki.ca_file, self.front_client)
        self.pids: tuple[int, int] = (0, 0)  # server, agent


@pytest.fixture
async def front(tmp_path: Path) -> AsyncIterator[tuple[Setup, int, int, list[bytes], int]]:
    setup = Setup(tmp_path)
    backend, backend_port, heads = await head_echo_backend()

    async def ws_echo(connection) -> None:  # type: ignore[no-untyped-def]
        async for message in connection:
            await connection.send(f"echo:{message}")

    ws_server = await ws_serve(ws_echo, "127.0.0.1", 0)
    ws_port = ws_server.sockets[0].getsockname()[1]
    # Only the backend ports are allowed (plus the port 1 probe target below).
    allow = f"127.0.0.1:{backend_port}+{ws_port}+1"
    server = await start_server(
        setup.pki,
        extra=[
            "--front-client-ca-file", str(setup.front_ca_file),
            "--front-node-addresses", f"127.0.0.1={NODE}",
            "--front-head-timeout", "1s",
        ],
    )  # fmt: skip
    agent: RunningService | None = None
    try:
        assert server.front_port, "the server logged no front port"
        agent = await start_service(
            agent_argv(setup.pki, f"127.0.0.1:{server.agent_port}", allow=allow)
        )

        async def agent_ready() -> bool:
            return (await http_get(agent.admin_port, "/readyz"))[0] == 200

        ready = False

        async def poll() -> None:
            nonlocal ready
            while not ready:
                ready = await agent_ready()
                await asyncio.sleep(0.1)

        await asyncio.wait_for(poll(), 20)
        setup.pids = (server.service.process.pid, agent.process.pid)
        yield setup, server.front_port, backend_port, heads, ws_port
    finally:
        if agent is not None:
            assert await agent.stop() == 0
        assert await server.service.stop() == 0
        backend.close()
        ws_server.close()


async def test_a_request_to_node_address_and_port_reaches_the_backend(front) -> None:
    setup, front_port, backend_port, heads, _ = front
    response = await https_request(
        front_port,
        setup.context,
        f"GET /containerLogs/ns/pod/c?follow=false HTTP/1.1\r\nHost: 127.0.0.1:{backend_port}\r\n"
        "X-Remote-User: system:admin\r\nImpersonate-Group: system:masters\r\n"
        "Connection: keep-alive\r\n\r\n".encode(),
    )
    assert response.startswith(b"HTTP/1.1 200 OK\r\n")
    (head,) = heads
    assert head.startswith(b"GET /containerLogs/ns/pod/c?follow=false HTTP/1.1\r\n")
    assert b"Connection: close\r\n" in head and b"keep-alive" not in head
    assert b"X-Remote-User" not in head and b"Impersonate-Group" not in head


async def test_absolute_form_and_a_body_of_a_mebibyte(front) -> None:
    setup, front_port, backend_port, heads, _ = front
    body = b"x" * (1024 * 1024)
    response = await https_request(
        front_port,
        setup.context,
        f"POST http://127.0.0.1:{backend_port}/run HTTP/1.1\r\nHost: ignored:1\r\n"
        f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body,
    )
    assert response.startswith(b"HTTP/1.1 200 OK")
    assert response.endswith(b"body-bytes:1048576")
    assert heads[0].startswith(b"POST /run HTTP/1.1\r\n")


async def test_a_websocket_upgrade_is_relayed(front) -> None:
    setup, front_port, _, _, ws_port = front
    async with ws_connect(
        f"wss://127.0.0.1:{ws_port}/exec",
        host="127.0.0.1",
        port=front_port,
        ssl=setup.context,
        server_hostname=SERVER_NAME,
        open_timeout=10,
    ) as session:
        for i in range(3):
            await session.send(f"line {i}")
            assert await asyncio.wait_for(session.recv(), 10) == f"echo:line {i}"


@pytest.mark.parametrize(
    ("host", "status", "reason"),
    [
        ("127.0.0.9:{backend}", 400, "no edge node is known for address 127.0.0.9"),
        ("edge-9:{backend}", 503, "no agent for node edge-9"),
        ("127.0.0.1:2", 403, ""),
        ("127.0.0.1:1", 502, ""),
        ("127.0.0.1", 400, "HOST:PORT"),
    ],
)
async def test_refusals_are_a_status_with_a_reason(front, host, status, reason) -> None:
    setup, front_port, backend_port, _, _ = front
    response = await https_request(
        front_port,
        setup.context,
        f"GET / HTTP/1.1\r\nHost: {host.format(backend=backend_port)}\r\n\r\n".encode(),
    )
    assert response.startswith(f"HTTP/1.1 {status} ".encode()), response[:200]
    body = response.partition(b"\r\n\r\n")[2].decode()
    assert reason in body and body.strip(), body


@pytest.mark.parametrize("who", ["no certificate", "a certificate from another CA"])
async def test_clients_without_a_certificate_from_the_front_ca_are_refused(front, who) -> None:
    setup, front_port, backend_port, heads, _ = front
    client = None if who == "no certificate" else setup.wrong_client
    context = client_context(setup.pki.ca_file, client)
    request = f"GET / HTTP/1.1\r\nHost: 127.0.0.1:{backend_port}\r\n\r\n".encode()
    with pytest.raises((ssl.SSLError, ConnectionError, asyncio.IncompleteReadError)):
        response = await https_request(front_port, context, request)
        # TLS 1.3: the refusal of the certificate can arrive after the handshake.
        if not response:
            raise ConnectionResetError("closed without a response")
    assert heads == []


async def test_a_slow_head_gets_408_and_is_never_forwarded(front) -> None:
    setup, front_port, backend_port, heads, _ = front
    reader, writer = await asyncio.open_connection(
        "127.0.0.1", front_port, ssl=setup.context, server_hostname=SERVER_NAME
    )
    writer.write(f"GET / HTTP/1.1\r\nHost: 127.0.0.1:{backend_port}\r\n".encode())
    await writer.drain()
    response = await asyncio.wait_for(reader.read(), 5)  # head timeout 1 s
    writer.close()
    assert response.startswith(b"HTTP/1.1 408 Request Timeout\r\n")
    assert b"no complete request head within 1s" in response
    assert heads == []


async def test_a_head_over_64_kib_gets_431(front) -> None:
    setup, front_port, backend_port, heads, _ = front
    response = await https_request(
        front_port,
        setup.context,
        f"GET / HTTP/1.1\r\nHost: 127.0.0.1:{backend_port}\r\nX-Big: ".encode()
        + b"a" * (70 * 1024),
    )
    assert response.startswith(b"HTTP/1.1 431 ")
    assert heads == []


def open_descriptors(pids: tuple[int, ...]) -> list[int]:
    return [len(os.listdir(f"/proc/{pid}/fd")) for pid in pids]


async def test_finished_and_abandoned_connections_release_their_descriptors(front) -> None:
    setup, front_port, backend_port, _, ws_port = front
    request = f"GET / HTTP/1.1\r\nHost: 127.0.0.1:{backend_port}\r\n\r\n".encode()
    await https_request(front_port, setup.context, request)  # warm-up: channels, caches
    # The agent refills its pool of data connections in the background after each
    # dial: the baseline is the most each process holds over a second of that, not
    # one reading taken mid-refill (which the full pool would then exceed for good).
    baseline = open_descriptors(setup.pids)
    for _ in range(10):
        await asyncio.sleep(0.1)
        baseline = [max(a, b) for a, b in zip(baseline, open_descriptors(setup.pids), strict=True)]
    for _ in range(20):
        assert (await https_request(front_port, setup.context, request)).startswith(b"HTTP/1.1 200")
    for _ in range(10):  # clients that vanish in the middle of a body
        _reader, writer = await asyncio.open_connection(
            "127.0.0.1", front_port, ssl=setup.context, server_hostname=SERVER_NAME
        )
        writer.write(
            f"POST / HTTP/1.1\r\nHost: 127.0.0.1:{backend_port}\r\nContent-Length: 100000\r\n\r\n".encode()
            + b"x" * 5000
        )
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.transport.abort()
    for _ in range(5):  # upgraded sessions dropped without a close frame
        session = await ws_connect(
            f"wss://127.0.0.1:{ws_port}/exec",
            host="127.0.0.1",
            port=front_port,
            ssl=setup.context,
            server_hostname=SERVER_NAME,
            open_timeout=10,
        )
        await session.send("x")
        await asyncio.wait_for(session.recv(), 10)
        session.transport.abort()
    await until(
        lambda: all(n <= b for n, b in zip(open_descriptors(setup.pids), baseline, strict=True)),
        f"server and agent descriptors back to {baseline}",
        timeout=15,
    )
