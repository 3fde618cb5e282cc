"""ingress-nginx's limit-rate and limit-rate-after: a response's body paced to the client.

nginx's `limit_rate` (ngx_http_write_filter): after `limit_rate_after` bytes, at
time t since the response began at most `after + rate x (t + 1)` bytes have gone
to the client (nginx allows the first second's worth at once); what is over
waits, the connection's write delayed by a timer, never a busy loop.

Here the pacing sits where the response's body enters the proxy, so every pair
of client and backend protocols paces alike: an HTTP/1.1 backend's bytes enter
`Exchange.response_data` (for HTTP/1.1 and HTTP/2 clients), an HTTP/2 backend's
`H2Exchange.on_data`. What the allowance does not cover is held here and the
backend is paused (an HTTP/1.1 upstream stops being read; an HTTP/2 stream's
window is not reopened), so what is held is bounded by one read or one window;
a timer hands the held bytes back to the same entry point as they become due,
as if the backend had just sent them, so the framing, the end of the response
and the connection's reuse are decided exactly as without pacing. A response
ends only after its last byte has been handed on. The limit is per response
(nginx: per request), on body bytes (nginx also counts the head's).

A route without limit-rate pays one attribute test per body read.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

# The timer fires when at least this share of a second's allowance is due (or all
# that is held): about eight writes a second, whatever the rate.
_SLICES = 8
_MIN_WAIT = 0.001


class ResponseThrottle:
    """One response's pacing: the allowance, what is held, the timer."""

    __slots__ = ("after", "end", "feeding", "flows", "held", "rate", "sent", "start", "timer")

    def __init__(self, rate: int, after: int) -> None:
        self.rate = rate  # bytes per second
        self.after = after  # bytes before the rate applies
        self.start = -1.0  # the first body byte's time (-1: none yet)
        self.sent = 0  # body bytes handed on
        self.held: list[bytes] = []
        # HTTP/2 upstreams: the flow-control credit of each held piece (acknowledged
        # to the backend only once its bytes are handed on).
        self.flows: list[int] = []
        self.feeding = False  # the timer is handing held bytes back
        # HTTP/2 upstreams: the stream's end, deferred until what is held is handed on.
        self.end: Callable[[], None] | None = None
        self.timer: asyncio.TimerHandle | None = None

    def allowance(self, now: float) -> int:
        """Bytes that may be handed on at `now` (nginx's `limit`)."""
        if self.start < 0:
            self.start = now
        return self.after + int(self.rate * (now - self.start + 1.0)) - self.sent

    def split(self, data: bytes, now: float) -> tuple[bytes, bytes]:
        """(what may go now, what must wait), the first counted as sent."""
        allowed = self.allowance(now)
        if allowed >= len(data):
            self.sent += len(data)
            return data, b""
        allowed = max(allowed, 0)
        self.sent += allowed
        return data[:allowed], data[allowed:]

    def wait(self, now: float) -> float:
        """Seconds until the next share of what is held is due."""
        held = sum(len(piece) for piece in self.held)
        need = min(held, max(1, self.rate // _SLICES))
        return max(_MIN_WAIT, (need - self.allowance(now)) / self.rate)

    def arm(self, loop: asyncio.AbstractEventLoop, callback: Callable[[], None]) -> None:
        if self.timer is None:
            self.timer = loop.call_later(self.wait(loop.time()), callback)

    def cancel(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        self.held = []
        self.flows = []
        self.end = None

    def take_due(self, now: float) -> list[tuple[bytes, int]]:
        """The held pieces (or parts) now due, with the credit each frees."""
        out: list[tuple[bytes, int]] = []
        held, flows = self.held, self.flows
        while held:
            piece = held[0]
            now_part, rest = self.split(piece, now)
            if not rest:
                held.pop(0)
                out.append((piece, flows.pop(0) if flows else 0))
                continue
            if now_part:
                held[0] = rest
                out.append((now_part, 0))
            break
        return out


# ---------------------------------------------------------------- HTTP/1.1 upstreams


def admit(exchange: Any, throttle: ResponseThrottle, data: bytes, now: float) -> bytes:
    """`Exchange.response_data`'s first step on a paced route: the part of `data`
    due now (b"": none); the rest is held, the upstream paused and the timer set."""
    if throttle.feeding:
        return data  # handed back by the timer: already counted
    if not throttle.held:
        data, rest = throttle.split(data, now)
        if not rest:
            return data
    else:
        rest, data = data, b""
    throttle.held.append(rest)
    exchange.downstream_paused(True)  # the upstream waits (and its inactivity restarts)
    throttle.arm(exchange.loop, lambda: _release(exchange, throttle))
    return data


def _release(exchange: Any, throttle: ResponseThrottle) -> None:
    throttle.timer = None
    if exchange.throttle is not throttle or exchange.req is None:
        throttle.cancel()  # the exchange ended or went on to another request
        return
    now = exchange.loop.time()
    throttle.feeding = True
    try:
        for piece, _ in throttle.take_due(now):
            exchange.response_data(piece, now)
            if exchange.throttle is not throttle or exchange.req is None:
                return
    finally:
        throttle.feeding = False
    if throttle.held:
        exchange.downstream_paused(True)
        throttle.arm(exchange.loop, lambda: _release(exchange, throttle))
    elif not exchange.down.write_paused:
        exchange.downstream_paused(False)


# ---------------------------------------------------------------- HTTP/2 upstreams


def admit_h2(stream: Any, throttle: ResponseThrottle, data: bytes, flow: int, now: float) -> bool:
    """`H2Exchange.on_data`'s first step on a paced route: True when `data` goes on
    now; else it is held (the part due now handed on here), its credit with it (the
    backend's window stays shut meanwhile) and the timer set."""
    if throttle.feeding:
        return True
    if not throttle.held:
        now_part, rest = throttle.split(data, now)
        if not rest:
            return True
        if now_part:
            throttle.feeding = True
            try:
                stream.on_data(now_part, 0)
            finally:
                throttle.feeding = False
        data = rest
    throttle.held.append(data)
    throttle.flows.append(flow)
    throttle.arm(stream.ctx.loop, lambda: _release_h2(stream, throttle))
    return False


def held_end(throttle: ResponseThrottle, finish: Callable[[], None]) -> bool:
    """The backend's stream ended (trailers or END_STREAM) while bytes are held:
    `finish` runs once the last of them is handed on (True: deferred)."""
    if not throttle.held:
        return False
    if throttle.end is None:  # trailers first, then END_STREAM: the trailers end it
        throttle.end = finish
    return True


def _release_h2(stream: Any, throttle: ResponseThrottle) -> None:
    throttle.timer = None
    if stream.finished:
        throttle.cancel()
        return
    now = stream.ctx.loop.time()
    throttle.feeding = True
    try:
        for piece, flow in throttle.take_due(now):
            stream.on_data(piece, flow)
            if stream.finished:
                return
    finally:
        throttle.feeding = False
    if throttle.held:
        throttle.arm(stream.ctx.loop, lambda: _release_h2(stream, throttle))
    elif throttle.end is not None:
        end, throttle.end = throttle.end, None
        end()
