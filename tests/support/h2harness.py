"""The proxy with its HTTP/2 side on real sockets: h2c and HTTP/1.1 on one plain port.

`running_h2_proxy` starts a `ProxyServer` (the harness's `running_proxy`,
whose port serves HTTP/1.1 and h2c, as every listener does) with the HTTP/2
limits given.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from tests.support.proxyharness import running_proxy
from waygate.proxy.http2 import GracefulStateMachine, H2Limits
from waygate.proxy.server import ProxyServer


@contextlib.asynccontextmanager
async def running_h2_proxy(
    routes_table: Any = None, *, limits: H2Limits | None = None, **kw: Any
) -> AsyncIterator[tuple[ProxyServer, int]]:
    async with running_proxy(routes_table, h2_limits=limits or H2Limits(), **kw) as (
        server,
        port,
    ):
        yield server, port


def serve_h2_upstreams(
    server: ProxyServer, routes: list[Any], limits: H2Limits | None = None
) -> None:
    """The limits of the proxy's HTTP/2 connections to backends. Which backends speak
    HTTP/2 is the routing table's (`routing.Backend.http2`: the route's
    upstreamProtocol, or the service port's appProtocol); `routes` is unused."""
    if limits is not None:
        server.h2_upstreams.limits = limits


class GrpcBackend:
    """A real grpcio (aio) server with one raw-bytes service, `test.Echo`: Unary
    (echo; b"sleep:S" sleeps S seconds first), ServerStream (the request's
    count of b"tick"), ClientStream (the requests joined), Bidi (each echoed),
    Fail (aborts with the status code the request names)."""

    def __init__(self) -> None:
        self.server: Any = None
        self.port = 0
        self.calls = 0
        self.traceparents: list[str] = []  # as the backend received them

    async def start(self) -> GrpcBackend:
        import grpc

        async def unary(request: bytes, context: Any) -> bytes:
            self.calls += 1
            if request.startswith(b"sleep:"):
                await asyncio.sleep(float(request[6:]))
            metadata = dict(context.invocation_metadata())
            if "traceparent" in metadata:
                self.traceparents.append(metadata["traceparent"])
            return request + b"|" + metadata.get("x-forwarded-for", "").encode()

        async def server_stream(request: bytes, context: Any) -> Any:
            self.calls += 1
            for _ in range(int(request)):
                yield b"tick"

        async def client_stream(requests: Any, context: Any) -> bytes:
            self.calls += 1
            return b"".join([r async for r in requests])

        async def bidi(requests: Any, context: Any) -> Any:
            self.calls += 1
            async for request in requests:
                yield request

        async def fail(request: bytes, context: Any) -> bytes:
            code = next(c for c in grpc.StatusCode if c.value[0] == int(request))
            await context.abort(code, "failed as asked")
            return b""

        handler = grpc.method_handlers_generic_handler(
            "test.Echo",
            {
                "Unary": grpc.unary_unary_rpc_method_handler(unary),
                "ServerStream": grpc.unary_stream_rpc_method_handler(server_stream),
                "ClientStream": grpc.stream_unary_rpc_method_handler(client_stream),
                "Bidi": grpc.stream_stream_rpc_method_handler(bidi),
                "Fail": grpc.unary_unary_rpc_method_handler(
                    fail,
                ),
            },
        )
        self.server = grpc.aio.server()
        self.server.add_generic_rpc_handlers((handler,))
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()
        return self

    async def stop(self) -> None:
        await self.server.stop(0)


class H2Backend:
    """A real HTTP/2 (h2c) backend on the h2 state machine that records which
    connection processed which path (and each request's fields), and answers
    with the path as body and an `x-backend: h2` header. `goaway_after`: on its first connection,
    once that many streams have arrived, it sends GOAWAY naming the first
    stream as the last it will process, answers that one, and never the rest.
    `tls`: a server context (with ALPN h2) makes it an h2-over-TLS backend.
    A path starting with /upload is answered at the request's end, with the
    length and SHA-256 of the request body it received (`_digest`) as its body;
    one starting with /nolength without content-length, in two DATA frames and
    trailers."""

    def __init__(self, goaway_after: int = 0, *, tls: Any = None) -> None:
        self.goaway_after = goaway_after
        self.tls = tls
        self.port = 0
        self.processed: list[tuple[int, str]] = []  # (connection number, path)
        self.received: list[tuple[int, str]] = []
        self.headers: list[list[tuple[bytes, bytes]]] = []  # each request's fields
        self.connections = 0
        self._server: Any = None

    async def start(self) -> H2Backend:
        import h2.config
        import h2.connection
        import h2.events

        backend = self

        class Protocol(asyncio.Protocol):
            def connection_made(self, transport: Any) -> None:
                backend.connections += 1
                self.number = backend.connections
                self.transport = transport
                config = h2.config.H2Configuration(client_side=False, header_encoding=None)
                self.h2 = h2.connection.H2Connection(config=config)
                self.h2.state_machine = GracefulStateMachine()
                self.h2.initiate_connection()
                self.pending: list[tuple[int, str]] = []
                self.uploads: dict[int, bytes] = {}
                transport.write(self.h2.data_to_send())

            def data_received(self, data: bytes) -> None:
                for event in self.h2.receive_data(data):
                    if isinstance(event, h2.events.DataReceived):
                        if event.stream_id in self.uploads:
                            self.uploads[event.stream_id] += event.data
                            self.h2.acknowledge_received_data(
                                event.flow_controlled_length, event.stream_id
                            )
                    elif (
                        isinstance(event, h2.events.StreamEnded) and event.stream_id in self.uploads
                    ):
                        self.reply(event.stream_id, _digest(self.uploads.pop(event.stream_id)))
                    if not isinstance(event, h2.events.RequestReceived):
                        continue
                    path = dict(event.headers)[b":path"].decode()
                    backend.received.append((self.number, path))
                    backend.headers.append(list(event.headers))
                    if path.startswith("/upload"):
                        if event.stream_ended is not None:
                            self.reply(event.stream_id, _digest(b""))
                        else:
                            self.uploads[event.stream_id] = b""
                        continue
                    self.pending.append((event.stream_id, path))
                    if (
                        backend.goaway_after
                        and self.number == 1
                        and len(self.pending) == backend.goaway_after
                    ):
                        first_id, first_path = self.pending[0]
                        self.h2.close_connection(last_stream_id=first_id)
                        self.answer(first_id, first_path)
                        self.pending = []
                    elif not backend.goaway_after or self.number > 1:
                        for stream_id, waiting in self.pending:
                            self.answer(stream_id, waiting)
                        self.pending = []
                self.transport.write(self.h2.data_to_send())

            def answer(self, stream_id: int, path: str) -> None:
                backend.processed.append((self.number, path))
                if path.startswith("/nolength"):
                    # No content-length: the body in two DATA frames, then trailers.
                    self.h2.send_headers(stream_id, [(b":status", b"200")])
                    self.h2.send_data(stream_id, b"first,")
                    self.h2.send_data(stream_id, path.encode())
                    self.h2.send_headers(stream_id, [(b"x-trailer", b"t")], end_stream=True)
                    return
                self.reply(stream_id, path.encode())

            def reply(self, stream_id: int, body: bytes) -> None:
                self.h2.send_headers(
                    stream_id,
                    [
                        (b":status", b"200"),
                        (b"content-length", b"%d" % len(body)),
                        (b"x-backend", b"h2"),
                    ],
                )
                self.h2.send_data(stream_id, body, end_stream=True)

        self._server = await asyncio.get_running_loop().create_server(
            Protocol, "127.0.0.1", 0, ssl=self.tls
        )
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def stop(self) -> None:
        self._server.close()


def _digest(body: bytes) -> bytes:
    """What H2Backend answers an /upload with: the body's length and SHA-256."""
    import hashlib

    return b"%d %s" % (len(body), hashlib.sha256(body).hexdigest().encode())
