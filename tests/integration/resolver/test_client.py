"""waygate.resolver.client against a real resolver gRPC server (in-process, real sockets).

Chunked snapshots of 100,000 endpoints, resume with (version, epoch), a fresh
snapshot after a restart (new epoch), the last view kept while the resolver is
away, and nothing left behind after cancellation.
"""

from __future__ import annotations

import asyncio
import math
import os
import random
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import grpc
import pytest
from prometheus_client import REGISTRY

from tests.support.poll import until as eventually
from tests.support.tcpforward import TcpForwarder
from waygate.core.backoff import Backoff
from waygate.core.errors import Unavailable
from waygate.core.grpcserver import GrpcServer
from waygate.resolver.client import Kind, ResolverWatch, Route, RouteBackend, View
from waygate.resolver.model import (
    Endpoint,
    EndpointPort,
    RouteTLS,
    Service,
    ServicePort,
    TLSTermination,
)
from waygate.resolver.server import ResolverServicer
from waygate.resolver.store import Store
from waygate.resolver.v1 import resolver_pb2 as pb
from waygate.resolver.v1 import resolver_pb2_grpc

SOURCE = "test"


@dataclass
class Running:
    store: Store
    server: GrpcServer
    port: int

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


async def serve(store: Store, port: int = 0, heartbeat: float = 0.0) -> Running:
    servicer = ResolverServicer(store, watch_heartbeat=heartbeat)
    server = GrpcServer(host="127.0.0.1", port=port, registrations=[servicer.registration()])
    bound = await server.start()
    await server.set_serving()
    return Running(store, server, bound)


def seeded_store() -> Store:
    store = Store()
    store.upsert_service(
        Service("shop", "web", ports=(ServicePort("http", 80, "8080"),)), source=SOURCE
    )
    store.set_endpoints(
        "shop",
        "web",
        [Endpoint("shop", "web", "10.0.0.1", (EndpointPort("http", 8080),))],
        source=SOURCE,
    )
    store.upsert_route(
        Route("shop", "web", "shop.example.com", backends=(RouteBackend("web"),)), source=SOURCE
    )
    return store


def factory(address: str) -> Callable[[], grpc.aio.Channel]:
    return lambda: grpc.aio.insecure_channel(address)


def quick_backoff() -> Backoff:
    return Backoff(initial=0.05, maximum=0.2, rng=random.Random(1))


@pytest.fixture
async def running() -> AsyncIterator[Running]:
    handle = await serve(seeded_store())
    try:
        yield handle
    finally:
        await handle.server.stop(0)


async def start_watch(watch: ResolverWatch) -> asyncio.Task[None]:
    task = asyncio.create_task(watch.run())
    await watch.wait_synced(10)
    return task


async def stop_watch(task: asyncio.Task[None]) -> None:
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_first_view_then_changes_applied_in_place(running: Running) -> None:
    views: list[View] = []
    watch = ResolverWatch(factory(running.address), on_view=views.append, backoff=quick_backoff())
    assert watch.view is None and math.isinf(watch.staleness())
    task = await start_watch(watch)
    try:
        first = watch.view
        assert first is not None and first.from_snapshot
        assert first.epoch == running.store.epoch and first.version == running.store.version
        assert [e.address for e in first.endpoints[("shop", "web")]] == ["10.0.0.1"]
        assert first.routes[("shop", "web")].host == "shop.example.com"
        running.store.set_endpoints("shop", "web", [], source=SOURCE)
        await eventually(
            lambda: watch.view is not first and ("shop", "web") not in watch.view.endpoints
        )  # type: ignore[union-attr]
        assert [e.address for e in first.endpoints[("shop", "web")]] == ["10.0.0.1"], (
            "a published view never changes"
        )
        assert not views[-1].from_snapshot and views[-1].version == running.store.version
        assert watch.staleness() < 5 and watch.connected
    finally:
        await stop_watch(task)


async def test_100000_endpoints_arrive_in_bounded_chunks_and_apply_at_once(
    running: Running,
) -> None:
    running.store.set_endpoints(
        "big",
        "svc",
        [
            Endpoint(
                "big",
                "svc",
                f"10.{i >> 16}.{(i >> 8) & 255}.{i & 255}",
                (EndpointPort("http", 8080),),
                zone="zone-a",
                node_name=f"node-{i % 500}",
            )
            for i in range(100_000)
        ],
        source=SOURCE,
    )
    # The raw stream: several events, each under the bound, all but the last with more.
    channel = grpc.aio.insecure_channel(running.address)
    try:
        call = resolver_pb2_grpc.ResolverStub(channel).Watch(pb.WatchRequest())
        events = []
        while True:
            event = await asyncio.wait_for(call.read(), 30)
            events.append(event)
            if not event.snapshot.more:
                break
        call.cancel()
    finally:
        await channel.close()
    assert len(events) > 3
    assert all(e.ByteSize() <= 1024 * 1024 for e in events)
    assert {e.version for e in events} == {running.store.version}
    assert sum(len(e.snapshot.endpoints) for e in events) == 100_001

    views: list[View] = []
    watch = ResolverWatch(factory(running.address), on_view=views.append, backoff=quick_backoff())
    task = asyncio.create_task(watch.run())
    try:
        view = await watch.wait_synced(60)
        assert len(views) == 1, "the chunks were applied as one view"
        assert len(view.endpoints[("big", "svc")]) == 100_000
        assert view.routes[("shop", "web")].host == "shop.example.com"
    finally:
        await stop_watch(task)


async def test_resume_after_a_lost_stream_gets_only_the_changes(running: Running) -> None:
    views: list[View] = []
    reasons: list[str] = []
    watch = ResolverWatch(
        factory(running.address),
        on_view=views.append,
        backoff=quick_backoff(),
        on_disconnect=lambda reason, delay: reasons.append(reason),
    )
    task = await start_watch(watch)
    try:
        # The server ends every stream (as when draining); a change lands meanwhile.
        running.store.end_subscriptions()
        running.store.upsert_route(
            Route("shop", "api", "api.example.com", backends=(RouteBackend("web"),)), source=SOURCE
        )
        await eventually(lambda: watch.view is not None and ("shop", "api") in watch.view.routes)
        assert reasons and "shutting down" in reasons[0]
        assert not views[-1].from_snapshot, "resumed with deltas, not a fresh snapshot"
        assert views[-1].epoch == views[0].epoch
    finally:
        await stop_watch(task)


async def test_restarted_resolver_gives_a_fresh_snapshot_and_the_last_view_serves_meanwhile() -> (
    None
):
    first = await serve(seeded_store())
    # The restarted process listens elsewhere (rebinding a freed port races other
    # tests); the forwarder is the one address the client knows, as a Service is.
    forwarder = TcpForwarder(first.port)
    await forwarder.start()
    watch = ResolverWatch(
        factory(forwarder.address),
        backoff=quick_backoff(),
        kinds=[Kind.ROUTES, Kind.ENDPOINTS],
        on_disconnect=lambda r, d: None,
    )
    task = await start_watch(watch)
    try:
        before = watch.view
        assert before is not None and not before.services, "only the kinds asked for"
        await first.server.stop(0)
        await eventually(lambda: not watch.connected)
        await asyncio.sleep(0.3)
        assert watch.view is before, "the last view keeps serving while the resolver is away"
        assert watch.staleness() >= 0.3
        assert REGISTRY.get_sample_value("waygate_resolver_client_connected") == 0.0
        stale = REGISTRY.get_sample_value("waygate_resolver_client_staleness_seconds")
        assert stale is not None and stale >= 0.3
        # A new process on the same port: its own epoch and versions.
        store = Store(initial_version=before.version + 5)
        store.upsert_route(
            Route("shop", "new", "new.example.com", backends=(RouteBackend("web"),)), source=SOURCE
        )
        second = await serve(store)
        await forwarder.switch(second.port)
        try:
            await eventually(lambda: watch.view is not before, timeout=15)
            after = watch.view
            assert after is not None and after.from_snapshot
            assert after.epoch == store.epoch != before.epoch
            assert set(after.routes) == {("shop", "new")}, (
                "nothing of the old replica's view survives"
            )
            assert REGISTRY.get_sample_value("waygate_resolver_client_connected") == 1.0
        finally:
            await second.server.stop(0)
    finally:
        await stop_watch(task)
        await forwarder.close()


async def test_unreachable_resolver_is_unavailable_with_the_reason() -> None:
    watch = ResolverWatch(
        factory("127.0.0.1:1"), backoff=quick_backoff(), on_disconnect=lambda r, d: None
    )
    task = asyncio.create_task(watch.run())
    try:
        with pytest.raises(Unavailable, match="no view from the resolver within"):
            await watch.wait_synced(1.0)
    finally:
        await stop_watch(task)


async def test_silent_stream_counts_as_lost(running: Running) -> None:
    """No heartbeat within stale_after: the watch reconnects (and resumes) by itself."""
    reasons: list[str] = []
    watch = ResolverWatch(
        factory(running.address),
        backoff=quick_backoff(),
        stale_after=0.3,
        on_disconnect=lambda reason, delay: reasons.append(reason),
    )
    task = await start_watch(watch)
    try:
        await eventually(lambda: bool(reasons))
        assert "no event or heartbeat" in reasons[0]
    finally:
        await stop_watch(task)


async def test_heartbeats_keep_the_view_fresh() -> None:
    handle = await serve(seeded_store(), heartbeat=0.1)
    reasons: list[str] = []
    watch = ResolverWatch(
        factory(handle.address),
        backoff=quick_backoff(),
        # 30 heartbeats' worth: generous on a loaded machine, still a real bound.
        stale_after=3.0,
        on_disconnect=lambda reason, delay: reasons.append(reason),
    )
    task = await start_watch(watch)
    try:
        await asyncio.sleep(3.5)
        assert not reasons, "heartbeats arrived, the stream was never taken for dead"
        assert watch.staleness() < 3.0
    finally:
        await stop_watch(task)
        await handle.server.stop(0)


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def test_cancel_leaves_no_task_or_channel_behind(running: Running) -> None:
    # Warm up gRPC's own threads and sockets once, so the count compares like with like.
    task = await start_watch(ResolverWatch(factory(running.address)))
    await stop_watch(task)
    await asyncio.sleep(0.2)
    tasks_before, fds_before = len(asyncio.all_tasks()), open_fds()
    for _ in range(5):
        task = await start_watch(ResolverWatch(factory(running.address)))
        await stop_watch(task)
    # A watch cancelled while reconnecting to nobody, too.
    task = asyncio.create_task(
        ResolverWatch(
            factory("127.0.0.1:1"), backoff=quick_backoff(), on_disconnect=lambda r, d: None
        ).run()
    )
    await asyncio.sleep(0.3)
    await stop_watch(task)
    await asyncio.sleep(0.3)
    assert len(asyncio.all_tasks()) == tasks_before
    assert open_fds() <= fds_before + 1


class MisbehavingServicer(ResolverServicer):
    """A real gRPC resolver whose Watch can be told to break its promises."""

    def __init__(self, store: Store) -> None:
        super().__init__(store)
        self.mode = "normal"
        self.requests: list[pb.WatchRequest] = []

    async def Watch(self, request, context):  # type: ignore[no-untyped-def,override]
        self.requests.append(request)
        store = self._store
        if self.mode == "half-snapshot":
            # The first chunk of a snapshot that never completes.
            yield pb.WatchEvent(
                version=store.version + 100,
                epoch=store.epoch,
                snapshot=pb.Snapshot(
                    routes=[pb.Route(namespace="shop", name="partial", host="p.example.com")],
                    more=True,
                ),
            )
            raise Unavailable("gone mid-snapshot")
        if self.mode == "gap":
            yield pb.WatchEvent(
                version=store.version + 7,
                epoch=store.epoch,
                changes=pb.Changes(from_version=store.version + 6),
            )
            raise Unavailable("sent a gap")
        async for event in super().Watch(request, context):
            yield event


async def test_a_broken_snapshot_or_a_gap_never_reaches_the_view() -> None:
    store = seeded_store()
    servicer = MisbehavingServicer(store)
    server = GrpcServer(host="127.0.0.1", port=0, registrations=[servicer.registration()])
    port = await server.start()
    await server.set_serving()
    views: list[View] = []
    reasons: list[str] = []
    watch = ResolverWatch(
        factory(f"127.0.0.1:{port}"),
        on_view=views.append,
        backoff=quick_backoff(),
        on_disconnect=lambda reason, delay: reasons.append(reason),
    )
    task = await start_watch(watch)
    try:
        good = watch.view
        assert good is not None
        servicer.mode = "half-snapshot"
        store.end_subscriptions()
        await eventually(lambda: any("mid-snapshot" in r for r in reasons))
        assert watch.view is good and len(views) == 1, "the partial snapshot was dropped"
        servicer.mode = "gap"
        await eventually(lambda: any("do not continue" in r for r in reasons))
        assert watch.view is good and len(views) == 1, "the gap was not applied"
        servicer.mode = "normal"
        await eventually(lambda: len(views) == 2)
        # After a gap the client asked for a fresh snapshot instead of resuming.
        assert servicer.requests[-1].resume_from_version == 0
        assert views[-1].from_snapshot and ("shop", "partial") not in views[-1].routes
    finally:
        await stop_watch(task)
        await server.stop(0)


async def test_a_large_changes_event_is_converted_in_slices_then_applied_at_once(
    running: Running, monkeypatch: pytest.MonkeyPatch
) -> None:
    """5,000 endpoint changes: the loop runs between slices of the conversion (a
    callback scheduled at the first conversion runs before the last), and the view
    changes once, after all of it."""
    from waygate.resolver import client as client_module

    views: list[View] = []
    watch = ResolverWatch(factory(running.address), on_view=views.append, backoff=quick_backoff())
    task = await start_watch(watch)
    try:
        first = watch.view
        converted: list[int] = []
        seen_meanwhile: list[tuple[int, View | None]] = []
        real = client_module.convert.endpoint_from_proto

        def counting(message: pb.Endpoint) -> Endpoint:
            if not converted:
                asyncio.get_running_loop().call_soon(
                    lambda: seen_meanwhile.append((len(converted), watch.view))
                )
            converted.append(1)
            return real(message)

        monkeypatch.setattr(client_module.convert, "endpoint_from_proto", counting)
        running.store.set_endpoints(
            "shop",
            "web",
            [Endpoint("shop", "web", f"10.9.{i >> 8}.{i & 255}") for i in range(5000)],
            source=SOURCE,
        )
        await eventually(lambda: len(views) == 2, timeout=30)
        assert len(views[1].endpoints[("shop", "web")]) == 5000
        assert seen_meanwhile, "the loop never ran during the conversion"
        count, view = seen_meanwhile[0]
        assert count < 5000 and view is first, "the loop ran mid-conversion, view untouched"
    finally:
        await stop_watch(task)


async def test_an_event_too_large_to_receive_resyncs_from_a_chunked_snapshot() -> None:
    """A Changes event over the client's 4 MiB receive limit: RESOURCE_EXHAUSTED.
    Resuming would be sent the same event forever; the client asks for a snapshot,
    which comes in bounded chunks."""
    store = seeded_store()
    # A server whose event bound is above what its clients receive (as
    # --max-message-bytes 16MiB made it before the bound was capped).
    servicer = ResolverServicer(store, max_event_bytes=8 << 20)
    server = GrpcServer(host="127.0.0.1", port=0, registrations=[servicer.registration()])
    port = await server.start()
    await server.set_serving()
    reasons: list[str] = []
    watch = ResolverWatch(
        factory(f"127.0.0.1:{port}"),
        backoff=quick_backoff(),
        on_disconnect=lambda reason, delay: reasons.append(reason),
    )
    task = await start_watch(watch)
    try:
        routes = [
            Route(
                "big",
                f"r{i}",
                f"r{i}.example.com",
                backends=(RouteBackend("web"),),
                tls=RouteTLS(TLSTermination.EDGE, certificate="C" * 60_000),
            )
            for i in range(90)
        ]
        store.replace_source("bulk", services=(), endpoints=(), routes=routes)
        await eventually(
            lambda: watch.view is not None and len(watch.view.routes) == 91, timeout=20
        )
        assert reasons, "the oversized event was refused once"
        assert watch.view is not None and watch.view.from_snapshot
    finally:
        await stop_watch(task)
        await server.stop(0)


async def test_an_unexpected_error_is_retried_with_backoff_not_the_end_of_the_watch(
    running: Running,
) -> None:
    """A channel factory that raises once (as a bad certificate file being rewritten
    might): the watch used to end for good."""
    calls: list[int] = []
    reasons: list[str] = []

    def flaky() -> grpc.aio.Channel:
        calls.append(1)
        if len(calls) == 1:
            raise OSError("certificate file half-written")
        return grpc.aio.insecure_channel(running.address)

    watch = ResolverWatch(
        flaky, backoff=quick_backoff(), on_disconnect=lambda reason, delay: reasons.append(reason)
    )
    task = await start_watch(watch)
    try:
        assert watch.connected and len(calls) == 2
        assert reasons and "OSError" in reasons[0] and "half-written" in reasons[0]
    finally:
        await stop_watch(task)


async def test_a_resume_with_nothing_new_is_connected_at_once(running: Running) -> None:
    """No heartbeats and nothing new after a resume: the healthy stream looked
    disconnected (and ever staler) until the next change."""
    reasons: list[str] = []
    watch = ResolverWatch(
        factory(running.address),
        backoff=quick_backoff(),
        on_disconnect=lambda reason, delay: reasons.append(reason),
    )
    task = await start_watch(watch)
    try:
        before = watch.view
        running.store.end_subscriptions()
        await eventually(lambda: bool(reasons))
        await eventually(lambda: watch.connected, timeout=5)
        assert watch.view is not None and watch.view.version == before.version  # type: ignore[union-attr]
        assert not watch.view.from_snapshot, "resumed, not resynced"
        assert watch.staleness() < 5
    finally:
        await stop_watch(task)


async def test_a_filtered_watch_follows_the_version_through_heartbeats() -> None:
    """Routes only, while services change: heartbeats carry the client to the
    server's version, so a resume stays within the history."""
    handle = await serve(seeded_store(), heartbeat=0.1)
    reasons: list[str] = []
    watch = ResolverWatch(
        factory(handle.address),
        kinds=[Kind.ROUTES],
        backoff=quick_backoff(),
        on_disconnect=lambda reason, delay: reasons.append(reason),
    )
    task = await start_watch(watch)
    try:
        for index in range(5):
            handle.store.upsert_service(
                Service("shop", f"s{index}", ports=(ServicePort("http", 80, "8080"),)),
                source=SOURCE,
            )
        await eventually(
            lambda: watch.view is not None and watch.view.version == handle.store.version
        )
        await asyncio.sleep(0.3)
        assert not reasons, "the heartbeats continued the view, no resync"
    finally:
        await stop_watch(task)
        await handle.server.stop(0)
