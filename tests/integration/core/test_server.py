"""The core gRPC server and admin listener, in-process on port 0, over real sockets."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from tests.support import demo_server
from waygate.core.admin import AdminServer, Readiness
from waygate.core.grpcclient import open_channel
from waygate.core.grpcserver import GrpcServer, ServiceRegistration


@pytest.fixture
async def server():
    srv = GrpcServer(
        host="127.0.0.1",
        port=0,
        registrations=[ServiceRegistration(demo_server.SERVICE, demo_server._add, None)],
    )
    await srv.start()
    yield srv
    await srv.stop(0)


@pytest.fixture
async def channel(server):
    async with open_channel(f"127.0.0.1:{server.port}", retry=False) as ch:
        yield ch


async def check(channel, service=""):
    reply = await health_pb2_grpc.HealthStub(channel).Check(
        health_pb2.HealthCheckRequest(service=service), timeout=5
    )
    return reply.status


async def test_health_is_not_serving_until_ready(server, channel):
    assert await check(channel) == health_pb2.HealthCheckResponse.NOT_SERVING
    assert await check(channel, demo_server.SERVICE) == health_pb2.HealthCheckResponse.NOT_SERVING
    await server.set_serving()
    assert await check(channel) == health_pb2.HealthCheckResponse.SERVING
    assert await check(channel, demo_server.SERVICE) == health_pb2.HealthCheckResponse.SERVING


async def test_reflection_lists_the_services(channel):
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    call = stub.ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")])
    )
    names = set()
    async for response in call:
        names |= {s.name for s in response.list_services_response.service}
        break
    call.cancel()
    assert {
        demo_server.SERVICE,
        "grpc.health.v1.Health",
        "grpc.reflection.v1alpha.ServerReflection",
    } <= names


@pytest.mark.parametrize(
    ("error", "code"),
    [
        ("InvalidArgument", grpc.StatusCode.INVALID_ARGUMENT),
        ("NotFound", grpc.StatusCode.NOT_FOUND),
        ("FailedPrecondition", grpc.StatusCode.FAILED_PRECONDITION),
        ("Unavailable", grpc.StatusCode.UNAVAILABLE),
        ("Unauthenticated", grpc.StatusCode.UNAUTHENTICATED),
        ("PermissionDenied", grpc.StatusCode.PERMISSION_DENIED),
    ],
)
async def test_domain_errors_become_status_codes_with_their_message(channel, error, code):
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await channel.unary_unary(f"/{demo_server.SERVICE}/Fail")(error.encode(), timeout=5)
    assert caught.value.code() == code
    assert caught.value.details() == f"demo {error}"


async def test_a_bug_is_internal_with_a_pointer_to_the_log_never_unknown(channel, caplog):
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await channel.unary_unary(f"/{demo_server.SERVICE}/Fail")(b"bug", timeout=5)
    assert caught.value.code() == grpc.StatusCode.INTERNAL
    assert "internal error in Fail; see the server log (trace " in caught.value.details()
    assert "demo bug" not in caught.value.details()  # internals stay in the log
    assert any(
        "unhandled error in /waygate.test.Demo/Fail" in r.getMessage() for r in caplog.records
    )


async def test_a_cancelled_stream_runs_the_handlers_cleanup_and_logs_no_error(
    server, channel, caplog
):
    closed_before = demo_server.STREAMS_CLOSED
    call = channel.unary_stream(f"/{demo_server.SERVICE}/Ticks")(b"")
    received = [await call.read() for _ in range(3)]
    assert received == [b"tick"] * 3
    call.cancel()
    async with asyncio.timeout(5):
        while closed_before >= demo_server.STREAMS_CLOSED:
            await asyncio.sleep(0.01)
    await asyncio.sleep(0.1)
    assert not [r for r in caplog.records if r.levelname == "ERROR"], [
        r.getMessage() for r in caplog.records
    ]


async def test_unknown_method_is_unimplemented(channel):
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await channel.unary_unary(f"/{demo_server.SERVICE}/Nope")(b"", timeout=5)
    assert caught.value.code() == grpc.StatusCode.UNIMPLEMENTED


async def test_stop_sets_not_serving_and_lets_an_in_flight_call_finish(server, channel):
    await server.set_serving()
    call = asyncio.ensure_future(
        channel.unary_unary(f"/{demo_server.SERVICE}/Sleep")(b"0.5", timeout=5)
    )
    await asyncio.sleep(0.1)
    stopping = asyncio.ensure_future(server.stop(grace=5))
    assert await call == b"slept"
    await stopping
    statuses = {name: status for name, status in server.health._server_status.items()}
    assert set(statuses.values()) == {health_pb2.HealthCheckResponse.NOT_SERVING}


# ---------------------------------------------------------------- admin HTTP


async def http(port: int, raw: bytes) -> tuple[int, bytes]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(raw)
    data = await asyncio.wait_for(reader.read(), 5)
    writer.close()
    status = int(data.split(b" ", 2)[1])
    return status, data.split(b"\r\n\r\n", 1)[1]


@pytest.fixture
async def admin():
    readiness = Readiness()
    server = AdminServer(readiness, head_timeout=0.5, max_connections=4)
    await server.start("127.0.0.1", 0)
    yield server, readiness
    await server.stop()


async def test_admin_probes_and_metrics(admin):
    server, readiness = admin
    assert await http(server.port, b"GET /healthz HTTP/1.1\r\n\r\n") == (200, b"ok\n")
    assert await http(server.port, b"GET /readyz HTTP/1.1\r\n\r\n") == (
        503,
        b"not ready: starting\n",
    )
    readiness.set_ready()
    assert await http(server.port, b"GET /readyz?verbose HTTP/1.1\r\n\r\n") == (200, b"ready\n")
    readiness.set_not_ready("draining")
    assert await http(server.port, b"GET /readyz HTTP/1.1\r\n\r\n") == (
        503,
        b"not ready: draining\n",
    )
    status, body = await http(server.port, b"GET /metrics HTTP/1.1\r\n\r\n")
    assert status == 200 and b"# TYPE python_gc_objects_collected_total counter" in body


@pytest.mark.parametrize(
    ("raw", "status"),
    [
        (b"GET /nope HTTP/1.1\r\n\r\n", 404),
        (b"POST /readyz HTTP/1.1\r\n\r\n", 405),
        (b"GARBAGE\r\n\r\n", 400),
        (b"GET / SPDY/3\r\n\r\n", 400),
        (b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\n\r\n", 400),
    ],
)
async def test_admin_rejects_bad_requests(admin, raw, status):
    server, _ = admin
    assert (await http(server.port, raw))[0] == status


async def test_admin_times_out_a_slow_request_head(admin):
    server, _ = admin
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(b"GET /healthz HTTP/1.1\r\n")  # never finishes the head
    data = await asyncio.wait_for(reader.read(), 5)
    writer.close()
    assert data.startswith(b"HTTP/1.1 400 ")
