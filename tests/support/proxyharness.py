"""Real sockets for the proxy's tests: a recording upstream, a proxy on port 0, raw clients.

`RecordingUpstream` is a small real HTTP/1.1 server (asyncio streams) that
records every byte it receives, so a test can assert that a refused request
reached no upstream. It answers with JSON describing what it received
(method, target, headers, body length), honours keep-alive and reads
Content-Length and chunked bodies. Special paths drive failure cases:
/slow?s=N waits N seconds before answering; /big?n=N streams N bytes;
/chunked answers chunked; /close answers close-delimited; /bad answers a
malformed response head. A request header X-Echo-Set-Header: "Name:value,..."
makes it send those response headers (as the Gateway API conformance echo does).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import AsyncIterator, Awaitable, Callable

from waygate.proxy.metrics import ProxyMetrics
from waygate.proxy.routing import Defaults, RouteTable, build_table
from waygate.proxy.server import ProxyServer
from waygate.proxy.upstream import Dialer
from waygate.resolver.model import Endpoint, EndpointPort, Route, RouteBackend


class RecordingUpstream:
    def __init__(self, name: str = "up", host: str = "127.0.0.1") -> None:
        self.name = name
        self.host = host  # another loopback address: another "pod" of one Service
        self.received = bytearray()
        self.requests: list[dict[str, object]] = []
        self.connections = 0
        self.port = 0
        self._server: asyncio.AbstractServer | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    async def start(self) -> RecordingUpstream:
        self._server = await asyncio.start_server(self._serve, self.host, 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def stop(self) -> None:
        assert self._server is not None
        self._server.close()
        for writer in list(self._writers):
            writer.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._server.wait_closed(), 2)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self._writers.add(writer)
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                self.received += head
                lines = head.decode("latin-1").split("\r\n")
                method, target, _ = lines[0].split(" ", 2)
                headers = [tuple(x.split(": ", 1)) for x in lines[1:] if x]
                lower = {k.lower(): v for k, v in headers}
                body = b""
                if lower.get("expect", "").lower() == "100-continue":
                    writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
                if lower.get("transfer-encoding", "").lower() == "chunked":
                    while True:
                        size_line = await reader.readuntil(b"\r\n")
                        self.received += size_line
                        size = int(size_line.split(b";")[0], 16)
                        chunk = await reader.readexactly(size + 2)
                        self.received += chunk
                        body += chunk[:-2]
                        if size == 0:
                            break
                elif "content-length" in lower:
                    length = int(lower["content-length"])
                    while len(body) < length:
                        piece = await reader.read(min(1 << 20, length - len(body)))
                        if not piece:
                            return
                        body += piece if length < 1 << 20 else b""
                        if length >= 1 << 20:
                            length -= len(piece)
                    self.received += body
                record = {
                    "upstream": self.name,
                    "method": method,
                    "target": target,
                    "headers": headers,
                    "body_length": len(body),
                }
                self.requests.append(record)
                path = target.split("?")[0]
                if path == "/slow":
                    await asyncio.sleep(float(target.split("s=")[1]))
                if path == "/big":
                    size = int(target.split("n=")[1])
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % size)
                    block = b"x" * (1 << 16)
                    sent = 0
                    while sent < size:
                        piece = block[: min(len(block), size - sent)]
                        writer.write(piece)
                        sent += len(piece)
                        await writer.drain()
                    continue
                payload = json.dumps(record).encode()
                if path == "/bad":
                    writer.write(b"HTTP/1.1 200 OK\r\nBad Header : x\r\n\r\n")
                    await writer.drain()
                    continue
                if path == "/chunked":
                    writer.write(
                        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n"
                        % (len(payload), payload)
                    )
                elif path == "/close":
                    writer.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n" + payload)
                    await writer.drain()
                    writer.close()
                    return
                elif path == "/204":
                    writer.write(b"HTTP/1.1 204 No Content\r\n\r\n")
                elif path.startswith("/status/") and path[8:].isdigit():
                    # httpbun's /status/NNN (ingress-nginx's e2e backend): that status.
                    status = int(path[8:])
                    writer.write(
                        b"HTTP/1.1 %d X\r\nContent-Length: %d\r\n\r\nstatus %d"
                        % (status, len(b"status %d" % status), status)
                    )
                else:
                    # The conformance echo server's X-Echo-Set-Header ("Name:value,..."):
                    # response headers the test asks the backend to send.
                    extra = b"".join(
                        b"%s: %s\r\n" % tuple(pair.strip().encode().split(b":", 1))
                        for pair in lower.get("x-echo-set-header", "").split(",")
                        if ":" in pair
                    )
                    writer.write(
                        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                        b"Content-Length: %d\r\n%s\r\n" % (len(payload), extra)
                    )
                    if method != "HEAD":
                        writer.write(payload)
                await writer.drain()
        finally:
            self._writers.discard(writer)
            writer.close()


def route(
    host: str, services: list[tuple[str, int]], *, path: str = "/", name: str = "r", **kw: object
) -> Route:
    return Route(
        namespace="demo",
        name=name,
        host=host,
        path=path,
        backends=tuple(RouteBackend(service=s, weight=w) for s, w in services),
        **kw,  # type: ignore[arg-type]
    )


def endpoint(service: str, port: int, address: str = "127.0.0.1", **kw: object) -> Endpoint:
    return Endpoint(
        namespace="demo",
        service=service,
        address=address,
        ports=(EndpointPort(name="http", port=port),),
        **kw,  # type: ignore[arg-type]
    )


def table(
    routes: list[Route], endpoints: list[Endpoint], previous: RouteTable | None = None, **kw: object
) -> RouteTable:
    grouped: dict[tuple[str, str], tuple[Endpoint, ...]] = {}
    for ep in endpoints:
        grouped[ep.service_key] = (*grouped.get(ep.service_key, ()), ep)
    return build_table(
        {r.key: r for r in routes},
        grouped,
        {},
        defaults=Defaults(**kw),  # type: ignore[arg-type]
        cookie_key=b"k" * 32,
        previous=previous,
    )


@contextlib.asynccontextmanager
async def running_proxy(
    routes_table: RouteTable | None = None, **kw: object
) -> AsyncIterator[tuple[ProxyServer, int]]:
    server = ProxyServer(
        defaults=kw.pop("defaults", Defaults()),  # type: ignore[arg-type]
        dialer=kw.pop("dialer", Dialer()),  # type: ignore[arg-type]
        metrics=ProxyMetrics(),
        cookie_key=b"k" * 32,
        max_connections=kw.pop("max_connections", 1000),  # type: ignore[arg-type]
        **kw,  # type: ignore[arg-type]
    )
    if routes_table is not None:
        server.set_table(routes_table)
    port = await server.start("127.0.0.1", 0)
    try:
        yield server, port
    finally:
        await server.drain(1.0)


async def exchange(
    port: int, data: bytes, *, timeout: float = 5.0, half_close: bool = True
) -> bytes:
    """Send raw bytes, half-close, read until the proxy closes (or the timeout)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    await writer.drain()
    if half_close:
        with contextlib.suppress(OSError):
            writer.write_eof()
    out = bytearray()
    try:
        async with asyncio.timeout(timeout):
            while True:
                piece = await reader.read(65536)
                if not piece:
                    break
                out += piece
    finally:
        writer.close()
    return bytes(out)


async def request(
    port: int, data: bytes, *, timeout: float = 5.0
) -> tuple[bytes, asyncio.StreamReader, asyncio.StreamWriter]:
    """Send raw bytes and read one response (head + Content-Length body); keep the connection."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    response = await read_response(reader, timeout=timeout)
    return response, reader, writer


async def read_response(reader: asyncio.StreamReader, *, timeout: float = 5.0) -> bytes:
    async with asyncio.timeout(timeout):
        head = await reader.readuntil(b"\r\n\r\n")
        length = 0
        for line in head.split(b"\r\n"):
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":")[1])
        body = await reader.readexactly(length) if length else b""
    return head + body


def body_json(response: bytes) -> dict[str, object]:
    return json.loads(response.split(b"\r\n\r\n", 1)[1])  # type: ignore[no-any-return]


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.asynccontextmanager
async def scripted_upstream(
    handler: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]],
) -> AsyncIterator[int]:
    """A real upstream whose every connection runs `handler` (a misbehaving server's
    script); yields its port and closes every connection afterwards."""
    writers: set[asyncio.StreamWriter] = set()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writers.add(writer)
        try:
            await handler(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writers.discard(writer)
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()
        for writer in list(writers):
            writer.transport.abort()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(server.wait_closed(), 2)
