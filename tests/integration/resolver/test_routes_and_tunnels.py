"""ListRoutes / ApplyRoute / DeleteRoute and ReportTunnels over real gRPC."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from google.protobuf import duration_pb2

from tests.integration.resolver.conftest import Resolver, start_resolver
from tests.support.pki import self_signed
from tests.support.poll import until as eventually
from waygate.resolver.filesource import FileSource
from waygate.resolver.store import Store
from waygate.resolver.v1 import resolver_pb2 as pb


def route(**fields: object) -> pb.Route:
    base: dict[str, object] = {
        "namespace": "shop",
        "name": "api",
        "host": "API.Example.com",
        "path": "/v1",
        "backends": [pb.RouteBackend(service="web", weight=10)],
    }
    base.update(fields)
    return pb.Route(**base)  # type: ignore[arg-type]


async def apply_error(resolver: Resolver, message: pb.Route) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await resolver.stub.ApplyRoute(pb.ApplyRouteRequest(route=message), timeout=5)
    return info.value.code(), info.value.details() or ""


async def test_apply_list_delete_round_trip_persists_in_the_file(resolver: Resolver) -> None:
    cert, key = self_signed("api.example.com")
    applied = await resolver.stub.ApplyRoute(
        pb.ApplyRouteRequest(
            route=route(
                tls=pb.RouteTLS(
                    termination=pb.TLS_TERMINATION_EDGE,
                    certificate=cert,
                    key=key,
                    insecure_edge_termination_policy=pb.INSECURE_EDGE_POLICY_REDIRECT,
                ),
                timeouts=pb.RouteTimeouts(server=duration_pb2.Duration(seconds=45)),
                balance=pb.BALANCE_POLICY_SOURCE,
            )
        ),
        timeout=5,
    )
    assert applied.route.host == "api.example.com", "host lower-cased"
    assert applied.version == resolver.store.version
    listed = await resolver.stub.ListRoutes(pb.ListRoutesRequest(namespace="shop"), timeout=5)
    assert [r.name for r in listed.routes] == ["api", "web"]
    assert listed.routes[0] == applied.route
    # What a restarted resolver would read back from the file:
    fresh = Store()
    assert resolver.file is not None
    assert FileSource(fresh, resolver.file.path).load()
    stored = fresh.get_route("shop", "api")
    assert stored is not None and stored.timeouts.server == 45.0 and stored.tls is not None
    assert stored.tls.key == key
    await resolver.stub.DeleteRoute(
        pb.DeleteRouteRequest(ref=pb.RouteRef(namespace="shop", name="api")), timeout=5
    )
    assert resolver.store.get_route("shop", "api") is None
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await resolver.stub.DeleteRoute(
            pb.DeleteRouteRequest(ref=pb.RouteRef(namespace="shop", name="api")), timeout=5
        )
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"host": "bad_host.example.com"}, "host"),
        ({"path": "v1"}, "path"),
        ({"backends": [pb.RouteBackend(service="web", weight=257)]}, "backends[0].weight"),
        ({"backends": []}, "backends"),
        (
            {
                "tls": pb.RouteTLS(
                    termination=pb.TLS_TERMINATION_EDGE, certificate="junk", key="junk"
                )
            },
            "tls.certificate",
        ),
        (
            {"tls": pb.RouteTLS(termination=pb.TLS_TERMINATION_PASSTHROUGH, certificate="x")},
            "tls.certificate",
        ),
        ({"tls": pb.RouteTLS(termination=7)}, "tls.termination"),
        ({"namespace": ""}, "namespace"),
    ],
)
async def test_apply_route_validation_errors_name_the_field(
    resolver: Resolver, fields: dict[str, object], field: str
) -> None:
    assert resolver.file is not None
    before = resolver.file.path.read_bytes()
    code, message = await apply_error(resolver, route(**fields))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert f"{field}:" in message, message
    assert resolver.file.path.read_bytes() == before, "a rejected route leaves the file alone"


async def test_key_not_matching_certificate_is_rejected(resolver: Resolver) -> None:
    cert, _ = self_signed("api.example.com")
    _, other_key = self_signed("other.example.com")
    code, message = await apply_error(
        resolver,
        route(
            tls=pb.RouteTLS(termination=pb.TLS_TERMINATION_EDGE, certificate=cert, key=other_key)
        ),
    )
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert "tls.key: does not match" in message


async def test_all_zero_weights_are_accepted(resolver: Resolver) -> None:
    applied = await resolver.stub.ApplyRoute(
        pb.ApplyRouteRequest(
            route=route(
                backends=[
                    pb.RouteBackend(service="web", weight=0),
                    pb.RouteBackend(service="lb", weight=0),
                ]
            )
        ),
        timeout=5,
    )
    assert [b.weight for b in applied.route.backends] == [0, 0]


async def test_routes_are_read_only_without_a_routes_file(tmp_path: Path) -> None:
    handle, server, channel = await start_resolver(tmp_path, routes=None)
    try:
        code, message = await apply_error(handle, route())
        assert code == grpc.StatusCode.FAILED_PRECONDITION and "read-only" in message
        listed = await handle.stub.ListRoutes(pb.ListRoutesRequest(), timeout=5)
        assert list(listed.routes) == []
    finally:
        await channel.close()
        await server.stop(0)


async def test_routes_owned_by_kubernetes_are_read_only(resolver: Resolver) -> None:
    from waygate.resolver.model import Route, RouteBackend

    resolver.store.upsert_route(
        Route("shop", "api", "k.example.com", "/", (RouteBackend("web"),)), source="kubernetes"
    )
    code, message = await apply_error(resolver, route())
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "kubernetes" in message


# ---------------------------------------------------------------- ReportTunnels


class Reporter:
    """A tunnel server's side of one ReportTunnels stream."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[pb.TunnelReport | None] = asyncio.Queue()

    async def requests(self) -> AsyncIterator[pb.TunnelReport]:
        while (report := await self.queue.get()) is not None:
            yield report

    def send(
        self,
        server_id: str,
        nodes: list[str],
        lease: float | None = None,
        address: str = "127.0.0.1:7004",
    ) -> None:
        report = pb.TunnelReport(server=pb.TunnelServer(id=server_id, address=address), nodes=nodes)
        if lease is not None:
            report.lease.FromNanoseconds(int(lease * 1e9))
        self.queue.put_nowait(report)


def holders(resolver: Resolver, node: str) -> list[str]:
    presence = resolver.store.tunnel_presence(node)
    return [s.id for s in presence.servers] if presence else []


async def test_presence_follows_reports_and_goes_when_the_stream_ends(resolver: Resolver) -> None:
    a, b = Reporter(), Reporter()
    call_a = resolver.stub.ReportTunnels(a.requests())
    call_b = resolver.stub.ReportTunnels(b.requests())
    a.send("ts-a", ["edge-1", "edge-2"])
    b.send("ts-b", ["edge-2"], address="127.0.0.2:7004")
    await eventually(lambda: holders(resolver, "edge-2") == ["ts-a", "ts-b"])
    assert holders(resolver, "edge-1") == ["ts-a"]
    a.send("ts-a", ["edge-2"])  # a state, not a delta: edge-1 is no longer held
    await eventually(lambda: holders(resolver, "edge-1") == [])
    a.queue.put_nowait(None)  # the stream ends cleanly
    response = await asyncio.wait_for(call_a, 10)
    assert response.version == resolver.store.version, "the answer includes its own removal"
    assert holders(resolver, "edge-2") == ["ts-b"]
    call_b.cancel()  # the stream breaks
    await eventually(lambda: holders(resolver, "edge-2") == [])
    await eventually(lambda: resolver.tunnels.open_streams == 0)


async def test_presence_goes_when_the_lease_lapses_and_returns_with_a_report(
    tmp_path: Path,
) -> None:
    handle, server, channel = await start_resolver(
        tmp_path, tunnels={"default_lease": 30.0, "min_lease": 0.2, "max_lease": 60.0}
    )
    reporter = Reporter()
    call = handle.stub.ReportTunnels(reporter.requests())
    try:
        reporter.send("ts-a", ["edge-1"], lease=0.1)  # clamped up to 0.2s
        await eventually(lambda: holders(handle, "edge-1") == ["ts-a"])
        await eventually(lambda: holders(handle, "edge-1") == [], timeout=10)
        reporter.send("ts-a", ["edge-1"], lease=30)
        await eventually(lambda: holders(handle, "edge-1") == ["ts-a"])
    finally:
        call.cancel()
        await channel.close()
        await server.stop(0)


@pytest.mark.parametrize(
    ("server_id", "address", "nodes", "field"),
    [
        ("", "127.0.0.1:7004", ["edge-1"], "server.id"),
        ("Bad_Id", "127.0.0.1:7004", ["edge-1"], "server.id"),
        ("ts-a", "no-port", ["edge-1"], "server.address"),
        ("ts-a", "127.0.0.1:99999", ["edge-1"], "server.address"),
        ("ts-a", "127.0.0.1:7004", ["Not A Node"], "nodes"),
    ],
)
async def test_bad_reports_are_invalid_argument(
    resolver: Resolver, server_id: str, address: str, nodes: list[str], field: str
) -> None:
    reporter = Reporter()
    call = resolver.stub.ReportTunnels(reporter.requests())
    reporter.send(server_id, nodes, address=address)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await asyncio.wait_for(call, 10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (info.value.details() or "").startswith(f"{field}:")
    await eventually(lambda: resolver.tunnels.open_streams == 0)


async def test_a_stream_cannot_switch_server(resolver: Resolver) -> None:
    reporter = Reporter()
    call = resolver.stub.ReportTunnels(reporter.requests())
    reporter.send("ts-a", ["edge-1"])
    reporter.send("ts-b", ["edge-1"])
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await asyncio.wait_for(call, 10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    await eventually(lambda: holders(resolver, "edge-1") == [])


async def test_draining_ends_report_streams_with_unavailable(resolver: Resolver) -> None:
    reporter = Reporter()
    call = resolver.stub.ReportTunnels(reporter.requests())
    reporter.send("ts-a", ["edge-1"])
    await eventually(lambda: holders(resolver, "edge-1") == ["ts-a"])
    resolver.tunnels.end_streams()
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await asyncio.wait_for(call, 10)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "shutting down" in (info.value.details() or "")
    assert holders(resolver, "edge-1") == []
    assert resolver.tunnels.open_streams == 0


# ---------------------------------------------------------------- route keys


async def test_route_private_keys_never_go_to_plaintext_clients_and_the_file_is_0600(
    resolver: Resolver,
) -> None:
    """Any client may list routes; only a route reader's Watch (over mTLS, see
    test_route_readers) gets the key, never a plaintext client's. The file that
    holds the key is written 0600 even when it was world-readable."""
    assert resolver.file is not None
    resolver.file.path.chmod(0o644)
    cert, key = self_signed("api.example.com")
    tls = pb.RouteTLS(termination=pb.TLS_TERMINATION_EDGE, certificate=cert, key=key)
    applied = await resolver.stub.ApplyRoute(pb.ApplyRouteRequest(route=route(tls=tls)), timeout=5)
    assert applied.route.tls.certificate == cert and applied.route.tls.key == ""
    listed = await resolver.stub.ListRoutes(pb.ListRoutesRequest(), timeout=5)
    (api,) = [r for r in listed.routes if r.name == "api"]
    assert api.tls.certificate == cert and api.tls.termination == pb.TLS_TERMINATION_EDGE
    assert api.tls.key == ""
    assert all(r.tls.key == "" for r in listed.routes)
    assert resolver.file.path.stat().st_mode & 0o777 == 0o600
    assert key.splitlines()[1] in resolver.file.path.read_text(), "the file keeps the key"

    call = resolver.stub.Watch(pb.WatchRequest(kinds=[pb.RESOURCE_KIND_ROUTES]))
    try:
        event = await asyncio.wait_for(call.read(), 10)
        (watched,) = [r for r in event.snapshot.routes if r.name == "api"]
        assert watched.tls.certificate == cert and watched.tls.key == ""
        resolver.store.delete_route("shop", "api", source=f"file:{resolver.file.path}")
        await resolver.stub.ApplyRoute(pb.ApplyRouteRequest(route=route(tls=tls)), timeout=5)
        while True:
            change = await asyncio.wait_for(call.read(), 10)
            upserts = [c.route_upserted for c in change.changes.changes if c.route_upserted.name]
            if upserts:
                break
        assert upserts[0].tls.certificate == cert and upserts[0].tls.key == ""
    finally:
        call.cancel()
