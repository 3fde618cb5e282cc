"""Bytes through the server's splice of two TLS data connections arrive intact and in
order both ways, with the shared decrypt buffer lent to the other side's encryption
(`relay.Link._read_plain`): a reuse of the buffer before it was used up would show
here as corrupted or reordered bytes."""

from __future__ import annotations

import asyncio
import hashlib
import os
from pathlib import Path

from tests.integration.tunnel.harness import NODE, Tunnel, echo_server
from waygate.tunnel import relay
from waygate.tunnel.client import DataStream


async def test_megabytes_both_ways_through_the_splice_arrive_intact(
    tmp_path: Path, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    lent: list[bool] = []
    original = relay.splice

    def recording(a, b):  # type: ignore[no-untyped-def]
        done = original(a, b)
        lent.extend(half.lend for half in (a.protocol, b.protocol) if isinstance(a, relay.Link))
        return done

    monkeypatch.setattr("waygate.tunnel.server.splice", recording)
    t = Tunnel(tmp_path)
    await t.start_server()
    await t.start_agent()
    try:
        echo, port = await echo_server()
        async with echo:
            stream = await t.client().dial(NODE, port)
            assert isinstance(stream, DataStream)
            assert lent == [True, True]  # both directions of the server's splice lend
            payload = os.urandom(24 * 1024 * 1024)
            sent, got = hashlib.sha256(payload), hashlib.sha256()
            received = 0

            async def send() -> None:
                view = memoryview(payload)
                for start in range(0, len(payload), 300_001):  # not record-aligned
                    await stream.write(bytes(view[start : start + 300_001]))
                await stream.write_eof()

            sender = asyncio.ensure_future(send())
            async with asyncio.timeout(60):
                while data := await stream.read():
                    got.update(data)
                    received += len(data)
            await sender
            assert received == len(payload)
            assert got.hexdigest() == sent.hexdigest()
    finally:
        await t.close()


class _Count(asyncio.Protocol):
    """What the proxy's upstream protocol sees of a download: bytes, then its end."""

    def __init__(self) -> None:
        self.received = 0
        self.ended: asyncio.Future[str] = asyncio.get_running_loop().create_future()

    def data_received(self, data: bytes) -> None:
        self.received += len(data)

    def eof_received(self) -> bool:
        if not self.ended.done():
            self.ended.set_result("EOF")
        return True

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.ended.done():
            self.ended.set_result(f"lost: {exc!r}")


async def test_downloads_that_end_with_the_source_closing_arrive_whole(tmp_path: Path) -> None:
    """A source that sends and closes at once, received as the proxy receives (a protocol
    on the data connection): every byte arrives, then a clean end, forty times over."""
    size = 6 * 1024 * 1024
    chunk = os.urandom(256 * 1024)

    async def source(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.readexactly(1)
            for _ in range(size // len(chunk)):
                writer.write(chunk)
                await writer.drain()
        except (ConnectionError, OSError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    t = Tunnel(tmp_path)
    await t.start_server()
    await t.start_agent()
    server = await asyncio.start_server(source, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        client = t.client()
        for attempt in range(40):
            stream = await client.dial(NODE, port)
            assert isinstance(stream, DataStream)
            counter = _Count()
            stream.link.attach(counter)
            stream.link.write(b"g")
            async with asyncio.timeout(60):
                ended = await counter.ended
            stream.link.abort()
            assert (attempt, counter.received, ended) == (attempt, size, "EOF")
    finally:
        server.close()
        await server.wait_closed()
        await t.close()
