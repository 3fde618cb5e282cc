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

from tests.integration.proxy.harness import running_proxy
from waygate.proxy.http2 import H2Limits
from waygate.proxy.server import ProxyServer


@contextlib.asynccontextmanager
async def running_h2_proxy(
    routes_table: Any = None, *, limits: H2Limits | None = None, **kw: Any
) -> AsyncIterator[tuple[ProxyServer, int]]:
    async with running_proxy(routes_table, **kw) as (server, port):
        server.h2_limits = limits or H2Limits()  # type: ignore[attr-defined]
        yield server, port


def serve_h2_upstreams(
    server: ProxyServer, routes: list[Any], limits: H2Limits | None = None
) -> None:
    """Let the proxy speak HTTP/2 to the backends of `routes` whose
    upstreamProtocol asks for it (no services: the route field decides)."""
    from waygate.proxy.h2upstream import H2Upstreams

    upstreams = H2Upstreams(server, limits or H2Limits())
    upstreams.update({r.key: r for r in routes}, {})
    server.h2_upstreams = upstreams  # type: ignore[attr-defined]


class GrpcBackend:
    """A real grpcio (aio) server with one raw-bytes service, `test.Echo`: Unary
    (echo; b"sleep:S" sleeps S seconds first), ServerStream (the request's
    count of b"tick"), ClientStream (the requests joined), Bidi (each echoed),
    Fail (aborts with the status code the request names)."""

    def __init__(self) -> None:
        self.server: Any = None
        self.port = 0
        self.calls = 0

    async def start(self) -> GrpcBackend:
        import grpc

        async def unary(request: bytes, context: Any) -> bytes:
            self.calls += 1
            if request.startswith(b"sleep:"):
                await asyncio.sleep(float(request[6:]))
            metadata = dict(context.invocation_metadata())
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
