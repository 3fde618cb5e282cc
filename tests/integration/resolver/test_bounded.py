"""Issue 8 against a real resolver gRPC server: bounded replies, hostile route input,
and route writes refused while the routes file is missing or invalid.

Each test reproduces the attack and then checks that a well-behaved client is
still served (Resolve and Watch answer within seconds).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from tests.integration.resolver.conftest import ROUTES, Resolver, start_resolver
from tests.support.poll import until
from waygate.core.grpcserver import GrpcServer
from waygate.resolver.model import (
    Endpoint,
    EndpointPort,
    Route,
    RouteBackend,
    RouteTLS,
    Service,
    ServicePort,
    TLSTermination,
)
from waygate.resolver.server import MAX_PAGE_SIZE, ResolverServicer
from waygate.resolver.store import Snapshot, Store
from waygate.resolver.v1 import resolver_pb2 as pb
from waygate.resolver.v1 import resolver_pb2_grpc

SOURCE = "test"
# What a client may receive in grpc-message without trouble; the leak this guards
# against echoed megabytes.
SHORT = 600


async def rpc_error(call: object) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await asyncio.wait_for(call, 20)  # type: ignore[arg-type]
    return info.value


async def still_serving(stub: resolver_pb2_grpc.ResolverStub) -> None:
    """A well-behaved client is answered promptly (generous bound: a busy machine)."""
    response = await stub.Resolve(
        pb.ResolveRequest(namespace="shop", name="web", port="http"), timeout=5
    )
    assert response.targets


def api_route(**fields: object) -> pb.Route:
    base = {
        "namespace": "shop",
        "name": "api",
        "host": "api.example.com",
        "backends": [pb.RouteBackend(service="web", weight=100)],
    }
    base.update(fields)
    return pb.Route(**base)  # type: ignore[arg-type]


# ---------------------------------------------------------------- hostile route input


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"path": "/../../etc/passwd"}, "path"),
        ({"path": "/%2e%2e/admin"}, "path"),
        ({"path": "/a\x00b"}, "path"),
        ({"path": "/\x1b[2Jlog-forgery"}, "path"),
        ({"path": "/" + "a" * (1 << 20)}, "path"),
        ({"host": "h" * (3 << 20) + ".example.com"}, "host"),
        ({"name": "n" * (3 << 20)}, "name"),
        ({"target_port": "p" * (1 << 20)}, "target_port"),
    ],
)
async def test_hostile_route_values_are_refused_briefly(
    resolver: Resolver, caplog: pytest.LogCaptureFixture, fields: dict[str, object], field: str
) -> None:
    before = resolver.file.path.read_bytes()  # type: ignore[union-attr]
    with caplog.at_level(logging.DEBUG):
        error = await rpc_error(
            resolver.stub.ApplyRoute(pb.ApplyRouteRequest(route=api_route(**fields)))
        )
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    details = error.details() or ""
    assert f"{field}:" in details and len(details) < SHORT, details[:SHORT]
    assert all(len(record.getMessage()) < 4096 for record in caplog.records), "logs stay short"
    assert resolver.file.path.read_bytes() == before  # type: ignore[union-attr]
    assert resolver.store.get_route("shop", "api") is None
    await still_serving(resolver.stub)


async def test_paths_are_stored_normalised(resolver: Resolver) -> None:
    reply = await resolver.stub.ApplyRoute(
        pb.ApplyRouteRequest(route=api_route(path="/%7Eu/a%3a")), timeout=10
    )
    assert reply.route.path == "/~u/a%3A"


@pytest.mark.parametrize(
    "request_fields",
    [
        {"namespace": "shop", "name": "n" * (3 << 20)},
        {"namespace": "\x1b[2J" * 1000, "name": "web"},
        {"namespace": "shop", "name": "web", "port": "p" * (3 << 20)},
    ],
)
async def test_resolve_errors_repeat_only_an_excerpt(
    resolver: Resolver, request_fields: dict[str, str]
) -> None:
    """A 3 MB name echoed whole overflowed the client's metadata limit."""
    error = await rpc_error(resolver.stub.Resolve(pb.ResolveRequest(**request_fields)))
    assert error.code() == grpc.StatusCode.NOT_FOUND
    assert len(error.details() or "") < SHORT and "\x1b" not in (error.details() or "")
    await still_serving(resolver.stub)


async def test_non_ascii_digits_are_not_port_numbers(resolver: Resolver) -> None:
    """str.isdigit() is true for "²", which int() refuses: that was an INTERNAL."""
    error = await rpc_error(
        resolver.stub.Resolve(pb.ResolveRequest(namespace="shop", name="web", port="²"))
    )
    assert error.code() == grpc.StatusCode.NOT_FOUND
    error = await rpc_error(
        resolver.stub.ApplyRoute(pb.ApplyRouteRequest(route=api_route(target_port="٣")))
    )
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    await still_serving(resolver.stub)


# ---------------------------------------------------------------- the routes file


async def test_apply_and_delete_refuse_while_the_file_is_missing(resolver: Resolver) -> None:
    """Issue 8: ApplyRoute with the file missing wrote a file holding only that route."""
    path = resolver.file.path  # type: ignore[union-attr]
    routes_before = resolver.store.routes()
    path.unlink()
    error = await rpc_error(resolver.stub.ApplyRoute(pb.ApplyRouteRequest(route=api_route())))
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "missing" in (error.details() or "")
    error = await rpc_error(
        resolver.stub.DeleteRoute(
            pb.DeleteRouteRequest(ref=pb.RouteRef(namespace="shop", name="web"))
        )
    )
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert not path.exists(), "nothing was written"
    assert resolver.store.routes() == routes_before, "the last good view keeps serving"
    await still_serving(resolver.stub)


async def test_apply_and_delete_refuse_while_the_file_is_invalid(resolver: Resolver) -> None:
    source = resolver.file
    assert source is not None
    broken = ROUTES.replace("host: shop.example.com", "host: NOT_A_HOST")
    source.path.write_text(broken)
    assert not await source.reload()
    for call in (
        resolver.stub.ApplyRoute(pb.ApplyRouteRequest(route=api_route())),
        resolver.stub.DeleteRoute(
            pb.DeleteRouteRequest(ref=pb.RouteRef(namespace="shop", name="web"))
        ),
    ):
        error = await rpc_error(call)
        assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "has an error" in (error.details() or "") and "host" in (error.details() or "")
    assert source.path.read_text() == broken, "the operator's file is left as they wrote it"
    assert resolver.store.get_route("shop", "web") is not None
    await still_serving(resolver.stub)


# ---------------------------------------------------------------- ListRoutes pages


@pytest.fixture
async def many_routes(tmp_path: Path) -> AsyncIterator[Resolver]:
    handle, server, channel = await start_resolver(tmp_path, routes=None)
    handle.store.replace_source(
        SOURCE,
        routes=[
            Route(f"ns{i % 3}", f"r{i:04d}", f"r{i}.example.com", backends=(RouteBackend("web"),))
            for i in range(1200)
        ],
    )
    try:
        yield handle
    finally:
        await channel.close()
        await server.stop(0)


async def list_all(stub: resolver_pb2_grpc.ResolverStub, **request: object) -> list[list[pb.Route]]:
    pages = []
    token = ""
    while True:
        reply = await stub.ListRoutes(pb.ListRoutesRequest(page_token=token, **request), timeout=10)  # type: ignore[arg-type]
        pages.append(list(reply.routes))
        token = reply.next_page_token
        if not token:
            return pages
        assert len(pages) < 100, "paging terminates"


async def test_list_routes_pages_cover_everything_once(many_routes: Resolver) -> None:
    pages = await list_all(many_routes.stub)
    assert [len(p) for p in pages] == [100] * 12, "the default page size is 100"
    names = [(r.namespace, r.name) for page in pages for r in page]
    assert names == sorted(set(names)) and len(names) == 1200
    capped = await list_all(many_routes.stub, page_size=100_000)
    assert [len(p) for p in capped] == [MAX_PAGE_SIZE, 200]
    ns1 = await list_all(many_routes.stub, namespace="ns1", page_size=150)
    assert [len(p) for p in ns1] == [150, 150, 100]
    assert all(r.namespace == "ns1" for page in ns1 for r in page)


async def test_a_page_token_that_is_not_ours_is_invalid_argument(many_routes: Resolver) -> None:
    for token in ("garbage!", "x" * 100_000):
        error = await rpc_error(many_routes.stub.ListRoutes(pb.ListRoutesRequest(page_token=token)))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "page_token" in (error.details() or "") and len(error.details() or "") < SHORT


async def test_list_routes_pages_are_bounded_in_bytes(tmp_path: Path) -> None:
    """Forty routes with 200 KB certificate chains would be an 8 MB reply in one piece."""
    handle, server, channel = await start_resolver(tmp_path, routes=None)
    try:
        chain = "-----BEGIN CERTIFICATE-----\n" + "A" * 200_000 + "\n-----END CERTIFICATE-----\n"
        handle.store.replace_source(
            SOURCE,
            routes=[
                Route(
                    "big",
                    f"r{i:02d}",
                    f"r{i}.example.com",
                    backends=(RouteBackend("web"),),
                    tls=RouteTLS(TLSTermination.EDGE, certificate=chain, key="secret"),
                )
                for i in range(40)
            ],
        )
        pages = await list_all(handle.stub)
        assert len(pages) > 4 and sum(len(p) for p in pages) == 40
        assert all(pb.ListRoutesResponse(routes=p).ByteSize() < 2 << 20 for p in pages)
        assert all(r.tls.key == "" for p in pages for r in p)
    finally:
        await channel.close()
        await server.stop(0)


# ---------------------------------------------------------------- Watch size bounds


async def serve(
    store: Store, **servicer: object
) -> tuple[GrpcServer, grpc.aio.Channel, resolver_pb2_grpc.ResolverStub]:
    server = GrpcServer(
        host="127.0.0.1", port=0, registrations=[ResolverServicer(store, **servicer).registration()]
    )  # type: ignore[arg-type]
    port = await server.start()
    await server.set_serving()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    return server, channel, resolver_pb2_grpc.ResolverStub(channel)


def endpoints(count: int, prefix: str = "10.0") -> list[Endpoint]:
    return [
        Endpoint("big", "svc", f"{prefix}.{i >> 8}.{i & 255}", (EndpointPort("http", 8080),))
        for i in range(count)
    ]


async def read_snapshot(call: grpc.aio.UnaryStreamCall) -> list[pb.WatchEvent]:
    events = []
    while True:
        event = await asyncio.wait_for(call.read(), 20)
        assert event.WhichOneof("event") == "snapshot"
        events.append(event)
        if not event.snapshot.more:
            return events


async def test_a_changes_batch_too_large_for_one_event_becomes_a_chunked_snapshot() -> None:
    store = Store()
    store.set_endpoints("big", "svc", endpoints(10), source=SOURCE)
    server, channel, stub = await serve(store, watch_chunk_bytes=8192, max_event_bytes=16384)
    try:
        call = stub.Watch(pb.WatchRequest())
        assert len(await read_snapshot(call)) == 1
        store.set_endpoints("big", "svc", endpoints(2000, "10.1"), source=SOURCE)
        chunks = await read_snapshot(call)
        assert len(chunks) > 4 and all(c.ByteSize() <= 8192 for c in chunks)
        assert {c.version for c in chunks} == {store.version}
        addresses = {e.address for c in chunks for e in c.snapshot.endpoints}
        assert len(addresses) == 2000 and "10.0.0.0" not in addresses
        call.cancel()
    finally:
        await channel.close()
        await server.stop(0)


async def test_an_object_larger_than_any_event_is_resource_exhausted_not_a_traceback(
    caplog: pytest.LogCaptureFixture,
) -> None:
    store = Store()
    store.upsert_route(
        Route(
            "big",
            "huge",
            "huge.example.com",
            backends=(RouteBackend("web"),),
            tls=RouteTLS(TLSTermination.EDGE, certificate="C" * 50_000, key="k"),
        ),
        source=SOURCE,
    )
    server, channel, stub = await serve(store, watch_chunk_bytes=8192, max_event_bytes=16384)
    try:
        with caplog.at_level(logging.INFO):
            call = stub.Watch(pb.WatchRequest())
            error = await rpc_error(call.read())
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "limit of one Watch event" in (error.details() or "")
        assert not [r for r in caplog.records if r.exc_info], "no traceback in the log"
        # The rest of the service is unaffected.
        await until(lambda: store.subscriber_count == 0, "the failed watch released")
        reply = await stub.ListRoutes(pb.ListRoutesRequest(), timeout=5)
        assert [r.name for r in reply.routes] == ["huge"]
    finally:
        await channel.close()
        await server.stop(0)


async def test_a_resolve_reply_over_the_limit_is_resource_exhausted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    store = Store()
    store.upsert_service(
        Service("big", "svc", ports=(ServicePort("http", 80, "8080"),)), source=SOURCE
    )
    store.set_endpoints("big", "svc", endpoints(3000), source=SOURCE)
    server, channel, stub = await serve(store, max_event_bytes=16384)
    try:
        with caplog.at_level(logging.INFO):
            error = await rpc_error(stub.Resolve(pb.ResolveRequest(namespace="big", name="svc")))
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "3000 ready endpoints" in (error.details() or "")
        assert not [r for r in caplog.records if r.exc_info], "no traceback in the log"
    finally:
        await channel.close()
        await server.stop(0)


async def test_a_large_snapshot_is_converted_off_the_loop_once_for_all_watchers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Converting 100,000 endpoints takes seconds; Resolve must be answered meanwhile.

    The conversion is held at a gate until a Resolve has been answered: were it on
    the event loop, that Resolve could not be answered first (the gate gives up
    after 5 s, so a regression fails instead of hanging).
    """
    import threading

    from waygate.resolver import events as wire

    store = Store()
    store.upsert_service(
        Service("big", "svc", ports=(ServicePort("http", 80, "8080"),)), source=SOURCE
    )
    store.set_endpoints("big", "svc", endpoints(20_000), source=SOURCE)
    entered, release = threading.Event(), threading.Event()
    conversions: list[int] = []
    real = wire.watch_events

    def gated(item, *args, **kwargs):  # type: ignore[no-untyped-def]
        if isinstance(item, Snapshot):
            conversions.append(1)
            entered.set()
            release.wait(5)
        return real(item, *args, **kwargs)

    monkeypatch.setattr(wire, "watch_events", gated)
    server, channel, stub = await serve(store)
    try:
        calls = [stub.Watch(pb.WatchRequest()) for _ in range(3)]
        firsts = [asyncio.ensure_future(call.read()) for call in calls]
        await until(entered.is_set, "the conversion started")
        reply = await stub.Resolve(
            pb.ResolveRequest(namespace="big", name="svc", pick=pb.PICK_POLICY_RANDOM), timeout=5
        )
        assert reply.picked.address and not any(f.done() for f in firsts)
        # All three wait on the one conversion before it may finish (a late one
        # would find it done and count as a second call).
        await until(lambda: store.subscriber_count == 3, "every watcher subscribed")
        release.set()
        events = await asyncio.wait_for(asyncio.gather(*firsts), 30)
        assert all(e.WhichOneof("event") == "snapshot" for e in events)
        assert len(conversions) == 1, "three watchers, one conversion"
        for call in calls:
            call.cancel()
    finally:
        release.set()
        await channel.close()
        await server.stop(0)


async def test_a_large_changes_batch_to_a_connected_watcher_is_converted_off_the_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """20,000 endpoints land while a watcher is connected: the Changes event is
    converted in a worker thread, so Resolve is answered meanwhile (the conversion
    is held at a gate until then; the gate gives up after 5 s, so a regression
    fails instead of hanging)."""
    import threading

    from waygate.resolver import events as wire
    from waygate.resolver.store import Batch

    store = Store()
    store.upsert_service(
        Service("big", "svc", ports=(ServicePort("http", 80, "8080"),)), source=SOURCE
    )
    store.set_endpoints("big", "svc", endpoints(1), source=SOURCE)
    entered, release = threading.Event(), threading.Event()
    real = wire.watch_events

    def gated(item, *args, **kwargs):  # type: ignore[no-untyped-def]
        if isinstance(item, Batch) and len(item.changes) > 1000:
            entered.set()
            release.wait(5)
        return real(item, *args, **kwargs)

    monkeypatch.setattr(wire, "watch_events", gated)
    server, channel, stub = await serve(store)
    try:
        call = stub.Watch(pb.WatchRequest())
        await read_snapshot(call)
        store.set_endpoints("big", "svc", endpoints(20_000, "10.1"), source=SOURCE)
        changes = asyncio.ensure_future(call.read())
        await until(entered.is_set, "the conversion started")
        reply = await stub.Resolve(
            pb.ResolveRequest(namespace="big", name="svc", pick=pb.PICK_POLICY_RANDOM), timeout=5
        )
        assert reply.picked.address and not changes.done()
        release.set()
        event = await asyncio.wait_for(changes, 30)
        assert event.WhichOneof("event") == "changes"
        assert len(event.changes.changes) == 20_001  # 20,000 added, one removed
        call.cancel()
    finally:
        release.set()
        await channel.close()
        await server.stop(0)


async def test_a_batch_that_cannot_fit_one_event_is_never_converted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """More changes than the event bound could hold even at their smallest: the
    subscriber is resynced without converting the batch first (it would be thrown away)."""
    from waygate.resolver import events as wire
    from waygate.resolver.store import Batch

    store = Store()
    store.set_endpoints("big", "svc", endpoints(10), source=SOURCE)
    converted: list[int] = []
    real = wire.watch_events

    def counting(item, *args, **kwargs):  # type: ignore[no-untyped-def]
        if isinstance(item, Batch):
            converted.append(len(item.changes))
        return real(item, *args, **kwargs)

    monkeypatch.setattr(wire, "watch_events", counting)
    server, channel, stub = await serve(store, watch_chunk_bytes=8192, max_event_bytes=16384)
    try:
        call = stub.Watch(pb.WatchRequest())
        await read_snapshot(call)
        store.set_endpoints("big", "svc", endpoints(2000, "10.1"), source=SOURCE)
        chunks = await read_snapshot(call)
        assert sum(len(c.snapshot.endpoints) for c in chunks) == 2000
        assert converted == [], "the batch was converted only to be discarded"
        call.cancel()
    finally:
        await channel.close()
        await server.stop(0)
