"""Early data on a raw dial: a dialer's first bytes, sent with its DIAL line (TCP Fast Open's
idea, TLS 0-RTT's retry rule), so the request does not wait for the OK's round trip.

The wire (`waygate.tunnel.datapath`'s docstring has the whole grammar): a DIAL line
that ends in ``<length> <once|replay>`` (dialer -> replica) or ``<length>``
(replica -> agent on a parked connection) is followed by exactly `length` bytes,
1..`EARLY_LIMIT`. The agent writes them to the destination only once its connect
succeeded and the replica still waits for the answer; it answers as without them.

What an answer means for the bytes, which is what makes retrying safe:
- ``REFUSED``: they reached no destination. The dialer may send them again, to
  another replica (the replica itself moves on to another agent the same way).
- ``OK``: they were handed to the destination's connection, first, before any
  byte written on the dialled connection afterwards.
- no answer (the connection lost, the answer's time out): unknown, they may have
  reached the destination. Such a dial is not retried, on either hop, unless the
  dialer declared the bytes safe to deliver twice (``replay``: an idempotent
  request, as TLS 0-RTT asks of its callers); it fails with the reason said.

Where the agent answers on its Connect stream or on a data connection of its own
(DIAL_REQ: no parked connection), the replica sends the bytes as the first ones
after the agent's answer, with the same meaning for OK and REFUSED.

Invariants: at most `EARLY_LIMIT` bytes are held per dial, on each hop; every read
of them has a timeout; no grpc here.
"""

from __future__ import annotations

import asyncio
from typing import Any

from waygate.tunnel.relay import Link, LinkClosed

# The most a dialer may send with its dial: a request head, not an upload.
EARLY_LIMIT = 16 * 1024


class Unanswered(Exception):
    """The dial and its early data went out and no answer came back: the bytes may have
    reached the destination, so the dial must not be retried (unless replay-safe)."""


def parse_length(text: str) -> int:
    """The early-data length of a DIAL line; ValueError (said for the dialer) otherwise."""
    if not text.isdigit() or not 0 < int(text) <= EARLY_LIMIT:
        raise ValueError(
            f"early data must be 1..{EARLY_LIMIT} bytes, not {text[:12]!r} "
            "(larger first bytes go after the dial's answer)"
        )
    return int(text)


class _Collector(asyncio.Protocol):
    """Takes exactly `size` bytes off a Link before its user attaches, then hands the link
    back to what held it (its `_Holding`): later bytes, EOF or loss wait there as they
    would have, for `Link.attach` to replay."""

    def __init__(self, link: Link, size: int, holder: Any) -> None:
        self.link = link
        self.size = size
        self.holder = holder
        self.data = bytearray()
        self.done: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: Any) -> None:
        pass

    def data_received(self, data: bytes) -> None:
        if self.done.done():  # handed back already: only a replay from `attach` gets here
            self.holder.data_received(data)
            return
        wanted = self.size - len(self.data)
        self.data += data[:wanted]
        if len(self.data) == self.size:
            self.give_back()
            self.done.set_result(bytes(self.data))
            if len(data) > wanted:
                self.holder.data_received(bytes(data[wanted:]))

    def eof_received(self) -> bool:
        self.give_back()
        self.holder.eof_received()
        self._fail("the data connection ended before its early data")
        return True

    def connection_lost(self, exc: Exception | None) -> None:
        self.give_back()
        self.holder.connection_lost(exc)
        self._fail("the data connection was lost before its early data")

    def _fail(self, why: str) -> None:
        if not self.done.done():
            self.done.set_exception(LinkClosed(why))

    def give_back(self) -> None:
        if self.link.get_protocol() is self:
            self.link.set_protocol(self.holder)


async def read_early(link: Link, size: int, timeout: float) -> bytes:
    """The `size` bytes after the preamble line just read from `link` (not yet attached),
    within `timeout` (TimeoutError); LinkClosed when it ends first. Bounded: `size` is
    at most EARLY_LIMIT (`parse_length`), and reading goes on only until it is in."""
    holder = link.get_protocol()
    collector = _Collector(link, size, holder)
    try:
        link.attach(collector)  # what arrived with the line first, then the socket's reads
        async with asyncio.timeout(timeout):
            return await collector.done
    finally:
        collector.give_back()
        done = collector.done
        if not done.done():
            done.cancel()
        elif not done.cancelled():
            done.exception()  # retrieved: a failure is raised above, or was a timeout's
