"""Early data on a raw dial: a dialer's first bytes, sent with its DIAL line (TCP Fast Open's
idea, TLS 0-RTT's retry rule), so the request does not wait for the OK's round trip.

The wire (`waygate.tunnel.wire` has the whole grammar and its codec): a DIAL line
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

Their framing is `wire.dial`/`wire.parse_opening` (and `agent_dial`/`parse_agent_dial`
on a parked connection); reading them is `relay.Link.read_exact`, beside `read_line`.

Invariants: at most `EARLY_LIMIT` bytes are held per dial, on each hop; every read
of them has a timeout; no grpc here.
"""

from __future__ import annotations

# The most a dialer may send with its dial: a request head, not an upload.
EARLY_LIMIT = 16 * 1024


class Unanswered(Exception):
    """The dial and its early data went out and no answer came back: the bytes may have
    reached the destination, so the dial must not be retried (unless replay-safe).
    `silent`: the agent said nothing in its time (rather than its connection ending),
    which the dial selection charges it for."""

    def __init__(self, message: str, *, silent: bool = False) -> None:
        super().__init__(message)
        self.silent = silent
