"""A bare grpc.aio unary echo server: the yardstick the service benchmarks compare against.

No interceptors, no health, no reflection: a generic handler that returns the
request bytes. Prints its port on stdout, then serves until stdin closes.
"""

from __future__ import annotations

import asyncio
import sys

import grpc

SERVICE = "bench.Echo"


async def echo(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
    return request


async def main() -> None:
    server = grpc.aio.server()
    identity = lambda b: b  # noqa: E731
    handler = grpc.unary_unary_rpc_method_handler(
        echo, request_deserializer=identity, response_serializer=identity
    )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(SERVICE, {"Echo": handler}),)
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(port, flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    await server.stop(0)


if __name__ == "__main__":
    asyncio.run(main())
