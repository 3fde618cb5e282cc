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
- flood budgets, counted frame by frame as h2 parses them
  (`h2compat.GuardedFrameBuffer`: a read of thousands of frames stops at the
  one past the budget): overhead frames (PING, SETTINGS, PRIORITY,
  WINDOW_UPDATE, RST_STREAM, unknown types, and empty DATA not ending its
  stream) beyond `control_frames`, plus twice the useful frames (HEADERS, DATA
  of at least `min_data_payload`, DATA sent), plus `control_frame_rate` per
  second of the connection's life, end the connection with GOAWAY
  ENHANCE_YOUR_CALM; so do streams the client resets before their answer
  (rapid reset, CVE-2023-44487) once they pass `premature_resets` and half of
  the streams opened. The WINDOW_UPDATEs a read's DATA frames earn are given
  once per stream per read.
- small DATA frames (some payload, less than `min_data_payload`, not ending
  their stream: a gRPC stream of small messages, or an attacker's 1-byte
  frames) are fair, not fatal: each connection has its own bucket of them
  (`FrameBucket`: `small_data_rate` a second, `small_data_burst` saved), charged
  once per read; a connection past it stops being read (`pause_reading`) until
  its bucket is refilled, a timer resuming it. What was read is processed
  whole, so a flood costs the proxy at most the rate plus one read per pause,
  and its own connection waits for it, not the others.
- response bytes held for a client that does not take them (its window shut,
  or its socket backed up whatever its window says: `pause_writing`):
  `stream_buffer` per stream, `connection_buffer` for all of a connection's
  streams, past which the sources (the upstreams) are paused, every stream's
  at once when the connection's socket backs up; and `held_total` for the
  whole process, past which a stream that would hold more is reset
  (ENHANCE_YOUR_CALM). A client that never reads holds at most that much
  until the exchanges' server timeout ends them. The HPACK tables are bounded
  too (`hpackcache`: the encoder's at 4 KiB whatever the client advertises).
  Request bytes are acknowledged (WINDOW_UPDATE) only once handed to the
  upstream: a slow upstream closes the client's window instead of growing a
  buffer.
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

import h2.connection
import h2.events
import h2.exceptions
import h2.settings
from h2.errors import ErrorCodes
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from waygate.core import flow, httpheaders
from waygate.proxy import grpcstatus, h2compat, http1
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
    # Control frames allowed beyond twice the useful frames (see module doc): each
    # costs the proxy about 7 us, so a connection's free allowance is its cost to
    # an attacker who opens connection after connection (1,000: 7 ms each).
    control_frames: int = 200
    # ... and beyond that, this many per second of the connection's life (a
    # long-lived connection's keep-alive PINGs, a slow stream of small messages).
    control_frame_rate: int = 100
    # Streams reset by the client before their answer, beyond which (and past
    # half of the streams opened) the connection is refused more work.
    premature_resets: int = 100
    # Response bytes held per stream while the client's window is shut.
    stream_buffer: int = 256 * 1024
    # Response bytes held for all of one connection's streams (its window shut or
    # its socket backed up): past it every stream's source is paused.
    connection_buffer: int = 1024 * 1024
    # Response bytes held for every HTTP/2 client of the process together: a
    # stream whose hold would pass it is reset (ENHANCE_YOUR_CALM).
    held_total: int = 64 * 1024 * 1024
    # A DATA frame that does not end its stream and carries some payload but less
    # than this is a small one (an empty one is a control frame).
    min_data_payload: int = 256
    # Small DATA frames a connection may send a second, and save up (a fresh
    # connection's bucket is full); past them its reads wait for the bucket.
    small_data_rate: int = 5000
    small_data_burst: int = 5000


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
            # The HTTP/1.1 rule book's (no leading zeros, at most 18 digits).
            if content_length >= 0 or (content_length := http1.content_length(value)) < 0:
                raise BadRequest("malformed or repeated content-length (RFC 9110 section 8.6)")
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
    if scheme != b"https" and scheme != b"http":
        # What an HTTP/1.1 request cannot name either (origin-form targets only).
        raise BadRequest(":scheme other than http or https (RFC 9113 section 8.3.1)")
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


def h2_connection(limits: H2Limits, *, client_side: bool) -> h2.connection.H2Connection:
    """An h2 state machine with the proxy's settings (`h2compat.connection`).

    A listener's connection (`client_side` False) counts its peer's frames
    against the flood budget as they are parsed (`h2compat.GuardedFrameBuffer`);
    towards backends the header block is bounded only."""
    if client_side:
        buffer: h2compat.BoundedFrameBuffer = h2compat.BoundedFrameBuffer(server=False)
    else:
        guarded = h2compat.GuardedFrameBuffer(server=True)
        guarded.budget = limits.control_frames
        guarded.refill = limits.control_frame_rate
        guarded.min_payload = max(1, limits.min_data_payload)
        buffer = guarded
    buffer.max_header_block = limits.max_header_list_size + 1024
    return h2compat.connection(
        client_side=client_side,
        max_concurrent_streams=limits.max_concurrent_streams,
        stream_window=limits.stream_window,
        connection_window=limits.connection_window,
        max_header_list_size=limits.max_header_list_size,
        frame_buffer=buffer,
    )


class FrameBucket:
    """A connection's bucket of small DATA frames (sans-IO: times are given).

    It holds at most `burst` frames, starts full and refills at `rate` a
    second. `charge(frames, now)` takes a read's frames, into debt if need be,
    and says how long the connection must not be read for the bucket to be
    back at zero (0.0: read on). Charged once per read, not per frame."""

    __slots__ = ("burst", "level", "rate", "stamp")

    def __init__(self, rate: float, burst: float, now: float) -> None:
        self.rate = float(rate)
        self.burst = float(burst)
        self.level = self.burst
        self.stamp = now

    def charge(self, frames: int, now: float) -> float:
        level = self.level + (now - self.stamp) * self.rate
        if level > self.burst:
            level = self.burst
        level -= frames
        self.level = level
        self.stamp = now
        return 0.0 if level >= 0 else -level / self.rate


class H2Stats:
    """Counters of the HTTP/2 listeners (exported by `H2Collector`, read by the
    attack tests). Plain attributes: a stream costs an integer add."""

    def __init__(self) -> None:
        self.connections = {"h2": 0, "h2c": 0}  # opened, by protocol
        self.streams = {"h2": 0, "h2c": 0}  # request streams opened, by protocol
        self.goaway: dict[str, int] = {}  # connections ended by the proxy, by reason
        self.held_bytes = 0  # response bytes held for clients not taking them, now
        self.held_refused = 0  # streams reset at the process's bound on held bytes
        self.small_data = 0  # small DATA frames taken from clients (FrameBucket)
        self.small_data_pauses = 0  # reads paused for a connection's small DATA frames

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
            "response bytes held now for HTTP/2 clients whose window is shut "
            "or whose socket is backed up",
            value=STATS.held_bytes,
        )
        yield CounterMetricFamily(
            "waygate_proxy_h2_held_refused",
            "HTTP/2 streams reset because the process held its bound of response bytes "
            "for clients not taking them (--h2-held-total)",
            value=STATS.held_refused,
        )
        yield CounterMetricFamily(
            "waygate_proxy_h2_small_data_frames",
            "small DATA frames taken from HTTP/2 clients (payload below --h2-min-data-payload, "
            "not ending their stream), charged to each connection's read rate",
            value=STATS.small_data,
        )
        yield CounterMetricFamily(
            "waygate_proxy_h2_small_data_pauses",
            "times an HTTP/2 client connection's reads were paused because it sent small "
            "DATA frames faster than --h2-small-data-rate (past --h2-small-data-burst)",
            value=STATS.small_data_pauses,
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
        conn = self.conn
        if self.held or conn.write_paused:
            self._hold(data)
            return
        rest = conn._send_data(self, data, end)
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
        """Keep response bytes the client cannot take now (its window is shut or
        its socket backed up), within the stream's, the connection's and the
        process's bounds (see H2Limits)."""
        conn = self.conn
        limits = conn.limits
        size = len(data)
        if STATS.held_bytes + size > limits.held_total:
            # Every client together holds the process's bound: this stream is
            # refused, its exchange ended on the next turn (not inside its own call).
            STATS.held_refused += 1
            conn._reset(self, ErrorCodes.ENHANCE_YOUR_CALM)
            conn.loop.call_soon(conn._abandon, self)
            return
        self.held.append(data)
        self.held_size += size
        conn.held += size
        STATS.held_bytes += size
        conn.blocked.add(self)
        if conn.held > limits.connection_buffer:
            conn._pause_sources()
        elif self.held_size > limits.stream_buffer and not self.source_paused:
            self._pause_source()

    def _pause_source(self) -> None:
        self.source_paused = True
        exchange = self.exchange
        if exchange is not None:
            exchange.pause_source(True)

    def _resume_source(self) -> None:
        """Resume the source once the stream is below low water (and its connection
        does not hold every source paused)."""
        if self.held_size < LOW_WATER and not self.conn.sources_paused:
            self.source_paused = False
            exchange = self.exchange
            if exchange is not None:
                exchange.pause_source(False)

    def _flush(self) -> None:
        """The client's window opened (or its socket drained): send what is held;
        resume the source below low water."""
        conn = self.conn
        while self.held and not conn.write_paused:
            data = self.held[0]
            # The response's last bytes carry its END_STREAM (unless trailers follow).
            last = self.ended and len(self.held) == 1 and not self.trailers
            rest = conn._send_data(self, data, last)
            sent = len(data) - len(rest)
            if self.closed:
                return  # they did (or the stream went): _drop freed what it held
            self.held_size -= sent
            conn.held -= sent
            STATS.held_bytes -= sent
            if rest:
                self.held[0] = rest
                break
            self.held.pop(0)
        if not self.held:
            conn.blocked.discard(self)
            if self.ended:
                conn._end(self)
        if conn.sources_paused:
            conn._maybe_resume_sources()
        elif self.source_paused:
            self._resume_source()

    def _drop(self) -> None:
        """The stream is gone: free what it holds."""
        self.closed = True
        conn = self.conn
        STATS.held_bytes -= self.held_size
        conn.held -= self.held_size
        self.held = []
        self.held_size = 0
        conn.blocked.discard(self)
        if conn.sources_paused and not conn.closed:
            conn._maybe_resume_sources()  # what it held may have been the connection's budget


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
        # The peer's frames, counted against the flood budget as they are parsed.
        self.frames: h2compat.GuardedFrameBuffer = self.h2.incoming_buffer  # type: ignore[assignment]
        self.held = 0  # response bytes its streams hold (Stream._hold)
        self.sources_paused = False  # every stream's source, by the connection (_pause_sources)
        self.acks: dict[int, int] = {}  # stream id -> request bytes to acknowledge after a read
        self.closed = False
        self.goaway_sent = False
        self.last_stream = 0
        self.write_paused = False
        self.read_paused = False  # by either of: write_paused, small_data_wait
        # Small DATA frames charged to this connection's reads, and the timer that
        # resumes them once its bucket is refilled (None: not waiting).
        self.small_data_bucket = FrameBucket(
            limits.small_data_rate, limits.small_data_burst, self.loop.time()
        )
        self.small_data_wait: asyncio.TimerHandle | None = None
        self.opened = 0
        self.premature = 0
        self.peer = "unknown"
        self.client_key = b"unknown"
        self.context: http1.ForwardedContext | None = None
        # The PROXY protocol header's addresses (waygate.proxy.accept), set before
        # connection_made: the client address is the header's. None: the peer's.
        self.proxied: Any = None
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
        port = server.https_port if self.secure else server.listen_port
        context = http1.client_context(transport, self.proxied, port, bool(self.secure))
        self.peer = context.client_ip.decode("ascii", "replace")
        self.client_key = context.client_ip
        # Counted like an HTTP/1.1 connection (total and per-source caps; at a cap
        # idle HTTP/1.1 keep-alive connections make room first); its streams are
        # exchanges, not connections.
        if server.admit(self):
            self.closed = True
            transport.abort()
            return
        STATS.connections["h2" if self.secure else "h2c"] += 1
        self.context = context
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
        except h2compat.FloodError as exc:
            self._goaway_now(exc.error_code, "control_flood")
            return
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
            # Per event, not per read (control frames are counted per frame,
            # as they are parsed: h2compat.GuardedFrameBuffer).
            if self.premature > self.limits.premature_resets:
                self._check_floods()
                if self.closed:
                    return
        if self.frames.small:
            self._charge_small_data()
        if self.acks:
            self._ack_read()
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
        self._cancel_small_data_wait()
        for stream in list(self.streams.values()):
            self._abandon(stream)
        self.streams.clear()
        self.server.connection_closed(self)

    def pause_writing(self) -> None:
        # Our writes back up, whatever the client's windows say: read no more
        # frames until the client reads (a PING or SETTINGS flood from a client
        # that never reads grows nothing here), and hold what the streams'
        # sources send next (Stream.send) with every source paused.
        self.write_paused = True
        if self.transport is not None and not self.read_paused:
            self.read_paused = True
            self.transport.pause_reading()
        self._pause_sources()

    def resume_writing(self) -> None:
        self.write_paused = False
        if self.closed:
            return
        if self.transport is not None and self.read_paused and self.small_data_wait is None:
            self.read_paused = False
            self.transport.resume_reading()
        for stream in list(self.blocked):
            stream._flush()
            if self.write_paused or self.closed:
                return
        self._maybe_resume_sources()

    def _charge_small_data(self) -> None:
        """The read's small DATA frames, charged to this connection's bucket: past
        it, no more reads until the bucket is back at zero (what was read is done)."""
        frames = self.frames.small
        self.frames.small = 0
        STATS.small_data += frames
        wait = self.small_data_bucket.charge(frames, self.loop.time())
        if not wait:
            return
        STATS.small_data_pauses += 1
        if self.small_data_wait is not None:
            self.small_data_wait.cancel()  # a read delivered while pausing: wait for all
        if not self.read_paused and self.transport is not None:
            self.read_paused = True
            self.transport.pause_reading()
        self.small_data_wait = self.loop.call_later(wait, self._small_data_refilled)

    def _small_data_refilled(self) -> None:
        self.small_data_wait = None
        if self.closed or self.write_paused or not self.read_paused:
            return
        self.read_paused = False
        self.transport.resume_reading()  # type: ignore[union-attr]

    def _cancel_small_data_wait(self) -> None:
        if self.small_data_wait is not None:
            self.small_data_wait.cancel()
            self.small_data_wait = None

    def _pause_sources(self) -> None:
        """The connection holds its budget or cannot write: every stream's source
        waits until the socket drains and it holds half its budget or less."""
        self.sources_paused = True
        for stream in list(self.streams.values()):
            if not stream.source_paused and not stream.closed:
                stream._pause_source()

    def _maybe_resume_sources(self) -> None:
        if (
            self.sources_paused
            and not self.write_paused
            and self.held <= self.limits.connection_buffer // 2
        ):
            self.sources_paused = False
            for stream in list(self.streams.values()):
                if stream.source_paused and not stream.closed:
                    stream._resume_source()

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
            if h2.settings.SettingCodes.INITIAL_WINDOW_SIZE in event.changed_settings:
                self._window_opened(0)
        elif kind is h2.events.ConnectionTerminated:
            self._close()
        # PING, PRIORITY, SETTINGS acks, unknown frames: nothing to do (their
        # frames were counted as they were parsed).

    def _request(self, event: Any) -> None:
        stream_id = event.stream_id
        self.opened += 1
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
        if stream is None or stream.exchange is None or stream.closed:
            if size:
                acks = self.acks
                acks[event.stream_id] = acks.get(event.stream_id, 0) + size
            return
        stream.exchange.request_data(event.data)
        if stream.upload_paused:
            stream.ack_held += size
        elif size:
            # Acknowledged once per stream per read, after its frames (data_received).
            acks = self.acks
            acks[stream.id] = acks.get(stream.id, 0) + size

    def _ack_read(self) -> None:
        """The WINDOW_UPDATEs the read's DATA frames earned: one h2 call per stream."""
        acknowledge = self.h2.acknowledge_received_data
        for stream_id, size in self.acks.items():
            with contextlib.suppress(h2.exceptions.StreamClosedError, h2.exceptions.ProtocolError):
                acknowledge(size, stream_id)
        self.acks.clear()

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
        if self.premature > self.limits.premature_resets and self.premature * 2 > self.opened:
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
            self.frames.useful += 1
        else:
            view = memoryview(data)
            pos = 0
            while pos < take:
                stop = min(pos + frame, take)
                h2conn.send_data(
                    stream.id, view[pos:stop].tobytes(), end_stream=last and stop == take
                )
                self.frames.useful += 1
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
        self._cancel_small_data_wait()
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
