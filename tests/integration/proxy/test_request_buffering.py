"""Request buffering (waygate.proxy.bodybuffer), through every pair of client and backend protocol.

A route's body is taken in whole, in memory and then a temporary file, before
any backend connection or stream is used (issue 31, finding 9): checked on
real sockets with real backends (`RecordingUpstream`, `H2Backend`) for
HTTP/1.1 (Content-Length and chunked) and HTTP/2 (with and without
content-length) clients x HTTP/1.1 and HTTP/2 backends: nothing reaches the
backend before the body's last byte, the body arrives whole, bounds answer
413, a trickled body is cut with no backend slot used, a failed connect is
redispatched with the buffered body, and memory, files and tasks return to
zero however the exchange ends.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
from typing import Any

import pytest

from tests.integration.proxy import test_request_core as core
from tests.integration.proxy.test_request_core import HOST, PAIRS, built, core_route
from tests.support.h2client import H2Client
from tests.support.proxyharness import running_proxy
from waygate.proxy.bodybuffer import BufferLimits
from waygate.proxy.server import Limits

backends = core.backends  # the fixture: the two real backends behind other/svc
BODY = os.urandom(300 * 1024)  # past the memory bound below: spilled to a file


def buffered_limits(tmp_path: Any, **kw: Any) -> Limits:
    buffer = BufferLimits(
        memory_per_request=kw.pop("memory", 16 * 1024),
        memory_total=1024 * 1024,
        max_body=kw.pop("max_body", 1024 * 1024),
        directory=str(tmp_path),
    )
    return Limits(request_buffer=buffer, **kw)


class Upload:
    """One POST of `body` in two halves, from a client of either protocol."""

    def __init__(self, client: str, port: int, body: bytes, framing: str) -> None:
        self.client, self.port, self.body, self.framing = client, port, body, framing
        self.h2: H2Client | None = None
        self.stream = 0
        self.writer: asyncio.StreamWriter | None = None
        self.reader: asyncio.StreamReader | None = None

    def _h1_framed(self, piece: bytes, last: bool) -> bytes:
        if self.framing == "length":
            return piece
        out = b"%x\r\n%s\r\n" % (len(piece), piece) if piece else b""
        return out + (b"0\r\n\r\n" if last else b"")

    async def send_first(self, size: int) -> None:
        first = self.body[:size]
        if self.client == "h2c":
            self.h2 = await H2Client.connect(self.port)
            headers = [("content-length", str(len(self.body)))] if self.framing == "length" else []
            self.stream = self.h2.start("POST", "/upload", HOST, headers, end=False)
            await self.h2.send_body(self.stream, first, end=False)
            return
        self.reader, self.writer = await asyncio.open_connection("127.0.0.1", self.port)
        framing = (
            b"Content-Length: %d\r\n" % len(self.body)
            if self.framing == "length"
            else b"Transfer-Encoding: chunked\r\n"
        )
        self.writer.write(
            b"POST /upload HTTP/1.1\r\nHost: "
            + HOST.encode()
            + b"\r\n"
            + framing
            + b"Connection: close\r\n\r\n"
            + self._h1_framed(first, False)
        )
        await self.writer.drain()

    async def send_rest(self, size: int) -> tuple[int, bytes]:
        rest = self.body[size:]
        if self.h2 is not None:
            await self.h2.send_body(self.stream, rest, end=True)
            response = await self.h2.wait(self.stream)
            await self.h2.close()
            return response.status, response.body
        assert self.writer is not None and self.reader is not None
        self.writer.write(self._h1_framed(rest, True))
        return await self.answer()

    async def answer(self) -> tuple[int, bytes]:
        if self.h2 is not None:
            response = await self.h2.wait(self.stream)
            await self.h2.close()
            return response.status, response.body
        assert self.reader is not None and self.writer is not None
        data = await asyncio.wait_for(self.reader.read(-1), 10)
        self.writer.close()
        head, _, body = data.partition(b"\r\n\r\n")
        return int(head.split(b" ")[1]), body

    async def vanish(self) -> None:
        if self.h2 is not None:
            self.h2.writer.transport.abort()
        elif self.writer is not None:
            self.writer.transport.abort()


def received_whole(backend: str, status: int, answer: bytes, body: bytes) -> bool:
    if status != 200:
        return False
    if backend == "h2c":
        return answer == b"%d %s" % (len(body), hashlib.sha256(body).hexdigest().encode())
    return json.loads(answer)["body_length"] == len(body)


def backend_connections(backends: Any) -> int:
    return backends.h1.connections + backends.h2.connections


async def settled(server: Any) -> dict[str, int]:
    buffers = server.context.buffers
    for _ in range(100):
        if not (buffers.files_open or buffers.memory_used):
            break
        await asyncio.sleep(0.02)
    return {"files": buffers.files_open, "memory": buffers.memory_used}


@pytest.mark.parametrize(("client", "backend"), PAIRS)
@pytest.mark.parametrize("framing", ["length", "chunked"])
async def test_the_body_is_taken_in_before_the_backend_is_used(
    backends, client, backend, framing, tmp_path
):
    table = built([core_route(backend)], [backends.endpoint()])
    async with running_proxy(table, limits=buffered_limits(tmp_path)) as (server, port):
        upload = Upload(client, port, BODY, framing)
        await upload.send_first(200 * 1024)
        await asyncio.sleep(0.3)
        # Two thirds of the body are in: in memory to its bound, the rest in an
        # unnamed file; no backend connection, stream or endpoint slot yet.
        assert backend_connections(backends) == 0
        assert not any(server.pool.opened.values())
        assert server.context.buffers.files_open == 1
        assert server.context.buffers.memory_used <= 16 * 1024
        assert list(tmp_path.iterdir()) == []
        status, answer = await upload.send_rest(200 * 1024)
        assert received_whole(backend, status, answer, BODY), (status, answer[:200])
        assert await settled(server) == {"files": 0, "memory": 0}


@pytest.mark.parametrize(("client", "backend"), PAIRS)
@pytest.mark.parametrize("framing", ["length", "chunked"])
async def test_a_body_over_the_bound_is_refused_413_and_the_backend_never_asked(
    backends, client, backend, framing, tmp_path
):
    table = built([core_route(backend)], [backends.endpoint()])
    limits = buffered_limits(tmp_path, max_body=100 * 1024)
    async with running_proxy(table, limits=limits) as (server, port):
        upload = Upload(client, port, BODY, framing)
        # Declared too large: refused at once, from the head. Chunked: refused
        # past the bound (one byte past it, so nothing is left unread).
        await upload.send_first(0 if framing == "length" else 100 * 1024 + 1)
        status, answer = await upload.answer()
        assert status == 413, answer
        assert b"larger than the proxy buffers" in answer or client == "h2c"
        assert backend_connections(backends) == 0
        assert await settled(server) == {"files": 0, "memory": 0}


@pytest.mark.parametrize(("client", "backend"), PAIRS)
async def test_a_route_with_buffering_off_streams_the_body(backends, client, backend, tmp_path):
    table = built([core_route(backend, request_buffering=False)], [backends.endpoint()])
    async with running_proxy(table, limits=buffered_limits(tmp_path)) as (server, port):
        upload = Upload(client, port, BODY, "length")
        await upload.send_first(100 * 1024)
        for _ in range(100):
            if backend_connections(backends):
                break
            await asyncio.sleep(0.02)
        assert backend_connections(backends) == 1  # the upload flows as it comes
        assert server.context.buffers.files_open == 0
        status, answer = await upload.send_rest(100 * 1024)
        assert received_whole(backend, status, answer, BODY)


@pytest.mark.parametrize(("client", "backend"), PAIRS)
async def test_a_buffered_body_is_redispatched_after_a_failed_connect(
    backends, client, backend, tmp_path
):
    table = built([core_route(backend)], [await core.dead_endpoint(), backends.endpoint()])
    async with running_proxy(table, limits=buffered_limits(tmp_path)) as (server, port):
        for _ in range(4):
            upload = Upload(client, port, BODY, "length")
            await upload.send_first(len(BODY) // 2)
            status, answer = await upload.send_rest(len(BODY) // 2)
            assert received_whole(backend, status, answer, BODY), (status, answer[:200])
        assert server.metrics.redispatches >= 1
        assert await settled(server) == {"files": 0, "memory": 0}


@pytest.mark.parametrize(("client", "backend"), PAIRS)
async def test_a_trickled_body_is_cut_while_buffered_and_never_reaches_a_backend(
    backends, client, backend, tmp_path
):
    table = built([core_route(backend)], [backends.endpoint()])
    limits = buffered_limits(tmp_path, min_request_body_rate=1000, request_body_grace=0.3)
    async with running_proxy(table, limits=limits) as (server, port):
        upload = Upload(client, port, BODY, "length")
        await upload.send_first(10)
        status, _ = await asyncio.wait_for(upload.answer(), 10)
        assert status == 408
        assert backend_connections(backends) == 0
        assert server.metrics.refused.get("slow_body") == 1
        assert await settled(server) == {"files": 0, "memory": 0}


@pytest.mark.parametrize(("client", "backend"), PAIRS)
async def test_a_client_that_vanishes_mid_body_leaves_nothing_behind(
    backends, client, backend, tmp_path
):
    table = built([core_route(backend)], [backends.endpoint()])
    async with running_proxy(table, limits=buffered_limits(tmp_path)) as (server, port):
        tasks = len(asyncio.all_tasks())
        fds = len(os.listdir("/proc/self/fd"))
        uploads = [Upload(client, port, BODY, "length") for _ in range(5)]
        for upload in uploads:
            await upload.send_first(200 * 1024)
        await asyncio.sleep(0.2)
        assert server.context.buffers.files_open == 5
        for upload in uploads:
            await upload.vanish()
        assert await settled(server) == {"files": 0, "memory": 0}
        for _ in range(100):
            if len(os.listdir("/proc/self/fd")) <= fds and len(asyncio.all_tasks()) <= tasks:
                break
            await asyncio.sleep(0.02)
        assert len(os.listdir("/proc/self/fd")) <= fds
        assert len(asyncio.all_tasks()) <= tasks
        assert backend_connections(backends) == 0


@pytest.mark.parametrize(("client", "backend"), PAIRS)
async def test_a_large_buffered_body_is_replayed_as_the_backend_takes_it(
    backends, client, backend, tmp_path
):
    # 6 MiB from the file: more than the upstream socket's high-water mark and the
    # HTTP/2 backend's windows, so the replay pauses and resumes (flow control).
    body = os.urandom(6 * 1024 * 1024)
    table = built([core_route(backend)], [backends.endpoint()])
    limits = buffered_limits(tmp_path, max_body=8 * 1024 * 1024)
    async with running_proxy(table, limits=limits) as (server, port):
        upload = Upload(client, port, body, "length")
        await upload.send_first(len(body) - 1)
        status, answer = await upload.send_rest(len(body) - 1)
        assert status == 200, answer[:200]
        if backend == "h2c":
            assert received_whole(backend, status, answer, body)
        else:
            # RecordingUpstream answers once it has read Content-Length bytes, and
            # keeps the last (under 1 MiB) of a large body: they end it, in order.
            tail = json.loads(answer)["body_length"]
            assert tail and bytes(backends.h1.received).endswith(body[-tail:])
        assert await settled(server) == {"files": 0, "memory": 0}


@pytest.mark.parametrize("backend", ["http/1.1", "h2c"])
async def test_expect_100_continue_is_answered_by_the_proxy_while_it_buffers(
    backends, backend, tmp_path
):
    # The client waits for 100 before its body: the proxy invites it itself (the
    # body is for the proxy first, as nginx), before any backend is asked; the
    # backend's own 100 is not passed on (one 100, then the answer).
    table = built([core_route(backend)], [backends.endpoint()])
    async with running_proxy(table, limits=buffered_limits(tmp_path)) as (_, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(
            b"POST /upload HTTP/1.1\r\nHost: " + HOST.encode() + b"\r\nContent-Length: 5000\r\n"
            b"Expect: 100-continue\r\nConnection: close\r\n\r\n"
        )
        invited = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        assert invited.startswith(b"HTTP/1.1 100 ")
        assert backend_connections(backends) == 0
        writer.write(b"z" * 5000)
        rest = await asyncio.wait_for(reader.read(-1), 10)
        writer.close()
    assert rest.startswith(b"HTTP/1.1 200 "), rest[:200]
    assert b"HTTP/1.1 100" not in rest
