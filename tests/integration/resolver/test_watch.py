"""Watch over real gRPC: snapshot, ordered deltas, resume, too-old resume, coalescing."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc

from tests.integration.resolver.conftest import Resolver, start_resolver
from tests.support.poll import until as eventually
from waygate.resolver.model import Endpoint, EndpointPort, Route, RouteBackend, Service, ServicePort
from waygate.resolver.v1 import resolver_pb2 as pb

SOURCE = "test"


def endpoint(address: str, zone: str = "") -> Endpoint:
    return Endpoint("shop", "web", address, (EndpointPort("http", 8080),), zone=zone)


async def next_event(call: grpc.aio.UnaryStreamCall) -> pb.WatchEvent:
    event = await asyncio.wait_for(call.read(), 10)
    assert event is not grpc.aio.EOF
    return event


async def test_snapshot_first_then_ordered_changes(resolver: Resolver) -> None:
    store = resolver.store
    call = resolver.stub.Watch(pb.WatchRequest())
    try:
        first = await next_event(call)
        assert first.WhichOneof("event") == "snapshot"
        assert first.version == store.version
        assert first.source == f"file:{resolver.file.path}"  # type: ignore[union-attr]
        assert first.HasField("last_sync")
        assert {(s.namespace, s.name) for s in first.snapshot.services} >= {("shop", "web")}
        assert [r.host for r in first.snapshot.routes] == ["shop.example.com"]
        endpoints = {e.address for e in first.snapshot.endpoints if e.service == "web"}
        assert endpoints == {"10.1.0.1", "10.1.0.2", "10.1.0.3", "10.1.0.4"}

        store.upsert_service(
            Service("shop", "api", ports=(ServicePort("", 80, "80"),)), source=SOURCE
        )
        store.set_tunnel_presence("edge-1", [])
        store.delete_service("shop", "api", source=SOURCE)
        versions = [first.version]
        kinds = []
        while versions[-1] < store.version:
            event = await next_event(call)
            assert event.WhichOneof("event") == "changes"
            assert event.changes.from_version == versions[-1], "each event continues the last"
            versions.append(event.version)
            kinds += [c.WhichOneof("change") for c in event.changes.changes]
        assert kinds in (
            ["service_upserted", "service_deleted"],
            ["service_deleted"],  # both landed before the stream ran: coalesced to the latest
        )
    finally:
        call.cancel()


async def test_removed_endpoint_arrives_as_a_delete(resolver: Resolver) -> None:
    store = resolver.store
    call = resolver.stub.Watch(pb.WatchRequest(kinds=[pb.RESOURCE_KIND_ENDPOINTS]))
    try:
        snapshot = await next_event(call)
        assert not snapshot.snapshot.services and not snapshot.snapshot.routes
        remaining = [e for e in store.endpoints_of("shop", "web") if e.address != "10.1.0.1"]
        store.set_endpoints("shop", "web", remaining, source=f"file:{resolver.file.path}")  # type: ignore[union-attr]
        event = await next_event(call)
        (change,) = event.changes.changes
        assert change.WhichOneof("change") == "endpoint_deleted"
        assert (change.endpoint_deleted.service, change.endpoint_deleted.address) == (
            "web",
            "10.1.0.1",
        )
    finally:
        call.cancel()


async def test_resume_from_a_version_gets_only_the_changes_after_it(resolver: Resolver) -> None:
    store = resolver.store
    resume = store.version
    store.set_endpoints("shop", "web2", [Endpoint("shop", "web2", "10.7.0.1")], source=SOURCE)
    store.set_endpoints("shop", "web2", [Endpoint("shop", "web2", "10.7.0.2")], source=SOURCE)
    call = resolver.stub.Watch(
        pb.WatchRequest(resume_from_version=resume, resume_epoch=store.epoch)
    )
    try:
        event = await next_event(call)
        assert event.WhichOneof("event") == "changes"
        assert event.epoch == store.epoch
        assert event.changes.from_version == resume and event.version == store.version
        got = [
            (c.WhichOneof("change"), c.endpoint_upserted.address or c.endpoint_deleted.address)
            for c in event.changes.changes
        ]
        assert got == [("endpoint_deleted", "10.7.0.1"), ("endpoint_upserted", "10.7.0.2")]
    finally:
        call.cancel()


async def test_too_old_resume_gets_a_full_snapshot(tmp_path: Path) -> None:
    handle, server, channel = await start_resolver(tmp_path, history_limit=5)
    try:
        old = handle.store.version
        for i in range(10):
            handle.store.set_endpoints(
                "shop", "churn", [Endpoint("shop", "churn", f"10.8.0.{i}")], source=SOURCE
            )
        call = handle.stub.Watch(
            pb.WatchRequest(resume_from_version=old, resume_epoch=handle.store.epoch)
        )
        event = await next_event(call)
        assert event.WhichOneof("event") == "snapshot"
        assert event.version == handle.store.version
        churn = [e.address for e in event.snapshot.endpoints if e.service == "churn"]
        assert churn == ["10.8.0.9"]
        # A version from another resolver process (smaller clock base) is too old as well.
        call.cancel()
        call = handle.stub.Watch(
            pb.WatchRequest(resume_from_version=57, resume_epoch=handle.store.epoch)
        )
        assert (await next_event(call)).WhichOneof("event") == "snapshot"
        call.cancel()
    finally:
        await channel.close()
        await server.stop(0)


async def test_resume_with_a_foreign_or_missing_epoch_gets_a_snapshot(resolver: Resolver) -> None:
    """A version from another replica's version space is never continued with deltas,
    even when it is inside this replica's history."""
    store = resolver.store
    resume = store.version
    store.set_endpoints("shop", "web2", [Endpoint("shop", "web2", "10.7.0.1")], source=SOURCE)
    for epoch in (0, store.epoch ^ 2):
        call = resolver.stub.Watch(pb.WatchRequest(resume_from_version=resume, resume_epoch=epoch))
        try:
            event = await next_event(call)
            assert event.WhichOneof("event") == "snapshot" and event.epoch == store.epoch
            assert not event.snapshot.more
        finally:
            call.cancel()


async def test_slow_consumer_gets_coalesced_latest_state(resolver: Resolver) -> None:
    store = resolver.store
    call = resolver.stub.Watch(pb.WatchRequest())
    try:
        snapshot = await next_event(call)
        # 500 versions land while this consumer reads nothing (the loop never
        # yields to the stream in between): it must get the latest state of
        # each key, not 500 queued events.
        for i in range(500):
            store.set_endpoints("shop", "hot", [endpoint_for_hot(i)], source=SOURCE)
        store.upsert_route(
            Route("shop", "late", "late.example.com", "/", (RouteBackend("hot"),)), source=SOURCE
        )
        event = await next_event(call)
        assert event.changes.coalesced
        assert event.changes.from_version == snapshot.version
        assert event.version == store.version
        upserted = [
            c.endpoint_upserted for c in event.changes.changes if c.HasField("endpoint_upserted")
        ]
        assert [(e.address, e.zone) for e in upserted] == [("10.6.0.1", "z499")]
        assert [
            c.route_upserted.name for c in event.changes.changes if c.HasField("route_upserted")
        ] == ["late"]
        assert len(event.changes.changes) == 2
    finally:
        call.cancel()


def endpoint_for_hot(i: int) -> Endpoint:
    return Endpoint("shop", "hot", "10.6.0.1", (EndpointPort("http", 8080),), zone=f"z{i}")


async def test_client_cancellation_releases_the_subscription(resolver: Resolver) -> None:
    store = resolver.store
    calls = [resolver.stub.Watch(pb.WatchRequest()) for _ in range(5)]
    for call in calls:
        await next_event(call)
    assert store.subscriber_count == 5
    for call in calls:
        call.cancel()
    await eventually(lambda: store.subscriber_count == 0)


async def test_bad_kind_is_invalid_argument(resolver: Resolver) -> None:
    call = resolver.stub.Watch(pb.WatchRequest(kinds=[42]))
    try:
        await call.read()
    except grpc.aio.AioRpcError as exc:
        assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "kinds" in (exc.details() or "")
    else:
        raise AssertionError("an unknown kind must be refused")
    assert resolver.store.subscriber_count == 0


async def test_consumer_that_stops_reading_is_never_queued_without_bound(tmp_path: Path) -> None:
    """The client reads nothing while the server keeps running and changing: the
    backlog grows (each round of changes lands between two turns of the server's
    stream, and HTTP/2 flow control stalls the stream once the client's window
    is full). It never holds more than `watch_max_pending` keys: past that the
    consumer gets a fresh snapshot, and catching up ends at exactly the store's
    state."""
    max_pending, keys, rounds = 100, 300, 10
    changes = keys * rounds
    handle, server, channel = await start_resolver(tmp_path, watch_max_pending=max_pending)
    store = handle.store
    call = handle.stub.Watch(pb.WatchRequest(kinds=[pb.RESOURCE_KIND_ENDPOINTS]))
    try:
        first = await next_event(call)
        (subscription,) = store._subscriptions
        largest_backlog = 0
        for i in range(changes):
            key = i % keys
            store.set_endpoints(
                "shop",
                f"hot-{key}",
                [Endpoint("shop", f"hot-{key}", "10.6.0.1", hostname="h" * 60, zone=f"z{i}")],
                source=SOURCE,
            )
            largest_backlog = max(largest_backlog, subscription.backlog)
            if key == keys - 1:
                await asyncio.sleep(0)  # the server's stream may run between rounds
        assert largest_backlog <= max_pending

        # Replay what the consumer receives onto its own copy of the view.
        view = {(e.service, e.address): e.zone for e in first.snapshot.endpoints}
        events = snapshots = 0
        while True:
            event = await next_event(call)
            events += 1
            if event.WhichOneof("event") == "snapshot":
                snapshots += 1
                view = {(e.service, e.address): e.zone for e in event.snapshot.endpoints}
            for change in event.changes.changes:
                upserted = change.endpoint_upserted
                view[(upserted.service, upserted.address)] = upserted.zone
            if event.version == store.version:
                break
        assert snapshots >= 1, "a backlog past the bound is replaced by a snapshot"
        assert events < changes
        expected = {
            (e.service, e.address): e.zone
            for key in range(keys)
            for e in store.endpoints_of("shop", f"hot-{key}")
        }
        assert {k: v for k, v in view.items() if k[0].startswith("hot-")} == expected
        assert expected[("hot-299", "10.6.0.1")] == f"z{changes - 1}"
    finally:
        call.cancel()
        await channel.close()
        await server.stop(0)


async def test_quiet_stream_gets_heartbeats_with_the_last_sync_time(tmp_path: Path) -> None:
    handle, server, channel = await start_resolver(tmp_path, watch_heartbeat=0.1)
    call = handle.stub.Watch(pb.WatchRequest())
    try:
        snapshot = await next_event(call)
        assert handle.file is not None
        handle.file.poll()  # the file is unchanged: the source confirms it again
        beat = await next_event(call)
        assert beat.WhichOneof("event") == "changes" and not beat.changes.changes
        assert beat.changes.from_version == beat.version == snapshot.version
        assert beat.last_sync.ToDatetime() >= snapshot.last_sync.ToDatetime()
        handle.store.set_endpoints(
            "shop", "late", [Endpoint("shop", "late", "10.9.9.9")], source=SOURCE
        )
        while not (event := await next_event(call)).changes.changes:
            pass
        assert event.changes.from_version == snapshot.version
    finally:
        call.cancel()
        await channel.close()
        await server.stop(0)
