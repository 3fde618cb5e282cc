"""`relay.SocketLink`, the data connection on its own socket (TLS through OpenSSL's socket
BIO), on real loopback TCP with real TLS: half-close both ways (close_notify alone, with
reading going on: `SSLSocket.unwrap` would have thrown those bytes away), plaintext
OpenSSL still holds when a paused reader resumes, a bounded write buffer against a peer
that does not read, an abort that the peer sees, and nothing left open afterwards. Through
the replica's and the agent's splices (the harness's `Tunnel`, in-process): the endings
that must lose nothing."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import socket
import ssl
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration.tunnel.harness import NODE, Tunnel
from tests.support.pki import LocalCA
from waygate.core.tls import can_send_close_notify, server_context
from waygate.tunnel import relay
from waygate.tunnel.client import DataStream


class Collect(asyncio.Protocol):
    """Everything a link delivers, its EOF and its end; `pause_each` pauses reading after
    every delivery and resumes it on the next loop turn."""

    def __init__(self, pause_each: bool = False) -> None:
        self.transport: Any = None
        self.hash = hashlib.sha256()
        self.size = 0
        self.eof = asyncio.get_running_loop().create_future()
        self.lost = asyncio.get_running_loop().create_future()
        self.pause_each = pause_each
        self.write_paused = 0

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.hash.update(data)
        self.size += len(data)
        if self.pause_each:
            self.transport.pause_reading()
            asyncio.get_running_loop().call_soon(self.transport.resume_reading)

    def eof_received(self) -> bool:
        self.eof.set_result(None)
        return True

    def pause_writing(self) -> None:
        self.write_paused += 1

    def resume_writing(self) -> None:
        pass

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.lost.done():
            self.lost.set_result(exc)


@contextlib.asynccontextmanager
async def socket_links(directory: Path) -> AsyncIterator[tuple[relay.Link, relay.Link]]:
    """A connected (client, server) pair of SocketLinks over mTLS, handshakes done; both
    aborted and the listener closed afterwards."""
    assert can_send_close_notify()  # CPython on Linux: the path the tunnel takes
    ca = LocalCA()
    server_files = ca.write_files(directory / "s", dns=["localhost"], ips=["127.0.0.1"])
    client_files = ca.write_files(directory / "c", uris=["spiffe://t/ns/t/sa/c"])
    server_ctx = server_context(
        chain_pem=server_files.cert.read_bytes(),
        key_pem=server_files.key.read_bytes(),
        client_ca_pem=ca.pem,
        client_auth="required",
    )
    client_ctx = relay.client_context(
        ca.pem, client_files.cert.read_bytes(), client_files.key.read_bytes()
    )
    accepted: asyncio.Queue[relay.Link] = asyncio.Queue()
    listener = relay.LinkListener(server_ctx, accepted.put_nowait)
    port = await listener.start("127.0.0.1", 0)
    try:
        client = await relay.open_link(
            "127.0.0.1", port, client_ctx, server_hostname="localhost", timeout=10
        )
        server = await asyncio.wait_for(accepted.get(), 10)
        try:
            await asyncio.wait_for(server.established, 10)
            assert isinstance(client, relay.SocketLink) and isinstance(server, relay.SocketLink)
            yield client, server
        finally:
            client.abort()
            server.abort()
    finally:
        listener.close()


@pytest.fixture
async def pair(tmp_path: Path) -> AsyncIterator[tuple[relay.Link, relay.Link]]:
    async with socket_links(tmp_path) as links:
        yield links


async def test_half_close_both_ways_keeps_every_byte(pair: tuple[relay.Link, relay.Link]) -> None:
    client, server = pair
    at_client, at_server = Collect(), Collect()
    client.attach(at_client)
    server.attach(at_server)
    request = os.urandom(300_001)
    answer = os.urandom(3 * 1024 * 1024 + 7)
    client.write(request)
    client.pause_reading()
    server.write(answer[:70_000])
    await asyncio.sleep(0.05)  # (in the client's socket, not read yet)
    client.write_eof()  # close_notify alone: the bytes waiting and those after arrive
    client.resume_reading()
    await asyncio.wait_for(at_server.eof, 10)
    assert at_server.size == len(request)
    assert at_server.hash.digest() == hashlib.sha256(request).digest()
    for start in range(70_000, len(answer), 70_000):
        server.write(answer[start : start + 70_000])
    server.write_eof()
    await asyncio.wait_for(at_client.eof, 10)
    assert at_client.size == len(answer)
    assert at_client.hash.digest() == hashlib.sha256(answer).digest()
    # Both sides sent close_notify: a clean end, the sockets closed, no error.
    assert await asyncio.wait_for(at_client.lost, 10) is None
    assert await asyncio.wait_for(at_server.lost, 10) is None
    assert client.get_extra_info("socket") is None and server.get_extra_info("socket") is None


async def test_a_reader_paused_after_every_delivery_gets_everything(
    pair: tuple[relay.Link, relay.Link],
) -> None:
    """A full read buffer can end inside a TLS record: OpenSSL then holds plaintext that
    epoll does not report; resuming must deliver it."""
    client, server = pair
    at_server = Collect(pause_each=True)
    client.attach(Collect())
    server.attach(at_server)
    payload = os.urandom(8 * 1024 * 1024 + 5)
    client.write(payload)
    client.write_eof()
    await asyncio.wait_for(at_server.eof, 30)
    assert at_server.size == len(payload)
    assert at_server.hash.digest() == hashlib.sha256(payload).digest()


async def test_plaintext_openssl_holds_reaches_a_reader_that_resumes_later(
    pair: tuple[relay.Link, relay.Link],
) -> None:
    """Records of 1,000 then 16 x 16,384 bytes: the 256 KiB read buffer fills 1,000 bytes
    into the last record, whose rest OpenSSL holds with the socket empty (no EOF yet);
    reading paused then resumed later must still deliver it."""
    client, server = pair
    at_server = Collect()
    client.attach(Collect())
    server.attach(at_server)
    loop = asyncio.get_running_loop()

    def received(data: bytes) -> None:
        Collect.data_received(at_server, data)
        server.pause_reading()
        loop.call_later(0.05, server.resume_reading)

    at_server.data_received = received  # type: ignore[method-assign]
    client.write(b"a" * 1000)
    client.write(b"b" * 16 * 16384)
    async with asyncio.timeout(10):
        while at_server.size < 1000 + 16 * 16384:
            await asyncio.sleep(0.01)
    assert at_server.size == 1000 + 16 * 16384


async def test_the_write_buffer_is_bounded_against_a_peer_that_does_not_read(
    pair: tuple[relay.Link, relay.Link],
) -> None:
    client, server = pair
    at_client = Collect()
    client.attach(at_client)
    server.attach(Collect())
    server.pause_reading()
    chunk = b"x" * 65536
    for _ in range(4096):  # 256 MiB if nothing pushed back: far past the socket buffers
        client.write(chunk)
        if at_client.write_paused:
            break
        await asyncio.sleep(0)
    assert at_client.write_paused == 1
    low, high = client.get_write_buffer_limits()
    assert 0 < client.get_write_buffer_size() <= high + len(chunk)
    # The reader catches up: everything written arrives and writing resumes.
    server.resume_reading()
    client.write_eof()
    await asyncio.wait_for(server.protocol.eof, 30)  # type: ignore[attr-defined]
    assert client.get_write_buffer_size() == 0 and low < high


async def test_an_abort_reaches_the_peer_as_an_error(pair: tuple[relay.Link, relay.Link]) -> None:
    client, server = pair
    at_server = Collect()
    client.attach(Collect())
    server.attach(at_server)
    client.write(b"partial")
    await asyncio.sleep(0.05)
    client.abort()
    lost = await asyncio.wait_for(at_server.lost, 10)
    assert isinstance(lost, (ConnectionError, ssl.SSLError))
    assert server.is_closing()


async def test_a_full_close_after_the_peer_half_closed_is_an_abort_there(
    pair: tuple[relay.Link, relay.Link],
) -> None:
    """`close` without waiting for the peer's close_notify: the peer, which half-closed,
    learns that nobody reads its answer (as `Link.eof_received`)."""
    client, server = pair
    at_client, at_server = Collect(), Collect()
    client.attach(at_client)
    server.attach(at_server)
    client.write_eof()
    await asyncio.wait_for(at_server.eof, 10)
    server.close()  # close_notify, then the FIN
    await asyncio.wait_for(at_client.eof, 10)
    # The client sent its close_notify before: both ends finished cleanly.
    assert await asyncio.wait_for(at_client.lost, 10) is None
    assert await asyncio.wait_for(at_server.lost, 10) is None


async def test_a_fin_before_this_side_finished_fails_the_link(
    pair: tuple[relay.Link, relay.Link],
) -> None:
    client, server = pair
    at_client, at_server = Collect(), Collect()
    client.attach(at_client)
    server.attach(at_server)
    server.close()  # the server lets go of the whole connection; the client never ended
    await asyncio.wait_for(at_client.eof, 10)
    lost = await asyncio.wait_for(at_client.lost, 10)
    assert isinstance(lost, relay.LinkClosed) and "before this side finished" in str(lost)


async def test_a_plain_link_paused_at_its_eof_stays_half_open_when_resumed() -> None:
    """The agent's destination socket (`relay.plain_link`): the destination's last bytes
    and its FIN arrive in one read while the splice pauses reading (the data connection's
    buffer is full). Resuming must not read the socket again: at EOF it stays readable,
    and taking that for a peer that went away aborted the splice, and with it the data
    connection's unsent tail (round 6's truncated downloads, `bench.tunnel.pull_stress`)."""
    loop = asyncio.get_running_loop()
    server = socket.create_server(("127.0.0.1", 0))
    destination = socket.create_connection(server.getsockname())
    ours, _ = server.accept()
    server.close()
    ours.setblocking(False)
    link = relay.plain_link(ours)
    at_link = Collect()

    def received(data: bytes) -> None:
        Collect.data_received(at_link, data)
        link.pause_reading()  # as the splice does when the other side's buffer is full

    at_link.data_received = received  # type: ignore[method-assign]
    link.attach(at_link)
    destination.sendall(b"tail" * 1000)
    destination.shutdown(socket.SHUT_WR)  # the last bytes and the FIN, together
    await asyncio.wait_for(at_link.eof, 10)
    assert at_link.size == 4000
    link.resume_reading()
    for _ in range(5):
        await asyncio.sleep(0.01)
    assert not at_link.lost.done(), at_link.lost.result()
    # Still half-open: this side's bytes and its FIN reach the destination.
    link.write(b"answer")
    link.write_eof()
    destination.settimeout(10)
    received_back = b""
    while chunk := await loop.run_in_executor(None, destination.recv, 65536):
        received_back += chunk
    destination.close()
    assert received_back == b"answer"
    assert await asyncio.wait_for(at_link.lost, 10) is None


class Sender(asyncio.Protocol):
    """The proxy's side of an upload: writes on the data connection as its transport,
    waiting while the link's write buffer is past its high-water mark."""

    def __init__(self) -> None:
        self.transport: Any = None
        self.writable: asyncio.Future[None] | None = None

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def pause_writing(self) -> None:
        self.writable = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if self.writable is not None and not self.writable.done():
            self.writable.set_result(None)
        self.writable = None

    def connection_lost(self, exc: Exception | None) -> None:
        self.resume_writing()

    async def send(self, data: bytes, times: int) -> None:
        for _ in range(times):
            self.transport.write(data)
            if self.writable is not None:
                await self.writable


async def counting_server() -> tuple[asyncio.Server, int, asyncio.Queue[tuple[int, str]]]:
    """A destination that reads each connection to its end and queues (bytes, how it ended)."""
    counts: asyncio.Queue[tuple[int, str]] = asyncio.Queue()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        size, how = 0, "EOF"
        try:
            while data := await reader.read(1 << 20):
                size += len(data)
        except (ConnectionError, OSError) as exc:
            how = repr(exc)
        counts.put_nowait((size, how))
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1], counts


async def test_an_upload_that_ends_with_a_full_close_arrives_whole(tunnel: Tunnel) -> None:
    """A dialer that sends and then closes (close_notify, then its FIN: no half-close and no
    wait for an answer) through the replica's splice and the agent's: its FIN reaches the
    replica while the bytes before it still wait in the replica's and the agent's buffers.
    They must reach the destination, then its end, as TCP delivers what a peer sent
    before closing; aborting the other side there (a reset) dropped megabytes of them."""
    server, port, counts = await counting_server()
    chunk = os.urandom(256 * 1024)
    times = 64  # 16 MiB: far more than the buffers between the dialer and the destination
    async with server:
        client = tunnel.client()
        for attempt in range(3):
            stream = await client.dial(NODE, port)
            assert isinstance(stream, DataStream)
            assert isinstance(stream.link, relay.SocketLink)
            sender = Sender()
            stream.link.attach(sender)
            await sender.send(chunk, times)
            stream.link.close()
            received = await asyncio.wait_for(counts.get(), 60)
            assert (attempt, received) == (attempt, (len(chunk) * times, "EOF"))


def unread_bytes(sock: Any) -> int:
    """What the kernel holds in `sock`'s receive queue, unread (FIONREAD)."""
    import fcntl
    import termios

    return int.from_bytes(fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0\0\0\0"), "little")


async def reset_behind_unread(client: Any, server: Any, at_client: Any, unread: int) -> None:
    """Once `unread` bytes wait in the paused client's socket: the server's reset behind
    them, then reading resumed; the link must end with an error, nothing left polled."""
    raw = client.get_extra_info("socket")
    async with asyncio.timeout(10):
        while unread_bytes(raw) < unread:
            await asyncio.sleep(0.01)
    server.abort()  # the reset lands behind them
    await asyncio.sleep(0.05)
    client.resume_reading()
    lost = await asyncio.wait_for(at_client.lost, 10)
    assert isinstance(lost, (ConnectionError, ssl.SSLError)), lost
    assert client.get_extra_info("socket") is None  # closed, nothing left polled


def test_a_reset_with_more_than_a_read_unread_ends_the_link_under_uvloop(tmp_path: Path) -> None:
    """Under uvloop (the loop the tunnel's processes run), a socket that reports an error
    (the peer's reset) stops being polled once its callback ran: libuv stops the poll on
    POLLERR, uvloop runs the reader once and closes it. A link that then read only one
    buffer's worth, with more bytes and the reset still unread, was never called again:
    the link (and a splice's other side) stayed open for good. Run on uvloop's loop
    directly; the asyncio loop the other tests use keeps polling."""
    import uvloop

    async def scenario() -> None:
        async with socket_links(tmp_path) as (client, server):
            at_client = Collect()
            client.attach(at_client)
            server.attach(Collect())
            client.pause_reading()  # (the splice's other side is full)
            raw = client.get_extra_info("socket")
            raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
            chunk = os.urandom(256 * 1024)
            for _ in range(16):
                server.write(chunk)
            # Several reads' worth in the socket.
            await reset_behind_unread(client, server, at_client, 4 * len(chunk))

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(scenario())


def test_a_reset_behind_short_records_ends_the_link_under_uvloop(tmp_path: Path) -> None:
    """A read shorter than a full record ends the read loop without the failing read only
    when a poll finds nothing behind it (`relay._drained`): small records with the peer's
    reset behind them, all unread when reading resumes, must still end the link (uvloop
    runs the reader once for the event that carries the reset, then stops polling)."""
    import uvloop

    async def scenario() -> None:
        async with socket_links(tmp_path) as (client, server):
            at_client = Collect()
            client.attach(at_client)
            server.attach(Collect())
            client.pause_reading()
            for _ in range(5):
                server.write(b"a short record")  # one TLS record each
            # Every record in the socket.
            await reset_behind_unread(client, server, at_client, 5 * (14 + 22))

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(scenario())
