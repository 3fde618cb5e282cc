"""The agent's connect step (`waygate.tunnel.agent.connect_socket`), on real sockets.

A loopback connect is complete when connect() returns, so the agent does not
wait a loop turn for it; a connect that is not (a listener whose accept queue
is full drops the SYN, so the kernel retries it about a second later) waits for
writability within its timeout, as `loop.sock_connect` would.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import socket

import pytest

from waygate.tunnel.agent import connect_socket


def _client() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setblocking(False)
    return sock


def _full_listener() -> tuple[socket.socket, list[socket.socket]]:
    """A listener that takes no more connections: its accept queue (backlog 0) is full."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    queued = []
    for _ in range(2):  # backlog 0 still queues one (Linux: backlog + 1)
        sock = _client()
        with contextlib.suppress(BlockingIOError):
            sock.connect(listener.getsockname())
        queued.append(sock)
    return listener, queued


async def test_a_loopback_connect_completes_and_carries_bytes() -> None:
    accepted: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.set_result(await reader.readexactly(5))
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    sock = _client()
    try:
        await connect_socket(sock, server.sockets[0].getsockname(), 5.0)
        assert sock.getpeername() == server.sockets[0].getsockname()
        await asyncio.get_running_loop().sock_sendall(sock, b"hello")
        assert await asyncio.wait_for(accepted, 5) == b"hello"
    finally:
        sock.close()
        server.close()
        await server.wait_closed()


async def test_a_refused_connect_raises_oserror_with_its_errno() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        address = probe.getsockname()  # bound, never listening: connects are refused
        sock = _client()
        try:
            with pytest.raises(OSError) as raised:
                await connect_socket(sock, address, 5.0)
            assert raised.value.errno == errno.ECONNREFUSED
        finally:
            sock.close()


async def test_a_connect_that_does_not_complete_times_out_and_leaves_no_watcher() -> None:
    listener, queued = _full_listener()
    sock = _client()
    try:
        with pytest.raises(TimeoutError):
            await connect_socket(sock, listener.getsockname(), 0.2)
        # The writability watcher went with the timeout (remove_writer: False when
        # the loop watches nothing for the socket).
        assert not asyncio.get_running_loop().remove_writer(sock)
    finally:
        sock.close()
        for held in queued:
            held.close()
        listener.close()


async def test_a_connect_that_completes_later_is_waited_for() -> None:
    listener, queued = _full_listener()
    sock = _client()
    try:
        connecting = asyncio.ensure_future(connect_socket(sock, listener.getsockname(), 10.0))
        await asyncio.sleep(0.05)
        assert not connecting.done()  # the SYN was dropped: it waits
        listener.setblocking(False)
        # Room in the queue, kept free until the connect completes: the kernel's retried
        # SYN gets in. (Draining once is not enough: the other dropped client's retry can
        # take the freed place first, and then every later retry of ours meets a full queue.)
        while not connecting.done():
            with contextlib.suppress(BlockingIOError):
                while True:
                    listener.accept()[0].close()
            await asyncio.wait([connecting], timeout=0.05)
        await connecting
        assert sock.getpeername() == listener.getsockname()
    finally:
        sock.close()
        for held in queued:
            held.close()
        listener.close()
