"""The demo echo backend over real sockets: what it answers, and the limits it keeps."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
from collections.abc import AsyncIterator

import pytest

from waygate.demo.echo import Settings, serve

BASE = Settings(http_port=0)


@contextlib.asynccontextmanager
async def running(settings: Settings = BASE) -> AsyncIterator[int]:
    started: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(serve(settings, started))
    try:
        yield await asyncio.wait_for(started, 5)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def exchange(port: int, raw: bytes, timeout: float = 5) -> bytes:
    """Send `raw`, then read until the server closes (every case here ends in a close)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(raw)
        return await asyncio.wait_for(reader.read(), timeout)
    finally:
        writer.close()


def responses(data: bytes) -> list[tuple[int, dict[str, str], bytes]]:
    """Split Content-Length framed responses."""
    found = []
    while data:
        head, _, rest = data.partition(b"\r\n\r\n")
        lines = head.decode().split("\r\n")
        headers = dict(line.split(": ", 1) for line in lines[1:])
        length = int(headers["Content-Length"])
        found.append((int(lines[0].split()[1]), headers, rest[:length]))
        data = rest[length:]
    return found


async def test_answers_with_method_path_headers_and_body_size() -> None:
    async with running() as port:
        data = await exchange(
            port,
            b"POST /a/b?x=1 HTTP/1.1\r\nHost: echo.localtest.me\r\nX-Thing: One\r\n"
            b"Content-Length: 5\r\nConnection: close\r\n\r\nhello",
        )
    ((status, headers, body),) = responses(data)
    assert status == 200 and headers["Content-Type"] == "application/json"
    answer = json.loads(body)
    assert answer["method"] == "POST" and answer["path"] == "/a/b" and answer["query"] == "x=1"
    assert answer["version"] == "1.1" and answer["body_bytes"] == 5
    assert answer["headers"][:2] == ["Host: echo.localtest.me", "X-Thing: One"]


async def test_pipelined_requests_are_answered_in_order_on_one_connection() -> None:
    async with running() as port:
        data = await exchange(
            port,
            b"GET /1 HTTP/1.1\r\nHost: a\r\n\r\n"
            b"POST /2 HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n"
            b"GET /3 HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n",
        )
    answers = [json.loads(body) for _, _, body in responses(data)]
    assert [a["path"] for a in answers] == ["/1", "/2", "/3"]
    assert answers[1]["body_bytes"] == 3


@pytest.mark.parametrize(
    "raw",
    [
        b"GET / HTTP/1.1\r\nHost: a\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost : a\r\n\r\n",
        b"BAD\r\n\r\n",
    ],
)
async def test_a_malformed_request_is_a_400_and_a_close(raw: bytes) -> None:
    async with running() as port:
        data = await exchange(port, raw)
    assert data.startswith(b"HTTP/1.1 400 ") and b"Connection: close" in data


async def test_limits_answer_431_413_and_408() -> None:
    settings = dataclasses.replace(BASE, max_head_bytes=1024, max_body_bytes=10, head_timeout=0.3)
    async with running(settings) as port:
        big_head = b"GET / HTTP/1.1\r\nHost: a\r\nX-Big: " + b"x" * 2000 + b"\r\n\r\n"
        assert (await exchange(port, big_head)).startswith(b"HTTP/1.1 431 ")
        big_body = b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 11\r\n\r\n"
        assert (await exchange(port, big_body)).startswith(b"HTTP/1.1 413 ")
        chunked = (
            b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\nb\r\n" + b"x" * 11
        )
        assert (await exchange(port, chunked)).startswith(b"HTTP/1.1 413 ")
        slow = b"GET / HTTP/1.1\r\nHost: a\r\n"  # never finished
        assert (await exchange(port, slow)).startswith(b"HTTP/1.1 408 ")
        # A connection that sends nothing is closed without an answer.
        assert await exchange(port, b"") == b""


async def test_connections_over_the_limit_are_closed_and_all_are_released_at_stop() -> None:
    settings = dataclasses.replace(BASE, max_connections=2)
    async with running(settings) as port:
        held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(2)]
        await asyncio.sleep(0.1)
        assert await exchange(port, b"GET / HTTP/1.1\r\nHost: a\r\n\r\n") == b""
    # Stopping the server closed the held connections too.
    for reader, writer in held:
        assert await asyncio.wait_for(reader.read(), 5) == b""
        writer.close()
