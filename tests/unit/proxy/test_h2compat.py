"""Each hook of `waygate.proxy.h2compat` against the installed h2 and hpack.

Every test checks two things: that what the hook patches still exists in the
shape it patches (a release that renames or reshapes it fails here, not in a
request), and that the hook still has its effect through h2's public calls.
pyproject.toml pins h2 and hpack to the versions these tests pass on.
"""

from __future__ import annotations

import logging

import h2.config
import h2.connection
import h2.events
import h2.exceptions
import h2.frame_buffer
import h2.windows
import hpack
import hpack.hpack
import pytest
from hyperframe.frame import (
    ContinuationFrame,
    DataFrame,
    HeadersFrame,
    PingFrame,
    SettingsFrame,
    WindowUpdateFrame,
)

from waygate.proxy import h2compat, hpackcache, http2
from waygate.proxy.http2 import H2Limits

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
REQUEST = [(b":method", b"POST"), (b":scheme", b"http"), (b":authority", b"a"), (b":path", b"/")]


def _listener(limits: H2Limits | None = None) -> h2.connection.H2Connection:
    conn = http2.h2_connection(limits or H2Limits(), client_side=False)
    conn.initiate_connection()
    conn.receive_data(PREFACE + SettingsFrame(0).serialize())
    conn.data_to_send()
    return conn


def _frames(data: bytes) -> list[tuple[int, int]]:
    """(type, stream id) of each frame in `data`."""
    out = []
    while len(data) >= 9:
        length = int.from_bytes(data[:3], "big")
        out.append((data[3], int.from_bytes(data[5:9], "big") & 0x7FFFFFFF))
        data = data[9 + length :]
    return out


def _headers(stream_id: int, *, end_stream: bool = False) -> bytes:
    """A request's HEADERS frame (END_HEADERS; a body follows unless `end_stream`)."""
    frame = HeadersFrame(stream_id, data=hpack.Encoder().encode(REQUEST))
    frame.flags.add("END_HEADERS")
    if end_stream:
        frame.flags.add("END_STREAM")
    return bytes(frame.serialize())


# ---------------------------------------------------------------- GracefulStateMachine


def test_transitions_table_still_closes_on_goaway_and_ours_keeps_open():
    # What the hook overrides: h2's class-level table, keyed (state, input), where
    # GOAWAY from an open connection leads to CLOSED.
    table = h2.connection.H2ConnectionStateMachine._transitions
    states = h2.connection.ConnectionState
    inputs = h2.connection.ConnectionInputs
    for state in (states.CLIENT_OPEN, states.SERVER_OPEN):
        for goaway in (inputs.SEND_GOAWAY, inputs.RECV_GOAWAY):
            assert table[(state, goaway)][1] is states.CLOSED
            assert h2compat.GracefulStateMachine._transitions[(state, goaway)] == (None, state)
    # And h2's process_input reads it from the instance's class.
    assert "_transitions" in h2.connection.H2ConnectionStateMachine.process_input.__code__.co_names


def test_graceful_goaway_lets_streams_in_flight_finish():
    conn = _listener()
    events = conn.receive_data(_headers(1, end_stream=True))
    assert any(isinstance(e, h2.events.RequestReceived) for e in events)
    conn.close_connection(last_stream_id=1)  # a drain: GOAWAY NO_ERROR
    conn.send_headers(1, [(b":status", b"200")])
    conn.send_data(1, b"still answered", end_stream=True)
    kinds = [kind for kind, _ in _frames(conn.data_to_send())]
    assert kinds[-3:] == [0x7, 0x1, 0x0]  # GOAWAY, then HEADERS and DATA
    plain = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False))
    plain.initiate_connection()
    plain.receive_data(PREFACE + SettingsFrame(0).serialize())
    plain.receive_data(_headers(1))
    plain.close_connection(last_stream_id=1)
    with pytest.raises(h2.exceptions.ProtocolError):  # what the hook exists for
        plain.send_headers(1, [(b":status", b"200")])


# ---------------------------------------------------------------- frame buffers


def test_frame_buffer_still_passes_every_frame_through_update_header_buffer():
    assert hasattr(h2.frame_buffer.FrameBuffer, "_update_header_buffer")
    assert "_update_header_buffer" in h2.frame_buffer.FrameBuffer.__next__.__code__.co_names
    assert "_headers_buffer" in h2.frame_buffer.FrameBuffer(server=True).__dict__
    # receive_data iterates its incoming_buffer, the attribute the hook replaces.
    assert "incoming_buffer" in h2.connection.H2Connection.receive_data.__code__.co_names


def test_header_block_is_bounded_in_bytes():
    conn = _listener(H2Limits(max_header_list_size=4096))
    start = HeadersFrame(1, data=hpack.Encoder().encode(REQUEST))  # no END_HEADERS
    pieces = b"".join(ContinuationFrame(1, data=b"\x00" * 3000).serialize() for _ in range(3))
    with pytest.raises(h2.exceptions.DenialOfServiceError):
        conn.receive_data(start.serialize() + pieces)


def test_control_frames_are_counted_frame_by_frame_as_they_are_parsed():
    limits = H2Limits(control_frames=50)
    conn = _listener(limits)
    buffer = conn.incoming_buffer
    assert isinstance(buffer, h2compat.GuardedFrameBuffer)
    before = buffer.junk  # the client's SETTINGS
    assert before == 1
    flood = PingFrame(0, opaque_data=b"12345678").serialize() * 5000
    with pytest.raises(h2compat.FloodError):
        conn.receive_data(flood)
    # Parsing stopped at the frame past the budget: the rest was never parsed.
    assert buffer.junk == limits.control_frames + 1
    parsed = limits.control_frames + 1 - before
    assert len(buffer._data) == (5000 - parsed) * 17
    acks = [kind for kind, _ in _frames(conn.data_to_send()) if kind == 0x6]
    assert len(acks) == parsed - 1  # the one past the budget was never acted on


def test_small_data_frames_are_counted_apart_and_empty_ones_toward_the_budget():
    # No refill with the connection's age: the budget's arithmetic alone, whatever
    # the time the test takes on a loaded machine.
    limits = H2Limits(
        control_frames=20, min_data_payload=100, stream_window=2**20, control_frame_rate=0
    )
    conn = _listener(limits)
    buffer = conn.incoming_buffer
    assert buffer.junk == 1  # the client's SETTINGS
    conn.receive_data(_headers(1))
    assert buffer.useful == 1
    conn.receive_data(DataFrame(1, data=b"x" * 100).serialize() * 5)
    assert (buffer.useful, buffer.junk, buffer.small) == (6, 1, 0)
    conn.receive_data(DataFrame(1, data=b"x" * 99, pad_length=100, flags=["PADDED"]).serialize())
    assert (buffer.junk, buffer.small) == (1, 1)  # padding is no payload
    conn.receive_data(DataFrame(1, data=b"", pad_length=100, flags=["PADDED"]).serialize())
    assert (buffer.junk, buffer.small) == (2, 1)  # an empty frame is a control frame
    conn.receive_data(DataFrame(1, data=b"x", flags=["END_STREAM"]).serialize())
    assert (buffer.junk, buffer.small) == (2, 1)  # a stream's last frame may be short
    conn.receive_data(WindowUpdateFrame(0, window_increment=1).serialize())
    assert buffer.junk == 3
    # Small frames never end the connection here (the connection paces them:
    # http2.FrameBucket); empty ones do, past the budget.
    conn2 = _listener(limits)
    conn2.receive_data(_headers(1))
    conn2.receive_data(DataFrame(1, data=b"x").serialize() * 1000)
    assert (conn2.incoming_buffer.small, conn2.incoming_buffer.junk) == (1000, 1)
    with pytest.raises(h2compat.FloodError):
        conn2.receive_data(DataFrame(1, data=b"").serialize() * 1000)
    # SETTINGS and 22 empty frames: past 20 + 2 * the one HEADERS.
    assert conn2.incoming_buffer.junk == limits.control_frames + 2 + 1


def test_min_data_payload_zero_makes_no_frame_small():
    conn = _listener(H2Limits(min_data_payload=0))
    conn.receive_data(_headers(1) + DataFrame(1, data=b"x").serialize() * 10)
    assert (conn.incoming_buffer.small, conn.incoming_buffer.useful) == (0, 11)


# ---------------------------------------------------------------- the inbound window manager


def test_inbound_window_manager_is_sized_for_the_connection_window():
    plain = h2.connection.H2Connection()
    manager = plain._inbound_flow_control_window_manager
    assert isinstance(manager, h2.windows.WindowManager)
    assert manager.max_window_size == 65535
    limits = H2Limits(connection_window=1 << 20, stream_window=1 << 20)
    conn = _listener(limits)
    assert conn._inbound_flow_control_window_manager.max_window_size == 1 << 20
    conn.increment_flow_control_window((1 << 20) - 65535)
    conn.data_to_send()
    conn.receive_data(_headers(1))
    # Half the connection window received and acknowledged: one WINDOW_UPDATE on 0.
    for _ in range(32):
        conn.receive_data(DataFrame(1, data=b"x" * 16384).serialize())
        conn.acknowledge_received_data(16384, 1)
    updates = [sid for kind, sid in _frames(conn.data_to_send()) if kind == 0x8]
    assert updates.count(0) == 1
    assert conn.inbound_flow_control_window == 1 << 20


# ---------------------------------------------------------------- hpack.hpack.log, h2 repr


def test_hpack_debug_calls_are_silenced_unless_asked_for(monkeypatch):
    # hpack still logs through its module's `log` global (what the hook replaces).
    assert isinstance(logging.getLogger("hpack.hpack"), logging.Logger)
    calls: list[tuple] = []

    class Recorder:
        def debug(self, *args: object) -> None:
            calls.append(args)

    monkeypatch.setattr(hpack.hpack, "log", Recorder())
    hpack.Encoder().encode([(b"a", b"b")])
    assert calls, "hpack no longer logs through hpack.hpack.log"
    # The hook: silenced unless hpack's debug lines were asked for.
    monkeypatch.setattr(hpack.hpack, "log", logging.getLogger(hpack.hpack.__name__))
    monkeypatch.delattr(h2.connection, "repr", raising=False)
    monkeypatch.setattr(h2compat, "_silenced", False)
    logger = logging.getLogger("hpack.hpack")
    level = logger.level
    try:
        logger.setLevel(logging.DEBUG)
        http2.h2_connection(H2Limits(), client_side=False)
        assert isinstance(hpack.hpack.log, logging.Logger)  # asked for: left alone
        monkeypatch.setattr(h2compat, "_silenced", False)
        logger.setLevel(logging.WARNING)
        connection = http2.h2_connection(H2Limits(), client_side=False)
    finally:
        logger.setLevel(level)
    assert hpack.hpack.log is h2compat.SILENT
    assert connection.config.logger is h2compat.SILENT
    assert hpack.hpack.log.debug("Encoding %d", 5) == ""
    assert h2.connection.repr is id  # type: ignore[attr-defined]


def test_h2_still_reprs_each_received_frame_through_its_module_global(monkeypatch):
    seen: list[object] = []

    def recording_repr(obj: object) -> str:
        seen.append(obj)
        return ""

    conn = _listener()  # silence() has run: h2.connection.repr is id
    monkeypatch.setattr(h2.connection, "repr", recording_repr, raising=False)
    conn.receive_data(PingFrame(0, opaque_data=b"12345678").serialize())
    assert any(isinstance(frame, PingFrame) for frame in seen)


# ---------------------------------------------------------------- hpack's encoder table


def test_encoder_table_stays_at_most_the_default_whatever_the_peer_advertises():
    assert isinstance(hpack.Encoder.__dict__["header_table_size"], property)
    conn = _listener()
    conn.receive_data(SettingsFrame(0, settings={0x1: 2**31}).serialize())
    assert conn.encoder.header_table_size == hpackcache.MAX_ENCODER_TABLE
    conn.receive_data(SettingsFrame(0, settings={0x1: 100}).serialize())
    assert conn.encoder.header_table_size == 100
    assert conn.encoder.table_size_changes == [100]


def test_a_connections_age_refills_its_budget(monkeypatch):
    # A long-lived connection's keep-alive PINGs are never cut off; a burst is.
    limits = H2Limits(control_frames=10, control_frame_rate=2)
    conn = _listener(limits)
    buffer = conn.incoming_buffer
    ping = PingFrame(0, opaque_data=b"12345678").serialize()
    conn.receive_data(ping * 9)  # with the SETTINGS: the budget, exactly
    now = buffer.born
    monkeypatch.setattr(h2compat.time, "monotonic", lambda: now + 60)
    conn.receive_data(ping * 120)  # 60 s at 2 a second
    with pytest.raises(h2compat.FloodError):
        conn.receive_data(ping)


def test_hpack_header_table_still_has_what_the_counted_table_hooks():
    # hpackcache.CountedTable counts the table's changes by overriding `add` and
    # the `maxsize` setter; the coders read `header_table` and `resized`
    # (tests/unit/proxy/test_hpackcache.py checks the bytes against hpack's).
    from hpack.table import HeaderTable

    assert isinstance(HeaderTable.__dict__["maxsize"], property)
    assert HeaderTable.__dict__["maxsize"].fset is not None
    assert callable(HeaderTable.add)
    table = hpackcache.CountedTable()
    assert table.resized is False
    table.add(b"a", b"b")
    table.maxsize = 100
    assert (table.generation, table.resized) == (2, True)
    assert isinstance(hpack.Encoder().header_table, HeaderTable)
    assert isinstance(hpack.Decoder().header_table, HeaderTable)
