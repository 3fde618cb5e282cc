"""The gRPC backend of bench.h2: a grpcio (aio) server with raw-bytes methods.

    python -m bench.h2.grpc_backend PORT

`bench.Echo/Unary` answers its request; `bench.Echo/Stream` answers N small
messages (N = the request, decimal). Serves until stdin closes.
"""

from __future__ import annotations

import asyncio
import sys
from typing import Any

import grpc


async def unary(request: bytes, context: Any) -> bytes:
    return request


async def stream(request: bytes, context: Any) -> Any:
    for _ in range(int(request)):
        yield b"m" * 32


async def main(port: int) -> None:
    server = grpc.aio.server()
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                "bench.Echo",
                {
                    "Unary": grpc.unary_unary_rpc_method_handler(unary),
                    "Stream": grpc.unary_stream_rpc_method_handler(stream),
                },
            ),
        )
    )
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    await server.stop(1)


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1])))
