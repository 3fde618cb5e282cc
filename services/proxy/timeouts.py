"""An exchange's timeouts, checked when its driver's ticker entry fires (sans-IO).

The server timeout runs from the last byte moved either way (an upload is not
cut while it flows; the whole response head is due within it); the client
timeout while the request body is due; the minimum request-body rate
(`server.Limits.min_request_body_rate`) once its grace has passed, measured
only while an upstream takes the body. `check` returns the delay until the
next check, or -1 when a timeout fired (the exchange failed, or its driver
was aborted). No timer object exists per request: the drivers keep one
deadline each, compared by the server's ticker.
"""

from __future__ import annotations

from typing import Any


def check(exchange: Any, now: float) -> float:
    """The exchange's deadline passed: the delay until the next check, or -1
    when a timeout fired (the exchange failed or the driver was aborted)."""
    entry = exchange.entry
    assert entry is not None
    options = entry.options
    # The server timeout runs from the last byte moved either way: request
    # body bytes count (an upload longer than the timeout is not cut while it
    # flows), response bytes count only from the final head on (1xx heads and
    # a trickled head do not extend it: the whole head is due within it).
    last_client = exchange.last_client
    last_up = exchange.last_up
    up_idle = now - (last_up if last_up > last_client else last_client)
    if up_idle >= options.server_timeout:
        if exchange.queued:
            target = exchange.target
            assert target is not None
            exchange.fail(
                503,
                f"no connection to endpoint {target.address}:{target.port} (at its limit "
                f"of {exchange.ctx.pool.max_per_endpoint}) within {options.server_timeout:g}s",
                "endpoint_limit",
            )
        elif exchange.response_started:
            exchange.upstream_failed(504, "", "server_timeout")
        else:
            exchange.fail(
                504,
                f"upstream did not answer within {options.server_timeout:g}s",
                "server_timeout",
            )
        return -1.0
    wait = options.server_timeout - up_idle
    if not exchange.req_complete:
        client_idle = now - exchange.last_client
        if client_idle >= options.client_timeout:
            if exchange.response_started:
                exchange.upstream_failed(408, "", "client_timeout")
            else:
                exchange.fail(
                    408,
                    f"request body stalled for {options.client_timeout:g}s",
                    "client_timeout",
                )
            return -1.0
        wait = min(wait, options.client_timeout - client_idle)
        limits = exchange.ctx.limits
        rate = limits.min_request_body_rate
        if (
            rate
            and (exchange.upstream is not None or exchange.buffer is not None)
            and not exchange.upstream_blocked
        ):
            # A body that trickles (1 byte every few seconds never trips the
            # client timeout) would hold an upstream connection slot for hours,
            # or (buffered) the proxy's memory.
            elapsed = now - exchange.body_rate_from
            grace = limits.request_body_grace
            if elapsed >= grace:
                if exchange.body_received - exchange.body_rate_base < rate * elapsed:
                    reason = f"request body slower than {rate} bytes/s"
                    if exchange.response_started:
                        exchange.upstream_failed(408, reason, "slow_body")
                    else:
                        exchange.fail(408, reason, "slow_body")
                    return -1.0
                wait = min(wait, 1.0)
            else:
                wait = min(wait, grace - elapsed)
    return wait
