"""ingress-nginx's proxy-next-upstream beyond `error timeout`: a backend's answer sends
the request to another endpoint.

nginx's proxy_next_upstream `http_500`, `http_502`, `http_503`, `http_504`,
`http_403`, `http_404`, `http_429` (that status) and `invalid_header` (a
malformed response head) drop the answer and pass the request to the next
server, while nothing went to the client, at most proxy_next_upstream_tries
times in all and within proxy_next_upstream_timeout of the request's start; a
request whose method is not idempotent (POST, LOCK, PATCH) only with
`non_idempotent`. When no try is left, the last answer goes to the client as
it came (a malformed head: 502).

Here a request is passed on only when it can be sent again exactly: it is not
an upgrade, and it has no body or its body was buffered whole in memory
(request buffering, at most the buffer's per-request memory: `keep_body` keeps
a copy at dispatch, replayed to the next endpoint) by an exchange with an
HTTP/1.1 backend or the HTTP/2 bridge; an HTTP/2 client's body to an HTTP/2
backend, an unbuffered body or one spilled to disk is never sent twice. The
decision and its bookkeeping live here;
the drivers call `retried` at a final answer's head (`Exchange.response_head`
for HTTP/1.1 backends and the HTTP/2 bridge, `H2Exchange.on_response` for
HTTP/2 backends) and `retried_broken` (`retried_h2(..., broken=True)`) where a
malformed or missing head would be a 502.
A route without these tokens pays one attribute test per answer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

# nginx's non-idempotent methods (ngx_http_upstream_next: POST, LOCK, PATCH).
NON_IDEMPOTENT = frozenset((b"POST", b"LOCK", b"PATCH"))


class NextUpstream:
    """One route's proxy-next-upstream answers, read once per routing table."""

    __slots__ = ("invalid_header", "non_idempotent", "repick", "statuses", "timeout", "tries")

    def __init__(
        self,
        tokens: str,
        tries: int,
        timeout: float,
        default_tries: int,
        repick: Callable[[Any, Any, Any, Any], bool],
    ) -> None:
        words = tokens.split()
        self.statuses = frozenset(int(w[5:]) for w in words if w.startswith("http_"))
        self.invalid_header = "invalid_header" in words
        self.non_idempotent = "non_idempotent" in words
        self.tries = tries or default_tries
        self.timeout = timeout  # seconds from the request's start (0: no bound)
        # decision.repick (handed in by decision, which builds the policy: no cycle).
        self.repick = repick

    def allows(self, req: Any, tries: int, elapsed: float, body_kept: bool) -> bool:
        """Whether a request that was tried `tries` times, `elapsed` seconds ago, may
        go to another endpoint: it can be sent again exactly (`body_kept`: its body
        is kept whole) and a try is left."""
        if req is None or req.upgrade or (req.has_body and not body_kept):
            return False
        if req.method in NON_IDEMPOTENT and not self.non_idempotent:
            return False
        if tries >= self.tries:
            return False
        return not self.timeout or elapsed < self.timeout


def policy_of(
    route: Any, default_tries: int, repick: Callable[[Any, Any, Any, Any], bool]
) -> NextUpstream | None:
    """The route's policy, None when it asks for nothing beyond `error timeout`."""
    words = route.next_upstream.split()
    if "off" in words or not any(w.startswith("http_") or w == "invalid_header" for w in words):
        return None
    return NextUpstream(
        route.next_upstream,
        route.next_upstream_tries,
        route.next_upstream_timeout,
        default_tries,
        repick,
    )


def keep_body(forward: Any, buffer: Any) -> None:
    """At dispatch: a copy of a buffered body held whole in memory (not replayed yet),
    for a resend; none for one spilled to disk."""
    if buffer.file is None and buffer.size == buffer.memory:
        forward.body_copy = b"".join(buffer.chunks)


def _another(exchange: Any, forward: Any, facts: Any, now: float, body_kept: bool) -> bool:
    """The next endpoint for `forward` (True: taken, the try counted)."""
    ctx = exchange.ctx
    policy: NextUpstream = forward.next_upstream
    if not policy.allows(exchange.req, forward.tries, now - exchange.started, body_kept):
        return False
    if not policy.repick(ctx.view, forward, facts, exchange.target):
        return False
    forward.tries += 1
    ctx.metrics.redispatches += 1
    return True


def retried(exchange: Any, status: int, now: float) -> bool:
    """An HTTP/1.1 backend's (or the HTTP/2 bridge's) final answer `status`: True when
    it was dropped and the request sent to another endpoint (`Exchange`)."""
    forward = exchange.forward
    if status not in forward.next_upstream.statuses:
        return False
    return _again(exchange, forward, now)


def retried_broken(exchange: Any) -> bool:
    """A malformed answer head (invalid_header): True when the request went on."""
    forward = exchange.forward
    if forward is None or forward.next_upstream is None or exchange.response_started:
        return False
    if not forward.next_upstream.invalid_header:
        return False
    return _again(exchange, forward, exchange.loop.time())


def _again(exchange: Any, forward: Any, now: float) -> bool:
    body = forward.body_copy
    if not _another(exchange, forward, exchange.down, now, body is not None):
        return False
    exchange.abandon_upstream()  # the answer goes with its connection (or stream)
    exchange.target = forward.target
    if exchange.req.has_body:
        # The body again, whole, from the copy (what the last try left of it goes).
        exchange._drop_buffer()
        buffer = exchange.buffer = exchange.ctx.buffers.new_buffer()
        buffer.write([body])
    exchange.dispatch()
    return True


def retried_h2(stream: Any, status: int, *, broken: bool = False) -> bool:
    """An HTTP/2 backend's final answer `status` (or a malformed head: `broken`) to an
    HTTP/2 client's stream (`H2Exchange`): True when it was reset and the request
    sent elsewhere."""
    forward = stream.forward
    policy: NextUpstream = forward.next_upstream
    if not (policy.invalid_header if broken else status in policy.statuses):
        return False
    if not _another(stream, forward, stream.facts, stream.ctx.loop.time(), False):
        return False
    stream._cancel_upstream()
    upstream = stream.upstream
    stream.upstream = None
    if upstream is not None:
        upstream.stream_done(stream.stream_id)
    stream.stream_id = 0
    stream.end_sent = False
    stream.target = forward.target
    stream._moved()
    stream.dispatch()
    return True
