"""How the admin listener shares its room, in-process on port 0 over real sockets.

Slow request heads are limited per source address and in total; when a new
connection finds no room, the OLDEST pending head is dropped (one per newcomer),
never the newcomer, so a probe that sends its head at once is always answered.
A connection counts until its socket is gone, and an answer the peer does not
read is aborted after the head timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket

import pytest
from prometheus_client import CollectorRegistry, Gauge, generate_latest

from tests.support.poll import until
from waygate.core.admin import AdminServer, Readiness

Connection = tuple[asyncio.StreamReader, asyncio.StreamWriter]


@pytest.fixture
async def admin():
    server = AdminServer(
        Readiness(), head_timeout=10, max_connections=8, max_connections_per_source=2
    )
    await server.start("127.0.0.1", 0)
    yield server
    await server.stop()


async def slow(server: AdminServer, source: str) -> Connection:
    """A connection from `source` that starts a head and never finishes it."""
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port, local_addr=(source, 0))
    writer.write(b"GET /healthz HTTP/1.1\r\n")
    await writer.drain()
    return reader, writer


async def dropped(connection: Connection) -> bool:
    """Whether the server closed this connection (EOF or reset) within a few seconds."""
    reader, _ = connection
    try:
        await asyncio.wait_for(reader.read(), 5)
    except ConnectionError:
        pass
    except TimeoutError:
        return False
    return True


def still_open(connection: Connection) -> bool:
    return not connection[0].at_eof()


async def healthz(server: AdminServer, source: str = "127.0.0.1") -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port, local_addr=(source, 0))
    writer.write(b"GET /healthz HTTP/1.1\r\n\r\n")
    data = await asyncio.wait_for(reader.read(), 5)
    writer.close()
    return data.split(b"\r\n", 1)[0]


async def test_a_source_over_its_share_loses_its_oldest_pending_head(admin: AdminServer) -> None:
    first = await slow(admin, "127.0.0.2")
    second = await slow(admin, "127.0.0.2")
    await until(lambda: len(admin._pending) == 2, "two pending heads")
    third = await slow(admin, "127.0.0.2")
    assert await dropped(first)
    await asyncio.sleep(0.2)
    assert still_open(second) and still_open(third)
    # The same source's probe still gets its answer: it is the newest, not the oldest.
    assert await healthz(admin, "127.0.0.2") == b"HTTP/1.1 200 OK"
    for _, writer in (second, third):
        writer.close()


async def test_when_the_head_room_is_full_the_oldest_pending_head_anywhere_goes(
    admin: AdminServer,
) -> None:
    # The whole room (8) held by pending heads from four sources (two each, their share).
    connections = [await slow(admin, f"127.0.0.{3 + i // 2}") for i in range(8)]
    await until(lambda: len(admin._pending) == 8, "eight pending heads")
    newcomer = await slow(admin, "127.0.0.9")
    assert await dropped(connections[0])
    await asyncio.sleep(0.2)
    # One newcomer costs exactly one pending head: the aborted one no longer counts.
    assert all(still_open(c) for c in connections[1:]) and still_open(newcomer)
    assert len(admin._open) == 8
    assert await healthz(admin) == b"HTTP/1.1 200 OK"
    assert await dropped(connections[1])  # the probe took the next-oldest head's place
    assert all(still_open(c) for c in connections[2:])
    for _, writer in (*connections[2:], newcomer):
        writer.close()
    await until(lambda: not admin._pending and not admin._open, "every connection forgotten")


async def test_an_answer_nobody_reads_holds_its_place_then_is_aborted() -> None:
    registry = CollectorRegistry()
    big = Gauge("padding", "a large /metrics answer", ["label"], registry=registry)
    for index in range(6_000):  # about 12 MB: more than the kernel's buffers hold (4 MB)
        big.labels("x" * 2000 + str(index)).set(index)
    server = AdminServer(
        Readiness(), registry=registry, head_timeout=1.0, max_connections=2,
        max_connections_per_source=2,
    )  # fmt: skip
    await server.start("127.0.0.1", 0)
    try:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window
        sock.connect(("127.0.0.1", server.port))
        reader, writer = await asyncio.open_connection(sock=sock)
        writer.write(b"GET /metrics HTTP/1.1\r\n\r\n")
        await until(lambda: server._open and not server._pending, "the answer being sent")
        assert len(server._open) == 1  # answering, not reading: it still holds a place
        await until(lambda: not server._open, "the unread answer aborted", timeout=10)
        received = b""
        with contextlib.suppress(ConnectionError):
            while chunk := await asyncio.wait_for(reader.read(1 << 20), 5):
                received += chunk
        assert len(received) < len(generate_latest(registry))  # cut off, not finished
        writer.close()
    finally:
        await server.stop()
