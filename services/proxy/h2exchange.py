"""An HTTP/2 request stream as an exchange of the proxy.

`start_exchange` is called by `waygate.proxy.http2` for every request
stream. A route whose backend speaks HTTP/2 (its `upstreamProtocol`, or its
service port's `appProtocol`) goes to `waygate.proxy.h2upstream`; every
other request drives the proxy's HTTP/1.1 exchange through `_StreamBridge`:

The bridge is the transport of one `ClientConnection` (one per stream): the
request goes in as the HTTP/1.1 head it means (`http2.request_head`, then
`http1.parse_request_head`: one rule book for both versions) and its body,
chunked when it has no content-length; the exchange's answer comes back as
HTTP/1.1 bytes, is parsed (`http1.parse_response_head`, the framing of the
proxy's own output) and leaves as HEADERS, DATA and the stream's end. Every
rule of the HTTP/1.1 path (routing by :authority, Host agreement, header
hygiene, balancing, sticky cookies, HSTS, timeouts, auth-proxy routes and
the client certificate, the explained 502/503/504, metrics, spans, access
log) holds because it is that code that runs.

Flow control crosses the bridge both ways: the exchange's pause of its
"client" (`pause_reading`, the upstream is slow) holds the stream's
WINDOW_UPDATEs; the stream's full buffer (the client's window is shut)
pauses the exchange's upstream (`pause_writing` on the exchange).
"""

from __future__ import annotations

from typing import Any

from waygate.proxy import grpcstatus, http1
from waygate.proxy.http1 import (
    FRAMING_CHUNKED,
    FRAMING_CLOSE,
    FRAMING_LENGTH,
    FRAMING_NONE,
    BadMessage,
    ChunkedReader,
)
from waygate.proxy.http2 import (
    BadRequest,
    H2ClientConnection,
    Request,
    Stream,
    _h1_class,
    request_head,
)


def start_exchange(conn: H2ClientConnection, stream: Stream, request: Request, end: bool) -> None:
    """Route the stream's request to the exchange that serves its route's backend."""
    upstreams = getattr(conn.server, "h2_upstreams", None)
    if upstreams is not None and upstreams.try_start(conn, stream, request, end):
        return
    chunked = not end and request.content_length < 0
    try:
        head = request_head(request, chunked)
    except BadRequest as exc:
        conn._local_error(stream, exc.status, exc.reason, grpc=stream.grpc)
        return
    bridge = _StreamBridge(conn, stream, chunked)
    stream.exchange = bridge
    h1 = _h1_class()(conn.server)
    bridge.h1 = h1
    h1.connection_made(bridge)
    if bridge.closing:
        return
    h1.data_received(head)


class _StreamBridge:
    """The in-memory transport between one HTTP/2 stream and one HTTP/1.1 exchange."""

    __slots__ = (
        "buf",
        "chunked",
        "closing",
        "conn",
        "done",
        "framing",
        "h1",
        "reader",
        "remaining",
        "stream",
        "swallow",
    )

    def __init__(self, conn: H2ClientConnection, stream: Stream, chunked: bool) -> None:
        self.conn = conn
        self.stream = stream
        self.chunked = chunked
        self.h1: Any = None
        self.closing = False
        self.buf = b""
        self.framing = -1  # -1: the response head has not come yet
        self.remaining = 0
        self.reader: ChunkedReader | None = None
        self.done = False  # the response is complete
        self.swallow = False  # the body of a local answer turned into a gRPC status

    # ------------------------------------------------------------ the stream's calls

    def request_data(self, data: bytes) -> None:
        if self.closing or not data:
            return
        if self.chunked:
            self.h1.data_received(b"%x\r\n%s\r\n" % (len(data), data))
        else:
            self.h1.data_received(data)

    def request_end(self) -> None:
        if self.chunked and not self.closing:
            self.h1.data_received(b"0\r\n\r\n")

    def request_trailers(self, headers: Any) -> None:
        # Request trailers are dropped, as on HTTP/1.1 (see waygate.proxy.http1).
        self.request_end()

    def pause_source(self, paused: bool) -> None:
        if self.closing:
            return
        if paused:
            self.h1.pause_writing()
        else:
            self.h1.resume_writing()

    def abandon(self) -> None:
        """The client reset the stream or went: the exchange ends now."""
        if not self.closing:
            self.h1.abort()

    # ------------------------------------------------------------ asyncio.Transport

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        transport = self.conn.transport
        return transport.get_extra_info(name, default) if transport is not None else default

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        """The stream's own buffer bound applies (H2Limits.stream_buffer)."""

    def is_closing(self) -> bool:
        return self.closing

    def can_write_eof(self) -> bool:
        return False

    def write_eof(self) -> None:
        """Never called: an HTTP/2 stream carries no upgrade."""

    def pause_reading(self) -> None:
        self.stream.upload_paused = True

    def resume_reading(self) -> None:
        if not self.closing:
            self.stream.upload_resume()

    def writelines(self, parts: Any) -> None:
        self.write(b"".join(parts))

    def write(self, data: bytes) -> None:
        if self.closing or self.done or not data:
            return
        if self.framing < 0:
            data = self._head(data)
            if not data:
                return
        if self.swallow:
            return
        self._body(data)

    def close(self) -> None:
        """The exchange is over (every request on a stream says Connection: close)."""
        if self.closing:
            return
        self.closing = True
        stream = self.stream
        if self.done or self.framing == FRAMING_CLOSE or self.swallow:
            self.done = True
            stream.finish()
        elif stream.responded or self.framing < 0:
            # The exchange ended before its answer did.
            stream.reset()
        self._lost()

    def abort(self) -> None:
        if self.closing:
            return
        self.closing = True
        if not self.done:
            self.stream.reset()
        self._lost()

    def _lost(self) -> None:
        # As a real transport does: connection_lost on the next loop turn.
        self.stream.exchange = None
        self.conn.loop.call_soon(self.h1.connection_lost, None)

    # ------------------------------------------------------------ the answer

    def _head(self, data: bytes) -> bytes:
        """Parse the exchange's response head(s); returns the body bytes after it."""
        while True:
            buf = self.buf + data if self.buf else data
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                self.buf = buf
                return b""
            self.buf = b""
            head, data = buf[: end + 4], buf[end + 4 :]
            try:
                response = http1.parse_response_head(head)
            except BadMessage:
                self.abort()
                return b""
            if response.status >= 200:
                break
            if not data:
                return b""  # 100 Continue: nothing for an HTTP/2 client
        stream = self.stream
        fields = _fields(response.fields)
        framing = http1.response_framing(stream.method, response)
        self.framing = framing
        error = dict(fields).get(b"x-waygate-error") if stream.grpc else None
        if error is not None:
            # A local answer on a gRPC call: its reason as a gRPC status.
            reason = error.decode("ascii", "replace")
            self.swallow = True
            self.done = True
            stream.respond(200, grpcstatus.trailers_only(response.status, reason), end=True)
            return b""
        length = response.content_length
        if framing == FRAMING_LENGTH:
            self.remaining = length
            fields.append((b"content-length", b"%d" % length))
        elif framing == FRAMING_CHUNKED:
            self.reader = ChunkedReader(rechunk=False, status=502)
        elif framing == FRAMING_NONE and length >= 0:
            fields.append((b"content-length", b"%d" % length))
        end = framing == FRAMING_NONE or (framing == FRAMING_LENGTH and length == 0)
        stream.respond(response.status, [(name, value) for name, value in fields], end=end)
        if end:
            self.done = True
        return data

    def _body(self, data: bytes) -> None:
        stream = self.stream
        framing = self.framing
        if framing == FRAMING_LENGTH:
            if len(data) > self.remaining:
                data = data[: self.remaining]
            self.remaining -= len(data)
            stream.send(data)
            if self.remaining == 0:
                self.done = True
                stream.finish()
        elif framing == FRAMING_CHUNKED:
            reader = self.reader
            assert reader is not None
            try:
                out, _ = reader.feed(data)
            except BadMessage:
                self.abort()
                return
            for piece in out:
                stream.send(piece)
            if reader.done:
                self.done = True
                stream.finish()
        elif framing == FRAMING_CLOSE:
            stream.send(data)


def _fields(block: bytes) -> list[tuple[bytes, Any]]:
    """b"\\r\\nName: value..." lines as HTTP/2 fields (lower-case names)."""
    out: list[tuple[bytes, Any]] = []
    if not block:
        return out
    for line in block.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        lname = name.lower()
        if lname == b"proxy-connection":
            continue
        out.append((lname, value.strip(b" \t")))
    return out
