"""What both ends of an agent stream share: limits, credit, refusals, identities.

The design (chosen for v1, stated once here):

- One long-lived `AgentTunnel.Connect` stream per (agent, server replica)
  carries many TCP connections as `Packet`s (konnectivity's design); one
  `Tunnel.Dial` stream per tunnelled connection faces the dialer, so gRPC's
  own per-stream flow control backs up a slow dialer into its own stream only.
- On the agent stream every connection has a credit window in each
  direction: a side sends DATA only while it holds credit, and the receiver
  grants more (WINDOW_UPDATE) once it has handed the bytes on (written to the
  dialer stream, or to the destination socket without crossing the socket's
  high-water mark). Every queue is therefore bounded by the window: a slow
  destination or a slow dialer stalls its own connection, never the stream.
  A peer that sends beyond its credit loses that connection.
- Chunks are at most `MAX_CHUNK` bytes (256 KiB: one uvloop socket read;
  measured against 64 KiB, a third less CPU per byte, since grpc.aio's cost
  is mostly per message); grants are batched (half a window, `GRANT_SHIFT`)
  so WINDOW_UPDATE costs a fraction of the DATA packets. DATA waiting in an
  `Outbox` is coalesced up to `MAX_CHUNK` per connection (see `Outbox`),
  and the server joins what waits for a dialer the same way (`join_queued`).

Invariants: `Credit` has one waiter at most (one sender per direction);
`close()` wakes it with `ConnectionClosed`, so no sender hangs on a dead
connection.
"""

from __future__ import annotations

import asyncio
import collections
from typing import Any

from waygate.core import errors
from waygate.tunnel.v1 import tunnel_pb2 as pb

MAX_CHUNK = 256 * 1024
DEFAULT_WINDOW = 1024 * 1024
# An Outbox's writer gathers DATA of at least GATHER_FROM bytes for up to
# GATHER_TURNS event-loop turns before writing it (measured on the bulk
# benchmark: packets server -> agent from 64 KiB to mostly 128-256 KiB, agent
# CPU per GiB -25%); smaller DATA (interactive traffic) is written at once.
GATHER_FROM = 16 * 1024
GATHER_TURNS = 4
# A receiver grants credit back once it owes `window >> GRANT_SHIFT` (half a
# window: one WINDOW_UPDATE per 512 KiB at the default; measured on the bulk
# benchmark, 0.6 s less CPU per GiB than a quarter). The sender then always
# holds at least half a window, and windows are at least 4 * MAX_CHUNK (the
# settings' check; a harness's smaller window must stay above 2 * the largest
# chunk), so a sender waiting for credit for one whole chunk is always granted.
GRANT_SHIFT = 1
AGENT_ID_METADATA = "waygate-agent-id"
# The replica ids an agent holds live streams to when it opens another (comma-separated):
# a replica it reaches that is not among them holds a stale stream of it, which the new
# one replaces; one among them is where a load balancer sent the attempt (ALREADY_EXISTS).
HELD_METADATA = "waygate-held"


class ConnectionClosed(Exception):
    """The tunnelled connection is gone; whoever waited on it stops."""


class Credit:
    """Bytes one side may still send on one connection; `take` waits for a grant."""

    __slots__ = ("_closed", "_waiter", "available", "limit")

    def __init__(self, initial: int, limit: int | None = None) -> None:
        # `limit` caps what a peer can grant: a peer that claims a huge window, or
        # grants more than it received, cannot make us queue more than `limit`.
        self.limit = initial if limit is None else limit
        self.available = min(initial, self.limit)
        self._waiter: asyncio.Future[None] | None = None
        self._closed = False

    async def take(self, size: int) -> None:
        while self.available < size:
            if self._closed:
                raise ConnectionClosed
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        if self._closed:
            raise ConnectionClosed
        self.available -= size

    def grant(self, size: int) -> None:
        self.available = min(self.available + size, self.limit)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def close(self) -> None:
        self._closed = True
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


class ReceiveWindow:
    """What one side of a connection may still receive, and the credit it owes back.

    The one bookkeeping both ends keep per connection (the server's
    `ServerConnection`, the agent's `AgentConnection`): `received` counts
    bytes in and says whether the peer stayed within the `window` it was
    given; `consumed` counts bytes handed on and returns the credit to grant
    now: nothing until half a window (`GRANT_SHIFT`) is owed, then all of it
    at once, so a WINDOW_UPDATE goes out per half window, not per chunk.
    `hold` (the agent, while the destination socket's buffer is above its
    high-water mark) keeps owing; `owed_now` grants what is owed once it may.
    """

    __slots__ = ("_threshold", "owed", "unacked", "window")

    def __init__(self, window: int) -> None:
        self.window = window  # bytes the peer may send before a grant
        self._threshold = window >> GRANT_SHIFT
        self.unacked = 0  # received and not yet granted back
        self.owed = 0  # handed on and not yet granted back

    def received(self, size: int) -> bool:
        """`size` bytes arrived; False when the peer sent beyond its window."""
        self.unacked += size
        return self.unacked <= self.window

    def consumed(self, size: int, *, hold: bool = False) -> int:
        """`size` bytes were handed on; the increment to grant now (0: none yet)."""
        owed = self.owed + size
        if hold or owed < self._threshold:
            self.owed = owed
            return 0
        self.unacked -= owed
        self.owed = 0
        return owed

    def owed_now(self) -> int:
        """Everything owed, to grant now whatever its size (0: nothing)."""
        owed = self.owed
        self.unacked -= owed
        self.owed = 0
        return owed


def join_queued(first: bytes, queued: collections.deque[Any]) -> bytes:
    """`first` and the bytes queued right behind it, joined up to `MAX_CHUNK`.

    Takes from the front of `queued` only while its head is bytes (a marker
    such as EOF stays, and stays after the data) and the joined size stays
    within `MAX_CHUNK`. A frame or packet costs grpc.aio about the same
    whatever its size: what queued up during the last write goes as one.
    """
    size = len(first)
    chunks = None
    while queued:
        head = queued[0]
        if head.__class__ is not bytes or size + len(head) > MAX_CHUNK:
            break
        queued.popleft()
        size += len(head)
        if chunks is None:
            chunks = [first]
        chunks.append(head)
    return first if chunks is None else b"".join(chunks)


class _QueuedData:
    """DATA for one connection waiting in an `Outbox`: chunks joined into one packet when written."""

    __slots__ = ("chunks", "connect_id", "eof", "size")

    def __init__(self, connect_id: int, data: bytes) -> None:
        self.connect_id = connect_id
        self.chunks = [data]
        self.size = len(data)
        self.eof = False

    def packet(self) -> pb.Packet:
        chunks = self.chunks
        payload = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        if self.eof:
            return pb.Packet(
                type=pb.DATA, data={"connect_id": self.connect_id, "data": payload, "eof": True}
            )
        return data_packet(self.connect_id, payload)


class Outbox:
    """The packets one agent stream has yet to write, in order, for its one writer.

    Unbounded by itself on purpose: what goes in is bounded by the credit
    windows (DATA) and by the connections (control packets). `end(marker)`
    drops what is queued and makes `marker` the next packet, so a closing
    stream stops writing at once.

    DATA is coalesced while it waits: a chunk for the connection whose DATA is
    last in the queue joins it as long as the packet stays within `MAX_CHUNK`,
    and an EOF joins it as its flag. grpc.aio's cost is mostly per message, so
    when the writer falls behind (the stream is the bottleneck) its packets
    grow towards `MAX_CHUNK` instead of the queue growing in count. Only the
    last queued item is ever extended, so the order on the wire is the order
    of `put`s, and the bytes are those the senders took credit for (a packet
    is never larger than the credit its chunks took, nor than `MAX_CHUNK`).
    Before writing DATA of `GATHER_FROM` bytes or more that is alone in the
    queue, `next` yields to the loop for up to `GATHER_TURNS` turns so the
    chunk read right behind it can join (a dialer writing 64 KiB frames
    otherwise sets the size of every packet on the agent stream).
    """

    __slots__ = ("_queue", "_ready")

    def __init__(self) -> None:
        self._queue: collections.deque[Any] = collections.deque()
        self._ready: asyncio.Future[None] | None = None

    def put(self, packet: Any) -> None:
        self._queue.append(packet)
        ready = self._ready
        if ready is not None and not ready.done():
            ready.set_result(None)

    def put_data(self, connect_id: int, data: bytes) -> None:
        """Queue `data` (at most `MAX_CHUNK` bytes) for `connect_id`, joined to its queued DATA if it fits."""
        queue = self._queue
        if queue:
            last = queue[-1]
            if (
                last.__class__ is _QueuedData
                and last.connect_id == connect_id
                and not last.eof
                and last.size + len(data) <= MAX_CHUNK
            ):
                last.chunks.append(data)
                last.size += len(data)
                return
        self.put(_QueuedData(connect_id, data))

    def put_eof(self, connect_id: int) -> None:
        """Queue the connection's EOF: the flag of its queued DATA when that is last."""
        queue = self._queue
        if queue:
            last = queue[-1]
            if last.__class__ is _QueuedData and last.connect_id == connect_id:
                last.eof = True
                return
        self.put(eof_packet(connect_id))

    def end(self, marker: Any) -> None:
        self._queue.clear()
        self.put(marker)

    async def next(self) -> Any:
        queue = self._queue
        while not queue:
            self._ready = asyncio.get_running_loop().create_future()
            try:
                await self._ready
            finally:
                self._ready = None
        head = queue[0]
        if head.__class__ is _QueuedData and head.size >= GATHER_FROM:
            # A chunk this large is likely part of a transfer whose next chunk is
            # already on its way to this loop: give the readers a few turns
            # (no timer, no sleep) to add to it while it is the last thing queued.
            turns = GATHER_TURNS
            while turns and head.size < MAX_CHUNK and not head.eof and head is queue[-1]:
                turns -= 1
                await asyncio.sleep(0)
        item = queue.popleft()
        if item.__class__ is _QueuedData:
            return item.packet()
        return item

    def __len__(self) -> int:
        return len(self._queue)


class Refused(errors.WaygateError):
    """A dial refused for `reason` (a `RefusalReason`); the status follows the reason."""

    def __init__(self, reason: int, message: str) -> None:
        super().__init__(message)
        self.reason: Any = reason  # a RefusalReason value (protobuf types it as its own enum)
        self.status = REFUSAL_STATUS.get(reason, "UNAVAILABLE")


class Silent(Refused):
    """The agent did not answer a dial at all within its time (TIMEOUT): it may be stuck,
    and another agent of the node may serve (`waygate.tunnel.selection`)."""


REFUSAL_STATUS: dict[int, str] = {
    pb.NOT_ALLOWED: "PERMISSION_DENIED",
    pb.UNREACHABLE: "UNAVAILABLE",
    pb.NO_AGENT: "NOT_FOUND",
    pb.TIMEOUT: "DEADLINE_EXCEEDED",
    pb.DRAINING: "UNAVAILABLE",
    pb.INVALID: "INVALID_ARGUMENT",
}

# Reasons another replica could answer differently: the caller may retry there.
RETRYABLE_ELSEWHERE: frozenset[int] = frozenset({pb.NO_AGENT, pb.DRAINING})


def reason_name(reason: int) -> str:
    return pb.RefusalReason.Name(reason) if reason in pb.RefusalReason.values() else str(reason)


def window_update(connect_id: int, increment: int) -> pb.Packet:
    # Sub-messages are given as mappings: under upb, a nested message passed as a
    # constructor argument is copied (for DATA, the whole chunk: ~500 us per 256 KiB
    # against ~8 us for the mapping form).
    return pb.Packet(
        type=pb.WINDOW_UPDATE,
        window_update={"connect_id": connect_id, "increment": increment},
    )


def close_request(connect_id: int, reason: str = "") -> pb.Packet:
    return pb.Packet(type=pb.CLOSE_REQ, close_request={"connect_id": connect_id, "reason": reason})


def data_packet(connect_id: int, data: bytes) -> pb.Packet:
    return pb.Packet(type=pb.DATA, data={"connect_id": connect_id, "data": data})


def eof_packet(connect_id: int) -> pb.Packet:
    return pb.Packet(type=pb.DATA, data={"connect_id": connect_id, "eof": True})
