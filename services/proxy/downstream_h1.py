"""The HTTP/1.1 client connection: a thin asyncio Protocol driving one `Exchange` at a time.

`ClientConnection` (one per accepted HTTP/1.1 connection; `waygate.proxy.accept`
makes it) only moves bytes: it finds request heads, lets `http1` parse and
check them, hands each to its `exchange.Exchange` (routing and every
per-request rule through `waygate.proxy.decision`, framing, keep-alive and
retry rules, response extras), writes what the Exchange answers, and keeps
pipelined requests waiting. No task exists per request: everything runs in
protocol callbacks.

Invariants:
- One exchange at a time per client connection; pipelined requests wait in
  a bounded buffer (reading pauses past the high-water mark) and are answered
  in order.
- Reading pauses at the high-water mark in both directions: a slow client
  pauses its upstream, a slow upstream pauses its client (`core.flow`).
- Timeouts cost no timer object per request: a connection keeps one deadline
  and its kind (head, idle keep-alive, exchange, relay), and the server's
  100 ms ticker (`server.ProxyServer`) fires the expired ones.
- Every upstream is released and every deadline dropped when the client
  connection goes away; tests count fds and tasks.
"""

from __future__ import annotations

import asyncio
from typing import Any

from waygate.core import flow
from waygate.proxy import access, filters, http1, tls
from waygate.proxy.decision import ANSWER_RESPONSE, Answer, decide
from waygate.proxy.exchange import (
    ANSWER_HEALTHZ,
    ANSWER_OPTIONS,
    ANSWER_REDIRECT,
    ANSWER_ROUTE_REDIRECT,
    Exchange,
)
from waygate.proxy.http1 import BadMessage, RequestHead, ResponseHead, client_context
from waygate.proxy.routing import Side

HIGH_WATER = flow.HIGH_WATER
LOW_WATER = flow.LOW_WATER
# A head shorter than this is within both head limits (request line, whole head).
_SHORT_HEAD = http1.MAX_REQUEST_LINE - 4

# Client timer kinds (the server's ticker reads `_timer_kind` and `_deadline`).
T_NONE, T_IDLE, T_HEAD, T_EXCHANGE, T_RELAY = range(5)
_T_NONE, _T_IDLE, _T_HEAD, _T_EXCHANGE, _T_RELAY = T_NONE, T_IDLE, T_HEAD, T_EXCHANGE, T_RELAY
# What `ProxyServer.admit` answers while draining: close quietly, no 503 page.
DRAINING = "draining"


class ClientConnection(asyncio.Protocol):
    """One HTTP/1.1 client connection: request heads in, responses out, in order.

    The driver of its `Exchange` (see exchange.Downstream for the interface it
    implements): it owns the bytes, the pipelining buffer, the connection's
    timers and its flow control; the Exchange owns the request.
    """

    # The access log's protocol field.
    protocol = "http/1.1"

    __slots__ = (
        "_deadline",
        "_eof",
        "_identity",
        "_identity_route",
        "_relay",
        "_timer_kind",
        "_up_eof",
        "buf",
        "chunked_ok",
        "client_key",
        "closed",
        "context",
        "exchange",
        "flow",
        "idle_since",
        "loop",
        "pending_head",
        "proxied",
        "scanned",
        "secure",
        "server",
        "transport",
        "write_paused",
    )

    def __init__(self, server: Any) -> None:
        self.server = server
        self.loop = server.loop
        self.transport: asyncio.Transport | None = None
        self.flow: flow.FlowControl | None = None
        # Bytes not yet handled: a head still arriving, or pipelined requests
        # waiting behind the current exchange (bounded by the limits / HIGH_WATER).
        self.buf = bytearray()
        self.scanned = 0
        self.closed = False
        self.exchange = Exchange(server.context, self)
        # A response head the Exchange handed over, written with the first body bytes.
        self.pending_head = b""
        self.chunked_ok = True
        self.write_paused = False
        self.secure: Side = False
        self.client_key = b""
        # The PROXY protocol header's addresses (waygate.proxy.accept), set before
        # connection_made: the client address is the header's. None: the peer's.
        self.proxied: Any = None
        # When the connection last became idle (accepted, or its exchange ended):
        # the oldest idle connection is closed first when room is needed.
        self.idle_since = 0.0
        self._deadline = 0.0
        self._timer_kind = _T_NONE
        self._relay = False
        self._eof = False
        self._up_eof = False  # a relay's upstream half-closed (its EOF went on to the client)
        # An auth-proxy route's answer for this connection's client certificate
        # (identity header lines, or the refusal), per route: a connection's
        # certificate never changes (no renegotiation), so it is read once.
        self._identity_route: Any = None
        self._identity: tuple[int, str] | bytes = b""

    # ------------------------------------------------------------ asyncio.Protocol

    def connection_made(self, transport: Any) -> None:
        server = self.server
        self.transport = transport
        self.secure = transport.get_extra_info("ssl_object") is not None
        port = server.https_port if self.secure else server.listen_port
        context = self.context = client_context(transport, self.proxied, port, self.secure)
        self.client_key = context.client_ip
        refusal = server.admit(self)
        if refusal:
            self.closed = True
            if refusal is not DRAINING:
                transport.write(http1.error_response(503, refusal))
                transport.close()
            else:
                transport.abort()
            return
        self.idle_since = self.loop.time()
        self.flow = flow.FlowControl(transport)
        transport.set_write_buffer_limits(high=HIGH_WATER, low=LOW_WATER)
        self._arm(server.defaults.http_request_timeout, _T_HEAD)

    def data_received(self, data: bytes) -> None:
        self.server.metrics.bytes_in += len(data)
        exchange = self.exchange
        if self._relay:
            exchange.relay_send(data)
            return
        if exchange.req is not None:
            if not exchange.req_complete:
                rest = exchange.request_body(data)
                if rest:
                    self._hold(rest)
            else:
                self._hold(data)
            return
        buf = self.buf
        if not buf and not self.write_paused:
            end = data.find(b"\r\n\r\n")
            if 0 <= end < _SHORT_HEAD and end + 4 == len(data):
                # Exactly one short head (a keep-alive client's next GET): what
                # _process would do, without its walk.
                if self._on_head(data):
                    if exchange.req is not None:
                        exchange.dispatch()
                    else:
                        self._arm(self._idle_timeout(), _T_IDLE)
                return
        if buf:
            # A head arriving in pieces: appended in place, searched from where
            # the last search stopped (linear however it is trickled).
            buf += data
            try:
                end = http1.find_head_end(buf, start=self.scanned)
            except BadMessage as exc:
                self.refuse(exc)
                return
            if end < 0:
                self.scanned = max(0, len(buf) - 3)
                return
            data = bytes(buf)
            buf.clear()
            self.scanned = 0
        self._process(data)

    def eof_received(self) -> bool | None:
        exchange = self.exchange
        if self._relay:
            self._eof = True
            if self._up_eof:
                # Both directions ended: nothing can move any more, release both.
                exchange.release_relay()
                self._close()
                return True
            if exchange.relay_send_eof():
                return True  # the upstream may still answer
            # The EOF cannot travel on (a TLS upstream has no half-close): the relay ends.
            exchange.release_relay()
            return None
        if exchange.req is not None and exchange.req_complete:
            # A client may half-close after its request; answer it, then close.
            self._eof = True
            return True
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._cancel_timer()
        self.exchange.close()
        self.server.connection_closed(self)

    def pause_writing(self) -> None:
        self.write_paused = True
        self.exchange.downstream_paused(True)

    def resume_writing(self) -> None:
        self.write_paused = False
        self.exchange.downstream_paused(False)
        control = self.flow
        if control is not None and control.reasons & flow.WRITING:
            # The client reads again: answer the requests held meanwhile.
            control.resume(flow.WRITING)
            if self.exchange.req is None and self.buf and not self.closed:
                data = self.buf
                self.buf = bytearray()
                self.scanned = 0
                self._process(data)

    # ------------------------------------------------------------ requests

    def _process(self, data: bytes | bytearray) -> None:
        """Parse heads from `data`; answer local ones; start at most one exchange.

        `data` is walked with an offset: each head is sliced out, the rest is
        never copied per head (many small pipelined requests in one read cost
        linear time). Local answers (healthz, 503, 302, 401/403) stop while the
        client's transport is paused for writing: the rest is held and reading
        paused until `resume_writing`, so a client that never reads cannot grow
        the proxy's buffers (a 503 page would amplify each small request).
        """
        pos = 0
        size = len(data)
        exchange = self.exchange
        while True:
            if self.write_paused and pos < size:
                self._keep(data, pos)
                self.pause_reading(flow.WRITING)
                self._arm(self._idle_timeout(), _T_IDLE)
                return
            end = data.find(b"\r\n\r\n", pos)
            if 0 <= end < pos + _SHORT_HEAD:
                end += 4  # a short head is within every size limit: nothing to check
            else:
                try:
                    end = http1.find_head_end(data, start=pos, origin=pos)
                except BadMessage as exc:
                    self.refuse(exc)
                    return
            if end < 0:
                self._keep(data, pos)
                self.scanned = max(0, len(self.buf) - 3)
                if pos < size and self._timer_kind == _T_IDLE:
                    self._arm(self._head_timeout(), _T_HEAD)
                return
            if pos == 0 and end == size and type(data) is bytes:
                head = data
            else:
                head = bytes(memoryview(data)[pos:end])
            pos = end
            if not self._on_head(head):
                return  # closed
            if exchange.req is not None:
                # An exchange started: the body bytes already here are checked
                # before anything is sent upstream, then pipelined requests wait.
                if pos < size and not exchange.req_complete:
                    rest = exchange.request_body(bytes(memoryview(data)[pos:]))
                    if self.closed or exchange.req is None:
                        return
                    exchange.dispatch()
                    if rest:
                        self._hold(rest)
                    return
                exchange.dispatch()
                if pos < size:
                    self._keep(data, pos)
                    if len(self.buf) > HIGH_WATER:
                        self.pause_reading(flow.PIPELINE)
                return
            if pos == size:
                self._arm(self._idle_timeout(), _T_IDLE)
                return

    def _keep(self, data: bytes | bytearray, pos: int) -> None:
        """Hold data[pos:] in `buf`: a bytearray is kept as it is (deleting its
        front is amortised O(1)), bytes are copied once."""
        if pos >= len(data):
            return
        if type(data) is bytearray and not self.buf:
            del data[:pos]
            self.buf = data
        else:
            self.buf += memoryview(data)[pos:]

    def _hold(self, data: bytes) -> None:
        """Keep bytes of later (pipelined) requests until the current exchange ends."""
        self.buf += data
        if len(self.buf) > HIGH_WATER:
            self.pause_reading(flow.PIPELINE)

    def _on_head(self, head: bytes) -> bool:
        """Handle one request head; False when the connection is now closing."""
        try:
            req = http1.parse_request_head(head)
        except BadMessage as exc:
            self.refuse(exc)
            return False
        now = self.loop.time()
        exchange = self.exchange
        server = self.server
        # Every per-request rule, decided once (waygate.proxy.decision).
        decided = decide(server.context.view, req, self, now)
        if type(decided) is Answer:
            exchange.answer(req, decided)  # type: ignore[arg-type]
            return not self.closed
        # The exchange's deadline (see _arm), armed without a second clock read.
        self._deadline = deadline = now + exchange.begin(req, decided, now)  # type: ignore[arg-type]
        self._timer_kind = _T_EXCHANGE
        if deadline <= server.soon_until:
            server.soon.append(self)
        return True

    # ------------------------------------------------------------ the Exchange's calls

    def client_identity(self, route: Any) -> tuple[int, str] | bytes:
        """An auth-proxy route's identity lines for this connection's certificate (cached)."""
        if self._identity_route is route:
            return self._identity
        checked = self.server.edge.client_identity(
            self.transport.get_extra_info("ssl_object"),  # type: ignore[union-attr]
            route,
        )
        self._identity_route = route
        self._identity = checked
        return checked

    def response_head(
        self,
        response: ResponseHead,
        framing: int,
        length: int,
        keep_alive: bool,
        extra: bytes,
        body: bytes,
        more: bool,
    ) -> None:
        head = http1.build_client_head(response, framing, length, keep_alive, extra)
        if more:
            self.pending_head = head  # written with the body bytes that follow: one send
            return
        self.transport.write(head + body if body else head)  # type: ignore[union-attr]

    def response_body(self, data: bytes) -> None:
        head = self.pending_head
        transport = self.transport
        assert transport is not None
        if head:
            self.pending_head = b""
            if len(data) < 65536:
                transport.write(head + data)
                return
            transport.write(head)
        transport.write(data)

    def response_pieces(self, pieces: list[bytes]) -> None:
        head = self.pending_head
        if head:
            self.pending_head = b""
            self.transport.write(head)  # type: ignore[union-attr]
        self.transport.writelines(pieces)  # type: ignore[union-attr]

    def informational(self, status: int) -> None:
        if self.transport is not None:
            self.transport.write(http1.CONTINUE_100)

    def answer(self, req: RequestHead, status: int, reason: str, kind: str) -> None:
        """A local answer (healthz, 302 to HTTPS, 401/403, 503); closes when it must."""
        server = self.server
        close = req.has_body or not req.keep_alive or server.context.draining
        if kind is ANSWER_HEALTHZ:
            response = http1.HEALTHZ_RESPONSE
            if close:
                response = response.replace(b"\r\n\r\n", b"\r\nConnection: close\r\n\r\n", 1)
        elif kind is ANSWER_OPTIONS:
            response = http1.OPTIONS_ANY_RESPONSE
            if close:
                response = response.replace(b"\r\n\r\n", b"\r\nConnection: close\r\n\r\n", 1)
        elif kind is ANSWER_ROUTE_REDIRECT:
            response = filters.redirect_head(status, reason.encode("latin-1"), close=close)
        elif kind is ANSWER_RESPONSE:
            response = reason.encode("latin-1")
            if close:
                response = response.replace(b"\r\n\r\n", b"\r\nConnection: close\r\n\r\n", 1)
        elif kind is ANSWER_REDIRECT:
            port = server.https_port or 443
            response = tls.redirect_response(req.host, req.target, port, close=close)
        elif kind is access.KIND_UNAUTHORIZED:
            response = access.challenge_response(
                reason, close=close, head_only=req.method == b"HEAD"
            )
        elif status == 503:
            response = http1.error_response(
                503,
                reason,
                close=close,
                head_only=req.method == b"HEAD",
                body=server.unavailable_page.replace(b"{reason}", reason.encode())
                if server.unavailable_page
                else b"",
            )
        elif status in (404, 500):
            # Gateway API answers (no route on a listener, an unusable backendRef):
            # the connection stays open when it can, as after a 503.
            response = http1.error_response(
                status, reason, close=close, head_only=req.method == b"HEAD"
            )
        else:
            response = http1.error_response(status, reason, head_only=req.method == b"HEAD")
        transport = self.transport
        assert transport is not None
        transport.write(response)
        if close:
            # The body is not read: close after answering, so it cannot be
            # taken for the next request.
            self._close()

    def exchange_done(self, keep_alive: bool, now: float, idle_timeout: float) -> None:
        """The response is complete; the next request (if any) may start."""
        server = self.server
        self.pending_head = b""
        if (
            not keep_alive
            or not self.exchange.req_complete
            or server.context.draining
            or self.closed
            or self._eof
        ):
            self._close()
            return
        control = self.flow
        if control is not None and control.reasons:
            control.resume(flow.PIPELINE | flow.PEER)
        # The keep-alive deadline (see _arm), from the clock read of the response.
        self.idle_since = now = now or self.loop.time()
        self._deadline = deadline = now + (idle_timeout or server.defaults.keep_alive_timeout)
        self._timer_kind = _T_IDLE
        if deadline <= server.soon_until:
            server.soon.append(self)
        if self.buf:
            data = self.buf  # handed over, not copied: _process walks it in place
            self.buf = bytearray()
            self.scanned = 0
            self._process(data)

    def failed(self, status: int, reason: str, head_only: bool, response: bytes = b"") -> None:
        """The exchange failed before its response started: answer why (or `response`,
        rendered already), then close."""
        transport = self.transport
        if self.closed or transport is None:
            return
        transport.write(response or http1.error_response(status, reason, head_only=head_only))
        self._close()

    def refuse(self, exc: BadMessage) -> None:
        """A refused request: the status with the rule it broke, then close."""
        metrics = self.server.metrics
        metrics.refused["bad_request"] = metrics.refused.get("bad_request", 0) + 1
        transport = self.transport
        if transport is not None and not self.closed:
            transport.write(http1.error_response(exc.status, exc.reason))
        self.exchange.abandon_upstream()
        self._close()

    def pause_reading(self, reason: int) -> None:
        if self.flow is not None:
            self.flow.pause(reason)

    def resume_reading(self, reason: int) -> None:
        if self.flow is not None and not self.closed:
            self.flow.resume(reason)

    # ------------------------------------------------------------ upgrades

    def start_relay(self, response: ResponseHead, rest: bytes) -> None:
        """After the upstream's 101: bytes flow both ways untouched."""
        transport = self.transport
        assert transport is not None
        transport.write(
            b"HTTP/1.1 101 Switching Protocols%s\r\nConnection: Upgrade\r\nUpgrade: %s\r\n\r\n"
            % (response.fields, response.upgrade)
        )
        self._relay = True
        entry = self.exchange.entry
        self._arm(entry.options.tunnel_timeout if entry else 3600.0, _T_RELAY)
        if rest:
            transport.write(rest)
        exchange = self.exchange
        if self.buf:
            exchange.relay_send(bytes(self.buf))
            self.buf.clear()
        if self._eof:
            # The client half-closed before the 101 arrived.
            exchange.relay_send_eof()
        self.resume_reading(flow.PIPELINE)

    def relay_write(self, data: bytes) -> None:
        self.transport.write(data)  # type: ignore[union-attr]

    def relay_eof(self) -> bool:
        self._up_eof = True
        if self._eof:
            # Both directions ended: nothing can move any more, release both.
            self.exchange.release_relay()
            self._close()
            return True
        transport = self.transport
        if transport is not None and transport.can_write_eof():
            transport.write_eof()
            return True
        return False

    def relay_closed(self) -> None:
        self._close()

    # ------------------------------------------------------------ closing

    def idle(self) -> bool:
        """Whether closing this connection loses nothing: no request in progress, no
        bytes of one received (a keep-alive connection between requests)."""
        return (
            self.exchange.req is None
            and not self.buf
            and not self._relay
            and not self.closed
            and self.transport is not None
        )

    def evict(self) -> None:
        """Closed to make room (the oldest idle connection under pressure)."""
        self._close()

    def drain(self) -> None:
        """Draining: close now if idle; otherwise after the current response."""
        if self.exchange.req is None and not self.buf:
            self._close()

    def _close(self) -> None:
        self.closed = True
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()
        self._cancel_timer()

    def abort(self) -> None:
        self.exchange.abandon_upstream()
        self._cancel_timer()
        if self.transport is not None:
            self.transport.abort()

    # ------------------------------------------------------------ timers

    def _head_timeout(self) -> float:
        return self.server.defaults.http_request_timeout

    def _idle_timeout(self) -> float:
        entry = self.exchange.entry
        if entry is not None:
            return entry.options.keep_alive_timeout
        return self.server.defaults.keep_alive_timeout

    def _arm(self, delay: float, kind: int) -> None:
        # No timer object per request: the server's ticker compares deadlines
        # (a deadline before its next full walk goes on its short list).
        deadline = self._deadline = self.loop.time() + delay
        self._timer_kind = kind
        server = self.server
        if deadline <= server.soon_until:
            server.soon.append(self)

    def _cancel_timer(self) -> None:
        self._timer_kind = _T_NONE

    def _on_timer(self) -> None:
        kind = self._timer_kind
        self._timer_kind = _T_NONE
        if self.closed:
            return
        if kind == _T_IDLE:
            self._close()
        elif kind == _T_HEAD:
            if self.buf:
                self.failed(408, "request head not received within the http-request timeout", False)
                metrics = self.server.metrics
                metrics.refused["timeout"] = metrics.refused.get("timeout", 0) + 1
            else:
                self._close()
        elif kind == _T_EXCHANGE:
            wait = self.exchange.on_timer(self.loop.time())
            if wait >= 0:
                self._arm(wait, _T_EXCHANGE)
        elif kind == _T_RELAY:
            wait = self.exchange.relay_timer(self.loop.time())
            if wait < 0:
                self.abort()
            else:
                self._arm(wait, _T_RELAY)
