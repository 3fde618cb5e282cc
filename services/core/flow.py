"""Flow control for asyncio Protocols: the one helper every relay uses.

A relay reads from one side and writes to the other; when the other side
cannot take bytes as fast as they come, reading must pause, or a buffer grows
without bound. This is uvicorn's `flow_control.py` generalised for relays
whose reading pauses for several independent reasons at once (the peer's write
buffer is full, pipelined requests wait, a connect is in progress, bytes wait
for tunnel credit):

- `FlowControl.pause(reason)` / `resume(reason)`: reasons are bits; the
  transport's reading pauses with the first reason and resumes when the last
  is gone. Nothing happens twice: a second pause or resume for a reason is a
  no-op, and a closed transport is never resumed.
- `queued(n)` / `drained(n)`: bytes held on the transport's behalf (e.g.
  waiting for a peer's credit), against the high- and low-water marks: reading
  pauses (reason `BUFFERED`) when more than `high` are held and resumes when
  they are down to `low` (hysteresis, so it does not flap per chunk).
- `pause_writing()` / `resume_writing()` (call them from the Protocol's
  callbacks of the same names) and `await drain()`: a writer task waits while
  the transport's own write buffer is above its high-water mark.

No allocation per call on the steady path (a future exists only while a
writer waits), no logging: it is on every relay's per-chunk path.
"""

from __future__ import annotations

import asyncio
from typing import Final, Protocol

# Reasons a transport's reading is paused (bits; a user may define more from 16 up).
BUFFERED: Final = 1  # bytes held for the peer above the high-water mark
PEER: Final = 2  # the peer's write buffer is full (its pause_writing)
PIPELINE: Final = 4  # later requests wait behind the current exchange
CONNECTING: Final = 8  # a body waits while the upstream connect runs
WRITING: Final = 16  # answers wait until this transport's own peer reads

HIGH_WATER: Final = 256 * 1024
LOW_WATER: Final = 64 * 1024


class ReadTransport(Protocol):
    def pause_reading(self) -> None: ...
    def resume_reading(self) -> None: ...
    def is_closing(self) -> bool: ...


class FlowControl:
    """Reading paused for any of several reasons; writing awaited past the high-water mark."""

    __slots__ = ("_writable", "buffered", "high", "low", "reasons", "transport", "write_paused")

    def __init__(
        self, transport: ReadTransport, *, high: int = HIGH_WATER, low: int = LOW_WATER
    ) -> None:
        if not 0 <= low <= high:
            raise ValueError(f"flow control needs 0 <= low ({low}) <= high ({high})")
        self.transport = transport
        self.high = high
        self.low = low
        self.reasons = 0
        self.buffered = 0
        self.write_paused = False
        self._writable: asyncio.Future[None] | None = None

    # ------------------------------------------------------------ reading

    @property
    def reading_paused(self) -> bool:
        return self.reasons != 0

    def pause(self, reason: int) -> None:
        if not self.reasons:
            self.transport.pause_reading()
        self.reasons |= reason

    def resume(self, reason: int) -> None:
        if self.reasons & reason:
            self.reasons &= ~reason
            if not self.reasons and not self.transport.is_closing():
                self.transport.resume_reading()

    def queued(self, size: int) -> None:
        """`size` more bytes are held for the peer: pause past the high-water mark."""
        self.buffered += size
        if self.buffered > self.high and not self.reasons & BUFFERED:
            self.pause(BUFFERED)

    def drained(self, size: int) -> None:
        """`size` held bytes went on: resume once down to the low-water mark."""
        self.buffered -= size
        if self.buffered <= self.low and self.reasons & BUFFERED:
            self.resume(BUFFERED)

    # ------------------------------------------------------------ writing

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        self._wake()

    async def drain(self) -> None:
        """Return once the transport takes writes again (at once when it does)."""
        if not self.write_paused:
            return
        waiter = self._writable
        if waiter is None:
            waiter = self._writable = asyncio.get_running_loop().create_future()
        try:
            await waiter
        finally:
            if self._writable is waiter:
                self._writable = None

    def closed(self) -> None:
        """The transport is gone: a waiting writer returns (and finds it closed)."""
        self.write_paused = False
        self._wake()

    def _wake(self) -> None:
        waiter = self._writable
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
