"""The far ends the tunnel benchmark measures against, each run as its own process.

    python -m bench.tunnel.peers sink HOST
        Two listeners on HOST, ports printed as one line "BULK HTTP":
        BULK reads each connection to EOF, then writes the byte count as 8
        bytes (big endian) and closes: the sender's clock stops only when every
        byte has arrived. HTTP answers every request head with a fixed 200
        (keep-alive), for latency and dial figures.
    python -m bench.tunnel.peers grpc-sink CERT KEY CA
        A bare grpc.aio server (mTLS, no interceptors) with one bidi method
        that counts the bytes of the chunks it receives and answers the count
        once the caller half-closes: the transport's own ceiling. Prints its
        port.

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
    print(bulk.sockets[0].getsockname()[1], http.sockets[0].getsockname()[1], flush=True)
    await _until_stdin_closes()
    bulk.close()
    http.close()


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

    handler = grpc.stream_stream_rpc_method_handler(
        _push, request_deserializer=identity, response_serializer=identity
    )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(GRPC_SERVICE, {"Push": handler}),)
    )
    port = server.add_secure_port("127.0.0.1:0", credentials)
    await server.start()
    print(port, flush=True)
    await _until_stdin_closes()
    await server.stop(0)


def main(argv: list[str]) -> None:
    if argv[:1] == ["sink"]:
        uvloop.run(sink(argv[1]))
    elif argv[:1] == ["grpc-sink"]:
        uvloop.run(grpc_sink(*argv[1:4]))
    else:
        sys.exit("usage: python -m bench.tunnel.peers sink HOST | grpc-sink CERT KEY CA")


if __name__ == "__main__":
    main(sys.argv[1:])
