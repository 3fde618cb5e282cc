"""An HTTP/1.1 client's request to an HTTP/2 backend: one upstream stream the Exchange drives.

The backend decides the upstream protocol, never the client (`Forward.http2`,
from `routing.Backend.http2`): a backend whose Service port says
`appProtocol: kubernetes.io/h2c` (or a route's `upstreamProtocol`) is spoken
to in HTTP/2 whichever HTTP version the client used. An HTTP/2 client's
stream goes to `h2upstream.H2Exchange` (stream to stream, trailers relayed);
an HTTP/1.1 client's request stays an `exchange.Exchange` (its framing,
keep-alive, timeouts, extras and records are the Exchange's, unchanged) whose
upstream is an `H2Bridge` instead of an `upstream_h1.UpstreamConnection`:

- to the Exchange it is an upstream connection (`begin`, `writelines`,
  `release`, `abort`, `pause_reading`/`resume_reading`) that calls back
  `response_head` (a `ResponseHead` made of the HEADERS: chunked when the
  backend gave no content-length, so the client connection stays reusable),
  `response_data`, `upstream_failed`, `upstream_paused`;
- to `h2upstream` it is one stream's user on a multiplexed connection of the
  shared `H2Pool` (the same connections, endpoint bound and queue as HTTP/2
  clients' streams), with the same redispatch after a failed connect
  (`decision.repick`) and the same resend of a stream a GOAWAY left
  unprocessed.

Flow control: request body bytes go as the stream's window allows; what does
not fit is held and the client paused (`upstream_paused`) until the window
opens. Response DATA is acknowledged to the backend only while the client
reads (`pause_reading` holds the acknowledgements). Request trailers are
dropped, as on HTTP/1.1; the response's trailers end the chunked body.
"""

from __future__ import annotations

import contextlib
from typing import Any

import h2.exceptions
from h2.errors import ErrorCodes

from waygate.core import httpheaders
from waygate.proxy.decision import Forward
from waygate.proxy.h2upstream import (
    H2UpstreamConnection,
    H2Upstreams,
    UpstreamStream,
    h2_request_fields,
    malformed_field,
)
from waygate.proxy.http1 import BadMessage, ChunkedReader, ResponseHead
from waygate.proxy.routing import RouteEntry, Target

_LAST_CHUNK = b"0\r\n\r\n"


class H2Bridge(UpstreamStream):
    """One HTTP/1.1 exchange's request as one stream to an HTTP/2 backend."""

    __slots__ = (
        "ack_held",
        "attempts",
        "connect_timeout",
        "data_sent",
        "decoder",
        "end_sent",
        "entry",
        "exchange",
        "facts",
        "finished",
        "forward",
        "held",
        "paused",
        "pool_key",
        "queued",
        "request_done",
        "response",
        "retried",
        "sent_at",
        "span",
        "stream_id",
        "target",
        "traceparent",
        "upstream",
        "upstreams",
        "user",
    )

    def __init__(self, upstreams: H2Upstreams, user: Any, forward: Forward, facts: Any) -> None:
        self.upstreams = upstreams
        self.user = user  # the Exchange (upstream_h1.H1User's callbacks)
        self.exchange = user
        self.forward = forward
        self.facts = facts  # the client connection (decision.ConnectionFacts)
        self.entry: RouteEntry = forward.entry
        self.target: Target = forward.target
        self.span = forward.span
        self.traceparent = forward.traceparent
        self.connect_timeout = forward.entry.options.connect_timeout
        self.pool_key: Any = None
        self.upstream: H2UpstreamConnection | None = None
        self.stream_id = 0
        self.held: list[bytes] = []  # request body waiting for the stream's window
        # A chunked request body arrives chunk-framed from the Exchange: the
        # payload alone goes on as DATA.
        self.decoder: ChunkedReader | None = (
            ChunkedReader(rechunk=False) if forward.req.chunked else None
        )
        self.request_done = False
        self.end_sent = False
        self.response: ResponseHead | None = None
        self.paused = False  # the client stopped reading: acknowledgements held
        self.ack_held = 0
        self.finished = False
        self.queued = False
        self.retried = False
        self.data_sent = False
        self.attempts = 1
        self.sent_at = 0.0

    # ------------------------------------------------------------ getting a stream

    def _moved(self) -> None:
        self.user.target = self.target

    def attach(self, connection: H2UpstreamConnection | None, reused: bool = False) -> None:
        if self.finished:
            return
        if connection is None:
            self.dispatch()  # the new connection filled up meanwhile
            return
        self.upstream = connection
        # The Exchange sends its head (and the body bytes held meanwhile) through begin.
        self.user._attach(self, reused=reused)

    # ------------------------------------------------------------ the Exchange's calls

    def begin(self, user: Any, reused: bool, sent_at: float, request: bytes | list[bytes]) -> None:
        self.sent_at = sent_at
        connection = self.upstream
        assert connection is not None
        if isinstance(request, bytes):
            head, body = request, []
        else:
            head, body = request[0], request[1:]
        forward = self.forward
        upstream_tls = self.upstreams.ctx.upstream_tls
        fields = h2_request_fields(
            head,
            forward.authority or forward.req.host,
            b"https"
            if upstream_tls is not None and forward.upstream_scope is not None
            else b"http",
            False,
        )
        for piece in body:
            self._take(piece)
        self.request_done = user.req_complete and user.buffer is None
        end = self.request_done and not self.held
        try:
            self.stream_id = connection.open_stream(self, fields, end)
        except (h2.exceptions.ProtocolError, h2.exceptions.TooManyStreamsError):
            self.upstream = None
            self.user.upstream = None
            self.dispatch()
            return
        self.end_sent = end
        if self.held:
            self.send_held()
        if user.req is not None and user.req.expect_continue and not self.request_done:
            # An HTTP/2 backend sends no 100: the client is told to go on at once.
            go_on = ResponseHead()
            go_on.status = 100
            user.informational(go_on, 0)

    def _take(self, piece: bytes) -> None:
        decoder = self.decoder
        if decoder is None:
            if piece:
                self.held.append(piece)
            return
        try:
            out, _ = decoder.feed(piece)
        except BadMessage:  # (the Exchange checked this framing already)
            return
        self.held.extend(p for p in out if p)

    def write(self, data: bytes) -> None:
        self.writelines([data])

    def writelines(self, pieces: list[bytes]) -> None:
        for piece in pieces:
            self._take(piece)
        if self.user.req_complete and self.user.buffer is None:
            self.request_done = True
        if self.stream_id:
            self.send_held()

    def write_eof(self) -> bool:
        return False  # no upgrade on HTTP/2: no relay to half-close

    def send_held(self) -> None:
        """Request DATA as the stream's window allows; the client paused meanwhile."""
        if self.upstream is not None and not self.finished and self.stream_id:
            self._send()

    def _blocked(self, blocked: bool) -> None:
        self.user.upstream_paused(blocked)

    def upstream_writable(self, writable: bool) -> None:
        self.user.upstream_paused(not writable)

    def pause_reading(self) -> None:
        self.paused = True

    def resume_reading(self) -> None:
        self.paused = False
        if self.ack_held:
            held, self.ack_held = self.ack_held, 0
            self._ack(held)

    def release(self, reusable: bool, now: float = 0.0) -> None:
        """The Exchange is done with the stream: it ends (reset if the backend has
        not ended it: nothing more of its answer is wanted)."""
        self._end_stream(cancel=not self.finished)

    def abort(self) -> None:
        self._end_stream(cancel=True)

    def close(self) -> None:
        self._end_stream(cancel=True)

    def _end_stream(self, *, cancel: bool) -> None:
        if self.queued:
            self.queued = False
            self.upstreams.ctx.pool.cancel_wait(self.target, self)
        upstream = self.upstream
        self.finished = True
        self.held = []
        if upstream is None:
            return
        upstream.blocked.discard(self)
        if self.stream_id:
            if cancel:
                with contextlib.suppress(h2.exceptions.ProtocolError):
                    upstream.h2.reset_stream(self.stream_id, ErrorCodes.CANCEL)
                upstream.flush()
            upstream.stream_done(self.stream_id)
        self.upstream = None

    # ------------------------------------------------------------ the backend's side

    def on_response(self, headers: list[tuple[bytes, bytes]], ended: bool) -> None:
        status = 0
        lines: list[bytes] = []
        length = -1
        for name, value in headers:
            if malformed_field(name, value):  # never relayed: a 502, as for an HTTP/2 client
                self.abort()
                self.user.upstream_failed(
                    502, "upstream sent a malformed response head", "bad_response"
                )
                return
            if name == b":status":
                status = int(value)
            elif name[:1] != b":" and name not in httpheaders.HOP_BY_HOP:
                if name == b"content-length":
                    length = int(value) if value.isdigit() else -1
                    continue
                lines.append(b"\r\n" + name + b": " + value)
        if status < 200:
            return  # 1xx: nothing for the client here (its 100-continue was answered)
        response = ResponseHead()
        response.status = status
        response.fields = b"".join(lines)
        if ended:
            response.content_length = 0 if length < 0 else length
        elif length >= 0:
            response.content_length = length
        else:
            response.chunked = True  # re-framed for the client: DATA as chunks
        self.response = response
        user = self.user
        user.response_head(response, b"", user.loop.time())

    def on_data(self, data: bytes, flow: int) -> None:
        response = self.response
        if response is not None and data:
            user = self.user
            now = user.loop.time()
            if response.chunked:
                user.response_data(b"%x\r\n%s\r\n" % (len(data), data), now)
            else:
                user.response_data(data, now)
        if flow:
            if self.paused:
                self.ack_held += flow
            else:
                self._ack(flow)

    def on_trailers(self, headers: list[tuple[bytes, bytes]]) -> None:
        self.on_end()  # trailers are dropped for an HTTP/1.1 client (see http1)

    def on_end(self) -> None:
        if self.finished:
            return
        self.finished = True
        response = self.response
        if response is not None and response.chunked:
            self.user.response_data(_LAST_CHUNK, self.user.loop.time())
        elif response is None:
            self.user.upstream_failed(
                502, "upstream ended the stream without an answer", "bad_response"
            )

    def on_reset(self, code: int) -> None:
        if self.finished:
            return
        if code == ErrorCodes.REFUSED_STREAM and self.response is None and not self.retried:
            self.unprocessed()
            return
        self.finished = True
        self.upstream = None
        self.user.upstream_failed(
            502, "upstream reset the stream (" + ErrorCodes(code).name + ")", "upstream_reset"
        )

    def _answered(self) -> bool:
        return self.response is not None

    def _gone(self, reason: str) -> None:
        self.finished = True
        self.user.upstream_failed(502, reason, "upstream_closed")

    def upstream_broke(self, reason: str) -> None:
        if self.finished:
            return
        self.finished = True
        self.upstream = None
        self.user.upstream_failed(502, reason, "upstream_closed")

    def fail(self, status: int, reason: str, kind: str) -> None:
        """No stream could be had (connect failed, endpoint at its limit)."""
        if self.finished:
            return
        self.finished = True
        self.user.upstream = None
        self.user.upstream_failed(status, reason, kind)
