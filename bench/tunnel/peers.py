"""The far ends the tunnel benchmark measures against, each run as its own process.

    python -m bench.tunnel.peers sink HOST
        Three listeners on HOST, ports printed as one line "BULK HTTP SOURCE":
        BULK reads each connection to EOF, then writes the byte count as 8
        bytes (big endian) and closes: the sender's clock stops only when every
        byte has arrived. HTTP answers every request head with a fixed 200
        (keep-alive), for latency and dial figures. SOURCE reads an 8-byte
        count N, sends N bytes in 1 MiB writes (pausing while its transport's
        buffer is full) and closes: the other direction.
    python -m bench.tunnel.peers grpc-sink CERT KEY CA
        A bare grpc.aio server (mTLS, no interceptors) with one bidi method
        that counts the bytes of the chunks it receives and answers the count
        once the caller half-closes, and one that streams N bytes back as 64
        KiB messages for a request of N (8 bytes): the transport's own ceiling
        both ways. Prints its port.

Both serve until stdin closes. uvloop, as Waygate's processes run.
"""

from __future__ import annotations

import asyncio
import struct
import sys
from collections.abc import AsyncIterator

import grpc
import uvloop

GRPC_SERVICE = "bench.Stream"
GRPC_METHOD = f"/{GRPC_SERVICE}/Push"
GRPC_PULL = f"/{GRPC_SERVICE}/Pull"
HTTP_RESPONSE = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Type: text/plain\r\n\r\nok"


class BulkSink(asyncio.Protocol):
    def __init__(self) -> None:
        self.count = 0
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.count += len(data)

    def eof_received(self) -> bool:
        assert self.transport is not None
        self.transport.write(struct.pack(">Q", self.count))
        self.transport.close()
        return True


class BulkSource(asyncio.Protocol):
    """Sends the count it is asked for (8 bytes, big endian), as fast as the peer reads."""

    BLOCK = memoryview(b"\x5a" * (1024 * 1024))

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.asked = b""
        self.left = 0
        self.paused = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        transport.set_write_buffer_limits(high=4 * 1024 * 1024)  # type: ignore[attr-defined]

    def data_received(self, data: bytes) -> None:
        if len(self.asked) >= 8:
            return
        self.asked += data
        if len(self.asked) >= 8:
            self.left = struct.unpack(">Q", self.asked[:8])[0]
            self._send()

    def _send(self) -> None:
        assert self.transport is not None
        while self.left and not self.paused:
            size = min(self.left, len(self.BLOCK))
            self.transport.write(self.BLOCK[:size])
            self.left -= size
        if not self.left:
            self.transport.close()

    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self.paused = False
        self._send()


class HttpResponder(asyncio.Protocol):
    """One fixed response per request head (bodiless GETs are all the benchmark sends)."""

    def __init__(self) -> None:
        self.buffer = b""
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        assert self.transport is not None
        self.buffer += data
        while b"\r\n\r\n" in self.buffer:
            _, self.buffer = self.buffer.split(b"\r\n\r\n", 1)
            self.transport.write(HTTP_RESPONSE)
        if len(self.buffer) > 65536:
            self.transport.close()


async def _until_stdin_closes() -> None:
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)


async def sink(host: str) -> None:
    loop = asyncio.get_running_loop()
    bulk = await loop.create_server(BulkSink, host, 0, backlog=4096)
    http = await loop.create_server(HttpResponder, host, 0, backlog=4096)
    source = await loop.create_server(BulkSource, host, 0, backlog=4096)
    print(
        bulk.sockets[0].getsockname()[1],
        http.sockets[0].getsockname()[1],
        source.sockets[0].getsockname()[1],
        flush=True,
    )
    await _until_stdin_closes()
    bulk.close()
    http.close()
    source.close()


async def _push(
    chunks: AsyncIterator[bytes], _context: grpc.aio.ServicerContext
) -> AsyncIterator[bytes]:
    count = 0
    async for chunk in chunks:
        count += len(chunk)
    yield struct.pack(">Q", count)


async def grpc_sink(cert: str, key: str, ca: str) -> None:
    with open(cert, "rb") as c, open(key, "rb") as k, open(ca, "rb") as a:
        credentials = grpc.ssl_server_credentials(
            [(k.read(), c.read())], root_certificates=a.read(), require_client_auth=True
        )
    server = grpc.aio.server(
        options=[("grpc.max_receive_message_length", 4 * 1024 * 1024)],
    )

    def identity(b: bytes) -> bytes:
        return b

    handlers = {
        name: grpc.stream_stream_rpc_method_handler(
            method, request_deserializer=identity, response_serializer=identity
        )
        for name, method in (("Push", _push), ("Pull", _pull))
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(GRPC_SERVICE, handlers),))
    port = server.add_secure_port("127.0.0.1:0", credentials)
    await server.start()
    print(port, flush=True)
    await _until_stdin_closes()
    await server.stop(0)


CHUNK = 64 * 1024


async def _pull(
    requests: AsyncIterator[bytes], _context: grpc.aio.ServicerContext
) -> AsyncIterator[bytes]:
    chunk = b"\x5a" * CHUNK
    async for request in requests:
        for _ in range(struct.unpack(">Q", request)[0] // CHUNK):
            yield chunk
        return


def main(argv: list[str]) -> None:
    if argv[:1] == ["sink"]:
        uvloop.run(sink(argv[1]))
    elif argv[:1] == ["grpc-sink"]:
        uvloop.run(grpc_sink(*argv[1:4]))
    else:
        sys.exit("usage: python -m bench.tunnel.peers sink HOST | grpc-sink CERT KEY CA")


if __name__ == "__main__":
    main(sys.argv[1:])
