"""A real HTTP/2 client for tests: h2 (python-hyper) over an asyncio socket.

`H2Client.connect(port)` speaks h2c with prior knowledge, or h2 over TLS
when given an `ssl.SSLContext` (ALPN h2). `request()` sends one request and
waits for the whole answer (status, fields, body, trailers). For the attack
tests, `send_raw(bytes)` writes frames the state machine would never build
(`frame(...)` serialises one with hyperframe), and `frames_seen` counts what
the server sent back by frame type; `closed` is set once the server closes.
Every wait has a timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from dataclasses import dataclass, field
from typing import Any

import h2.config
import h2.connection
import h2.events
import h2.exceptions
import h2.settings
from hyperframe.frame import Frame

from waygate.proxy.h2compat import GracefulStateMachine


@dataclass
class Response:
    status: int = 0
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    body: bytes = b""
    trailers: list[tuple[bytes, bytes]] = field(default_factory=list)
    reset: int | None = None  # the RST_STREAM error code, when reset

    def header(self, name: bytes) -> bytes | None:
        for key, value in self.headers:
            if key == name:
                return value
        return None

    def trailer(self, name: bytes) -> bytes | None:
        for key, value in self.trailers or self.headers:
            if key == name:
                return value
        return None


class _Pending:
    def __init__(self) -> None:
        self.response = Response()
        self.done: asyncio.Future[Response] = asyncio.get_running_loop().create_future()
        self.body = bytearray()


class H2Client:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        # No outbound validation: the tests send what a hostile client would.
        config = h2.config.H2Configuration(
            client_side=True, header_encoding=None, validate_outbound_headers=False
        )
        self.h2 = h2.connection.H2Connection(config=config)
        # Streams covered by a GOAWAY still finish (as a real client's do).
        self.h2.state_machine = GracefulStateMachine()
        self.pending: dict[int, _Pending] = {}
        self.closed = asyncio.Event()
        self.goaway: h2.events.ConnectionTerminated | None = None
        self.frames_seen: dict[str, int] = {}
        # Responses ended by an empty DATA frame (not END_STREAM on their last bytes).
        self.empty_data_ends = 0
        self.bytes_received = 0
        self.auto_window = True  # acknowledge received DATA at once
        self._task: asyncio.Task[None] | None = None
        self._senders: set[asyncio.Task[None]] = set()
        self._window = asyncio.Event()

    @classmethod
    async def connect(
        cls,
        port: int,
        *,
        host: str = "127.0.0.1",
        tls: ssl.SSLContext | None = None,
        server_hostname: str | None = None,
        settings: dict[int, int] | None = None,
        preface: bool = True,
    ) -> H2Client:
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(
                host, port, ssl=tls, server_hostname=server_hostname if tls else None
            ),
            10,
        )
        client = cls(reader, writer)
        if settings:
            client.h2.local_settings = h2.settings.Settings(client=True, initial_values=settings)
        if preface:
            client.h2.initiate_connection()
            client.flush()
        client._task = asyncio.get_running_loop().create_task(client._read_forever())
        return client

    def flush(self) -> None:
        data = self.h2.data_to_send()
        if data and not self.writer.is_closing():
            self.writer.write(data)

    def send_raw(self, data: bytes) -> None:
        if not self.writer.is_closing():
            self.writer.write(data)

    async def drain(self) -> None:
        with contextlib.suppress(ConnectionError):
            await asyncio.wait_for(self.writer.drain(), 10)

    def start(
        self,
        method: str,
        path: str,
        authority: str,
        headers: list[tuple[str, str]] | None = None,
        body: bytes | None = None,
        *,
        end: bool = True,
    ) -> int:
        """Open a stream (ending it unless `end` is False); returns its id."""
        stream_id = self.h2.get_next_available_stream_id()
        fields = [
            (b":method", method.encode()),
            (b":scheme", b"https"),
            (b":authority", authority.encode()),
            (b":path", path.encode()),
        ]
        fields += [(k.encode(), v.encode()) for k, v in headers or []]
        self.pending[stream_id] = _Pending()
        self.h2.send_headers(stream_id, fields, end_stream=end and not body)
        self.flush()
        if body:
            task = asyncio.get_running_loop().create_task(self.send_body(stream_id, body, end))
            self._senders.add(task)
            task.add_done_callback(self._senders.discard)
        return stream_id

    async def send_body(self, stream_id: int, body: bytes, end: bool = True) -> None:
        """Send `body` as the windows allow (waits for WINDOW_UPDATEs, 10 s each)."""
        view = memoryview(body)
        while True:
            window = min(
                self.h2.local_flow_control_window(stream_id), self.h2.max_outbound_frame_size
            )
            if window > 0 or not view:
                piece = view[:window]
                view = view[len(piece) :]
                self.h2.send_data(stream_id, piece.tobytes(), end_stream=end and not view)
                self.flush()
                if not view:
                    return
                continue
            self._window.clear()
            await asyncio.wait_for(self._window.wait(), 10)

    async def wait(self, stream_id: int, timeout: float = 10.0) -> Response:
        return await asyncio.wait_for(asyncio.shield(self.pending[stream_id].done), timeout)

    async def request(
        self,
        method: str,
        path: str,
        authority: str,
        headers: list[tuple[str, str]] | None = None,
        body: bytes | None = None,
        timeout: float = 10.0,
    ) -> Response:
        return await self.wait(self.start(method, path, authority, headers, body), timeout)

    async def _read_forever(self) -> None:
        try:
            while True:
                data = await self.reader.read(65536)
                if not data:
                    break
                self.bytes_received += len(data)
                self._count(data)
                try:
                    events = self.h2.receive_data(data)
                except h2.exceptions.ProtocolError:
                    break
                for event in events:
                    self._event(event)
                self.flush()
        except (ConnectionError, OSError):
            pass
        finally:
            self.closed.set()
            for pending in self.pending.values():
                if not pending.done.done():
                    pending.response.body = bytes(pending.body)
                    pending.response.reset = pending.response.reset or -1
                    pending.done.set_result(pending.response)

    def _count(self, data: bytes) -> None:
        # Frame types by a light walk over the bytes (after the 9-byte headers).
        buf = getattr(self, "_frame_buf", b"") + data
        while len(buf) >= 9:
            length = int.from_bytes(buf[:3], "big")
            if len(buf) < 9 + length:
                break
            frame = Frame.parse_frame_header(memoryview(buf[:9]))[0]
            kind = frame.__class__.__name__
            self.frames_seen[kind] = self.frames_seen.get(kind, 0) + 1
            if kind == "DataFrame" and length == 0 and "END_STREAM" in frame.flags:
                self.empty_data_ends += 1
            buf = buf[9 + length :]
        self._frame_buf = buf

    def _event(self, event: Any) -> None:
        pending = self.pending.get(getattr(event, "stream_id", 0) or 0)
        if isinstance(event, h2.events.ResponseReceived) and pending is not None:
            pending.response.status = int(dict(event.headers)[b":status"])
            pending.response.headers = [(k, v) for k, v in event.headers if k[:1] != b":"]
        elif isinstance(event, h2.events.DataReceived) and pending is not None:
            pending.body += event.data
            if self.auto_window and event.flow_controlled_length:
                self.h2.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
        elif isinstance(event, h2.events.TrailersReceived) and pending is not None:
            pending.response.trailers = list(event.headers)
        elif isinstance(event, h2.events.StreamEnded) and pending is not None:
            pending.response.body = bytes(pending.body)
            if not pending.done.done():
                pending.done.set_result(pending.response)
        elif isinstance(event, h2.events.StreamReset) and pending is not None:
            pending.response.reset = event.error_code
            pending.response.body = bytes(pending.body)
            if not pending.done.done():
                pending.done.set_result(pending.response)
        elif isinstance(event, (h2.events.WindowUpdated, h2.events.RemoteSettingsChanged)):
            self._window.set()
        elif isinstance(event, h2.events.ConnectionTerminated):
            self.goaway = event

    async def close(self) -> None:
        for task in list(self._senders):
            task.cancel()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        self.writer.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.writer.wait_closed(), 2)


def frame(kind: type[Frame], stream_id: int = 0, **attrs: Any) -> bytes:
    """One serialised frame of `kind` (hyperframe), attributes set as given."""
    flags = attrs.pop("flags", ())
    made = kind(stream_id, **{k: attrs.pop(k) for k in list(attrs) if k == "data"})
    for name, value in attrs.items():
        setattr(made, name, value)
    for flag in flags:
        made.flags.add(flag)
    return bytes(made.serialize())
