"""Issue 8's resolver cases against a real `waygate resolver serve` process.

Each test reproduces what a hostile (or unlucky) user did to the landed
resolver, then checks that a well-behaved client is still answered and that
the process logged no traceback:
- a view of 100,000 endpoints could never be watched (`Sent message larger
  than max`, with a traceback in the log);
- ApplyRoute with the routes file missing wrote a file holding only that route;
- route paths took dot-segments, NUL and escapes, and 1 MiB lengths;
- route keys went to any Watch client, plaintext ones included.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest

from tests.support.pki import self_signed
from tests.support.processes import RunningService, resolver_serve_argv, start_service
from waygate.resolver.client import Kind, ResolverWatch
from waygate.resolver.v1 import resolver_pb2 as pb
from waygate.resolver.v1 import resolver_pb2_grpc

pytestmark = pytest.mark.system

ENDPOINTS = 100_000


def big_routes_file(path: Path) -> None:
    lines = [
        "services:",
        "  - namespace: shop",
        "    name: web",
        "    ports: [{name: http, port: 80, targetPort: 8080}]",
        "    endpoints: [{address: 10.200.0.1}]",
        "  - namespace: big",
        "    name: svc",
        "    ports: [{name: http, port: 80, targetPort: 8080}]",
        "    endpoints:",
    ]
    lines += [
        f"      - {{address: 10.{i >> 16}.{(i >> 8) & 255}.{i & 255}, zone: zone-{i % 3}}}"
        for i in range(ENDPOINTS)
    ]
    lines += ["routes:", "  - {namespace: shop, name: web, host: shop.example.com, to: web}"]
    path.write_text("\n".join(lines) + "\n")


async def serve(routes: Path) -> RunningService:
    service = await start_service(
        resolver_serve_argv(routes),
        timeout=120,
    )
    return service


def no_traceback(service: RunningService) -> None:
    text = "\n".join(str(entry) for entry in service.logs)
    assert "Traceback" not in text and "larger than max" not in text, text[-2000:]


async def ready(stub: resolver_pb2_grpc.ResolverStub) -> None:
    """Resolve answers (the process has loaded its file)."""
    async with asyncio.timeout(120):
        while True:
            try:
                await stub.Resolve(pb.ResolveRequest(namespace="shop", name="web"), timeout=5)
                return
            except grpc.aio.AioRpcError:
                await asyncio.sleep(0.2)


async def test_100000_endpoints_watch_fine_from_a_real_process(tmp_path: Path) -> None:
    routes = tmp_path / "routes.yaml"
    big_routes_file(routes)
    service = await serve(routes)
    channel = grpc.aio.insecure_channel(service.grpc_address)
    try:
        await ready(resolver_pb2_grpc.ResolverStub(channel))
        watch = ResolverWatch(
            lambda: grpc.aio.insecure_channel(service.grpc_address),
            kinds=[Kind.ENDPOINTS, Kind.SERVICES],
        )
        task = asyncio.create_task(watch.run())
        try:
            view = await watch.wait_synced(120)
            assert len(view.endpoints[("big", "svc")]) == ENDPOINTS
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        # A well-behaved client meanwhile and after.
        stub = resolver_pb2_grpc.ResolverStub(channel)
        reply = await stub.Resolve(pb.ResolveRequest(namespace="shop", name="web"), timeout=5)
        assert [t.address for t in reply.targets] == ["10.200.0.1"]
    finally:
        await channel.close()
        assert await service.stop(timeout=60) == 0
    no_traceback(service)


async def test_route_writes_hostile_paths_and_keys_against_a_real_process(tmp_path: Path) -> None:
    routes = tmp_path / "routes.yaml"
    routes.write_text(
        "services: [{namespace: shop, name: web, ports: [{port: 80, targetPort: 8080}],"
        " endpoints: [{address: 10.0.0.1}]}]\n"
        "routes: [{namespace: shop, name: web, host: shop.example.com, to: web}]\n"
    )
    service = await serve(routes)
    channel = grpc.aio.insecure_channel(service.grpc_address)
    stub = resolver_pb2_grpc.ResolverStub(channel)
    try:
        await ready(stub)

        def api(**fields: object) -> pb.ApplyRouteRequest:
            route = {"namespace": "shop", "name": "api", "host": "api.example.com"}
            route.update(fields)  # type: ignore[arg-type]
            return pb.ApplyRouteRequest(
                route=pb.Route(backends=[pb.RouteBackend(service="web", weight=1)], **route)  # type: ignore[arg-type]
            )

        for path in (
            "/../../etc/passwd",
            "/%2e%2e/admin",
            "/a\x00b",
            "/\x1b[31m",
            "/" + "a" * (1 << 20),
        ):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.ApplyRoute(api(path=path), timeout=10)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert len(info.value.details() or "") < 600

        # A plaintext client never receives a route's private key.
        cert, key = self_signed("api.example.com")
        tls = pb.RouteTLS(termination=pb.TLS_TERMINATION_EDGE, certificate=cert, key=key)
        await stub.ApplyRoute(api(tls=tls), timeout=10)
        call = stub.Watch(pb.WatchRequest(kinds=[pb.RESOURCE_KIND_ROUTES]))
        event = await asyncio.wait_for(call.read(), 10)
        call.cancel()
        (watched,) = [r for r in event.snapshot.routes if r.name == "api"]
        assert watched.tls.certificate == cert and watched.tls.key == ""
        assert event.epoch != 0

        # The routes file disappears: writes are refused, nothing is written.
        routes.unlink()
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.ApplyRoute(api(name="other", host="other.example.com"), timeout=10)
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "missing" in (info.value.details() or "")
        assert not routes.exists()
        reply = await stub.ListRoutes(pb.ListRoutesRequest(), timeout=5)
        assert sorted(r.name for r in reply.routes) == ["api", "web"], "last good state served"
        await stub.Resolve(pb.ResolveRequest(namespace="shop", name="web"), timeout=5)
    finally:
        await channel.close()
        assert await service.stop() == 0
    no_traceback(service)
