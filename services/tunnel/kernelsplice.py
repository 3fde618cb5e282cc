"""The relay between two plain TCP sockets with Linux `splice(2)`: bytes never enter user space.

For the replica's "TLS end to end" mode: once a dial is authorized, the dialer's
TLS runs to the agent and the replica only copies ciphertext between two plain
TCP sockets. `relay.splice` over two plain `SocketLink`s would `recv` every byte
into Python and `send` it again; here each direction is `splice(socket -> pipe)`
then `splice(pipe -> socket)`, one pipe per direction, driven by the running
loop's `add_reader`/`add_writer` (asyncio's or uvloop's): no task, no buffer, no
per-chunk allocation or logging.

    relay = kernel_splice(a, b)   # a, b: connected TCP sockets; ownership passes here
    await relay.done              # both directions ended (or one side broke)
    relay.abort()                 # the replica's shutdown: everything released at once

Semantics (those of `relay.splice`, `_Splice` and `_Half`):

- A peer's FIN (EOF) is passed on as `shutdown(SHUT_WR)` to the other socket once
  every byte read before it was written there; the other direction goes on
  (half-close). Once both directions ended, both sockets are closed (FIN) and
  `done` is resolved.
- An error on a side (a reset when reading it, EPIPE/ECONNRESET when writing or
  shutting it down) aborts both: each socket is closed with SO_LINGER 0 (a reset).
  EXCEPT when that side had ended its direction first (its FIN was passed on,
  then it closed fully: the reset answers what was sent to it): the other side
  then gets everything already read and a normal close, as `_Splice.lost` does.
  Before that close, what the other side sent and nobody will read is
  discarded: closing a TCP socket with unread bytes sends a reset in place of
  the FIN and drops the bytes not yet sent.
- Backpressure: a direction whose pipe cannot be written on (the destination does
  not read, its socket buffer is full) stops reading its source until the pipe is
  empty again; what the relay holds is bounded by the two pipes.
- `done` is resolved (None) once both sockets and the four pipe ends are closed;
  `abort()`, or cancelling `done`, closes everything at once with resets.

Invariants: ownership of both sockets passes to the relay when `kernel_splice`
returns (before that, an exception leaves them to the caller); every descriptor
is closed exactly once, its reader and writer removed from the loop first; a
direction has its source's reader or its destination's writer registered, never
both; a callback yields the loop after `TURN` bytes (then one `call_soon`, as
uvloop stops polling a socket that reported an error once its callback ran, see
`relay.SocketLink._read`).

Linux only (`available()`; elsewhere `kernel_splice` raises OSError ENOSYS); the
sockets must be plain TCP (an `ssl.SSLSocket` is refused: splice would bypass its
TLS) and on no loop transport. Pipe sizes: an unprivileged user's pipes count
against `fs.pipe-user-pages-soft` (16,384 pages: 32 relays at 2 x 1 MiB); past it
F_SETPIPE_SZ is refused (the relay keeps the default 64 KiB) and new pipes get two
pages, slower but still correct. `pipe_size` is the knob.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import functools
import os
import socket
import ssl
import struct

PIPE_SIZE = 1 << 20  # asked per pipe with F_SETPIPE_SZ; whatever the kernel grants is used
TURN = 4 * PIPE_SIZE  # bytes one direction moves per callback before it yields the loop
_FLAGS = getattr(os, "SPLICE_F_MOVE", 0) | getattr(os, "SPLICE_F_NONBLOCK", 0)
_RESET = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close() sends RST
_DISCARD_READS = 64  # at most 64 x 64 KiB of unread bytes dropped before a normal close
_SCRATCH = bytearray(64 * 1024)  # where they go (MSG_TRUNC: TCP copies nothing into it)


@functools.cache
def available() -> bool:
    """Whether `os.splice` exists and moves socket bytes through a pipe here (probed once,
    on a socketpair); when not, the caller falls back to `relay.splice`."""
    if not hasattr(os, "splice") or not hasattr(fcntl, "F_SETPIPE_SZ"):
        return False
    try:
        left, right = socket.socketpair()
    except OSError:
        return False
    with left, right:
        try:
            read_end, write_end = os.pipe()
        except OSError:
            return False
        try:
            left.sendall(b"x")
            if os.splice(right.fileno(), write_end, 1) != 1:
                return False
            return os.splice(read_end, left.fileno(), 1) == 1 and right.recv(1) == b"x"
        except OSError:
            return False
        finally:
            os.close(read_end)
            os.close(write_end)


def kernel_splice(
    a: socket.socket,
    b: socket.socket,
    *,
    to_a: bytes = b"",
    to_b: bytes = b"",
    pipe_size: int = PIPE_SIZE,
) -> KernelSplice:
    """Relay between the connected TCP sockets `a` and `b` on the running loop until both
    directions ended or one side broke (see the module docstring); its `done` says when.

    `to_b` (`to_a`): bytes already read from `a` (`b`), say past a preamble, that go to
    `b` (`a`) before anything else; each at most what a pipe holds (64 KiB, but 8 KiB for
    a user past fs.pipe-user-pages-soft), ValueError otherwise. The sockets are made non-blocking. Ownership passes to
    the relay on return; on an exception (no pipes left: OSError) they stay the caller's.
    """
    return KernelSplice(a, b, to_a=to_a, to_b=to_b, pipe_size=pipe_size)


class _Way:
    """One direction: `src` -> pipe -> `dst`."""

    __slots__ = (
        "dst",
        "dst_fd",
        "loop",
        "pipe_r",
        "pipe_w",
        "queued",
        "reading",
        "relay",
        "shut",
        "size",
        "src",
        "src_fd",
        "step",
        "writing",
    )

    def __init__(
        self, relay: KernelSplice, src: socket.socket, dst: socket.socket, pipe_size: int
    ) -> None:
        self.relay = relay
        self.loop = relay.loop
        self.src, self.dst = src, dst
        self.src_fd, self.dst_fd = src.fileno(), dst.fileno()
        self.pipe_r, self.pipe_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            # (EPERM past fs.pipe-max-size or the user's pipe pages: the default stays)
            with contextlib.suppress(OSError):
                fcntl.fcntl(self.pipe_w, fcntl.F_SETPIPE_SZ, pipe_size)
            self.size = fcntl.fcntl(self.pipe_w, fcntl.F_GETPIPE_SZ)
        except BaseException:
            os.close(self.pipe_r)
            os.close(self.pipe_w)
            raise
        self.queued = 0  # bytes in the pipe
        self.shut = False  # the source's FIN was passed on: this direction ended
        self.reading = False  # the source's reader is registered
        self.writing = False  # the destination's writer is registered
        self.step = self.pump  # one bound method for every registration

    def preload(self, data: bytes) -> None:
        if not data:
            return
        try:
            written = os.write(self.pipe_w, data)
        except BlockingIOError:
            written = 0
        if written != len(data):
            raise ValueError(f"{len(data)} bytes to send first: more than a pipe holds here")
        self.queued = written

    def start(self) -> None:
        if self.queued:
            self.want_write()
        else:
            self.want_read()

    def want_read(self) -> None:
        if self.writing:
            self.writing = False
            self.loop.remove_writer(self.dst_fd)
        if not self.reading:
            self.reading = True
            self.loop.add_reader(self.src_fd, self.step)

    def want_write(self) -> None:
        if self.reading:
            self.reading = False
            self.loop.remove_reader(self.src_fd)
        if not self.writing:
            self.writing = True
            self.loop.add_writer(self.dst_fd, self.step)

    def idle(self) -> None:
        if self.reading:
            self.reading = False
            self.loop.remove_reader(self.src_fd)
        if self.writing:
            self.writing = False
            self.loop.remove_writer(self.dst_fd)

    def pump(self) -> None:
        """Empty the pipe into `dst`, then refill it from `src`, until one would block."""
        relay = self.relay
        if relay.closed or self.shut:
            return  # (a call_soon from before this direction's end)
        splice, flags = os.splice, _FLAGS
        queued, moved = self.queued, 0
        while True:
            while queued:
                try:
                    sent = splice(self.pipe_r, self.dst_fd, queued, None, None, flags)
                except BlockingIOError:
                    sent = 0
                except OSError as exc:
                    self.queued = queued
                    relay.lost(self.dst, exc)
                    return
                if not sent:
                    # `dst` is full: stop reading `src` until it takes the pipe's bytes.
                    self.queued = queued
                    self.want_write()
                    return
                queued -= sent
            self.queued = 0
            if moved >= TURN:
                self.want_read()
                self.loop.call_soon(self.step)
                return
            try:
                queued = splice(self.src_fd, self.pipe_w, self.size, None, None, flags)
            except BlockingIOError:
                self.want_read()  # (the pipe is empty: the socket is)
                return
            except OSError as exc:
                relay.lost(self.src, exc)
                return
            if not queued:  # the FIN, and the pipe is empty: pass it on
                self.end()  # (and read no more: a socket at EOF stays readable)
                return
            moved += queued

    def end(self) -> None:
        """The source's FIN, after every byte before it: pass it on."""
        self.idle()
        try:
            self.dst.shutdown(socket.SHUT_WR)
        except OSError as exc:
            self.relay.lost(self.dst, exc)
            return
        self.shut = True
        self.relay.ended()

    def close_pipe(self) -> None:
        self.idle()
        os.close(self.pipe_r)
        os.close(self.pipe_w)


class KernelSplice:
    """A running kernel relay between two sockets (`kernel_splice`).

    `done`: resolved (None) once both sockets and the pipes are closed; cancelling it
    aborts. `error`: the OSError that ended it, if one did. `a_ended`/`b_ended`: that
    side's FIN was passed on to the other. `abort()`: close everything now, with resets.
    """

    __slots__ = ("_a", "_ab", "_b", "_ba", "closed", "done", "error", "loop")

    def __init__(
        self,
        a: socket.socket,
        b: socket.socket,
        *,
        to_a: bytes = b"",
        to_b: bytes = b"",
        pipe_size: int = PIPE_SIZE,
    ) -> None:
        if isinstance(a, ssl.SSLSocket) or isinstance(b, ssl.SSLSocket):
            raise TypeError("kernel_splice relays plain sockets: splice would bypass TLS")
        if not 0 < pipe_size < 1 << 31:
            raise ValueError(f"pipe_size {pipe_size}: not a size F_SETPIPE_SZ takes")
        if not hasattr(os, "splice"):
            raise OSError(errno.ENOSYS, "no splice(2) here: see kernelsplice.available()")
        self.loop = asyncio.get_running_loop()
        self.closed = False
        self.error: OSError | None = None
        self._a, self._b = a, b
        self._ab = _Way(self, a, b, pipe_size)
        try:
            self._ba = _Way(self, b, a, pipe_size)
        except BaseException:
            self._ab.close_pipe()
            raise
        try:
            self._ab.preload(to_b)
            self._ba.preload(to_a)
        except BaseException:
            self._ab.close_pipe()
            self._ba.close_pipe()
            raise
        a.setblocking(False)
        b.setblocking(False)
        self.done: asyncio.Future[None] = self.loop.create_future()
        self.done.add_done_callback(self._on_done)
        self._ab.start()
        self._ba.start()

    @property
    def a_ended(self) -> bool:
        return self._ab.shut

    @property
    def b_ended(self) -> bool:
        return self._ba.shut

    def abort(self) -> None:
        """Close both sockets with a reset and the pipes, now; resolve `done`."""
        self._release(reset_a=True, reset_b=True)

    def ended(self) -> None:
        if self._ab.shut and self._ba.shut:
            self._release(reset_a=False, reset_b=False)

    def lost(self, side: socket.socket, exc: OSError) -> None:
        """`side` broke (`exc`): abort both, unless `side` had ended its direction first."""
        if self.closed:
            return
        self.error = exc
        if side is self._a:
            if self._ab.shut:
                _discard_unread(self._b)
                self._release(reset_a=True, reset_b=False)
                return
        elif self._ba.shut:
            _discard_unread(self._a)
            self._release(reset_a=False, reset_b=True)
            return
        self._release(reset_a=True, reset_b=True)

    def _on_done(self, _done: asyncio.Future[None]) -> None:
        if not self.closed:  # cancelled from outside
            self.abort()

    def _release(self, *, reset_a: bool, reset_b: bool) -> None:
        if self.closed:
            return
        self.closed = True
        self._ab.close_pipe()
        self._ba.close_pipe()
        for sock, reset in ((self._a, reset_a), (self._b, reset_b)):
            if reset:
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RESET)
            sock.close()
        if not self.done.done():
            self.done.set_result(None)


def _discard_unread(sock: socket.socket) -> None:
    """Drop what `sock`'s peer sent that nobody will read (bounded), so that closing it
    sends a FIN after the bytes still queued rather than a reset instead of them."""
    for _ in range(_DISCARD_READS):
        try:
            if not sock.recv_into(_SCRATCH, len(_SCRATCH), socket.MSG_TRUNC):
                return
        except OSError:  # (BlockingIOError: nothing more)
            return
