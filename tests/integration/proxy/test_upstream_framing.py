"""An upstream connection whose framing is off is never pooled: bytes that follow a
response without a body (HEAD, 204, 304, Content-Length: 0) in the same read, or
that arrive while the connection is idle, would otherwise be read as the next
response on it, possibly another client's."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from tests.support.proxyharness import endpoint, read_response, route, running_proxy, table

H = b"Host: echo.test\r\n"
STRAY = b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nEVIL!"


class StrayUpstream:
    """Answers a bodiless response followed by a stray response, split over two
    writes (the second 0.3 s later); every other request gets a normal 200."""

    def __init__(self, bodiless: bytes) -> None:
        self.bodiless = bodiless
        self.connections = 0
        self.port = 0
        self._server: asyncio.AbstractServer | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> StrayUpstream:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                if head.startswith((b"HEAD ", b"GET /bodiless ")):
                    writer.write(self.bodiless + STRAY[:20])
                    await writer.drain()
                    await asyncio.sleep(0.3)
                    writer.write(STRAY[20:])
                else:
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\ngood")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def stop(self) -> None:
        assert self._server is not None
        self._server.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._server.wait_closed(), 2)


@pytest.mark.parametrize(
    ("method", "bodiless"),
    [
        (b"HEAD /", b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n"),
        (b"GET /bodiless", b"HTTP/1.1 204 No Content\r\n\r\n"),
        (b"GET /bodiless", b"HTTP/1.1 304 Not Modified\r\n\r\n"),
        (b"GET /bodiless", b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"),
    ],
)
async def test_bytes_after_a_bodiless_response_are_never_the_next_response(
    method: bytes, bodiless: bytes
) -> None:
    upstream = await StrayUpstream(bodiless).start()
    routes = table([route("echo.test", [("echo", 100)])], [endpoint("echo", upstream.port)])
    try:
        async with running_proxy(routes) as (_, port):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            try:
                writer.write(method + b" HTTP/1.1\r\n" + H + b"\r\n")
                async with asyncio.timeout(5):
                    first = await reader.readuntil(b"\r\n\r\n")
                assert first.startswith(bodiless[:12]), first
                # Another client, at once: it must not get the stray response.
                second, _, w2 = await _get(port)
                w2.close()
                assert second.endswith(b"\r\n\r\ngood"), second
                assert upstream.connections == 2
            finally:
                writer.close()
    finally:
        await upstream.stop()


async def _get(port: int) -> tuple[bytes, asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /next HTTP/1.1\r\n" + H + b"\r\n")
    return await read_response(reader), reader, writer
