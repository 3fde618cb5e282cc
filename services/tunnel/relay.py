"""The tunnel's data connections: one TCP connection per tunnelled connection, and the relay.

A tunnelled connection's bytes do not cross gRPC when both ends can help it:
the agent opens a data connection to the server replica (mTLS with its agent
certificate), the dialer opens one to the same replica (mTLS with its dialer
certificate), each names what it is for in one preamble line, and from then
on the replica copies bytes from one to the other and the agent from its data
connection to the destination socket. No framing, no per-chunk Python beyond
`data_received -> write`; flow control is TCP's own: a side whose write buffer
passes `core.flow.HIGH_WATER` pauses reading the other (`splice`).

- `SocketLink` (a `Link`): a data connection on its own non-blocking socket,
  TLS through OpenSSL's socket BIO, driven by the loop's add_reader/add_writer:
  what `open_link` and `LinkListener` make wherever close_notify alone can be
  sent (`on_sockets`), the relay's cheapest path (fewest copies).
- `Link`: one TCP connection, TLS through a memory BIO (or plain, for the
  development mode without certificates): TLS inside another transport (the
  proxy's TLS to a backend inside a data connection), and the fallback. It is an asyncio.Protocol towards
  its socket and an asyncio.Transport towards whoever uses it, so a relay
  half, a `Stream` or the proxy's own upstream protocol can sit on it. TLS
  goes through `ssl.SSLObject` rather than asyncio's TLS transports because
  those cannot half-close: here `write_eof` sends TLS 1.3's close_notify (the
  sender's direction only) and reading goes on, so `nc`-style half-close works
  end to end. The socket itself is closed once both sides sent theirs; a FIN
  or reset before that is an abort (see `eof_received`), which is how a
  dialer's full close reaches the agent after both sides half-closed.
- `splice(a, b)`: the relay between two transports (Links, or a Link and a
  plain socket transport). Closes both once both directions ended; an abort
  on one side aborts the other, except after that side had ended its direction
  (a full close after close_notify): the other then gets those bytes and its end.
- `Stream`: read()/write() over a transport for callers that are not
  transports themselves (the gRPC Dial face, the front, `waygate tunnel
  dial`); its queue is bounded by `flow.HIGH_WATER` (reading pauses past it).
- Preamble lines: read (`read_line`, bounded by `wire.PREAMBLE_LIMIT`) and
  written (`write_line`) here; what they say is `waygate.tunnel.wire`'s grammar.

Invariants: nothing here imports grpc; every buffer is bounded (the socket
write buffers by flow.HIGH_WATER, a held preamble by wire.PREAMBLE_LIMIT plus one
socket read); every wait is under a timeout given by the caller.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hashlib
import os
import select
import socket
import ssl
import struct
import threading
import weakref
from collections.abc import Callable
from typing import Any, cast

from waygate.core import flow
from waygate.core.flow import HIGH_WATER, LOW_WATER
from waygate.core.tls import can_send_close_notify, send_close_notify, server_context
from waygate.tunnel import wire
from waygate.tunnel.wire import PREAMBLE_LIMIT

_READ_SIZE = 256 * 1024
_RESET = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close() sends RST
# Where every Link decrypts into: one buffer for the process, not one per connection
# (256 KiB each was most of an idle tunnelled connection's memory). Safe because
# what `_read_plain` hands on is either a copy or, to a splice half whose target
# encrypts it into its own BIO before `write` returns, a view used up within the call;
# a Link nested in another (the proxy's TLS to a backend inside the data connection,
# tunnel.client.Dialled.start_tls) runs its `_read_plain` inside the outer one's, on a
# copy, and the outer one refills the buffer only after the call returns.
_PLAIN = bytearray(_READ_SIZE)
_PLAIN_VIEW = memoryview(_PLAIN)  # never released: the buffer is never resized
# The most plaintext one TLS record carries: a read that returns less (or, plain, less
# than that) was the end of what the peer had written (`SocketLink._read`).
_RECORD = 16 * 1024
# Per thread (a poll object is not safe across threads): `_drained`'s poller.
_LOCAL = threading.local()
# How long after a dial took a warm data connection (the agent's pool and the dialer's)
# its replacement is opened: the dial finishes before the refill's handshake takes the
# CPU it waits on, here and on the replica.
REFILL_DELAY = 0.05
# How long the data listener resumes a TLS session (see datapath; OpenSSL's default: 2 h).
SESSION_TIMEOUT = 300


class LinkClosed(ConnectionError):
    """The link ended before the expected bytes arrived (or was aborted)."""


class LineTooLong(LinkClosed):
    """A preamble line ran past `wire.PREAMBLE_LIMIT` (the peer is to be refused)."""


class _Holding(asyncio.Protocol):
    """What a Link delivers to before anyone attached: kept for `read_line` and `attach`."""

    def __init__(self, link: Link) -> None:
        self.link = link
        self.data = bytearray()
        self.eof = False
        self.lost: BaseException | None = None
        self.is_lost = False
        self.waiter: asyncio.Future[None] | None = None
        self.expired = False

    def _wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # `Link.read_line` and `read_exact` wait through these rather than asyncio.timeout
    # (~10 us a use under uvloop, against ~2.5 for a timer handle): both run on every
    # dial, several times over its three parties.

    def start_timer(self, timeout: float) -> asyncio.TimerHandle:
        """Arm the deadline of one read: `wait` raises TimeoutError once it passed."""
        self.expired = False
        return self.link._loop.call_later(timeout, self._expire)

    def _expire(self) -> None:
        self.expired = True
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_exception(TimeoutError())

    async def wait(self) -> None:
        """Until the next delivery, EOF or loss (or the deadline: TimeoutError)."""
        if self.expired:
            raise TimeoutError
        waiter = self.waiter = self.link._loop.create_future()
        try:
            await waiter
        finally:
            self.waiter = None

    def data_received(self, data: bytes) -> None:
        self.data += data
        if len(self.data) > PREAMBLE_LIMIT:
            self.link.pause_reading()  # whoever attaches resumes it
        self._wake()

    def eof_received(self) -> bool:
        self.eof = True
        self._wake()
        return True

    def connection_lost(self, exc: Exception | None) -> None:
        self.is_lost = True
        self.lost = exc
        self._wake()


class Link(asyncio.Protocol, asyncio.Transport):
    """One data connection: TLS (memory BIO) or plain, a Transport for its user."""

    def __init__(
        self,
        context: ssl.SSLContext | None,
        *,
        server_side: bool,
        server_hostname: str | None = None,
        session: ssl.SSLSession | None = None,
    ) -> None:
        super().__init__()
        self._context = context
        self._session = session  # client side: a session to resume (see open_link)
        self._server_side = server_side
        self._server_hostname = server_hostname
        self.raw: Any = None
        self._ssl: ssl.SSLObject | None = None
        self._holding = _Holding(self)
        self.protocol: asyncio.BaseProtocol = self._holding
        loop = self._loop = asyncio.get_running_loop()
        self.established: asyncio.Future[None] = loop.create_future()
        self.gone: asyncio.Future[None] = loop.create_future()  # done once the link is lost
        self.eof_in = False  # the peer will send no more
        self.eof_out = False  # we sent our end
        self.lost = False
        self._closing = False

    # ------------------------------------------------- socket side (Protocol)

    def connection_made(self, transport: Any) -> None:
        self.raw = transport
        transport.set_write_buffer_limits(high=HIGH_WATER, low=LOW_WATER)
        if self._context is None:
            self.established.set_result(None)
            return
        self._in = ssl.MemoryBIO()
        self._out = ssl.MemoryBIO()
        self._ssl = self._context.wrap_bio(
            self._in,
            self._out,
            server_side=self._server_side,
            server_hostname=self._server_hostname,
            session=self._session,
        )
        self._session = None
        self._handshake()

    def _handshake(self) -> None:
        assert self._ssl is not None
        try:
            self._ssl.do_handshake()
        except ssl.SSLWantReadError:
            self._flush()
            return
        except (ssl.SSLError, ssl.CertificateError) as exc:
            self._flush()
            if not self.established.done():
                failed = LinkClosed(f"TLS handshake failed: {exc}")
                failed.__cause__ = exc  # the verification's own code, for who explains it
                self.established.set_exception(failed)
            self.raw.abort()
            return
        self._flush()
        if not self.established.done():
            self.established.set_result(None)
        self._read_plain()

    def data_received(self, data: bytes) -> None:
        if self._ssl is None:
            self.protocol.data_received(data)  # type: ignore[attr-defined]
            return
        self._in.write(data)
        if not self.established.done():
            self._handshake()
            return
        self._read_plain()

    def _read_plain(self) -> None:
        tls, view = self._ssl, _PLAIN_VIEW
        assert tls is not None
        protocol = self.protocol
        # A splice half whose target encrypts what it is given at once (a TLS Link)
        # takes the shared buffer itself: one 256 KiB copy less per read on the
        # server's relay. Anyone else gets bytes of their own.
        lend = type(protocol) is _Half and protocol.lend
        size = _READ_SIZE
        filled = 0
        eof = False
        while True:
            try:
                got = cast(int, tls.read(size - filled, view[filled:]))
            except ssl.SSLWantReadError:
                break
            except ssl.SSLZeroReturnError:
                eof = True
                break
            except ssl.SSLError as exc:
                self._fail(exc)
                return
            if not got:
                eof = True
                break
            filled += got
            if filled == size:
                protocol.data_received(view if lend else bytes(view))  # type: ignore[attr-defined]
                filled = 0
        if self._out.pending:
            self._flush()  # post-handshake messages (tickets, key updates)
        if filled:
            plain = view[:filled]
            protocol.data_received(plain if lend else bytes(plain))  # type: ignore[attr-defined]
        if eof and not self.eof_in:
            self._peer_eof()

    def _peer_eof(self) -> None:
        self.eof_in = True
        if not self.protocol.eof_received():  # type: ignore[attr-defined]
            # As asyncio's transports: a protocol that does not keep the connection
            # half-open (the proxy's upstream protocol) has it closed.
            self.close()
            return
        self._close_if_done()

    def eof_received(self) -> bool:
        if self._ssl is not None:
            # Under TLS a half-close is close_notify alone and the socket stays open
            # both ways, so a FIN always means the peer let go of the whole
            # connection. Before its close_notify: the stream was cut short. Before
            # ours: the peer will not read what we still send, which is an abort
            # (and the only way an abort reaches us once it has half-closed).
            if not self.eof_in:
                self._fail(LinkClosed("the peer closed without ending TLS (truncated)"))
            elif not self.eof_out:
                self._fail(LinkClosed("the peer went away before this side finished"))
            else:
                self.raw.close()
            return False
        if not self.eof_in:
            self._peer_eof()
        return True

    def connection_lost(self, exc: Exception | None) -> None:
        if self.lost:
            return
        self.lost = True
        self._gone()
        if not self.established.done():
            self.established.set_exception(LinkClosed(f"connection lost: {exc or 'closed'}"))
        if exc is None and not (self.eof_in and self.eof_out):
            exc = LinkClosed("the data connection ended before both sides finished")
        self.protocol.connection_lost(exc)

    def pause_writing(self) -> None:
        self.protocol.pause_writing()

    def resume_writing(self) -> None:
        self.protocol.resume_writing()

    def _fail(self, exc: BaseException) -> None:
        if self.raw is not None:
            self.raw.abort()
        if not self.lost:
            self.lost = True
            self._gone()
            self.protocol.connection_lost(exc if isinstance(exc, Exception) else None)

    def _gone(self) -> None:
        if not self.gone.done():
            self.gone.set_result(None)

    def _flush(self) -> None:
        data = self._out.read()
        if data and self.raw is not None and not self.raw.is_closing():
            self.raw.write(data)

    def _close_if_done(self) -> None:
        if self.eof_in and self.eof_out and self.raw is not None:
            self.raw.close()  # after the write buffer is flushed

    # ------------------------------------------------- user side (Transport)

    def attach(self, protocol: asyncio.BaseProtocol) -> None:
        """Hand the link to `protocol` (connection_made, then what was held before)."""
        held = self._holding
        self.protocol = protocol
        protocol.connection_made(self)
        if held.data:
            data, held.data = bytes(held.data), bytearray()
            protocol.data_received(data)  # type: ignore[attr-defined]
        if held.eof:
            protocol.eof_received()  # type: ignore[attr-defined]
        if held.is_lost:
            protocol.connection_lost(held.lost)  # type: ignore[arg-type]
        elif not self.is_closing():
            self.resume_reading()

    async def read_line(self, timeout: float) -> bytes:
        """The next preamble line (without LF), before the link is attached; TimeoutError
        after `timeout` seconds; `LineTooLong` when no LF comes within `PREAMBLE_LIMIT`
        bytes, however many arrived in one read. No timer when the line is in already
        (a dial's line and its early data usually arrive in one read)."""
        held = self._holding
        end = held.data.find(b"\n", 0, PREAMBLE_LIMIT)
        if end < 0:
            expiry = held.start_timer(timeout)
            try:
                while end < 0:
                    if len(held.data) >= PREAMBLE_LIMIT:
                        raise LineTooLong(wire.TOO_LONG)
                    if held.eof or held.is_lost:
                        raise LinkClosed("the data connection ended before its preamble")
                    await held.wait()
                    end = held.data.find(b"\n", 0, PREAMBLE_LIMIT)
            finally:
                expiry.cancel()
        line = bytes(held.data[:end])
        del held.data[: end + 1]
        return line

    async def read_exact(self, size: int, timeout: float) -> bytes:
        """The next `size` bytes after the preamble (a dial's early data), before the link
        is attached; what follows them stays held for the user. The caller bounds `size`
        (`early.EARLY_LIMIT`): the holder pauses reading past PREAMBLE_LIMIT, and this
        resumes it until the bytes are in."""
        held = self._holding
        if len(held.data) < size:
            expiry = held.start_timer(timeout)
            try:
                while len(held.data) < size:
                    if held.eof or held.is_lost:
                        raise LinkClosed("the data connection ended before its early data")
                    self.resume_reading()
                    await held.wait()
            finally:
                expiry.cancel()
        data = bytes(held.data[:size])
        del held.data[:size]
        return data

    def write_line(self, line: bytes) -> None:
        """Write one preamble line (a `waygate.tunnel.wire` encoding, LF included)."""
        self.write(line)

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self.protocol = protocol

    def get_protocol(self) -> asyncio.BaseProtocol:
        return self.protocol

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if self.eof_out or self.lost or self.raw is None:
            return
        tls = self._ssl
        if tls is None:
            self.raw.write(data)
            return
        try:
            tls.write(data)
        except ssl.SSLError as exc:
            self._fail(exc)
            return
        self.raw.write(self._out.read())

    def writelines(self, chunks: Any) -> None:
        for chunk in chunks:
            self.write(chunk)

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        if self.eof_out or self.lost or self.raw is None:
            return
        self.eof_out = True
        if self._ssl is not None:
            with contextlib.suppress(ssl.SSLError):
                self._ssl.unwrap()  # close_notify: our direction only (reading goes on)
            self._flush()  # no FIN: the socket stays open until both sides are done
        elif not self.raw.is_closing():
            self.raw.write_eof()
        self._close_if_done()

    def close(self) -> None:
        if self._closing or self.raw is None:
            return
        self._closing = True
        if self.established.done() and not self.lost:
            self.write_eof()
        self.raw.close()

    def abort(self) -> None:
        """Cut the connection with a reset: the peer learns of it even after a clean
        half-close in both our directions (a FIN would read as the normal end)."""
        self._closing = True
        raw = self.raw
        if raw is not None:
            sock = raw.get_extra_info("socket")
            if sock is not None and not raw.is_closing():
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RESET)
            raw.abort()

    def is_closing(self) -> bool:
        return self._closing or self.lost or (self.raw is not None and self.raw.is_closing())

    def pause_reading(self) -> None:
        if self.raw is not None and not self.raw.is_closing():
            self.raw.pause_reading()

    def resume_reading(self) -> None:
        if self.raw is not None and not self.raw.is_closing():
            self.raw.resume_reading()

    def is_reading(self) -> bool:
        return bool(self.raw is not None and self.raw.is_reading())

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        if self.raw is not None:
            self.raw.set_write_buffer_limits(high, low)

    def get_write_buffer_size(self) -> int:
        return int(self.raw.get_write_buffer_size()) if self.raw is not None else 0

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return self.raw.get_write_buffer_limits() if self.raw is not None else (0, 0)  # type: ignore[no-any-return]

    @property
    def context(self) -> ssl.SSLContext | None:
        """The TLS context the link was opened with (None: plain)."""
        return self._context

    async def step_out(self, timeout: float) -> socket.socket:
        """End TLS both ways and hand over the TCP socket under it (`SocketLink` only)."""
        self.abort()
        raise LinkClosed("TLS end to end needs a data connection on its own socket")

    @property
    def encrypts(self) -> bool:
        """Whether `write` encrypts (and so copies) what it is given before it returns."""
        return self._context is not None

    @property
    def resumed(self) -> bool:
        """Whether the TLS handshake resumed an earlier session (no certificate checked)."""
        return self._ssl is not None and self._ssl.session_reused

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        if name == "ssl_object":
            return self._ssl
        if name == "peercert_der":
            return self._ssl.getpeercert(binary_form=True) if self._ssl is not None else None
        if name == "peercert":
            return self._ssl.getpeercert() if self._ssl is not None else default
        return self.raw.get_extra_info(name, default) if self.raw is not None else default


class SocketLink(Link):
    """A data connection on its own non-blocking socket: TLS through OpenSSL's socket BIO
    (`ssl.SSLSocket`), driven by the loop's `add_reader`/`add_writer`; the same
    Transport face as `Link`, which stays for TLS inside another transport.

    Why: through a memory BIO every chunk is copied socket -> bytes -> BIO ->
    plaintext and plaintext -> BIO -> bytes -> socket buffer; here OpenSSL reads the
    kernel socket into its record buffer and decrypts into the shared `_PLAIN`
    buffer, and encrypts straight to the socket. On the replica's relay (one
    connection decrypted, the other encrypted) that took the CPU per GiB from
    about 3.1 s to 1.8 s (bench/RESULTS.md, the tunnel's bulk subsection).

    - Reading: `recv_into` (one TLS record at most per call) fills `_PLAIN`, which
      goes to the protocol when full or when the socket has no more (after a read
      shorter than a full record, a poll that finds nothing waiting says so
      without the failing read, `_drained`); a full buffer
      ends the turn (fairness) and the next turn reads on, whatever the loop
      reports: plaintext OpenSSL still holds (`SSLSocket.pending`) is invisible to
      epoll, and uvloop stops polling a socket that reported a reset.
    - Writing: `send` straight away; what the socket cannot take is copied, kept
      in order and retried when writable (OpenSSL wants a refused write retried
      with the same bytes: one entry per write, never joined). Past the high-water
      mark the protocol's `pause_writing` is called, at the low one `resume_writing`.
    - Half-close: `write_eof` sends close_notify alone (`tls.send_close_notify`:
      `SSLSocket.unwrap` would read on and throw application data away), after
      what is buffered; after the peer's close_notify the socket is watched for
      its FIN or reset: a FIN before this side sent its own is an abort, as in
      `Link.eof_received`. Plain (no TLS): `shutdown(SHUT_WR)` and a FIN.
    - `close` flushes, then closes (FIN); `abort` closes at once with a reset.
      `connection_lost` reaches the protocol once, from the loop, never inside
      the caller's own call (as asyncio's transports).
    """

    def __init__(
        self,
        context: ssl.SSLContext | None,
        sock: socket.socket,
        *,
        server_side: bool,
        server_hostname: str | None = None,
        session: ssl.SSLSession | None = None,
    ) -> None:
        super().__init__(context, server_side=server_side, server_hostname=server_hostname)
        self._fd = sock.fileno()
        self._names = (sock.getpeername(), sock.getsockname())
        if context is not None:
            sock = context.wrap_socket(
                sock,
                server_side=server_side,
                server_hostname=server_hostname,
                session=session,
                do_handshake_on_connect=False,
                suppress_ragged_eofs=False,
            )
        self._sock: Any = sock
        self._tls = context is not None
        self._pending: collections.deque[bytes | memoryview] | None = None
        self._buffered = 0
        self._high = HIGH_WATER
        self._low = LOW_WATER
        self._write_paused = False  # the protocol was told pause_writing
        self._reader = False  # registered with the loop
        self._writer = False
        self._read_paused = False
        self._read_waits_write = False  # OpenSSL must write before it reads on
        self._shutdown_due = False  # write_eof waits for the buffer to drain
        self._shut = False  # close_notify (or the FIN) went out
        self._close_due = False  # close waits for the buffer to drain
        self._fd_closed = False
        # Set while `step_out` runs: done once close_notify went both ways.
        self._stepping: asyncio.Future[None] | None = None

    def start(self) -> None:
        """Begin the handshake (or, plain, reading); `established` says when it is done."""
        if not self._tls:
            self.established.set_result(None)
            self._want_read(True)
            return
        self._handshake_step()

    # ------------------------------------------------- the loop's callbacks

    def _want_read(self, on: bool) -> None:
        if on != self._reader and not self._fd_closed:
            self._reader = on
            if on:
                self._loop.add_reader(self._fd, self._on_readable)
            else:
                self._loop.remove_reader(self._fd)

    def _want_write(self, on: bool) -> None:
        if on != self._writer and not self._fd_closed:
            self._writer = on
            if on:
                self._loop.add_writer(self._fd, self._on_writable)
            else:
                self._loop.remove_writer(self._fd)

    def _handshake_step(self) -> None:
        try:
            self._sock.do_handshake()
        except ssl.SSLWantReadError:
            self._want_write(False)
            self._want_read(True)
            return
        except ssl.SSLWantWriteError:
            self._want_read(False)
            self._want_write(True)
            return
        except (ssl.SSLError, ssl.CertificateError, OSError) as exc:
            if not self.established.done():
                failed = LinkClosed(f"TLS handshake failed: {exc}")
                failed.__cause__ = exc  # the verification's own code, for who explains it
                self.established.set_exception(failed)
            self.abort()
            return
        self._want_write(bool(self._pending))
        if not self.established.done():
            self.established.set_result(None)
        self._want_read(not self._read_paused and not self._closing)
        if self._pending:
            self._on_writable()
        elif self._shutdown_due:
            self._shutdown()

    def _on_readable(self) -> None:
        if self._fd_closed:
            return
        if not self.established.done():
            self._handshake_step()
        elif self.eof_in:
            if self._stepping is not None:
                # What follows the peer's close_notify is not this session's: the
                # socket's next owner reads it (`step_out`).
                self._want_read(False)
            elif self._tls:
                self._watch()  # the FIN after close_notify (or bytes that break TLS)
            else:
                # A plain socket's FIN was its EOF, and it stays readable after it:
                # reading on would take that EOF for a peer that went away.
                self._want_read(False)
        elif not self._read_paused:
            self._read()

    def _on_writable(self) -> None:
        if self._fd_closed:
            return
        if not self.established.done():
            self._handshake_step()
            return
        pending, sock, tls = self._pending, self._sock, self._tls
        while pending:
            head = pending[0]
            try:
                sent = sock.send(head)
            except (ssl.SSLWantWriteError, ssl.SSLWantReadError, BlockingIOError):
                return
            except (ssl.SSLError, OSError) as exc:
                self._fail(exc)
                return
            if tls or sent == len(head):
                pending.popleft()
                self._buffered -= len(head)
            else:
                pending[0] = memoryview(head)[sent:]
                self._buffered -= sent
            if self._write_paused and self._buffered <= self._low:
                self._write_paused = False
                self.protocol.resume_writing()
                if self._fd_closed:
                    return
        self._want_write(False)
        if self._read_waits_write:
            self._read_waits_write = False
            self._on_readable()
        if self._shutdown_due and not self._fd_closed:
            self._shutdown()
        elif self._close_due:
            self._close_fd(reset=False)

    def _read(self) -> None:
        sock, view = self._sock, _PLAIN_VIEW
        filled = 0
        while True:
            try:
                got = sock.recv_into(view[filled:])  # TLS: one record at most
            except (ssl.SSLWantReadError, BlockingIOError):
                break
            except ssl.SSLWantWriteError:
                # (a TLS 1.3 KeyUpdate to answer while the socket is full)
                self._read_waits_write = True
                self._want_write(True)
                break
            except ssl.SSLZeroReturnError:
                got = 0
            except ssl.SSLEOFError:
                if filled:
                    self._deliver(filled)
                # CPython reports a reset here too (SSL_read_ex returns 0 either way).
                self._fail(LinkClosed("the peer closed or reset without ending TLS"))
                return
            except (ssl.SSLError, OSError) as exc:
                self._fail(exc)
                return
            if not got:
                if filled:
                    self._deliver(filled)
                if not self.lost and not self.eof_in:
                    if not self._tls:
                        self._want_read(False)  # a plain socket at EOF is always readable
                    self._peer_eof()
                return
            filled += got
            if got < _RECORD and not (self._tls and sock.pending()) and _drained(self._fd):
                # A short read: the peer's write ended there and nothing (no byte, no
                # EOF, no error) waits behind it, so reading on would only fail with
                # "would block" (an SSLWantReadError for TLS: ~5 us against ~1).
                break
            if filled == _READ_SIZE:
                self._deliver(filled)
                if not self._fd_closed:
                    # Read on next turn whatever the loop reports: plaintext OpenSSL
                    # holds (`sock.pending`) is invisible to epoll, and uvloop stops
                    # polling a socket that reported an error (a reset) once this
                    # callback ran: the reset behind a full buffer would go unread and
                    # the link never end.
                    self._loop.call_soon(self._on_readable)
                return
        if filled:
            self._deliver(filled)

    def _deliver(self, size: int) -> None:
        protocol = self.protocol
        # As Link._read_plain: a splice half whose target copies what it is given
        # before `write` returns takes the shared buffer itself.
        if type(protocol) is _Half and protocol.lend:
            protocol.data_received(_PLAIN_VIEW if size == _READ_SIZE else _PLAIN_VIEW[:size])  # type: ignore[arg-type]
        else:
            protocol.data_received(bytes(_PLAIN_VIEW[:size]))  # type: ignore[attr-defined]

    def _watch(self) -> None:
        """After the peer's close_notify: its FIN ends the connection (an abort unless this
        side sent its close_notify first); anything else is a broken peer."""
        try:
            data = socket.socket.recv(self._sock, 1)  # the raw socket, below TLS
        except BlockingIOError:
            return
        except OSError as exc:
            self._fail(exc)
            return
        if data:
            self._fail(LinkClosed("the peer sent bytes after its close_notify"))
        elif not self.eof_out:
            self._fail(LinkClosed("the peer went away before this side finished"))
        else:
            self._want_read(False)
            self._close_fd(reset=False)

    # ------------------------------------------------- endings

    def _peer_eof(self) -> None:
        self.eof_in = True
        if not self.protocol.eof_received():  # type: ignore[attr-defined]
            self.close()  # (as asyncio's transports, see Link._peer_eof)
            return
        self._close_if_done()

    def _close_if_done(self) -> None:
        if self.eof_in and self.eof_out and self._shut:
            stepping = self._stepping
            if stepping is not None:
                if not stepping.done():
                    stepping.set_result(None)
                return
            self._close_due = True
            if not self._pending:
                self._close_fd(reset=False)

    def _shutdown(self) -> None:
        self._shutdown_due = False
        if self._tls:
            sent = send_close_notify(self._sock)
            if sent is False:
                self._shutdown_due = True
                self._want_write(True)
                return
            if sent is None:
                self._fail(LinkClosed("could not send close_notify"))
                return
        else:
            try:
                self._sock.shutdown(socket.SHUT_WR)
            except OSError as exc:
                self._fail(exc)
                return
        self._shut = True
        if self._close_due:
            self._close_fd(reset=False)
        else:
            self._close_if_done()

    def _close_fd(self, *, reset: bool) -> None:
        if self._fd_closed:
            return
        self._want_read(False)
        self._want_write(False)
        self._fd_closed = True
        self._pending = None
        self._buffered = 0
        sock = self._sock
        if reset:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RESET)
        # The descriptor only: `SSLSocket.close` frees the SSL at once, and OpenSSL
        # drops the session of an SSL freed before its close_notify went out (as
        # Link's SSLObject, it goes with the link: a session stays resumable).
        os.close(sock.detach())
        # Link's own end (its socket transport's connection_lost): once, from the loop.
        self._loop.call_soon(self.connection_lost, None)

    def _fail(self, exc: BaseException) -> None:
        self._closing = True
        stepping = self._stepping
        if stepping is not None and not stepping.done():
            stepping.set_exception(LinkClosed(f"connection lost while leaving TLS: {exc}"))
        if not self.established.done():
            failed = LinkClosed(f"connection lost: {exc}")
            failed.__cause__ = exc
            self.established.set_exception(failed)
        self._close_fd(reset=False)
        if not self.lost:
            self.lost = True
            self._gone()
            self.protocol.connection_lost(exc if isinstance(exc, Exception) else None)

    # ------------------------------------------------- user side (Transport)

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if self.eof_out or self.lost or self._fd_closed or not data:
            return
        if self._pending or not self.established.done():
            self._queue(bytes(data))
            return
        try:
            sent = self._sock.send(data)  # TLS: all of it, or SSLWantWriteError
        except (ssl.SSLWantWriteError, ssl.SSLWantReadError, BlockingIOError):
            sent = 0
        except (ssl.SSLError, OSError) as exc:
            self._fail(exc)
            return
        if sent < len(data):
            # TLS: OpenSSL wants this write again, whole (it sent part of it already).
            self._queue(bytes(data) if self._tls else bytes(memoryview(data)[sent:]))

    def _queue(self, data: bytes) -> None:
        if self._pending is None:
            self._pending = collections.deque()
        self._pending.append(data)
        self._buffered += len(data)
        if self.established.done():
            self._want_write(True)
        if not self._write_paused and self._buffered > self._high:
            self._write_paused = True
            self.protocol.pause_writing()

    def write_eof(self) -> None:
        if self.eof_out or self.lost or self._fd_closed:
            return
        self.eof_out = True
        if self._pending or not self.established.done():
            self._shutdown_due = True
            return
        self._shutdown()

    def close(self) -> None:
        if self._closing:
            return
        self._closing = True
        self._want_read(False)
        if not self.established.done():
            self._close_fd(reset=False)
            return
        if not self.lost:
            self.write_eof()
        self._close_due = True
        if not self._pending and not self._shutdown_due:
            self._close_fd(reset=False)

    def abort(self) -> None:
        """Cut the connection with a reset (see `Link.abort`)."""
        self._closing = True
        stepping = self._stepping
        if stepping is not None and not stepping.done():
            stepping.set_exception(LinkClosed("aborted while leaving TLS"))
        self._close_fd(reset=True)

    async def step_out(self, timeout: float) -> socket.socket:
        """End TLS both ways (close_notify each way) and hand over the TCP socket under it,
        for bytes that are not this session's: TLS end to end (wire's SPLICE).

        Called once the preamble lines are exchanged, nothing held unread and no
        protocol attached: bytes the peer sent before its close_notify would be lost,
        so they fail it. OpenSSL reads a socket one record at a time (no read-ahead),
        so what the peer sends after its close_notify is still in the socket for the
        new owner. The link is over afterwards (its descriptor is the socket's now);
        on a failure or timeout it is aborted and LinkClosed raised. Whoever needs the
        peer's certificate reads it before."""
        held = self._holding
        if not self._tls or self.protocol is not held or self._closing or self.lost:
            self.abort()
            raise LinkClosed("only an unattached TLS link can step out of TLS")
        stepping = self._stepping = self._loop.create_future()
        self.write_eof()  # our close_notify, after what is buffered
        if not self.eof_in and not self._read_paused:
            self._want_read(True)
        self._close_if_done()  # (the peer's came first)
        try:
            async with asyncio.timeout(timeout):
                await stepping
        except BaseException:
            self.abort()
            raise
        if held.data or held.is_lost:
            self.abort()
            raise LinkClosed("the peer sent bytes after its answer, before its close_notify")
        self._want_read(False)
        self._want_write(False)
        self._fd_closed = True
        self._closing = True
        self.lost = True
        self._gone()
        # The descriptor changes hands; the SSL goes with the SSLSocket, after both
        # close_notify alerts (its session stays resumable).
        sock = socket.socket(fileno=self._sock.detach())
        sock.setblocking(False)
        return sock

    def is_closing(self) -> bool:
        return self._closing or self.lost or self._fd_closed

    def pause_reading(self) -> None:
        self._read_paused = True
        if self.established.done():
            self._want_read(False)

    def resume_reading(self) -> None:
        if not self._read_paused or self._closing or self._fd_closed:
            return
        self._read_paused = False
        if self.eof_in and not self._tls:
            return  # nothing left to read (see _on_readable)
        if self.established.done():
            self._want_read(True)
            self._loop.call_soon(self._on_readable)  # plaintext OpenSSL holds, if any

    def is_reading(self) -> bool:
        return self._reader and not self._read_paused

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        if high is None:
            high = 64 * 1024 if low is None else 4 * low
        if low is None:
            low = high // 4
        if not high >= low >= 0:
            raise ValueError(f"high ({high!r}) must be >= low ({low!r}) must be >= 0")
        self._high, self._low = high, low

    def get_write_buffer_size(self) -> int:
        return self._buffered

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return self._low, self._high

    @property
    def resumed(self) -> bool:
        return self._tls and bool(self._sock.session_reused)

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        if name == "socket":
            return None if self._fd_closed else self._sock
        if name == "peername":
            return self._names[0]
        if name == "sockname":
            return self._names[1]
        if not self._tls:
            return None if name == "ssl_object" else default
        if name == "ssl_object":
            return self._sock
        if name == "peercert_der":
            return self._sock.getpeercert(binary_form=True)
        if name == "peercert":
            return self._sock.getpeercert()
        return default


# ---------------------------------------------------------------- opening links


async def open_link(
    host: str,
    port: int,
    context: ssl.SSLContext | None,
    *,
    server_hostname: str | None,
    timeout: float,
    session: ssl.SSLSession | None = None,
) -> Link:
    """A client link, TLS established (the server has not necessarily accepted our certificate
    yet under TLS 1.3: the caller reads the server's first line for that). `session`
    resumes an earlier session; nothing here keeps sessions to resume: keeping them
    (`SSLObject.session`, one at a time) grew native memory ~6 KiB per connection
    under OpenSSL 3.0 / Python 3.11 with nothing left on the Python side (found by
    the 10,000-cycle leak test), so pool refills make full handshakes."""
    loop = asyncio.get_running_loop()
    if not on_sockets(context):
        link = Link(context, server_side=False, server_hostname=server_hostname, session=session)
        try:
            async with asyncio.timeout(timeout):
                await loop.create_connection(lambda: link, host, port)
                await link.established
        except BaseException:
            link.abort()
            raise
        return link
    async with asyncio.timeout(timeout):
        sock = await _connect(loop, host, port)
        try:
            link = SocketLink(
                context,
                sock,
                server_side=False,
                server_hostname=server_hostname,
                session=session,
            )
        except BaseException:
            sock.close()
            raise
        try:
            link.start()
            await link.established
        except BaseException:
            link.abort()
            raise
    return link


def _drained(fd: int) -> bool:
    """Whether nothing waits to be read on `fd`: no byte, no EOF, no error (a poll that
    does not wait). The error matters: uvloop runs a reader once for an event that
    carried one (a reset) and then stops polling the socket, so a read loop that
    stopped with the reset still unread would leave the link open for ever."""
    try:
        poller = _LOCAL.poller
    except AttributeError:
        poller = _LOCAL.poller = select.poll()
    poller.register(fd, select.POLLIN)
    try:
        return not poller.poll(0)
    finally:
        poller.unregister(fd)


def plain_link(sock: socket.socket) -> SocketLink:
    """A connected non-blocking TCP socket (the agent's destination) as a plain SocketLink,
    reading already: what arrives before `splice` is held (`_Holding`, bounded), so a
    destination that speaks first loses nothing. OSError when the socket is gone already."""
    link = SocketLink(None, sock, server_side=False)
    link.start()
    return link


def on_sockets(context: ssl.SSLContext | None) -> bool:
    """Whether data connections are `SocketLink`s here: always plain, and with TLS where
    close_notify alone can be sent (`tls.can_send_close_notify`); `Link` otherwise."""
    return context is None or can_send_close_notify()


def _tcp_socket(family: int, kind: int, proto: int) -> socket.socket:
    sock = socket.socket(family, kind, proto)
    sock.setblocking(False)
    if family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # (as asyncio's)
    return sock


async def _connect(loop: asyncio.AbstractEventLoop, host: str, port: int) -> socket.socket:
    """A connected non-blocking TCP socket to the first address of `host` that answers."""
    infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    failure: OSError = OSError(f"no address for {host!r}")
    for family, kind, proto, _name, address in infos:
        sock = _tcp_socket(family, kind, proto)
        try:
            await loop.sock_connect(sock, address)
        except OSError as exc:
            sock.close()
            failure = exc
            continue
        except BaseException:
            sock.close()
            raise
        return sock
    raise failure


class LinkListener:
    """A listening socket whose connections become `SocketLink`s (for `on_sockets`):
    `accepted(link)` is called for each, then its handshake starts (`established`).
    One address (the first `host` resolves to)."""

    def __init__(self, context: ssl.SSLContext | None, accepted: Callable[[Link], None]) -> None:
        self._context = context
        self._accepted = accepted
        self._sock: socket.socket | None = None
        self.port = 0

    async def start(self, host: str | None, port: int, backlog: int = 100) -> int:
        loop = asyncio.get_running_loop()
        infos = await loop.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
        family, kind, proto, _name, address = infos[0]
        sock = socket.socket(family, kind, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
            sock.listen(backlog)
            sock.setblocking(False)
        except BaseException:
            sock.close()
            raise
        self._sock = sock
        self.port = sock.getsockname()[1]
        loop.add_reader(sock.fileno(), self._accept, backlog)
        return self.port

    def _accept(self, backlog: int) -> None:
        listening = self._sock
        if listening is None:
            return
        for _ in range(backlog):
            try:
                sock, _address = listening.accept()
            except (BlockingIOError, InterruptedError, ConnectionAbortedError):
                return
            except OSError:
                return  # (EMFILE and the like: the next readiness tries again)
            try:
                sock.setblocking(False)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                link = SocketLink(self._context, sock, server_side=True)
            except OSError:
                sock.close()  # (reset before we got to it)
                continue
            self._accepted(link)
            link.start()

    def close(self) -> None:
        sock, self._sock = self._sock, None
        if sock is not None:
            asyncio.get_running_loop().remove_reader(sock.fileno())
            sock.close()


def split_address(address: str) -> tuple[str, int]:
    """host:port or [v6]:port -> (host, port); ValueError when malformed."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise ValueError(f"expected HOST:PORT, got {address!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, int(port)


# ---------------------------------------------------------------- the relay


class _Half(asyncio.Protocol):
    """One direction of a splice: what its transport reads goes to `target`."""

    __slots__ = ("ended", "lend", "splice", "target", "target_flow")

    def __init__(self, splice: _Splice, target: Any, target_flow: flow.FlowControl) -> None:
        self.splice = splice
        self.target = target
        self.target_flow = target_flow  # the target's reading (it writes into our transport)
        self.ended = False
        # Whether a Link may hand this half its shared decrypt buffer (`_read_plain`):
        # only when the target copies what it is given before `write` returns (a TLS
        # Link encrypts it into its BIO; a SocketLink sends it or copies what the socket
        # did not take); a socket transport may keep a reference.
        self.lend = isinstance(target, SocketLink) or (isinstance(target, Link) and target.encrypts)

    def data_received(self, data: bytes) -> None:
        self.target.write(data)

    def eof_received(self) -> bool:
        if self.ended:
            return True
        self.ended = True
        target = self.target
        source = self.splice.other(target)
        if source not in self.splice.eof_written and _peer_closed(source):
            # Not a half-close: the peer closed its socket outright (a socketpair's
            # end shows POLLHUP then), so nobody will read the answer.
            self.splice.lost(LinkClosed("the peer closed its end"))
            return False
        if not target.is_closing():
            if target.can_write_eof():
                self.splice.eof_written.append(target)
                target.write_eof()
            else:
                target.close()
        self.splice.ended()
        return True

    def pause_writing(self) -> None:
        # Our transport's buffer is full: stop reading the side that writes into it.
        self.target_flow.pause(flow.PEER)

    def resume_writing(self) -> None:
        self.target_flow.resume(flow.PEER)

    def connection_lost(self, exc: Exception | None) -> None:
        self.splice.lost(exc, self.target)


def _peer_closed(transport: Any) -> bool:
    """True when a socketpair's peer closed both directions (POLLHUP; a Link never
    needs this: its abort arrives as a reset or an early FIN, see `Link.eof_received`)."""
    if isinstance(transport, Link):
        return False
    raw = transport.get_extra_info("socket")
    if raw is None or raw.family != socket.AF_UNIX:
        return False  # (TCP reports POLLHUP after a reset too: that is connection_lost's)
    poller = select.poll()
    poller.register(raw.fileno(), select.POLLIN)
    return any(events & select.POLLHUP for _fd, events in poller.poll(0))


class _Splice:
    __slots__ = ("a", "b", "done", "eof_written", "eofs")

    def __init__(self, a: Any, b: Any) -> None:
        self.a, self.b = a, b
        self.eofs = 0
        self.eof_written: list[Any] = []  # (after ours, POLLHUP is the normal end)
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def other(self, transport: Any) -> Any:
        return self.b if transport is self.a else self.a

    def ended(self) -> None:
        self.eofs += 1
        if self.eofs == 2:
            self.a.close()
            self.b.close()
            self._finish()

    def lost(self, exc: Exception | None, towards: Any = None) -> None:
        """One side ended otherwise than by both directions ending (`towards`: the side
        its bytes went to, when known)."""
        if self.done.done():
            return  # (handled already: the other side's end follows the first's)
        if towards is not None and towards in self.eof_written:
            # The lost side had ended its direction first (close_notify, then its FIN
            # or a reset: a full close): everything it sent is in `towards`'s buffers.
            # Close that side (those bytes, then its end) rather than abort it, as TCP
            # delivers what a peer sent before it closed; only the answer is dropped.
            self.other(towards).abort()
            towards.close()
            self._finish()
            return
        if self.eofs >= 2:
            # Both directions had ended: both sides are closing already (a reset
            # now, e.g. a destination that closed outright, is no failure of ours).
            self._finish()
            return
        if exc is not None or self.eofs < 2:
            self.a.abort()
            self.b.abort()
        else:
            self.a.close()
            self.b.close()
        self._finish()

    def _finish(self) -> None:
        if not self.done.done():
            self.done.set_result(None)


class Pending(asyncio.Protocol):
    """A plain transport's protocol until `splice`: holds what arrives (one read, then
    reading pauses), so a destination that speaks first loses nothing."""

    def __init__(self) -> None:
        self.transport: Any = None
        self.data: list[bytes] = []
        self.eof = False
        self.lost: Exception | None = None
        self.is_lost = False

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.data.append(data)
        self.transport.pause_reading()

    def eof_received(self) -> bool:
        self.eof = True
        return True

    def connection_lost(self, exc: Exception | None) -> None:
        self.is_lost = True
        self.lost = exc


def splice(a: Any, b: Any) -> asyncio.Future[None]:
    """Relay between transports `a` and `b` until both directions ended (or one side broke).

    `a` and `b` are Links or plain socket transports; a Link's held bytes (read
    past its preamble) are delivered first. The future is done once both are closed.
    """
    relay = _Splice(a, b)
    # core.flow: each side's reading pauses while the other's write buffer is full.
    half_a, half_b = _Half(relay, b, flow.FlowControl(b)), _Half(relay, a, flow.FlowControl(a))
    a.set_write_buffer_limits(high=HIGH_WATER, low=LOW_WATER)
    b.set_write_buffer_limits(high=HIGH_WATER, low=LOW_WATER)
    for transport, half in ((a, half_a), (b, half_b)):
        if isinstance(transport, Link):
            transport.attach(half)
            continue
        held = transport.get_protocol()
        transport.set_protocol(half)
        if isinstance(held, Pending):
            for data in held.data:
                half.data_received(data)
            if held.is_lost:
                if held.eof:
                    half.eof_received()
                half.connection_lost(held.lost)
                continue
            if held.eof:
                # Read to its end already: reading again would deliver the EOF twice
                # (uvloop reads again on resume_reading).
                half.eof_received()
                continue
        if not transport.is_closing():
            transport.resume_reading()
    return relay.done


def client_context(
    ca_pem: bytes | None, chain_pem: bytes | None = None, key_pem: bytes | None = None
) -> ssl.SSLContext:
    """A TLS client context (TLS 1.2+) that verifies the server against `ca_pem` (the
    system roots without it) and presents `chain_pem`/`key_pem` when given."""
    from waygate.core.tls import load_pem_chain

    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    if ca_pem:
        context.load_verify_locations(cadata=ca_pem.decode())
    else:
        context.load_default_certs()
    if chain_pem and key_pem:
        load_pem_chain(context, chain_pem, key_pem)
        if ca_pem:
            _CREDENTIALS[context] = (ca_pem, chain_pem, key_pem)
    return context


# ------------------------------------------------ TLS end to end (dialer <-> agent)

# The credentials behind each `client_context`, so the context TLS end to end needs
# beside it presents the same certificate (`end_to_end_context`).
_CREDENTIALS: weakref.WeakKeyDictionary[ssl.SSLContext, tuple[bytes, bytes, bytes]] = (
    weakref.WeakKeyDictionary()
)
_END_TO_END: weakref.WeakKeyDictionary[ssl.SSLContext, dict[bool, ssl.SSLContext]] = (
    weakref.WeakKeyDictionary()
)


def end_to_end_context(outer: ssl.SSLContext | None, *, server_side: bool) -> ssl.SSLContext | None:
    """The context for a TLS session from the dialer to the agent, inside a data connection
    that `outer` opened: the same certificate, so the inner handshake presents exactly
    what the replica authenticated on the outer one. None: `outer` has no certificate
    (development mode, or not built by `client_context`): no TLS end to end.

    - The agent's side (`server_side`) requires a client certificate chaining to the
      same trust (the dialer's); the caller pins it to the one the replica authorized.
    - The dialer's side verifies no chain itself: an agent's certificate is for client
      authentication only (waygate.tunnel.peers), which OpenSSL refuses from a server.
      The replica checked its chain and agent role on its own mTLS and names its
      SHA-256 in the answer; `open_end_to_end` pins the inner certificate to that,
      and the handshake proves the agent holds the key.
    TLS 1.3 only: both ends are Waygate's. Built once per outer context."""
    if outer is None:
        return None
    credentials = _CREDENTIALS.get(outer)
    if credentials is None:
        return None
    built = _END_TO_END.setdefault(outer, {})
    context = built.get(server_side)
    if context is None:
        ca_pem, chain_pem, key_pem = credentials
        if server_side:
            context = server_context(
                chain_pem=chain_pem, key_pem=key_pem, client_ca_pem=ca_pem, client_auth="required"
            )
        else:
            context = client_context(ca_pem, chain_pem, key_pem)
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE  # pinned instead (see above)
        context.minimum_version = ssl.TLSVersion.TLSv1_3
        built[server_side] = context
    return context


def fingerprint(der: bytes | None) -> str:
    """A certificate's SHA-256, hex: how the replica names the certificate it authenticated."""
    return hashlib.sha256(der or b"").hexdigest()


async def open_end_to_end(
    sock: socket.socket,
    context: ssl.SSLContext,
    *,
    server_side: bool,
    pin: str,
    timeout: float,
) -> SocketLink:
    """TLS end to end on a socket a link stepped out of: the handshake, then the peer's
    certificate pinned to `pin` (`fingerprint` of the one the replica authenticated);
    LinkClosed (the socket aborted) when either fails."""
    try:
        link = SocketLink(context, sock, server_side=server_side)
    except BaseException:
        sock.close()
        raise
    try:
        link.start()
        async with asyncio.timeout(timeout):
            await link.established
        der = link.get_extra_info("peercert_der")
        if not der or fingerprint(der) != pin:
            raise LinkClosed(
                "the end-to-end peer presented another certificate than the one the "
                "replica authenticated"
            )
    except BaseException:
        link.abort()
        raise
    return link


# ---------------------------------------------------------------- a stream API


class Stream(asyncio.Protocol):
    """read()/write() over a transport, for callers that are not transports.

    Bytes read are queued up to `flow.HIGH_WATER`; past it the transport stops
    reading until the caller took them (`read`) or, with `take`, said they were
    passed on (`delivered`): a slow consumer backs up into TCP.
    """

    def __init__(self) -> None:
        self.transport: Any = None
        self._queue: collections.deque[bytes] = collections.deque()
        # core.flow: bytes taken or queued and not yet delivered pause reading past the
        # high-water mark (resumed at the low one); a writer waits while the write
        # buffer is full. Set once the transport is known.
        self._flow: flow.FlowControl | None = None
        self.eof = False  # the peer half-closed
        self.ended = False  # the transport is gone
        self.error: Exception | None = None
        self._waiter: asyncio.Future[None] | None = None
        self.closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    @property
    def buffered(self) -> int:
        """Bytes read and not yet delivered (bounded: reading pauses at the high-water mark)."""
        return self._flow.buffered if self._flow is not None else 0

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        self._flow = flow.FlowControl(transport)

    def data_received(self, data: bytes) -> None:
        self._queue.append(data)
        self._flow.queued(len(data))  # type: ignore[union-attr]
        self._wake()

    def eof_received(self) -> bool:
        self.eof = True
        self._wake()
        return True

    def connection_lost(self, exc: Exception | None) -> None:
        self.ended = True
        self.error = exc
        self._wake()
        if self._flow is not None:
            self._flow.closed()
        if not self.closed.done():
            self.closed.set_result(None)

    def pause_writing(self) -> None:
        self._flow.pause_writing()  # type: ignore[union-attr]

    def resume_writing(self) -> None:
        self._flow.resume_writing()  # type: ignore[union-attr]

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def take(self) -> bytes:
        """The next bytes (joined up to a socket read's size), b"" at the peer's EOF;
        LinkClosed once the connection ended otherwise. Call `delivered` after."""
        queue = self._queue
        while not queue:
            if self.eof:
                return b""
            if self.ended:
                raise LinkClosed(str(self.error) if self.error else "the connection ended")
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        data = queue.popleft()
        if queue and len(data) < _READ_SIZE:
            parts = [data]
            size = len(data)
            while queue and size + len(queue[0]) <= _READ_SIZE:
                part = queue.popleft()
                parts.append(part)
                size += len(part)
            data = b"".join(parts)
        return data

    def delivered(self, size: int) -> None:
        self._flow.drained(size)  # type: ignore[union-attr]

    async def read(self) -> bytes:
        data = await self.take()
        self.delivered(len(data))
        return data

    async def write(self, data: bytes) -> None:
        if self.ended:
            raise LinkClosed(str(self.error) if self.error else "the connection ended")
        self.transport.write(data)
        stream_flow = self._flow
        if stream_flow is not None and stream_flow.write_paused:
            await stream_flow.drain()
            if self.ended:
                raise LinkClosed(str(self.error) if self.error else "the connection ended")

    def write_eof(self) -> None:
        if not self.ended:
            self.transport.write_eof()

    def close(self) -> None:
        self.transport.close()

    def abort(self) -> None:
        self.transport.abort()


def rotating_client_context(rotator: Any, trust: Any) -> Callable[[], ssl.SSLContext]:
    """`client_context` for a rotation client's current certificate and trust bundle:
    built again after a renewal (new connections present the new certificate; open
    ones keep the one they were opened with), not per connection."""
    built: list[Any] = [None, None, None]

    def context() -> ssl.SSLContext:
        held, bundle = rotator.current, trust.current
        if built[0] is not held or built[1] is not bundle:
            built[:] = [held, bundle, client_context(bundle.pem, held.chain_pem(), held.key_pem())]
        return cast(ssl.SSLContext, built[2])

    return context
