"""Every use the proxy makes of h2's and hpack's private parts, in one place.

h2 (python-hyper) and hpack are the proxy's HTTP/2 state machine and header
coding; a few of the proxy's rules and most of its HTTP/2 speed need hooks
those libraries do not offer publicly. Each hook is here, named, and checked
by `tests/unit/proxy/test_h2compat.py` against the installed h2 and hpack (a
release that renames or reshapes what a hook touches fails that test, not a
request in production); pyproject.toml pins h2 and hpack to the versions those
tests pass on.

The hooks:
- `GracefulStateMachine`: h2's connection transition table
  (`H2ConnectionStateMachine._transitions`), with GOAWAY leaving an open
  connection open for the streams it covers.
- `BoundedFrameBuffer`: h2's frame buffer (`_update_header_buffer`, called once
  per frame, and `_headers_buffer`), with the header block bounded in bytes;
  `GuardedFrameBuffer` adds the listeners' per-frame flood budget there.
- the inbound connection window manager
  (`H2Connection._inbound_flow_control_window_manager.max_window_size`), sized
  for the connection window the proxy advertises.
- the process-wide `hpack.hpack.log` and `h2.connection.repr`, replaced by
  no-ops (`silence`): hpack's debug calls and h2's per-frame repr cost about 6%
  of the CPU per request, for lines nobody writes.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import h2.config
import h2.connection
import h2.exceptions
import h2.frame_buffer
import h2.settings
import hpack.hpack

from waygate.proxy import hpackcache

# Frame type numbers (RFC 9113 section 6) the flood budget tells apart.
_DATA = 0x0
_HEADERS = 0x1
_CONTINUATION = 0x9


class FloodError(h2.exceptions.DenialOfServiceError):
    """The peer sent more control frames (or empty DATA frames) than its budget."""


class BoundedFrameBuffer(h2.frame_buffer.FrameBuffer):
    """h2's frame buffer with the header block bounded in bytes, not only in
    CONTINUATION frames (h2 holds up to 64 of 16 KiB each before decoding)."""

    max_header_block = 64 * 1024

    def _update_header_buffer(self, f: Any) -> Any:
        result = super()._update_header_buffer(f)
        if self._headers_buffer:
            held = sum(len(frame.data) for frame in self._headers_buffer)
            if held > self.max_header_block:
                raise h2.exceptions.DenialOfServiceError("header block too large")
        return result


class GuardedFrameBuffer(BoundedFrameBuffer):
    """The listeners' frame buffer: every frame is counted as it is parsed, before
    h2 acts on it, and the read stops at the frame that passes the budget.

    Overhead frames (`junk`): SETTINGS, PING, PRIORITY, WINDOW_UPDATE,
    RST_STREAM, GOAWAY, unknown types, and an empty DATA frame that does not end
    its stream (padding is no payload; Envoy's
    max_inbound_frames_with_empty_payload). Useful ones (`useful`): HEADERS,
    DATA of at least `min_payload`, and (counted by the connection) every DATA
    frame it sends. More than `budget + 2 * useful` overhead frames, plus
    `refill` for every second the connection has lived, raise `FloodError`: a
    read of 29,000 SETTINGS frames costs the parsing of `budget` of them, not
    all, while a long-lived connection's keep-alive PINGs are never cut off.
    CONTINUATION frames are the header block's, bounded in bytes above.

    Small DATA frames (`small`): some payload, less than `min_payload`, not
    ending their stream. Legitimate (a gRPC stream of small messages) but a
    cost per frame: counted here only, an integer add; the connection charges
    them to its own read rate once the read is parsed (`http2.FrameBucket`),
    slowing its reads, never ending it."""

    budget = 200
    refill = 100.0
    min_payload = 1
    junk = 0
    useful = 0
    small = 0

    def __init__(self, server: bool = False) -> None:
        super().__init__(server=server)
        self.born = time.monotonic()

    def _update_header_buffer(self, f: Any) -> Any:
        kind = f.type
        if kind == _DATA:
            size = len(f.data)
            if size >= self.min_payload:
                self.useful += 1
            elif "END_STREAM" not in f.flags:
                if size:
                    self.small += 1
                else:
                    self.junk += 1
                    if self.junk > self.budget + 2 * self.useful:
                        self._over_budget()
        elif kind == _HEADERS:
            self.useful += 1
        elif kind != _CONTINUATION:
            self.junk += 1
            if self.junk > self.budget + 2 * self.useful:
                self._over_budget()
        return super()._update_header_buffer(f)

    def _over_budget(self) -> None:
        """Past the count: what the connection's age allows beyond it, else FloodError."""
        allowed = self.budget + 2 * self.useful + (time.monotonic() - self.born) * self.refill
        if self.junk > allowed:
            raise FloodError("overhead frames past the budget")


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


SILENT = _Silent()
_silenced = False


def silence() -> None:
    """hpack's debug calls cost nothing, unless someone asked for hpack's debug
    lines (checked once, at the first connection: logging is configured by then).

    And h2's `repr(frame)` of every frame received, the argument of a trace line
    its configuration's logger drops (ours is `SILENT`), is `id` instead: a
    frame's repr formats its flags and body, about 3% of the CPU per request.
    `repr` is looked up in h2.connection's globals, where that trace line is its
    only use; every H2Connection in the proxy's process is built by `connection`."""
    global _silenced
    _silenced = True
    if not logging.getLogger(hpack.hpack.__name__).isEnabledFor(logging.DEBUG):
        hpack.hpack.log = SILENT  # type: ignore[assignment]
    h2.connection.repr = id  # type: ignore[attr-defined]


def connection(
    *,
    client_side: bool,
    max_concurrent_streams: int,
    stream_window: int,
    connection_window: int,
    max_header_list_size: int,
    frame_buffer: BoundedFrameBuffer,
) -> h2.connection.H2Connection:
    """An h2 state machine with the proxy's settings and hooks.

    On the listeners' side (`client_side` False) h2's inbound header checks and
    cookie joining are off: `http2.read_request` and `http2.check_trailers` keep
    the same RFC 9113 rules in one pass over the fields (h2's are a chain of
    seven generators per field, about a tenth of the proxy's CPU per request),
    and the HTTP/1.1 rule book checks the head after them. Towards backends
    (`client_side` True) h2 checks the responses itself."""
    if not _silenced:
        silence()
    config = h2.config.H2Configuration(
        client_side=client_side,
        header_encoding=None,
        logger=SILENT,  # type: ignore[arg-type]
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
            codes.MAX_CONCURRENT_STREAMS: max_concurrent_streams,
            codes.INITIAL_WINDOW_SIZE: stream_window,
            codes.MAX_HEADER_LIST_SIZE: max_header_list_size,
            codes.ENABLE_PUSH: 0,
        },
    )
    conn.decoder.max_header_list_size = max_header_list_size
    conn.incoming_buffer = frame_buffer
    # The window manager was built for the default 65,535: ours hands out the
    # connection window as h2 acknowledges data.
    conn._inbound_flow_control_window_manager.max_window_size = connection_window
    return conn
