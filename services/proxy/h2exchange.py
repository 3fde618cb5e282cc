"""An HTTP/2 request stream as an exchange of the proxy.

`start_exchange` is the stream handler `accept.py` gives every
`http2.H2ClientConnection`: it turns the stream's request into the HTTP/1.1
head it means (`http2.request_head`, by `http1.request_from_fields`: one rule
book for both versions), decides it once (`decision.decide`: routing by
:authority, Host agreement, header hygiene, the route's rules, balancing,
sticky cookies, tracing, the upstream head) and starts what serves it:

- a local answer, rendered as HTTP/2 (`answer_stream`), or as a gRPC status
  on gRPC;
- a backend that speaks HTTP/2 (`Forward.http2`): `h2upstream.H2Exchange`,
  stream to stream;
- any other backend: an `Exchange` (`waygate.proxy.exchange`, the one the
  HTTP/1.1 connection drives) with `StreamDownstream` as its driver: the
  Exchange answers through the `Downstream` methods; its response head
  becomes HEADERS, the bare payload (`chunked_ok` False) DATA, and the end the
  stream's end; its local answers are rendered by the same helpers as on
  HTTP/1.1, or as a gRPC status on gRPC.

Flow control crosses both ways: the Exchange's pause of its client
(`pause_reading`: the upstream is slow, or still connecting) holds the
stream's WINDOW_UPDATEs; the stream's full buffer (the client's window is
shut) pauses the upstream (`downstream_paused`). Timeouts: the Exchange's
deadline is kept here and fired by the HTTP/2 connection's entry in the
server's ticker (`H2ClientConnection.arm_stream`), so no timer object per
stream either.
"""

from __future__ import annotations

from typing import Any, Final

from waygate.core import httpheaders
from waygate.proxy import access, filters, grpcstatus, http1, tls
from waygate.proxy.decision import (
    ANSWER_HEALTHZ,
    ANSWER_OPTIONS,
    ANSWER_REDIRECT,
    ANSWER_RESPONSE,
    ANSWER_ROUTE_REDIRECT,
    HEALTHZ,
    OPTIONS_ANY,
    Answer,
    Forward,
    decide,
)
from waygate.proxy.exchange import Exchange
from waygate.proxy.http1 import (
    FRAMING_LENGTH,
    FRAMING_NONE,
    BadMessage,
    RequestHead,
    ResponseHead,
)
from waygate.proxy.http2 import H2ClientConnection, Request, Stream, request_head


def start_exchange(conn: H2ClientConnection, stream: Stream, request: Request, end: bool) -> None:
    """Decide the stream's request once (`decision.decide`) and start what serves it:
    a local answer, an HTTP/2 backend's stream (`h2upstream`), or an `Exchange`
    to an HTTP/1.1 backend driven by `StreamDownstream`. The backend decides the
    upstream protocol (`Forward.http2`)."""
    ctx = conn.server.context
    chunked = not end and request.content_length < 0
    try:
        req = request_head(request, chunked)
    except BadMessage as exc:
        ctx.records.refused("bad_request")
        conn._local_error(stream, exc.status, exc.reason, grpc=stream.grpc)
        return
    now = conn.loop.time()
    grpc_timeout = 0.0
    if request.grpc:
        for name, value in request.headers:
            if name == b"grpc-timeout":
                grpc_timeout = grpcstatus.parse_timeout(value) or 0.0
    decided = decide(ctx.view, req, conn, now, grpc_timeout, "2", request.grpc)
    if type(decided) is Answer:
        answer: Answer = decided  # type: ignore[assignment]
        if answer.refused:
            ctx.records.refused(answer.kind)
        if answer is not HEALTHZ and answer is not OPTIONS_ANY:
            ctx.records.finish(
                answer.route,
                req,
                answer.status,
                conn.client_key,
                None,
                0.0,
                None,
                "h2" if conn.secure else "h2c",
            )
        answer_stream(conn, stream, req, answer.status, answer.reason, answer.kind)
        return
    serve(conn, stream, request, req, decided, end, now)  # type: ignore[arg-type]


def serve(
    conn: H2ClientConnection,
    stream: Stream,
    request: Request,
    req: RequestHead,
    forward: Forward,
    end: bool,
    now: float,
) -> None:
    """Serve a stream's decided request: an HTTP/2 backend's stream (`h2upstream`),
    or an `Exchange` to an HTTP/1.1 backend driven by `StreamDownstream` (also how
    ingress-nginx's error backend takes over a stream: `errorpages`)."""
    if forward.http2:
        conn.server.context.h2.start(conn, stream, request, req, forward, end)
        return
    driver = StreamDownstream(conn, stream, not end and request.content_length < 0)
    stream.exchange = driver
    driver.begin(req, forward, now)


def answer_stream(
    conn: H2ClientConnection, stream: Stream, req: RequestHead, status: int, reason: str, kind: str
) -> None:
    """A local answer on an HTTP/2 stream: the bytes the HTTP/1.1 path renders, as
    HTTP/2 (`render_response`), or a gRPC status on gRPC."""
    server = conn.server
    head_only = req.method == b"HEAD"
    if kind is ANSWER_HEALTHZ:
        response = http1.HEALTHZ_RESPONSE
    elif kind is ANSWER_OPTIONS:
        response = http1.OPTIONS_ANY_RESPONSE
    elif kind is ANSWER_ROUTE_REDIRECT:
        response = filters.redirect_head(status, reason.encode("latin-1"), close=False)
    elif kind is ANSWER_RESPONSE:
        response = reason.encode("latin-1")
    elif kind is ANSWER_REDIRECT:
        port = server.https_port or 443
        response = tls.redirect_response(req.host, req.target, port, close=False)
    elif stream.grpc:
        stream.respond(200, grpcstatus.trailers_only(status, reason), end=True)
        return
    elif kind is access.KIND_UNAUTHORIZED:
        response = access.challenge_response(reason, close=False, head_only=head_only)
    elif status == 503 and server.unavailable_page:
        response = http1.error_response(
            503,
            reason,
            close=False,
            head_only=head_only,
            body=server.unavailable_page.replace(b"{reason}", reason.encode()),
        )
    else:
        response = http1.error_response(status, reason, close=False, head_only=head_only)
    render_response(stream, response, head_only)


def render_response(stream: Stream, response: bytes, head_only: bool) -> None:
    """An HTTP/1.1 answer of the proxy's own (head and body) as HTTP/2."""
    end = response.find(b"\r\n\r\n") + 4
    parsed = http1.parse_response_head(response[:end])
    body = b"" if head_only else response[end:]
    fields = _head_fields(parsed)
    if parsed.content_length >= 0:
        fields.append((b"content-length", b"%d" % parsed.content_length))
    stream.respond_fields(fields, not body)
    if body:
        stream.send(body, end=True)


class StreamDownstream:
    """One HTTP/2 stream as the `Downstream` of an Exchange."""

    __slots__ = (
        "chunked",
        "client_key",
        "conn",
        "context",
        "deadline",
        "done",
        "exchange",
        "paused",
        "protocol",
        "secure",
        "server",
        "stream",
        "write_paused",
    )

    # The Exchange hands this driver bare payload, never chunk framing.
    chunked_ok = False

    def __init__(self, conn: H2ClientConnection, stream: Stream, chunked: bool) -> None:
        self.conn = conn
        self.server = conn.server
        self.stream = stream
        self.chunked = chunked
        self.context = conn.context
        self.client_key = conn.client_key
        self.secure = conn.secure
        self.write_paused = False
        self.paused = 0  # the Exchange's reasons to hold the client's request bytes
        self.deadline = 0.0  # 0: no timer
        self.done = False
        self.protocol = "h2" if conn.secure else "h2c"
        self.exchange = Exchange(self.server.context, self)

    # ------------------------------------------------------------ driving

    def begin(self, req: RequestHead, forward: Forward, now: float) -> None:
        """Drive the Exchange of a request `decide` forwarded to an HTTP/1.1 backend."""
        exchange = self.exchange
        self._arm(now + exchange.begin(req, forward, now))
        exchange.dispatch()

    def _arm(self, deadline: float) -> None:
        self.deadline = deadline
        self.conn.arm_stream(deadline)

    def on_timer(self, now: float) -> None:
        """The connection's ticker: this stream's deadline passed."""
        if self.done or not self.deadline or now < self.deadline:
            return
        self.deadline = 0.0
        wait = self.exchange.on_timer(now)
        if wait >= 0 and not self.done:
            self._arm(now + wait)

    # ------------------------------------------------------------ the stream's calls

    def request_data(self, data: bytes) -> None:
        if self.done or not data or self.exchange.req is None:
            return
        if self.chunked:
            data = b"%x\r\n%s\r\n" % (len(data), data)
        self.exchange.request_body(data)

    def request_end(self) -> None:
        if self.chunked and not self.done and self.exchange.req is not None:
            self.exchange.request_body(b"0\r\n\r\n")

    def request_trailers(self, headers: Any) -> None:
        # Request trailers are dropped, as on HTTP/1.1 (see waygate.proxy.http1).
        self.request_end()

    def pause_source(self, paused: bool) -> None:
        """The stream's buffer is full (the client's window is shut), or drained."""
        self.write_paused = paused
        if not self.done:
            self.exchange.downstream_paused(paused)

    def abandon(self) -> None:
        """The client reset the stream or went: the exchange ends now."""
        if not self.done:
            self.exchange.close("client reset the stream")
            self._finished()

    # ------------------------------------------------------------ Downstream

    def client_identity(self, route: Any) -> tuple[int, str] | bytes:
        return self.conn.client_identity(route)  # type: ignore[no-any-return]

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
        fields = _head_fields(response)
        if extra:
            fields += _lines_fields(extra, 0, len(extra) - 2)
        if framing == FRAMING_LENGTH:
            fields.append((b"content-length", b"%d" % length))
        elif framing == FRAMING_NONE and response.content_length >= 0:
            fields.append((b"content-length", b"%d" % response.content_length))
        end = framing == FRAMING_NONE or (framing == FRAMING_LENGTH and length == 0)
        self.stream.respond_fields(fields, end)
        if body:
            # All of a small body came with the head: END_STREAM goes with it.
            self.stream.send(body, framing == FRAMING_LENGTH and len(body) == length)

    def response_body(self, data: bytes) -> None:
        # The Exchange counted these bytes before handing them over: when none
        # remain they are the last, and END_STREAM goes with them (not on an
        # empty DATA frame after them, when the body came in several reads).
        exchange = self.exchange
        self.stream.send(data, exchange.remaining == 0 and exchange.framing == FRAMING_LENGTH)

    def response_pieces(self, pieces: list[bytes]) -> None:
        # The chunked body's last pieces: its reader knows it is done.
        reader = self.exchange.reader
        last = len(pieces) - 1 if reader is not None and reader.done else -1
        for index, piece in enumerate(pieces):
            self.stream.send(piece, index == last)

    def informational(self, status: int) -> None:
        """1xx: nothing for an HTTP/2 client (the final answer follows)."""

    def answer(self, req: RequestHead, status: int, reason: str, kind: str) -> None:
        """A local answer: the bytes the HTTP/1.1 path renders, as HTTP/2, or a gRPC status."""
        answer_stream(self.conn, self.stream, req, status, reason, kind)
        self._finished()

    def exchange_done(self, keep_alive: bool, now: float, idle_timeout: float) -> None:
        self.stream.finish()
        self._finished()

    def failed(self, status: int, reason: str, head_only: bool, response: bytes = b"") -> None:
        if self.done:
            return
        if self.stream.responded:
            self.stream.reset()
        elif self.stream.grpc:
            self._grpc_status(status, reason)
        else:
            self._render(response or http1.error_response(status, reason, close=False), head_only)
        self._finished()

    def refuse(self, exc: BadMessage) -> None:
        metrics = self.server.metrics
        metrics.refused["bad_request"] = metrics.refused.get("bad_request", 0) + 1
        if not self.done:
            self.exchange.abandon_upstream()
        self.failed(exc.status, exc.reason, False)

    def abort(self) -> None:
        if self.done:
            return
        self.exchange.abandon_upstream()
        self.stream.reset()
        self._finished()

    def pause_reading(self, reason: int) -> None:
        self.paused |= reason
        self.stream.upload_paused = True

    def resume_reading(self, reason: int) -> None:
        if self.paused & reason:
            self.paused &= ~reason
            if not self.paused and not self.done:
                self.stream.upload_resume()

    # An HTTP/2 request never asks to upgrade: the relay calls cannot come.

    def start_relay(self, response: ResponseHead, rest: bytes) -> None:
        self.abort()

    def relay_write(self, data: bytes) -> None:
        self.abort()

    def relay_eof(self) -> bool:
        return False

    def relay_closed(self) -> None:
        self.abort()

    # ------------------------------------------------------------ helpers

    def _grpc_status(self, status: int, reason: str) -> None:
        self.stream.respond(200, grpcstatus.trailers_only(status, reason), end=True)
        self._finished()

    def _render(self, response: bytes, head_only: bool) -> None:
        render_response(self.stream, response, head_only)
        self._finished()

    def _finished(self) -> None:
        if self.done:
            return
        self.done = True
        self.deadline = 0.0
        if self.stream.exchange is self:
            self.stream.exchange = None
        # The exchange points back here (its `down`): without this the pair is
        # a reference cycle per stream that only the cyclic collector frees
        # (young collections every ~150 requests, about 1% of the CPU). Every
        # call that reaches the exchange through this slot checks `done` first.
        self.exchange = None  # type: ignore[assignment]


# The :status field of each status (the grammar's three digits), built once.
_STATUS: Final = {code: (b":status", b"%d" % code) for code in range(100, 1000)}
# Never an HTTP/2 field (RFC 9113 section 8.2.2). The upstream's own were dropped
# by http1.parse_response_head; this keeps the rule for lines added after it
# (a route's response header modifier, the proxy's extras).
_NOT_H2: Final = httpheaders.H2_CONNECTION_SPECIFIC


# Header lines -> their HTTP/2 fields, for the blocks seen last: a backend sends
# the same head over and over (it changes with a Date a second), a target the
# same sticky cookie, and splitting them into fields again is a Python loop per
# line. Keys: a forwarded field block (`ResponseHead.fields`, b"\r\nName: value"
# per line) or extra lines (b"Name: value\r\n" each; never starting with CR).
# Bounded: blocks of at most _FIELDS_BYTES, at most _FIELDS_ENTRIES of them (all
# forgotten when full).
_FIELDS: Final[dict[bytes, tuple[tuple[bytes, bytes], ...]]] = {}
_FIELDS_ENTRIES: Final = 256
_FIELDS_BYTES: Final = 2048


def _head_fields(head: ResponseHead) -> list[tuple[bytes, bytes]]:
    """A parsed HTTP/1.1 response head as HTTP/2 fields, `:status` first."""
    block = head.fields
    if not block:
        return [_STATUS[head.status]]
    return [_STATUS[head.status], *_lines_fields(block, 2, len(block))]


def _lines_fields(block: bytes, start: int, stop: int) -> tuple[tuple[bytes, bytes], ...]:
    """The fields of the header lines in block[start:stop], remembered (see _FIELDS)."""
    known = _FIELDS.get(block)
    if known is None:
        split: list[tuple[bytes, bytes]] = []
        _add_fields(split, block[start:stop].split(b"\r\n"))
        known = tuple(split)
        if len(block) <= _FIELDS_BYTES:
            http1.remember(_FIELDS, block, known, _FIELDS_ENTRIES)
    return known


def _add_fields(out: list[tuple[bytes, bytes]], lines: list[bytes]) -> None:
    """b"Name: value" lines (a checked head's, no CR or LF in them) as HTTP/2
    fields: lower-case names, values without their surrounding whitespace."""
    for line in lines:
        name, _, value = line.partition(b":")
        name = name.lower()
        if name not in _NOT_H2:
            out.append((name, value.strip(b" \t")))
