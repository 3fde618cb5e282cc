"""A real Waygate service process for tests of the shared core (no service logic).

It serves one test-only gRPC service, `waygate.test.Demo`, through the same
`ServiceProcess` / `GrpcServer` bootstrap every service uses:
- `Sleep`: request = decimal seconds as bytes; replies b"slept" after sleeping
  (an in-flight call for drain tests);
- `Fail`: raises the domain error named in the request (b"NotFound", ...),
  or a plain RuntimeError for anything else;
- `Call`: request = "host:port"; calls grpc.health.v1 Check there through
  `open_channel`, so a trace spans two processes;
- `Ticks`: a server stream of b"tick" every 10 ms until cancelled; each ended
  stream bumps `STREAMS_CLOSED` from the handler's own `finally`.
Raw bytes in and out: no proto needed. Run: python -m tests.support.demo_server --grpc-port N
"""

from __future__ import annotations

import asyncio
import dataclasses
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from waygate.core import errors
from waygate.core.grpcclient import open_channel
from waygate.core.grpcserver import GrpcServer, ServiceRegistration
from waygate.core.runtime import ServiceProcess
from waygate.core.settings import GrpcServerSettings, load_settings, setting

SERVICE = "waygate.test.Demo"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Settings(GrpcServerSettings):
    ready_delay: float = setting(0.0, help="seconds before the process declares itself ready")


async def sleep(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
    await asyncio.sleep(float(request.decode()))
    return b"slept"


async def fail(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
    name = request.decode()
    error = getattr(errors, name, None)
    if isinstance(error, type) and issubclass(error, errors.WaygateError):
        raise error(f"demo {name}")
    raise RuntimeError("demo bug")


async def call(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
    async with open_channel(request.decode()) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=5
        )
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status).encode()


STREAMS_CLOSED = 0


async def ticks(request: bytes, context: grpc.aio.ServicerContext):
    global STREAMS_CLOSED
    try:
        while True:
            yield b"tick"
            await asyncio.sleep(0.01)
    finally:
        STREAMS_CLOSED += 1


def _add(servicer: object, server: grpc.aio.Server) -> None:
    identity = lambda b: b  # noqa: E731
    handlers = {
        name: grpc.unary_unary_rpc_method_handler(
            fn, request_deserializer=identity, response_serializer=identity
        )
        for name, fn in (("Sleep", sleep), ("Fail", fail), ("Call", call))
    }
    handlers["Ticks"] = grpc.unary_stream_rpc_method_handler(
        ticks, request_deserializer=identity, response_serializer=identity
    )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))


async def setup(process: ServiceProcess, settings: Settings) -> None:
    process.add_grpc_server(
        GrpcServer.from_settings(settings, [ServiceRegistration(SERVICE, _add, None)])
    )

    async def become_ready() -> None:
        await asyncio.sleep(settings.ready_delay)
        await process.mark_ready()

    process.spawn(become_ready(), "become-ready")


def main(argv: list[str]) -> int:
    flags = {}
    for i in range(0, len(argv), 2):
        flags[argv[i].lstrip("-").replace("-", "_")] = argv[i + 1]
    settings = load_settings(Settings, flags=flags)
    process = ServiceProcess("demo", settings)
    return asyncio.run(process.run(lambda p: setup(p, settings)))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
