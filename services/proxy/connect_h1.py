"""The connect step of an exchange to an HTTP/1.1 backend: dial, TLS, redispatch.

`start_connect(exchange, target)` runs one connect as one task (the only task
of the request path, and only while a new upstream connection is opened):
the dial (direct, or through the tunnel, its early data carrying a bodiless
GET or HEAD, the request's trace context with it), reencrypt's TLS, and on a
failed connect or a failed verification of the backend's certificate another
endpoint (`decision.repick`, `decision.may_redispatch`). The
connection is then attached to the exchange (`Exchange._attach`).

The endpoint's reservation in the connection bound (`pool.Pool.reserve`,
taken by the caller) is a `Reservation`, released exactly once by the task's
done callback however the task ends: attached, failed, or cancelled, before
it ever ran included (an HTTP/2 stream reset in the same read as its HEADERS,
issue 31 finding 1); a redispatch moves it to the next endpoint.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from typing import Any, cast

from opentelemetry import context as otel_context
from opentelemetry.trace import set_span_in_context

from waygate.proxy.decision import may_redispatch, repick
from waygate.proxy.pool import Pool
from waygate.proxy.routing import Target
from waygate.proxy.upstream import Attachable, ConnectError, start
from waygate.proxy.upstream_h1 import SingleUseConnection, UpstreamConnection


class Reservation:
    """A connect's place in its endpoint's connection bound (`Pool.reserve`), released
    exactly once by the connect task's done callback (see start_connect)."""

    __slots__ = ("target",)

    def __init__(self, target: Target) -> None:
        self.target = target

    def move(self, pool: Pool, target: Target) -> Target:
        """A redispatch: the reservation moves to another endpoint."""
        pool.unreserve(self.target)
        pool.reserve(target, force=True)
        self.target = target
        return target

    def release(self, pool: Pool) -> Callable[[Any], None]:
        def done(_task: Any) -> None:
            pool.unreserve(self.target)

        return done


def start_connect(exchange: Any, target: Target) -> asyncio.Task[None]:
    """Connect `exchange` (an `exchange.Exchange`) to `target`, reserved by the caller."""
    reservation = Reservation(target)
    task = exchange.loop.create_task(_connect(exchange, reservation))
    task.add_done_callback(reservation.release(exchange.ctx.pool))
    return task  # type: ignore[no-any-return]


async def _connect(self: Any, reservation: Reservation) -> None:
    """Open a connection to the reserved endpoint (the open connection counts
    itself; the reservation ends with this task, see _start_connect)."""
    if self.span is not None:
        # This task's own context: lines it logs (a failed TLS handshake, a
        # tunnel dial) carry the request's trace.
        otel_context.attach(set_span_in_context(self.span))
    await _open(self, reservation)


def _redispatch(self: Any, target: Target, exc: ConnectError, attempts: int) -> bool:
    """A connect (or the backend's TLS verification) to `target` failed: another
    endpoint when one is left and nothing was sent (`decision.repick`)."""
    ctx = self.ctx
    ctx.metrics.connect_error(exc.kind)
    ctx.view.health.failed(target)
    forward = self.forward
    if (
        forward is not None
        and may_redispatch(exc.retryable, exc.kind, attempts, forward.entry.route)
        and self.req is not None
        and repick(ctx.view, forward, self.down, target)
    ):
        ctx.metrics.redispatches += 1
        self.target = forward.target
        return True
    self.connect_task = None
    self.fail(502, exc.reason, "connect_" + exc.kind)
    return False


async def _open(self: Any, reservation: Reservation) -> None:
    ctx = self.ctx
    entry = self.entry
    forward = self.forward
    assert entry is not None and forward is not None
    options = entry.options
    target = reservation.target
    attempts = 0
    while True:
        attempts += 1
        upstream_tls = ctx.upstream_tls
        # (decided per request: AUTO_HTTP's plain clients have no scope)
        reencrypt = upstream_tls is not None and forward.upstream_scope is not None
        head_sent = False
        try:
            # A socket, or a tunnel endpoint's data connection (upstream.Attachable).
            if target.tunnel and not reencrypt and _head_alone(self):
                # The head goes with the tunnel's dial (its early data): it does not
                # wait for the dial's answer. GET/HEAD only: safe to send twice.
                connection, head_sent = await ctx.dialer.connect_early(
                    target,
                    options.connect_timeout,
                    forward.traceparent,
                    self.upstream_head,
                    True,
                )
            else:
                connection = await ctx.dialer.connect(
                    target, options.connect_timeout, forward.traceparent
                )
            kind = SingleUseConnection if entry.route.upstream_http10 else UpstreamConnection
            factory = functools.partial(kind, ctx, target)
            if reencrypt:
                assert upstream_tls is not None
                # Reencrypt: a failed handshake is a 502 that says why.
                upstream = await upstream_tls.open(
                    factory,
                    connection,
                    entry.route,
                    target,
                    options.connect_timeout,
                    self.span,
                )
            elif head_sent:
                # Attached below, once bound to this exchange: the response may be
                # held in the connection already and comes at `attach`.
                upstream = factory()
            else:
                _, upstream = await start(connection, factory)
        except ConnectError as exc:
            if not _redispatch(self, target, exc, attempts):
                return
            target = reservation.move(ctx.pool, self.target)  # type: ignore[arg-type]
            continue
        except OSError as exc:
            self.connect_task = None
            self.fail(502, "upstream connection failed: " + str(exc), "connect_error")
            return
        break
    self.connect_task = None
    if forward.upstream_scope is not None:
        upstream.pool_key = (target, forward.upstream_scope)  # see routing.upstream_scope
    ctx.view.health.succeeded(target)
    ctx.metrics.upstream_opened += 1
    if head_sent:
        tunnelled = cast(Attachable, connection)  # only a tunnel's dial sends the head
        if self.req is None:
            tunnelled.abort()
            return
        self._attach(upstream, reused=False, head_sent=True)
        tunnelled.attach(upstream)
        if self.down.write_paused:  # (asked before the transport was there)
            upstream.pause_reading()
        return
    if self.req is None:
        upstream.close()
        return
    self._attach(upstream, reused=False)


def _head_alone(self: Any) -> bool:
    """Whether the request is its head alone, safe to send twice: a GET or HEAD with
    no body, no upgrade and no 100-continue (what may go as a tunnel's early data)."""
    req = self.req
    return (
        req is not None
        and req.method in (b"GET", b"HEAD")
        and not req.has_body
        and not req.upgrade
        and not req.expect_continue
        and not self.pending_body
    )
