"""`kernelsplice.kernel_splice`, the replica's relay between two plain TCP sockets through
splice(2), on real loopback sockets, under asyncio's loop and uvloop's (the tunnel's
processes run uvloop, whose polling differs on errors; see relay.SocketLink._read).

Each test: peers A and B, the relay's sockets a and b (A <-> a, B <-> b), and the
relay between a and b. Bytes both ways intact; half-close each way; a reset passed
on as a reset; a full close after a FIN delivers everything; a side that does not
read stalls the other without the relay reading on; abort and cancel release
everything. Descriptors and tasks are counted before and after every case, and the
relay is checked to start no task.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import hashlib
import os
import socket
import ssl
import termios
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import pytest
import uvloop

from tests.support.poll import until
from waygate.tunnel.kernelsplice import PIPE_SIZE, KernelSplice, available, kernel_splice

MIB = 1 << 20
_RESET = b"\x01\x00\x00\x00\x00\x00\x00\x00"  # SO_LINGER on, 0 s


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.fixture(params=["asyncio", "uvloop"])
def run(request: pytest.FixtureRequest) -> Callable[[Coroutine[Any, Any, None]], None]:
    """Run a scenario on a fresh loop of the kind the parameter names (60 s at most)."""
    factory = asyncio.new_event_loop if request.param == "asyncio" else uvloop.new_event_loop

    def runner(scenario: Coroutine[Any, Any, None]) -> None:
        async def bounded() -> None:
            async with asyncio.timeout(60):
                await scenario

        with asyncio.Runner(loop_factory=factory) as loop_runner:
            loop_runner.run(bounded())

    return runner


@dataclass
class Rig:
    A: socket.socket  # the peers (the test's ends)
    B: socket.socket
    a: socket.socket  # the relay's ends
    b: socket.socket
    relay: KernelSplice


def _pair(
    listener: socket.socket, *, peer_rcvbuf: int = 0, relay_sndbuf: int = 0
) -> tuple[socket.socket, socket.socket]:
    peer = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if peer_rcvbuf:
        peer.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, peer_rcvbuf)  # (before the window)
    peer.connect(listener.getsockname())
    ours, _ = listener.accept()
    if relay_sndbuf:
        ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, relay_sndbuf)
    for sock in (peer, ours):
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return peer, ours


@contextlib.asynccontextmanager
async def rig(pipe_size: int = PIPE_SIZE, **pair_options: int) -> AsyncIterator[Rig]:
    """A relay between two loopback connections; afterwards (the peers closed, the relay
    done) descriptors and tasks are back to what they were before, and the relay started
    no task of its own."""
    fds, tasks = open_fds(), len(asyncio.all_tasks())
    with socket.create_server(("127.0.0.1", 0)) as listener:
        A, a = _pair(listener, **pair_options)
        B, b = _pair(listener, **pair_options)
    relay = kernel_splice(a, b, pipe_size=pipe_size)
    assert len(asyncio.all_tasks()) == tasks  # callbacks only
    try:
        yield Rig(A, B, a, b, relay)
        await asyncio.wait([relay.done], timeout=30)  # (no task; cancelled is done too)
    finally:
        relay.abort()  # (a no-op when it ended)
        A.close()
        B.close()
    assert relay.done.done() and a.fileno() == -1 and b.fileno() == -1
    assert open_fds() == fds
    assert len(asyncio.all_tasks()) == tasks


async def read_to_end(sock: socket.socket) -> tuple[int, str]:
    """(bytes, sha256) of everything `sock` receives up to its EOF (an error propagates)."""
    loop = asyncio.get_running_loop()
    buffer = bytearray(MIB)
    view = memoryview(buffer)
    digest = hashlib.sha256()
    size = 0
    while got := await loop.sock_recv_into(sock, buffer):
        digest.update(view[:got])
        size += got
    return size, digest.hexdigest()


async def send_and_end(sock: socket.socket, data: bytes) -> None:
    await asyncio.get_running_loop().sock_sendall(sock, data)
    sock.shutdown(socket.SHUT_WR)


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def unsent(sock: socket.socket) -> int:
    """Bytes in `sock`'s send queue (not yet acknowledged)."""
    out = fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0")
    return int.from_bytes(out, "little")


def test_splice_works_here() -> None:
    assert available()  # Linux, where the tunnel's replicas run: the probe must pass


def test_without_splice_the_caller_is_told_to_fall_back(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(os, "splice")
    assert not available.__wrapped__()  # (the probe itself, not its cached answer)
    with socket.socket() as left, socket.socket() as right, pytest.raises(OSError) as raised:
        kernel_splice(left, right)
    assert raised.value.errno == errno.ENOSYS


def test_64_mib_each_way_at_once_arrive_intact(run: Any) -> None:
    async def scenario() -> None:
        forth, back = os.urandom(64 * MIB), os.urandom(64 * MIB)
        async with rig() as r:
            results = await asyncio.gather(
                send_and_end(r.A, forth),
                send_and_end(r.B, back),
                read_to_end(r.B),
                read_to_end(r.A),
            )
            assert results[2] == (len(forth), sha(forth))
            assert results[3] == (len(back), sha(back))
            await r.relay.done
            assert r.relay.error is None and r.relay.a_ended and r.relay.b_ended

    run(scenario())


@pytest.mark.parametrize("first", ["A", "B"])
def test_a_half_close_each_way_keeps_the_other_direction_open(run: Any, first: str) -> None:
    async def scenario() -> None:
        request, answer = os.urandom(3 * MIB + 1), os.urandom(2 * MIB + 3)
        async with rig() as r:
            asker, answerer = (r.A, r.B) if first == "A" else (r.B, r.A)
            await send_and_end(asker, request)
            assert await read_to_end(answerer) == (len(request), sha(request))
            assert (r.relay.a_ended, r.relay.b_ended) == (first == "A", first == "B")
            assert not r.relay.done.done()  # the answer's direction is still open
            await send_and_end(answerer, answer)
            assert await read_to_end(asker) == (len(answer), sha(answer))
            await r.relay.done
            assert r.relay.error is None

    run(scenario())


@pytest.mark.parametrize("resetting", ["A", "B"])
def test_a_reset_reaches_the_other_side_as_a_reset(run: Any, resetting: str) -> None:
    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        async with rig() as r:
            gone, other = (r.A, r.B) if resetting == "A" else (r.B, r.A)
            await loop.sock_sendall(gone, b"partial" * 1000)
            gone.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RESET)
            gone.close()
            with pytest.raises(ConnectionResetError):
                await read_to_end(other)
            await r.relay.done
            assert isinstance(r.relay.error, ConnectionError)

    run(scenario())


def test_a_reset_of_the_side_written_to_reaches_the_writer(run: Any) -> None:
    """B resets while A is sending (the error comes from a write into b)."""

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        async with rig(peer_rcvbuf=64 * 1024) as r:  # (the 64 MiB outgrow every buffer)
            sender = asyncio.ensure_future(loop.sock_sendall(r.A, os.urandom(64 * MIB)))
            await loop.sock_recv(r.B, 1)  # bytes flow
            r.B.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RESET)
            r.B.close()
            with pytest.raises((ConnectionResetError, BrokenPipeError)):
                await sender
            await r.relay.done
            assert isinstance(r.relay.error, ConnectionError)

    run(scenario())


@pytest.mark.parametrize("closing", ["A", "B"])
def test_a_full_close_after_a_fin_delivers_everything_it_sent(run: Any, closing: str) -> None:
    """X sends, half-closes, then resets (its full close): the reset surfaces when Y's
    answer is written into X's socket. Everything X sent is in Y's queues by then (most
    of it not sent yet: Y reads nothing), and must reach Y with an EOF, not a reset that
    drops it (`relay._Splice.lost`'s exception). A one-page pipe leaves most of Y's
    answer unread when the relay ends: closing with it unread would be a reset too."""

    async def scenario() -> None:
        upload = os.urandom(MIB)
        async with rig(4096, peer_rcvbuf=64 * 1024, relay_sndbuf=4 * MIB) as r:
            X, Y, y = (r.A, r.B, r.b) if closing == "A" else (r.B, r.A, r.a)
            x_ended = (lambda: r.relay.a_ended) if closing == "A" else (lambda: r.relay.b_ended)
            await send_and_end(X, upload)
            await until(x_ended, "X's FIN passed on to Y")
            assert unsent(y) > 0  # (the case under test: bytes still queued towards Y)
            X.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RESET)
            X.close()
            Y.send(b"?" * 48 * 1024)  # (one send, within the window: all of it at the relay)

            async def answer() -> bool:
                if not r.relay.done.done():
                    Y.send(b"?")  # into X's socket, which is gone: the relay sees it now
                return r.relay.done.done()

            await until(answer, "the relay to end on X's reset")
            assert isinstance(r.relay.error, ConnectionError)
            assert await read_to_end(Y) == (len(upload), sha(upload))

    run(scenario())


@pytest.mark.parametrize("closing", ["A", "B"])
def test_a_side_that_half_closed_then_reset_is_noticed_when_the_other_ends(
    run: Any, closing: str
) -> None:
    """X half-closes, then resets; nothing is written to X after, so the relay learns of
    the reset only when Y ends and its FIN cannot be passed on (ENOTCONN). X had ended
    its direction: Y is closed normally, its reads end with an EOF."""

    async def scenario() -> None:
        async with rig() as r:
            X, Y = (r.A, r.B) if closing == "A" else (r.B, r.A)
            x_ended = (lambda: r.relay.a_ended) if closing == "A" else (lambda: r.relay.b_ended)
            await send_and_end(X, b"last words")
            await until(x_ended, "X's FIN passed on to Y")
            X.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RESET)
            X.close()
            Y.shutdown(socket.SHUT_WR)
            await r.relay.done
            assert isinstance(r.relay.error, OSError) and r.relay.error.errno == errno.ENOTCONN
            assert await read_to_end(Y) == (10, sha(b"last words"))

    run(scenario())


def test_a_side_that_does_not_read_stalls_the_other_and_resumes(run: Any) -> None:
    """B reads nothing: once the pipe towards b is full the relay stops reading a, so A's
    own send buffer fills (A's sends would go on without bound otherwise). B then reads:
    everything arrives, and A's sends go through again."""

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        chunk = memoryview(os.urandom(MIB))
        cap = 256 * MIB  # far past every buffer between A and B
        digest = hashlib.sha256()
        async with rig() as r:
            sent = blocked = 0
            while sent < cap and not (blocked >= 10 and not r.relay._ab.reading):
                try:
                    n = r.A.send(chunk[sent % MIB :])
                except BlockingIOError:
                    blocked += 1
                    await asyncio.sleep(0.02)
                    continue
                blocked = 0
                digest.update(chunk[sent % MIB : sent % MIB + n])
                sent += n
                await asyncio.sleep(0)
            assert sent < cap, "A never stalled: the relay reads on without bound"
            assert not r.relay._ab.reading and r.relay._ab.writing  # waits on b, not on a
            assert 0 < r.relay._ab.queued <= r.relay._ab.size  # no more than a pipe held
            reader = asyncio.ensure_future(read_to_end(r.B))
            more = bytes(chunk) * 8  # goes through once B reads
            await loop.sock_sendall(r.A, more)
            digest.update(more)
            r.A.shutdown(socket.SHUT_WR)
            assert await reader == (sent + len(more), digest.hexdigest())
            r.B.shutdown(socket.SHUT_WR)
            assert await read_to_end(r.A) == (0, sha(b""))

    run(scenario())


@pytest.mark.parametrize("how", ["abort", "cancel"])
def test_abort_or_cancel_releases_everything_at_once(run: Any, how: str) -> None:
    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        async with rig() as r:
            await loop.sock_sendall(r.A, b"x" * 100_000)
            await loop.sock_sendall(r.B, b"y" * 100_000)
            await until(lambda: r.relay._ab.reading and r.relay._ba.reading, "the relay idle")
            if how == "abort":
                r.relay.abort()
                assert r.relay.done.done()
            else:
                r.relay.done.cancel()
                await asyncio.sleep(0)  # (done callbacks run on the next turn)
            assert r.a.fileno() == -1 and r.b.fileno() == -1
            for peer in (r.A, r.B):
                with pytest.raises(ConnectionResetError):
                    await read_to_end(peer)

    run(scenario())


def test_bytes_read_before_the_relay_go_first(run: Any) -> None:
    async def scenario() -> None:
        fds = open_fds()
        with socket.create_server(("127.0.0.1", 0)) as listener:
            A, a = _pair(listener)
            B, b = _pair(listener)
        with A, B:
            with pytest.raises(ValueError):
                kernel_splice(a, b, to_b=b"z" * (2 * MIB))  # more than a 1 MiB pipe holds
            assert a.fileno() != -1 and b.fileno() != -1  # still the caller's
            relay = kernel_splice(a, b, to_b=b"early-from-a ", to_a=b"early-from-b ")
            await send_and_end(A, b"rest")
            await send_and_end(B, b"answer")
            assert await read_to_end(B) == (17, sha(b"early-from-a rest"))
            assert await read_to_end(A) == (19, sha(b"early-from-b answer"))
            await relay.done
        assert open_fds() == fds

    run(scenario())


def test_a_pipe_size_the_kernel_refuses_leaves_the_default(
    run: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An unprivileged user past fs.pipe-max-size or its pipe pages gets EPERM from
    F_SETPIPE_SZ (simulated: these tests may run as root, who is exempt)."""
    original = fcntl.fcntl

    def refusing(fd: int, command: int, *arg: Any) -> Any:
        if command == fcntl.F_SETPIPE_SZ:
            raise PermissionError(1, "Operation not permitted")
        return original(fd, command, *arg)

    monkeypatch.setattr(fcntl, "fcntl", refusing)

    async def scenario() -> None:
        payload = os.urandom(8 * MIB)
        async with rig() as r:
            assert r.relay._ab.size == r.relay._ba.size == 16 * 4096  # Linux's default
            # Read while sending: 8 MiB need not fit the sockets' and pipes' buffers
            # (a loaded machine's autotuning left them smaller, and the send waited).
            _, received = await asyncio.gather(send_and_end(r.A, payload), read_to_end(r.B))
            assert received == (len(payload), sha(payload))
            r.B.shutdown(socket.SHUT_WR)
            assert await read_to_end(r.A) == (0, sha(b""))

    run(scenario())


def test_a_tls_socket_is_refused() -> None:
    context = ssl.create_default_context()
    with (
        context.wrap_socket(
            socket.socket(), do_handshake_on_connect=False, server_hostname="localhost"
        ) as tls,
        socket.socket() as plain,
        pytest.raises(TypeError),
    ):
        kernel_splice(tls, plain)
