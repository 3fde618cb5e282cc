"""HTTP/2 on the proxy's client side: a thin asyncio Protocol over the `h2` state machine.

`H2ClientConnection` serves one HTTP/2 connection: negotiated by ALPN `h2` on
the HTTPS port, or HTTP/2 with prior knowledge (h2c) on the HTTP port, told
apart from HTTP/1.1 by its first bytes (`waygate.proxy.accept.ClientProtocol`,
the factory both listeners use). `h2` (python-hyper) does the framing, HPACK and the stream
state machine; this module moves bytes, applies the proxy's limits, applies RFC
9113's rules on request fields (`read_request`, `check_trailers`, in one pass;
the rules themselves are `waygate.core.httpheaders`' h2_* ones; h2's own
inbound checks are off on this side, see `h2_connection`), and turns each
request stream into an exchange:

- a route whose backend speaks HTTP/1.1 (the default): the stream drives the
  proxy's `Exchange` (`waygate.proxy.exchange`, the one HTTP/1.1 connections
  drive) through `waygate.proxy.h2exchange.StreamDownstream`. The request
  becomes the HTTP/1.1 head it means (`request_head`) by the one header rule
  book in `waygate.proxy.http1`; routing by :authority, balancing, sticky
  cookies, timeouts, auth-proxy routes, the explained failures, metrics, spans
  and the access log are that exchange's, unchanged. The upstream's parsed
  response head leaves as HEADERS, its body as DATA.
- a route whose backend speaks HTTP/2 or gRPC: `waygate.proxy.h2upstream`.

A local answer on a gRPC request (content-type application/grpc...) leaves as
a gRPC status, trailers-only (`waygate.proxy.grpcstatus`), never an HTML page.

Limits (every one a flag of `waygate proxy serve`, see `H2Limits`):
- concurrent streams per connection (SETTINGS_MAX_CONCURRENT_STREAMS; h2
  refuses one more), header list size (the HPACK decoder stops inflating past
  it: an HPACK bomb costs at most that much), the compressed header block
  (HEADERS + CONTINUATION bytes held before decoding: a CONTINUATION flood
  stops there), stream and connection receive windows.
- flood budgets, counted, not timed: control frames (PING, SETTINGS,
  PRIORITY, WINDOW_UPDATE, empty DATA) beyond `control_frames` plus twice the
  useful frames (streams opened, DATA with payload either way) end the
  connection with GOAWAY ENHANCE_YOUR_CALM; so do streams the client resets
  before their answer (rapid reset, CVE-2023-44487) once they pass
  `premature_resets` and half of the streams opened.
- response bytes held per stream while the client's window is closed:
  `stream_buffer`; past it the upstream is paused (a client that never opens
  its window holds at most that much per stream, until the exchange's
  server timeout ends it). Request bytes are acknowledged (WINDOW_UPDATE)
  only once handed to the upstream: a slow upstream closes the client's
  window instead of growing a buffer.
- the proxy stops reading a connection whose own writes back up (PING and
  SETTINGS acknowledgements cannot pile up for a client that does not read).

Draining (SIGTERM): GOAWAY with the last stream id seen; streams in flight
finish within the grace period, then the connection closes. Under the
proxy's connection bounds a connection with no stream open is idle and may be
evicted like an HTTP/1.1 keep-alive (GOAWAY NO_ERROR, then closed).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import h2.config
import h2.connection
import h2.events
import h2.exceptions
import h2.frame_buffer
import h2.settings
import hpack.hpack
from h2.errors import ErrorCodes
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from waygate.core import flow, httpheaders
from waygate.proxy import grpcstatus, hpackcache, http1
from waygate.proxy.routing import Side

log = logging.getLogger(__name__)

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
HIGH_WATER = flow.HIGH_WATER
LOW_WATER = flow.LOW_WATER

# Connection-level timer kinds, as `waygate.proxy.server` names them (the
# server's ticker reads `_timer_kind`, `_deadline` and calls `_on_timer`).
_T_NONE = 0
_T_IDLE = 1
_T_STREAMS = 3  # the earliest deadline of a stream's exchange (StreamDownstream)


class H2Limits(NamedTuple):
    """HTTP/2 limits of the proxy's listeners (flags `--h2-*`, see app.Settings)."""

    max_concurrent_streams: int = 100
    # Receive windows: what a client may send ahead of the upstream reading it.
    stream_window: int = 256 * 1024
    connection_window: int = 1024 * 1024
    # Decoded header list (names + values + 32 per field, RFC 9113 6.5.2); the
    # same size as the HTTP/1.1 head limit.
    max_header_list_size: int = http1.MAX_HEAD_BYTES
    # Control frames allowed beyond twice the useful frames (see module doc).
    control_frames: int = 1000
    # Streams reset by the client before their answer, beyond which (and past
    # half of the streams opened) the connection is refused more work.
    premature_resets: int = 100
    # Response bytes held per stream while the client's window is shut.
    stream_buffer: int = 256 * 1024


# A regular field name as the HTTP/1.1 rule book takes it: lower-case token characters.
_HEADER_NAME = re.compile(rb"[!#$%&'*+\-.^_`|~0-9a-z]+")
# The regular fields read_request looks at; every other one is copied as it came.
_HOST, _COOKIE, _LENGTH, _TE, _CONTENT_TYPE, _SPECIFIC = range(6)
_READ = {
    b"host": _HOST,
    b"cookie": _COOKIE,
    b"content-length": _LENGTH,
    b"te": _TE,
    b"content-type": _CONTENT_TYPE,
    **dict.fromkeys(httpheaders.H2_CONNECTION_SPECIFIC, _SPECIFIC),
}


class BadRequest(Exception):
    """A request stream that cannot be an exchange; `reason` says why (400)."""

    def __init__(self, reason: str, status: int = 400) -> None:
        super().__init__(reason)
        self.reason = reason
        self.status = status


class Malformed(BadRequest):
    """A request RFC 9113 calls malformed (section 8.1.1): not answered; the
    connection ends with GOAWAY PROTOCOL_ERROR, as h2's own checks did."""


class Request(NamedTuple):
    """One HTTP/2 request as the proxy reads it."""

    method: bytes
    authority: bytes
    path: bytes
    scheme: bytes
    headers: tuple[tuple[bytes, bytes], ...]  # regular fields, names lower-case, cookies joined
    content_length: int  # -1: none
    grpc: bool


# Request blocks read last, and what they mean: a client sends the same block
# over and over (h2load every time; a browser or gRPC client with its :path
# changing), and hpackcache hands back the same field tuples for the same bytes,
# so the key's hash is cheap. Only blocks that passed every check are kept (a
# refused one raises each time); a Request is immutable (its fields a tuple).
# Bounded: blocks of at most _REQUESTS_FIELDS fields and _REQUESTS_BYTES of
# names and values, at most _REQUESTS_ENTRIES of them (all forgotten when full).
_REQUESTS: dict[tuple[bool, tuple[tuple[bytes, bytes], ...]], Request] = {}
_REQUESTS_ENTRIES = 256
_REQUESTS_FIELDS = 32
_REQUESTS_BYTES = 2048


def read_request(headers: list[tuple[bytes, bytes]], end_stream: bool) -> Request:
    """`_read_request`, remembered for the blocks seen last (see _REQUESTS)."""
    if len(headers) > _REQUESTS_FIELDS:
        return _read_request(headers, end_stream)[0]
    key = (end_stream, tuple(headers))
    known = _REQUESTS.get(key)
    if known is None:
        known, size = _read_request(headers, end_stream)
        if size <= _REQUESTS_BYTES:
            http1.remember(_REQUESTS, key, known, _REQUESTS_ENTRIES)
    return known


def _read_request(headers: list[tuple[bytes, bytes]], end_stream: bool) -> tuple[Request, int]:
    """The pseudo-headers and fields of one request block, checked in one pass,
    and the block's size (its names' and values' bytes: the bound of _REQUESTS).

    h2's own inbound checks are off on the proxy's listeners (see
    `h2_connection`): this is where RFC 9113's rules on a request block are
    kept, and what would break the HTTP/1.1 rule book is refused before it.

    Raises Malformed (RFC 9113 sections 8.1.1, 8.2, 8.3): a name with upper
    case, a control character or a colon, an empty name, NUL/CR/LF in a
    value or whitespace around it, a connection-specific field, TE other than
    "trailers", an unknown, repeated or late pseudo-header, a missing
    :method, :scheme or :path, an empty :path. Raises BadRequest for what
    the HTTP/1.1 rules refuse: CONNECT (405), a name that is no token,
    a missing :authority and Host, the two disagreeing (section 8.3.1),
    more than one Host, a bad content-length.
    """
    method = authority = path = scheme = None
    host = None
    fields: list[tuple[bytes, bytes]] = []
    cookies: list[bytes] | None = None
    content_length = -1
    grpc = False
    regular = False
    legal_value = httpheaders.h2_legal_value
    token = _HEADER_NAME.fullmatch
    size = 0
    for name, value in headers:
        size += len(name) + len(value)
        if legal_value(value) is None:
            raise Malformed("NUL, CR, LF or surrounding whitespace in a field value")
        if name[:1] == b":":
            if regular:
                raise Malformed("pseudo-header after a regular field (RFC 9113 section 8.3)")
            if name == b":method" and method is None:
                method = value
            elif name == b":path" and path is None:
                path = value
            elif name == b":authority" and authority is None:
                authority = value
            elif name == b":scheme" and scheme is None:
                scheme = value
            else:
                raise Malformed(
                    "unknown or repeated pseudo-header " + name.decode("ascii", "replace")
                )
            continue
        regular = True
        if token(name) is None:
            if not name or httpheaders.h2_illegal_name(name) is not None:
                raise Malformed("malformed field name (RFC 9113 section 8.2.1)")
            raise BadRequest("malformed header name (RFC 9113 section 8.2.1)")
        kind = _READ.get(name)
        if kind is None:
            fields.append((name, value))
        elif kind == _CONTENT_TYPE:
            if value.startswith(b"application/grpc"):
                grpc = True
            fields.append((name, value))
        elif kind == _COOKIE:
            if cookies is None:
                cookies = [value]
            else:
                cookies.append(value)
        elif kind == _HOST:
            if host is not None:
                raise BadRequest("more than one Host header (RFC 9112 section 3.2)")
            host = value
        elif kind == _LENGTH:
            if content_length >= 0 or not value.isdigit() or len(value) > 18:
                raise BadRequest("malformed or repeated content-length (RFC 9110 section 8.6)")
            content_length = int(value)
        elif kind == _TE:
            # "trailers" only (RFC 9113 section 8.2.2); hop-by-hop, never copied.
            if not httpheaders.h2_te_allowed(value):
                raise Malformed("TE other than trailers (RFC 9113 section 8.2.2)")
        else:
            raise Malformed("connection-specific header field (RFC 9113 section 8.2.2)")
    if method is None:
        raise Malformed("missing :method (RFC 9113 section 8.3.1)")
    if method == b"CONNECT":
        raise BadRequest("CONNECT is not served (reverse proxy)", 405)
    if scheme is None or path is None:
        raise Malformed("missing :scheme or :path (RFC 9113 section 8.3.1)")
    if not path:
        raise Malformed("empty :path (RFC 9113 section 8.3.1)")
    if not authority:
        if not host:
            raise BadRequest("missing :authority and Host (RFC 9113 section 8.3.1)")
        authority = host
    elif host is not None and authority.lower() != host.lower():
        raise BadRequest(":authority and Host disagree (RFC 9113 section 8.3.1)")
    if cookies is not None:
        # Split cookie fields are joined (RFC 9113 section 8.2.3).
        fields.append((b"cookie", b"; ".join(cookies)))
    if end_stream and content_length > 0:
        raise BadRequest("content-length without a body (RFC 9113 section 8.1.1)")
    return Request(method, authority, path, scheme, tuple(fields), content_length, grpc), size


def check_trailers(headers: list[tuple[bytes, bytes]]) -> None:
    """A request's trailer block, by RFC 9113's rules (h2's checks are off):
    Malformed for a pseudo-header, an illegal name or value, a
    connection-specific field or TE."""
    malformed = httpheaders.h2_trailer_malformed
    for name, value in headers:
        if malformed(name, value):
            raise Malformed("malformed trailer field (RFC 9113 sections 8.1, 8.2)")


# Requests read last -> the head each means (a pure function of the Request and
# `chunked`, usually the very Request read_request remembered): each caller gets
# its own copy to change. Bounded as _REQUESTS is (entries; heads of at most
# _REQUESTS_BYTES); a refused request is refused each time.
_HEADS: dict[tuple[Request, bool], http1.RequestHead] = {}


def request_head(request: Request, chunked: bool) -> http1.RequestHead:
    """The HTTP/1.1 request head the request means, by the one rule book
    (`http1.request_from_fields`: what the same request on HTTP/1.1 meets);
    raises `http1.BadMessage`. `chunked`: a body without a length follows."""
    key = (request, chunked)
    known = _HEADS.get(key)
    if known is not None:
        return http1.copy_head(known)
    head = http1.request_from_fields(
        request.method,
        request.path,
        request.authority,
        request.headers,
        request.content_length,
        chunked,
    )
    if len(request.headers) <= _REQUESTS_FIELDS and (
        len(head.fields) + len(head.target) <= _REQUESTS_BYTES
    ):
        http1.remember(_HEADS, key, http1.copy_head(head), _REQUESTS_ENTRIES)
    return head


class _BoundedFrameBuffer(h2.frame_buffer.FrameBuffer):
    """h2's frame buffer with the header block bounded in bytes, not only in
    CONTINUATION frames (h2 holds up to 64 of 16 KiB each before decoding)."""

    max_header_block = http1.MAX_HEAD_BYTES + 1024

    def _update_header_buffer(self, f: Any) -> Any:
        result = super()._update_header_buffer(f)
        if self._headers_buffer:
            held = sum(len(frame.data) for frame in self._headers_buffer)
            if held > self.max_header_block:
                raise h2.exceptions.DenialOfServiceError("header block too large")
        return result


class GracefulStateMachine(h2.connection.H2ConnectionStateMachine):
    """h2's connection state machine, except that a GOAWAY (sent or received)
    leaves the connection open for the streams it covers.

    h2 closes its state machine on GOAWAY, after which no frame of any stream
    can be sent or received; RFC 9113 section 6.8 has the streams up to the
    GOAWAY's last stream id finish (a graceful drain, and a backend's GOAWAY
    with answers still coming). New streams past it are refused by the proxy
    itself (`H2ClientConnection._request`, `H2UpstreamConnection.has_room`).

    Done in h2's own transition table (an open state stays itself on GOAWAY),
    not by overriding `process_input`: that override was a Python frame more on
    every frame sent or received, about 2% of the CPU per request."""

    _transitions = {  # noqa: RUF012 (h2 declares it on the class; read-only here)
        **h2.connection.H2ConnectionStateMachine._transitions,
        **{
            (state, goaway): (None, state)
            for state in (
                h2.connection.ConnectionState.CLIENT_OPEN,
                h2.connection.ConnectionState.SERVER_OPEN,
            )
            for goaway in (
                h2.connection.ConnectionInputs.SEND_GOAWAY,
                h2.connection.ConnectionInputs.RECV_GOAWAY,
            )
        },
    }


class _Silent:
    """A logger for h2's and hpack's debug calls that does nothing, at C speed.

    hpack logs through its module's `logging` logger about 30 times per request
    (each a `Logger.debug` and an `isEnabledFor` call, though disabled: about 3%
    of the proxy's CPU per request), h2 through its configuration's no-op
    `DummyLogger` about 9 times. `"".format` takes any arguments and returns at
    once without a Python frame."""

    __slots__ = ()
    debug = trace = "".format


_SILENT = _Silent()
_hpack_checked = False


def _silence_hpack() -> None:
    """hpack's debug calls cost nothing, unless someone asked for hpack's debug
    lines (checked once, at the first connection: logging is configured by then).

    And h2's `repr(frame)` of every frame received, the argument of a trace line
    its configuration's logger drops (ours is `_SILENT`), is `id` instead: a
    frame's repr formats its flags and body, about 3% of the CPU per request.
    `repr` is looked up in h2.connection's globals, where that trace line is its
    only use; every H2Connection in the proxy's process is built here."""
    global _hpack_checked
    _hpack_checked = True
    if not logging.getLogger(hpack.hpack.__name__).isEnabledFor(logging.DEBUG):
        hpack.hpack.log = _SILENT  # type: ignore[assignment]
    h2.connection.repr = id  # type: ignore[attr-defined]


def h2_connection(limits: H2Limits, *, client_side: bool) -> h2.connection.H2Connection:
    """An h2 state machine with the proxy's settings.

    On the listeners' side (`client_side` False) h2's inbound header checks and
    cookie joining are off: `read_request` and `check_trailers` keep the same
    RFC 9113 rules in one pass over the fields (h2's are a chain of seven
    generators per field, about a tenth of the proxy's CPU per request), and the
    HTTP/1.1 rule book checks the head after them. Towards backends
    (`client_side` True) h2 checks the responses itself."""
    if not _hpack_checked:
        _silence_hpack()
    config = h2.config.H2Configuration(
        client_side=client_side,
        header_encoding=None,
        logger=_SILENT,  # type: ignore[arg-type]
        validate_inbound_headers=client_side,
        normalize_inbound_headers=client_side,
        validate_outbound_headers=False,
        normalize_outbound_headers=False,
    )
    conn = h2.connection.H2Connection(config=config)
    conn.state_machine = GracefulStateMachine()
    # hpack's coders, remembering blocks that leave the header table unchanged
    # (the same fields, coded the same way: see waygate.proxy.hpackcache).
    conn.encoder = hpackcache.Encoder()
    conn.decoder = hpackcache.Decoder()
    codes = h2.settings.SettingCodes
    conn.local_settings = h2.settings.Settings(
        client=client_side,
        initial_values={
            codes.MAX_CONCURRENT_STREAMS: limits.max_concurrent_streams,
            codes.INITIAL_WINDOW_SIZE: limits.stream_window,
            codes.MAX_HEADER_LIST_SIZE: limits.max_header_list_size,
            codes.ENABLE_PUSH: 0,
        },
    )
    conn.decoder.max_header_list_size = limits.max_header_list_size
    buffer = _BoundedFrameBuffer(server=not client_side)
    buffer.max_header_block = limits.max_header_list_size + 1024
    conn.incoming_buffer = buffer
    # The window manager was built for the default 65,535: ours hands out the
    # stream window as h2 acknowledges data.
    conn._inbound_flow_control_window_manager.max_window_size = limits.connection_window
    return conn


class H2Stats:
    """Counters of the HTTP/2 listeners (exported by `H2Collector`, read by the
    attack tests). Plain attributes: a stream costs an integer add."""

    def __init__(self) -> None:
        self.connections = {"h2": 0, "h2c": 0}  # opened, by protocol
        self.streams = {"h2": 0, "h2c": 0}  # request streams opened, by protocol
        self.goaway: dict[str, int] = {}  # connections ended by the proxy, by reason
        self.held_bytes = 0  # response bytes held for closed client windows, now

    def refused(self, reason: str) -> None:
        self.goaway[reason] = self.goaway.get(reason, 0) + 1


STATS = H2Stats()


class H2Collector(Collector):
    """The HTTP/2 counters as Prometheus metrics (registered by `waygate.proxy.app`)."""

    def collect(self) -> Iterator[Any]:
        connections = CounterMetricFamily(
            "waygate_proxy_h2_connections",
            "HTTP/2 client connections accepted, by protocol (h2: TLS, h2c: prior knowledge)",
            labels=["protocol"],
        )
        streams = CounterMetricFamily(
            "waygate_proxy_h2_streams",
            "HTTP/2 request streams opened by clients, by protocol",
            labels=["protocol"],
        )
        for protocol in ("h2", "h2c"):
            connections.add_metric([protocol], STATS.connections[protocol])
            streams.add_metric([protocol], STATS.streams[protocol])
        refused = CounterMetricFamily(
            "waygate_proxy_h2_connections_refused",
            "HTTP/2 connections the proxy ended with an error GOAWAY, by reason "
            "(protocol_error, denial_of_service, control_flood, rapid_reset)",
            labels=["reason"],
        )
        for reason, count in STATS.goaway.items():
            refused.add_metric([reason], count)
        yield from (connections, streams, refused)
        yield GaugeMetricFamily(
            "waygate_proxy_h2_held_bytes",
            "response bytes held now for HTTP/2 clients whose window is shut",
            value=STATS.held_bytes,
        )


# ---------------------------------------------------------------- streams


class Stream:
    """One request stream: what the exchange behind it writes, and flow control.

    The exchange (`StreamDownstream` or an h2 upstream stream) calls `respond`,
    `send`, `finish` and `reset`; `paused` is its pause callback target.
    """

    __slots__ = (
        "ack_held",
        "closed",
        "conn",
        "ended",
        "exchange",
        "grpc",
        "held",
        "held_size",
        "id",
        "method",
        "request_done",
        "responded",
        "source_paused",
        "trailers",
        "upload_paused",
    )

    def __init__(self, conn: H2ClientConnection, stream_id: int) -> None:
        self.conn = conn
        self.id = stream_id
        self.exchange: Any = None
        self.method = b""
        self.grpc = False
        self.responded = False
        self.request_done = False
        self.ended = False  # the response's end has been queued
        self.closed = False
        # Response bytes waiting for the client's window (bounded by stream_buffer).
        self.held: list[bytes] = []
        self.held_size = 0
        self.trailers: list[tuple[bytes, bytes]] | None = None
        self.source_paused = False
        # Request bytes received but not acknowledged (the upstream is paused).
        self.upload_paused = False
        self.ack_held = 0

    # What the exchange calls.

    def respond(
        self, status: int, headers: list[tuple[bytes, bytes]], *, end: bool = False
    ) -> None:
        self.respond_fields([(b":status", b"%d" % status), *headers], end)

    def respond_fields(self, fields: list[tuple[bytes, bytes]], end: bool = False) -> None:
        """`respond` with the whole field list built by the caller, :status first."""
        if self.closed or self.responded:
            return
        self.responded = True
        self.conn._send_headers(self, fields, end)
        if end:
            self.ended = True

    def send(self, data: bytes, end: bool = False) -> None:
        """Response bytes; `end`: they are the last (END_STREAM goes with them)."""
        if self.closed:
            return
        if not data:
            if end:
                self.finish()
            return
        if end:
            if self.ended:
                return
            self.ended = True
        if self.held:
            self._hold(data)
            return
        rest = self.conn._send_data(self, data, end)
        if rest:
            self._hold(rest)

    def finish(self, trailers: list[tuple[bytes, bytes]] | None = None) -> None:
        if self.closed or self.ended:
            return
        self.ended = True
        self.trailers = trailers
        if not self.held:
            self.conn._end(self)

    def reset(self, code: int = ErrorCodes.INTERNAL_ERROR) -> None:
        if self.closed:
            return
        self.conn._reset(self, code)

    def upload_resume(self) -> None:
        self.upload_paused = False
        if self.ack_held:
            held, self.ack_held = self.ack_held, 0
            self.conn._ack(self, held)

    # Flow control of the response.

    def _hold(self, data: bytes) -> None:
        self.held.append(data)
        self.held_size += len(data)
        STATS.held_bytes += len(data)
        self.conn.blocked.add(self)
        if self.held_size > self.conn.limits.stream_buffer and not self.source_paused:
            self.source_paused = True
            exchange = self.exchange
            if exchange is not None:
                exchange.pause_source(True)

    def _flush(self) -> None:
        """The client's window opened: send what is held; resume the source below low water."""
        conn = self.conn
        while self.held:
            data = self.held[0]
            # The response's last bytes carry its END_STREAM (unless trailers follow).
            last = self.ended and len(self.held) == 1 and not self.trailers
            rest = conn._send_data(self, data, last)
            if self.closed:
                return  # they did (or the stream went): _drop freed what it held
            sent = len(data) - len(rest)
            self.held_size -= sent
            STATS.held_bytes -= sent
            if rest:
                self.held[0] = rest
                break
            self.held.pop(0)
        if not self.held:
            conn.blocked.discard(self)
            if self.ended:
                conn._end(self)
        if self.source_paused and self.held_size < LOW_WATER:
            self.source_paused = False
            exchange = self.exchange
            if exchange is not None:
                exchange.pause_source(False)

    def _drop(self) -> None:
        """The stream is gone: free what it holds."""
        self.closed = True
        STATS.held_bytes -= self.held_size
        self.held = []
        self.held_size = 0
        self.conn.blocked.discard(self)


# Serves one request stream: (connection, stream, request, end_stream).
StreamHandler = Callable[["H2ClientConnection", "Stream", Request, bool], None]


class H2ClientConnection(asyncio.Protocol):
    """One HTTP/2 client connection (h2 over TLS or h2c)."""

    def __init__(
        self, server: Any, limits: H2Limits, *, secure: Side, start_exchange: StreamHandler
    ) -> None:
        self.server = server
        # What serves each request stream (waygate.proxy.h2exchange.start_exchange,
        # handed in by waygate.proxy.accept: this module imports no exchange).
        self.start_exchange = start_exchange
        self.loop = server.loop
        self.limits = limits
        self.secure: Side = secure
        self.transport: asyncio.Transport | None = None
        self.h2 = h2_connection(limits, client_side=False)
        self.streams: dict[int, Stream] = {}
        self.blocked: set[Stream] = set()
        self.closed = False
        self.goaway_sent = False
        self.last_stream = 0
        self.write_paused = False
        self.read_paused = False
        self.junk = 0
        self.useful = 0
        self.opened = 0
        self.premature = 0
        self.peer = "unknown"
        self.client_key = b"unknown"
        self.context: http1.ForwardedContext | None = None
        self._identity_route: Any = None
        self._identity: tuple[int, str] | bytes = b""
        self._flush_soon = False
        # The server's ticker (see waygate.proxy.server.ProxyServer._sweep).
        self._timer_kind = _T_NONE
        self._deadline = 0.0
        # Since when no stream is open (the oldest idle connections are evicted
        # first under the connection bounds, as HTTP/1.1 keep-alives are).
        self.idle_since = server.loop.time()

    # ------------------------------------------------------------ asyncio.Protocol

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        server = self.server
        peer = transport.get_extra_info("peername")
        self.peer = peer[0] if peer else "unknown"
        self.client_key = self.peer.encode()
        # Counted like an HTTP/1.1 connection (total and per-source caps; at a cap
        # idle HTTP/1.1 keep-alive connections make room first); its streams are
        # exchanges, not connections.
        if server.admit(self):
            self.closed = True
            transport.abort()
            return
        STATS.connections["h2" if self.secure else "h2c"] += 1
        if self.secure:
            self.context = http1.ForwardedContext(self.peer, server.https_port, b"https")
        else:
            self.context = http1.ForwardedContext(self.peer, server.listen_port)
        transport.set_write_buffer_limits(high=HIGH_WATER, low=LOW_WATER)
        self.h2.initiate_connection()
        increment = self.limits.connection_window - 65535
        if increment > 0:
            self.h2.increment_flow_control_window(increment)
        self._flush_out()
        self._arm_idle(server.defaults.http_request_timeout)

    def data_received(self, data: bytes) -> None:
        if self.closed:
            return
        self.server.metrics.bytes_in += len(data)
        try:
            events = self.h2.receive_data(data)
        except h2.exceptions.DenialOfServiceError as exc:
            self._goaway_now(exc.error_code, "denial_of_service")
            return
        except h2.exceptions.ProtocolError as exc:
            self._goaway_now(exc.error_code, "protocol_error")
            return
        for event in events:
            self._event(event)
            if self.closed:
                return
            # Per frame, not per read: one read may hold thousands of frames.
            self._check_floods()
            if self.closed:
                return
        # What these frames asked for (acknowledgements, local answers) leaves now,
        # in one write; answers that come later leave once per loop turn (_flush_out).
        data = self.h2.data_to_send()
        if data:
            self.transport.write(data)  # type: ignore[union-attr]

    def eof_received(self) -> bool | None:
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._timer_kind = _T_NONE
        for stream in list(self.streams.values()):
            self._abandon(stream)
        self.streams.clear()
        self.server.connection_closed(self)

    def pause_writing(self) -> None:
        # Our writes back up: read no more frames until the client reads (a PING
        # or SETTINGS flood from a client that never reads grows nothing here).
        self.write_paused = True
        if self.transport is not None and not self.read_paused:
            self.read_paused = True
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        self.write_paused = False
        if self.transport is not None and self.read_paused and not self.closed:
            self.read_paused = False
            self.transport.resume_reading()

    # ------------------------------------------------------------ events

    def _event(self, event: Any) -> None:
        kind = type(event)
        if kind is h2.events.RequestReceived:
            self._request(event)
        elif kind is h2.events.DataReceived:
            self._data(event)
        elif kind is h2.events.StreamEnded:
            stream = self.streams.get(event.stream_id)
            if stream is not None:
                stream.request_done = True
                if stream.exchange is not None:
                    stream.exchange.request_end()
        elif kind is h2.events.WindowUpdated:
            self.junk += 1
            self._window_opened(event.stream_id)
        elif kind is h2.events.StreamReset:
            stream = self.streams.pop(event.stream_id, None)
            if stream is not None:
                if not stream.ended:
                    self.premature += 1
                self._abandon(stream)
        elif kind is h2.events.TrailersReceived:
            try:
                check_trailers(event.headers)
            except Malformed:
                self._goaway_now(ErrorCodes.PROTOCOL_ERROR, "protocol_error")
                return
            stream = self.streams.get(event.stream_id)
            if stream is not None and stream.exchange is not None:
                stream.exchange.request_trailers(event.headers)
        elif kind is h2.events.RemoteSettingsChanged:
            self.junk += 1
            if h2.settings.SettingCodes.INITIAL_WINDOW_SIZE in event.changed_settings:
                self._window_opened(0)
        elif kind is h2.events.ConnectionTerminated:
            self._close()
        else:
            # PING, PRIORITY, SETTINGS acks, unknown frames: counted.
            self.junk += 1

    def _request(self, event: Any) -> None:
        stream_id = event.stream_id
        self.opened += 1
        self.useful += 1
        self.last_stream = stream_id
        STATS.streams["h2" if self.secure else "h2c"] += 1
        if self._timer_kind == _T_IDLE:
            self._timer_kind = _T_NONE
        stream = Stream(self, stream_id)
        self.streams[stream_id] = stream
        end_stream = event.stream_ended is not None
        if self.goaway_sent:
            stream.reset(ErrorCodes.REFUSED_STREAM)
            return
        try:
            request = read_request(event.headers, end_stream)
        except Malformed:
            self._goaway_now(ErrorCodes.PROTOCOL_ERROR, "protocol_error")
            return
        except BadRequest as exc:
            self._local_error(stream, exc.status, exc.reason, grpc=False)
            return
        stream.method = request.method
        stream.grpc = request.grpc
        stream.request_done = end_stream
        self.start_exchange(self, stream, request, end_stream)

    def _data(self, event: Any) -> None:
        stream = self.streams.get(event.stream_id)
        size = event.flow_controlled_length
        if event.data:
            self.useful += 1
        elif event.stream_ended is None:
            self.junk += 1  # an empty DATA frame that ends nothing
        if stream is None or stream.exchange is None or stream.closed:
            if size:
                self._ack(None, size, event.stream_id)
            return
        stream.exchange.request_data(event.data)
        if stream.upload_paused:
            stream.ack_held += size
        elif size:
            self._ack(stream, size)

    def _ack(self, stream: Stream | None, size: int, stream_id: int = 0) -> None:
        with contextlib.suppress(h2.exceptions.StreamClosedError, h2.exceptions.ProtocolError):
            self.h2.acknowledge_received_data(size, stream.id if stream else stream_id)
        if stream is not None:
            self._flush_out()

    def _window_opened(self, stream_id: int) -> None:
        if stream_id:
            stream = self.streams.get(stream_id)
            if stream is not None and stream.held:
                stream._flush()
            return
        for stream in list(self.blocked):
            stream._flush()

    def _check_floods(self) -> None:
        limits = self.limits
        if self.junk > limits.control_frames + 2 * self.useful:
            self._goaway_now(ErrorCodes.ENHANCE_YOUR_CALM, "control_flood")
        elif self.premature > limits.premature_resets and self.premature * 2 > self.opened:
            self._goaway_now(ErrorCodes.ENHANCE_YOUR_CALM, "rapid_reset")

    # ------------------------------------------------------------ what streams call

    def _send_headers(self, stream: Stream, headers: list[tuple[bytes, bytes]], end: bool) -> None:
        try:
            self.h2.send_headers(stream.id, headers, end_stream=end)
        except (h2.exceptions.StreamClosedError, h2.exceptions.ProtocolError):
            self._forget(stream)
            return
        if end:
            self._forget(stream)
        self._flush_out()

    def _send_data(self, stream: Stream, data: bytes, end: bool = False) -> bytes:
        """Send what the windows allow; return the rest. `end`: the last bytes of
        the response: when all of them fit, END_STREAM is set on the last frame
        (one frame fewer than DATA and an empty DATA to end)."""
        h2conn = self.h2
        try:
            window = h2conn.local_flow_control_window(stream.id)
        except (h2.exceptions.StreamClosedError, h2.exceptions.ProtocolError):
            self._forget(stream)
            return b""
        if window <= 0:
            return data
        frame = h2conn.max_outbound_frame_size
        take = min(window, len(data))
        last = end and take == len(data)
        if take <= frame:
            h2conn.send_data(stream.id, data if take == len(data) else data[:take], end_stream=last)
            self.useful += 1
        else:
            view = memoryview(data)
            pos = 0
            while pos < take:
                stop = min(pos + frame, take)
                h2conn.send_data(
                    stream.id, view[pos:stop].tobytes(), end_stream=last and stop == take
                )
                self.useful += 1
                pos = stop
        self.server.metrics.bytes_out += take
        if last:
            self._forget(stream)
        self._flush_out()
        return data[take:] if take < len(data) else b""

    def _end(self, stream: Stream) -> None:
        try:
            if stream.trailers:
                self.h2.send_headers(stream.id, stream.trailers, end_stream=True)
            else:
                self.h2.end_stream(stream.id)
        except (h2.exceptions.StreamClosedError, h2.exceptions.ProtocolError):
            pass
        self._forget(stream)
        self._flush_out()

    def _reset(self, stream: Stream, code: int) -> None:
        with contextlib.suppress(h2.exceptions.StreamClosedError, h2.exceptions.ProtocolError):
            self.h2.reset_stream(stream.id, code)
        self._forget(stream)
        self._flush_out()

    def _forget(self, stream: Stream) -> None:
        """The stream's answer is complete (or it was reset): drop it."""
        stream._drop()
        self.streams.pop(stream.id, None)
        if not self.streams:
            if self.goaway_sent:
                self._close()
            else:
                self._arm_idle(self.server.defaults.keep_alive_timeout)

    def _abandon(self, stream: Stream) -> None:
        """The client went or reset the stream: end its exchange."""
        stream._drop()
        exchange = stream.exchange
        stream.exchange = None
        if exchange is not None:
            exchange.abandon()
        if not self.streams and not self.closed:
            if self.goaway_sent:
                self._close()
            else:
                self._arm_idle(self.server.defaults.keep_alive_timeout)

    def _local_error(self, stream: Stream, status: int, reason: str, *, grpc: bool) -> None:
        """A local answer (the request broke a rule): the status, or a gRPC status."""
        self.server.metrics.refused["bad_request"] = (
            self.server.metrics.refused.get("bad_request", 0) + 1
        )
        if grpc:
            stream.respond(200, grpcstatus.trailers_only(status, reason), end=True)
            return
        body = reason.encode("ascii", "replace") + b"\n"
        stream.respond(
            status,
            [
                (b"content-type", b"text/plain; charset=utf-8"),
                (b"content-length", b"%d" % len(body)),
                (b"cache-control", b"no-store"),
                (b"x-waygate-error", reason.encode("ascii", "replace")),
            ],
        )
        stream.send(body)
        stream.finish()

    # ------------------------------------------------------------ writing, closing

    def _flush_out(self) -> None:
        """Send what h2 queued, once per loop turn: a response's HEADERS, DATA and
        end (or many streams' frames) leave in one send, not one each."""
        if not self._flush_soon:
            self._flush_soon = True
            self.loop.call_soon(self._flush_now)

    def _flush_now(self) -> None:
        self._flush_soon = False
        data = self.h2.data_to_send()
        if data and self.transport is not None and not self.closed:
            self.transport.write(data)

    def _goaway_now(self, code: int, reason: str) -> None:
        """A connection error: GOAWAY with the last stream we handled, then close."""
        STATS.refused(reason)
        log.debug("h2 connection refused", extra={"client": self.peer, "reason": reason})
        # What h2 queued for this read's frames (a flood's PING and SETTINGS
        # acknowledgements, its own GOAWAY after a protocol error) gives way to
        # our GOAWAY; only if h2 cannot build one does its queue go out.
        queued = self.h2.data_to_send()
        try:
            self.h2.close_connection(error_code=code, last_stream_id=self.last_stream)
            data = self.h2.data_to_send()
        except h2.exceptions.ProtocolError:
            data = queued
        transport = self.transport
        self.goaway_sent = True
        if transport is not None and not self.closed:
            if data:
                transport.write(data)
            self._close()

    def _close(self) -> None:
        if self.closed:
            return
        self._flush_now()  # what is queued (a last answer, a GOAWAY) goes first
        self.closed = True
        self._timer_kind = _T_NONE
        for stream in list(self.streams.values()):
            self._abandon(stream)
        self.streams.clear()
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()

    def _arm_idle(self, seconds: float) -> None:
        server = self.server
        self.idle_since = now = self.loop.time()
        self._deadline = deadline = now + seconds
        self._timer_kind = _T_IDLE
        if deadline <= server.soon_until:
            server.soon.append(self)

    def client_identity(self, route: Any) -> tuple[int, str] | bytes:
        """An auth-proxy route's identity lines for this connection's certificate
        (cached per route: a connection's certificate never changes)."""
        if self._identity_route is route:
            return self._identity
        checked = self.server.edge.client_identity(
            self.transport.get_extra_info("ssl_object"),  # type: ignore[union-attr]
            route,
        )
        self._identity_route = route
        self._identity = checked
        return checked  # type: ignore[no-any-return]

    def arm_stream(self, deadline: float) -> None:
        """A stream's exchange has a deadline: the ticker calls us by the earliest."""
        if self._timer_kind == _T_STREAMS and self._deadline <= deadline:
            return
        self._deadline = deadline
        self._timer_kind = _T_STREAMS
        server = self.server
        if deadline <= server.soon_until:
            server.soon.append(self)

    def _on_timer(self) -> None:
        """The ticker: streams' deadlines, or no stream for the idle timeout (GOAWAY, close)."""
        kind = self._timer_kind
        self._timer_kind = _T_NONE
        if self.closed:
            return
        if kind == _T_STREAMS:
            now = self.loop.time()
            for stream in list(self.streams.values()):
                driver = stream.exchange
                deadline = getattr(driver, "deadline", 0.0)
                if deadline and deadline <= now:
                    driver.on_timer(now)
            following = [
                d for s in self.streams.values() if (d := getattr(s.exchange, "deadline", 0.0))
            ]
            if following:
                self.arm_stream(min(following))
            elif not self.streams:
                self._arm_idle(self.server.defaults.keep_alive_timeout)
            return
        if self.streams:
            return
        with contextlib.suppress(h2.exceptions.ProtocolError):
            self.h2.close_connection(
                error_code=ErrorCodes.NO_ERROR, last_stream_id=self.last_stream
            )
        self._flush_out()
        self._close()

    # ------------------------------------------------------------ the server's calls

    def idle(self) -> bool:
        """Whether closing this connection loses nothing: no stream open. (A
        request whose header block is still arriving has no stream yet: the
        GOAWAY's last stream id tells its client it was not processed, so it
        may be sent again, RFC 9113 section 6.8.)"""
        return not self.streams and not self.closed and self.transport is not None

    def evict(self) -> None:
        """Closed to make room (the oldest idle connections under the connection
        bounds): GOAWAY NO_ERROR with the last stream id seen, then closed."""
        if self.closed:
            return
        if not self.goaway_sent:
            self.goaway_sent = True
            with contextlib.suppress(h2.exceptions.ProtocolError):
                self.h2.close_connection(
                    error_code=ErrorCodes.NO_ERROR, last_stream_id=self.last_stream
                )
        self._close()

    def drain(self) -> None:
        """SIGTERM: GOAWAY (NO_ERROR, the last stream id seen); close once idle."""
        if self.closed or self.goaway_sent:
            return
        self.goaway_sent = True
        with contextlib.suppress(h2.exceptions.ProtocolError):
            self.h2.close_connection(
                error_code=ErrorCodes.NO_ERROR, last_stream_id=self.last_stream
            )
        self._flush_out()
        if not self.streams:
            self._close()

    def abort(self) -> None:
        self.closed = True
        for stream in list(self.streams.values()):
            self._abandon(stream)
        self.streams.clear()
        if self.transport is not None:
            self.transport.abort()
