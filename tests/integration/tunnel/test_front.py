"""The HTTPS front in one loop with a real hub and agent (real mTLS, real sockets).

What the process tests cannot see from outside: a client that stops reading
stalls only its own connection, with every buffer on the way bounded; and
every task and tunnelled connection the front opened is gone afterwards.
"""

from __future__ import annotations

import asyncio
import os
import socket
import ssl
import struct
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.integration.tunnel.harness import NODE, Tunnel
from tests.support.pki import LocalCA
from tests.support.poll import until
from waygate.core.flow import HIGH_WATER
from waygate.tunnel.front import Front, FrontSettings

RESPONSE_BYTES = 24 * 1024 * 1024


async def big_response_backend() -> tuple[asyncio.Server, int]:
    """Answers every request with RESPONSE_BYTES of body, as fast as the socket takes them."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % RESPONSE_BYTES)
            chunk = b"z" * 65536
            for _ in range(RESPONSE_BYTES // len(chunk)):
                writer.write(chunk)
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


@pytest.fixture
async def front(tmp_path: Path) -> AsyncIterator[tuple[Tunnel, Front, int, ssl.SSLContext]]:
    tunnel = Tunnel(tmp_path)
    await tunnel.start_server()
    await tunnel.start_agent()
    server_context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_context.minimum_version = ssl.TLSVersion.TLSv1_2
    server_context.load_cert_chain(tunnel.server_files.cert, tunnel.server_files.key)
    server_context.load_verify_locations(cadata=tunnel.ca.pem.decode())
    server_context.verify_mode = ssl.CERT_REQUIRED
    # A short head timeout makes the sweep (every half of it) quick.
    settings = FrontSettings(front_node_addresses=(f"127.0.0.1={NODE}",), front_head_timeout=1.0)
    front = Front(tunnel.hub, settings, dial_timeout=5.0)
    port = await front.start("127.0.0.1", 0, server_context)
    client_context = ssl.create_default_context(cafile=str(tunnel.dialer_files.ca))
    client_context.load_cert_chain(tunnel.dialer_files.cert, tunnel.dialer_files.key)
    client_context.check_hostname = False
    try:
        yield tunnel, front, port, client_context
    finally:
        await front.stop()
        await tunnel.close()


async def test_a_client_that_stops_reading_stalls_only_itself_with_bounded_buffers(front) -> None:
    tunnel, front_listener, port, context = front
    backend, backend_port = await big_response_backend()
    async with backend:
        baseline_tasks = len(asyncio.all_tasks())
        reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=context)
        # A small receive buffer makes "not reading" bite early.
        writer.transport.get_extra_info("socket").setsockopt(
            socket.SOL_SOCKET, socket.SO_RCVBUF, 65536
        )
        writer.write(f"GET /big HTTP/1.1\r\nHost: 127.0.0.1:{backend_port}\r\n\r\n".encode())
        await until(lambda: front_listener.connections and tunnel.hub.sessions[NODE].open_connections(),
                    "the relay to start")  # fmt: skip
        await asyncio.sleep(1.0)  # the backend pushes; nobody reads
        (connection,) = front_listener.connections
        transport = connection.transport
        assert transport is not None
        # The client transport's buffer stops near its high-water mark...
        assert transport.get_write_buffer_size() <= 4 * 1024 * 1024
        # ...the server's queue towards the front is bounded by the granted window...
        # (on its data connection: what its stream holds, at most one read past
        # the high-water mark at which it stops reading the agent)
        (tunnelled,) = tunnel.hub.sessions[NODE].data.values()
        assert tunnelled.stream is not None
        assert tunnelled.stream.buffered <= 2 * HIGH_WATER
        # ...and meanwhile another request through the same agent goes through at once.
        other_reader, other_writer = await asyncio.open_connection("127.0.0.1", port, ssl=context)
        other_writer.write(f"GET /x HTTP/1.1\r\nHost: 127.0.0.1:{backend_port}\r\n\r\n".encode())
        head = await asyncio.wait_for(other_reader.readuntil(b"\r\n\r\n"), 10)
        assert head.startswith(b"HTTP/1.1 200 OK")
        other_writer.transport.abort()
        # Reading resumes: every byte arrives.
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        received = 0
        async with asyncio.timeout(60):
            while received < RESPONSE_BYTES:
                data = await reader.read(1 << 20)
                assert data, f"ended after {received} bytes"
                received += len(data)
        assert received == RESPONSE_BYTES
        writer.close()
        await until(lambda: not front_listener.connections, "the front to let go")
        await until(
            lambda: not tunnel.hub.sessions[NODE].open_connections(), "tunnelled connections"
        )
        await until(lambda: not tunnel.agents[0].open_connections(), "the agent's sockets")
        await until(lambda: len(asyncio.all_tasks()) <= baseline_tasks, "tasks back to baseline")
        assert not front_listener.tasks


async def test_client_bytes_wait_for_credit_without_unbounded_buffering(front) -> None:
    tunnel, front_listener, port, context = front

    # A backend that reads nothing: the request body cannot drain.
    accepted: list[asyncio.StreamWriter] = []
    finished = asyncio.Event()

    async def sink(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(writer)
        writer.transport.pause_reading()
        await finished.wait()

    backend = await asyncio.start_server(sink, "127.0.0.1", 0)
    backend_port = backend.sockets[0].getsockname()[1]
    async with backend:
        _reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=context)
        writer.write(
            f"POST / HTTP/1.1\r\nHost: 127.0.0.1:{backend_port}\r\n"
            f"Content-Length: {64 * 1024 * 1024}\r\n\r\n".encode()
        )
        chunk = b"b" * 65536
        sent = 0
        # Write until the front stops taking bytes (drain blocks) or 64 MiB went out.
        try:
            async with asyncio.timeout(3):
                while sent < 64 * 1024 * 1024:
                    writer.write(chunk)
                    await writer.drain()
                    sent += len(chunk)
        except TimeoutError:
            pass
        assert sent < 64 * 1024 * 1024, "the front took everything: no backpressure"
        (connection,) = front_listener.connections
        assert connection.pending_bytes <= HIGH_WATER + 65536 * 4
        # The client vanishes (RST: with a zero window its FIN would queue behind
        # the unsent body) while its bytes wait for credit and reading is paused.
        writer.transport.get_extra_info("socket").setsockopt(
            socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
        )
        writer.transport.abort()
        await until(lambda: not front_listener.connections, "the front to let go")
        await until(
            lambda: not tunnel.hub.sessions[NODE].open_connections(), "tunnelled connections"
        )
        finished.set()
        for peer in accepted:
            peer.close()


async def tls_backend(tunnel: Tunnel, tmp_path: Path) -> tuple[asyncio.Server, int, list[str]]:
    """A kubelet-like backend: HTTPS, requires a client certificate, says who called."""
    files = tunnel.ca.write_files(tmp_path / "kubelet", ips=["127.0.0.1"], dns=[NODE])
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(files.cert, files.key)
    context.load_verify_locations(files.ca)
    context.verify_mode = ssl.CERT_REQUIRED
    callers: list[str] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.readuntil(b"\r\n\r\n")
            peer = writer.get_extra_info("peercert")
            callers.append(str(peer.get("subjectAltName")))
            body = b"kubelet says hi"
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
            await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError, ssl.SSLError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0, ssl=context)
    return server, server.sockets[0].getsockname()[1], callers


@pytest.mark.parametrize("upstream_ca", ["the nodes' CA", "another CA"])
async def test_tls_ports_are_spoken_to_in_tls_with_the_fronts_client_certificate(
    front, tmp_path: Path, upstream_ca: str
) -> None:
    tunnel, _, _, context = front
    backend, backend_port, callers = await tls_backend(tunnel, tmp_path)
    client_files = tunnel.ca.write_files(
        tmp_path / "front-client", uris=["spiffe://waygate.test/ns/t/sa/tunnel-front"]
    )
    ca_file = client_files.ca
    if upstream_ca == "another CA":
        ca_file = tmp_path / "other-ca.pem"
        ca_file.write_bytes(LocalCA().pem)
    settings = FrontSettings(
        front_node_addresses=(f"127.0.0.1={NODE}",),
        front_upstream_tls_ports=(str(backend_port),),
        front_upstream_ca_file=ca_file,
        front_upstream_cert_file=client_files.cert,
        front_upstream_key_file=client_files.key,
    )
    tls_front = Front(tunnel.hub, settings, dial_timeout=5.0)
    server_context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_context.load_cert_chain(tunnel.server_files.cert, tunnel.server_files.key)
    server_context.load_verify_locations(cadata=tunnel.ca.pem.decode())
    server_context.verify_mode = ssl.CERT_REQUIRED
    port = await tls_front.start("127.0.0.1", 0, server_context)
    try:
        async with backend:
            reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=context)
            writer.write(f"GET /pods HTTP/1.1\r\nHost: 127.0.0.1:{backend_port}\r\n\r\n".encode())
            response = await asyncio.wait_for(reader.read(), 10)
            writer.close()
        if upstream_ca == "the nodes' CA":
            assert response.startswith(b"HTTP/1.1 200 OK") and response.endswith(b"kubelet says hi")
            assert callers == ["(('URI', 'spiffe://waygate.test/ns/t/sa/tunnel-front'),)"]
        else:
            assert response.startswith(b"HTTP/1.1 502 Bad Gateway")
            assert b"TLS with node edge-1 at 127.0.0.1:" in response
            assert callers == []
        await until(lambda: not tls_front.connections, "the front to let go")
        await until(
            lambda: not tunnel.hub.sessions[NODE].open_connections(), "tunnelled connections"
        )
    finally:
        await tls_front.stop()


@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
async def test_full_duplex_megabytes_both_ways_at_once(front, tmp_path: Path, tls: bool) -> None:
    """A backend that echoes while it reads (like exec's streams): 4 MiB up and down at
    once through the front, with neither direction waiting for the other to finish."""
    tunnel, _, _, context = front
    backend_context = None
    if tls:
        files = tunnel.ca.write_files(tmp_path / "echo", ips=["127.0.0.1"])
        backend_context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        backend_context.load_cert_chain(files.cert, files.key)

    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        except (ConnectionError, ssl.SSLError):
            pass
        finally:
            writer.close()

    backend = await asyncio.start_server(echo, "127.0.0.1", 0, ssl=backend_context)
    backend_port = backend.sockets[0].getsockname()[1]
    settings = FrontSettings(
        front_node_addresses=(f"127.0.0.1={NODE}",),
        front_upstream_tls_ports=(str(backend_port),) if tls else (),
    )
    duplex_front = Front(tunnel.hub, settings, dial_timeout=5.0)
    server_context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_context.load_cert_chain(tunnel.server_files.cert, tunnel.server_files.key)
    server_context.load_verify_locations(cadata=tunnel.ca.pem.decode())
    server_context.verify_mode = ssl.CERT_REQUIRED
    port = await duplex_front.start("127.0.0.1", 0, server_context)
    try:
        async with backend:
            reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=context)
            body = os.urandom(4 * 1024 * 1024)
            head = (
                f"PUT /stream HTTP/1.1\r\nHost: 127.0.0.1:{backend_port}\r\n"
                f"Content-Length: {len(body)}\r\n\r\n"
            ).encode()

            async def send() -> None:
                writer.write(head)
                for i in range(0, len(body), 65536):
                    writer.write(body[i : i + 65536])
                    await writer.drain()

            async def receive() -> bytes:
                received = bytearray()
                while len(received) < len(head) + len(body):
                    data = await reader.read(1 << 20)
                    assert data, f"ended after {len(received)} bytes"
                    received.extend(data)
                return bytes(received)

            _, echoed = await asyncio.wait_for(asyncio.gather(send(), receive()), 60)
            writer.close()
            assert echoed.endswith(body)
            assert echoed.startswith(b"PUT /stream HTTP/1.1\r\n")
        await until(lambda: not duplex_front.connections, "the front to let go")
        await until(
            lambda: not tunnel.hub.sessions[NODE].open_connections(), "tunnelled connections"
        )
    finally:
        await duplex_front.stop()


async def recording_backend(
    answer: bytes, *, upgrade: bool = False
) -> tuple[asyncio.Server, int, list[bytes]]:
    """Reads a head, records what else arrives before and after answering `answer`."""
    seen: list[bytes] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            seen.append(head)
            before = b""
            try:
                async with asyncio.timeout(0.5):  # what arrives before we answer
                    while data := await reader.read(65536):
                        before += data
                        if not upgrade and b"hello" in before:
                            break
            except TimeoutError:
                pass
            seen.append(before)
            writer.write(answer)
            await writer.drain()
            after = b""
            try:
                async with asyncio.timeout(0.5):
                    while data := await reader.read(65536):
                        after += data
            except TimeoutError:
                pass
            seen.append(after)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1], seen


async def exchange(port: int, context: ssl.SSLContext, request: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=context)
    try:
        writer.write(request)
        response = b""
        async with asyncio.timeout(10):
            while data := await reader.read(65536):
                response += data
                if b"UPGRADED" in response:
                    break
        return response
    finally:
        writer.close()


async def test_a_pipelined_second_request_never_reaches_the_node(front) -> None:
    _tunnel, _front, port, context = front
    backend, backend_port, seen = await recording_backend(
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
    )
    host = f"Host: 127.0.0.1:{backend_port}\r\n".encode()
    async with backend:
        response = await exchange(
            port,
            context,
            b"POST /logs HTTP/1.1\r\n" + host + b"Content-Length: 5\r\n\r\nhello"
            b"GET /admin HTTP/1.1\r\n" + host + b"\r\n",
        )
        assert response.startswith(b"HTTP/1.1 200 OK")
        await until(lambda: len(seen) == 3, "the backend to finish")
    head, before, after = seen
    assert head.startswith(b"POST /logs ")
    assert before == b"hello"
    assert b"/admin" not in before + after and after == b""


async def test_a_chunked_body_is_forwarded_and_the_request_ends_with_it(front) -> None:
    _tunnel, _front, port, context = front
    backend, backend_port, seen = await recording_backend(
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
    )
    async with backend:
        await exchange(
            port,
            context,
            f"POST /x HTTP/1.1\r\nHost: 127.0.0.1:{backend_port}\r\n".encode()
            + b"Transfer-Encoding: chunked\r\n\r\n3\r\nhel\r\n2\r\nlo\r\n0\r\n\r\n"
            + b"GET /admin HTTP/1.1\r\nHost: x:1\r\n\r\n",
        )
        await until(lambda: len(seen) == 3, "the backend to finish")
    _head, before, after = seen
    before += after
    assert before.startswith(b"3\r\nhel\r\n2\r\nlo\r\n")
    assert before.endswith(b"0\r\n\r\n") and b"/admin" not in before


@pytest.mark.parametrize("answer", [b"101", b"400"])
async def test_upgrade_bytes_wait_for_the_nodes_101(front, answer: bytes) -> None:
    _tunnel, _front, port, context = front
    response = (
        b"HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n"
        b"UPGRADED"
        if answer == b"101"
        else b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n"
    )
    backend, backend_port, seen = await recording_backend(response, upgrade=True)
    async with backend:
        await exchange(
            port,
            context,
            f"GET /ws HTTP/1.1\r\nHost: 127.0.0.1:{backend_port}\r\n".encode()
            + b"Connection: Upgrade\r\nUpgrade: websocket\r\n\r\nEARLY-FRAME",
        )
        await until(lambda: len(seen) == 3, "the backend to finish")
    _head, before, after = seen
    assert before == b""  # nothing passes before the node agreed
    assert after == (b"EARLY-FRAME" if answer == b"101" else b"")
