"""A real service process on the shared core: readiness, drain on SIGTERM, and a
trace that crosses two processes into an OTLP receiver (a stand-in for Jaeger)."""

from __future__ import annotations

import asyncio
import signal

import grpc
import pytest

from tests.support.otlp import OtlpReceiver
from tests.support.processes import http_get, run_cli, start_service
from waygate.core.grpcclient import open_channel

pytestmark = pytest.mark.system

DEMO = ("tests.support.demo_server",)


async def test_not_ready_until_declared_then_sigterm_drains_an_in_flight_call():
    service = await start_service([*DEMO, "--ready-delay", "4", "--shutdown-grace", "10"])
    try:
        assert (await http_get(service.admin_port, "/readyz"))[0] == 503
        code, out, _ = await run_cli("health", service.grpc_address)
        assert (code, out.strip()) == (1, "NOT_SERVING")
        async with asyncio.timeout(10):
            while (await http_get(service.admin_port, "/readyz"))[0] != 200:
                await asyncio.sleep(0.1)
        code, out, _ = await run_cli("health", service.grpc_address)
        assert (code, out.strip()) == (0, "SERVING")

        async with open_channel(service.grpc_address, retry=False) as channel:
            call = asyncio.ensure_future(
                channel.unary_unary("/waygate.test.Demo/Sleep")(b"1.5", timeout=10)
            )
            await asyncio.sleep(0.3)
            service.process.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.3)
            # Draining: not ready for new traffic, but the in-flight call completes.
            assert await http_get(service.admin_port, "/readyz") == (503, "not ready: draining\n")
            assert await call == b"slept"
            with pytest.raises(grpc.aio.AioRpcError):
                await channel.unary_unary("/waygate.test.Demo/Sleep")(b"0", timeout=2)
        assert await service.stop(sig=None) == 0
        assert service.logged("draining") and service.logged("stopped")
    finally:
        await service.stop(signal.SIGKILL)


async def test_sigterm_cancels_calls_that_outlive_the_grace_period():
    service = await start_service([*DEMO, "--shutdown-grace", "0.5"])
    try:
        async with open_channel(service.grpc_address, retry=False) as channel:
            call = asyncio.ensure_future(
                channel.unary_unary("/waygate.test.Demo/Sleep")(b"30", timeout=60)
            )
            await asyncio.sleep(0.3)
            service.process.send_signal(signal.SIGTERM)
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await asyncio.wait_for(call, 10)
            assert caught.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
        assert await service.stop(sig=None) == 0
    finally:
        await service.stop(signal.SIGKILL)


async def test_one_trace_crosses_the_cli_and_the_server_process():
    receiver = OtlpReceiver()
    endpoint = await receiver.start()
    env = {"WAYGATE_OTLP_ENDPOINT": endpoint, "OTEL_BSP_SCHEDULE_DELAY": "100"}
    service = await start_service([*DEMO, "--ready-delay", "0"], env=env)
    try:
        code, _out, err = await run_cli("health", service.grpc_address, env=env)
        assert code == 0, err

        def both_sides(spans):
            names = {(s.service, s.kind) for s in spans if s.name == "grpc.health.v1.Health/Check"}
            return {
                ("waygate-cli", OtlpReceiver.SPAN_KIND_CLIENT),
                ("waygate-demo", OtlpReceiver.SPAN_KIND_SERVER),
            } <= names

        spans = await receiver.wait_for(both_sides)
        client = next(
            s
            for s in spans
            if s.service == "waygate-cli" and s.kind == OtlpReceiver.SPAN_KIND_CLIENT
        )
        server = next(
            s
            for s in spans
            if s.service == "waygate-demo"
            and s.kind == OtlpReceiver.SPAN_KIND_SERVER
            and s.trace_id == client.trace_id
        )
        assert server.parent_span_id == client.span_id
        assert server.attributes["rpc.system"] == "grpc"
        assert server.attributes["rpc.service"] == "grpc.health.v1.Health"
        assert server.attributes["rpc.grpc.status_code"] == 0
    finally:
        await service.stop()
        await receiver.stop()


async def test_server_to_server_call_continues_the_callers_trace():
    receiver = OtlpReceiver()
    endpoint = await receiver.start()
    env = {"WAYGATE_OTLP_ENDPOINT": endpoint, "OTEL_BSP_SCHEDULE_DELAY": "100"}
    first = await start_service([*DEMO], env=env)
    second = await start_service([*DEMO], env=env)
    try:
        async with open_channel(first.grpc_address) as channel:
            reply = await channel.unary_unary("/waygate.test.Demo/Call")(
                second.grpc_address.encode(), timeout=10
            )
        assert reply in (b"SERVING", b"NOT_SERVING")

        def chain(spans):
            call = [
                s
                for s in spans
                if s.name == "waygate.test.Demo/Call" and s.kind == OtlpReceiver.SPAN_KIND_SERVER
            ]
            checks = [s for s in spans if s.name == "grpc.health.v1.Health/Check"]
            return call and len({s.kind for s in checks if s.trace_id == call[0].trace_id}) == 2

        spans = await receiver.wait_for(chain)
        call = next(s for s in spans if s.name == "waygate.test.Demo/Call")
        hop = next(
            s
            for s in spans
            if s.trace_id == call.trace_id and s.kind == OtlpReceiver.SPAN_KIND_CLIENT
        )
        remote = next(
            s
            for s in spans
            if s.trace_id == call.trace_id
            and s.name == "grpc.health.v1.Health/Check"
            and s.kind == OtlpReceiver.SPAN_KIND_SERVER
        )
        assert hop.parent_span_id == call.span_id
        assert remote.parent_span_id == hop.span_id
    finally:
        await first.stop()
        await second.stop()
        await receiver.stop()
