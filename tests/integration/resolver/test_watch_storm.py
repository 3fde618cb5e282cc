"""Many watchers of one large view at once (issue 18 item 5), in-process, real sockets.

Every watcher gets the whole snapshot and then the same change; the events
they share are serialized once (the same bytes object for every stream); at
most `SNAPSHOT_SLOTS` streams send a large snapshot at once, every slot is
given back, and none is lost; watchers behind by the same changes share one
serialized backlog; a watcher stalled on flow control gets the latest state
and holds up no one; a stream's changes within its interval go out as one
event. `make bench` (bench/resolver_storm) measures the
same at 1,000 streams over 100,000 endpoints.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from waygate.core.grpcserver import GrpcServer
from waygate.resolver import server as resolver_server
from waygate.resolver.model import Endpoint, EndpointPort, Service, ServicePort, TunnelServer
from waygate.resolver.server import ResolverServicer, _WireCache
from waygate.resolver.store import Store
from waygate.resolver.v1 import resolver_pb2 as pb
from waygate.resolver.v1 import resolver_pb2_grpc

WATCHERS = 40
SERVICES, PER_SERVICE = 100, 100  # 10,000 endpoints: above the offload threshold


def big_store() -> Store:
    store = Store()
    for s in range(SERVICES):
        store.upsert_service(
            Service("storm", f"svc-{s}", ports=(ServicePort("http", 80, "8080"),)), source="t"
        )
        store.set_endpoints(
            "storm",
            f"svc-{s}",
            [
                Endpoint(
                    "storm",
                    f"svc-{s}",
                    f"10.{s}.{e // 250}.{e % 250}",
                    (EndpointPort("http", 8080),),
                )
                for e in range(PER_SERVICE)
            ],
            source="t",
        )
    return store


async def watcher(address: str, node: str) -> int:
    """Endpoints in the snapshot, once the change naming `node` arrived."""
    options = [("grpc.max_receive_message_length", 16 * 1024 * 1024)]
    endpoints = 0
    async with grpc.aio.insecure_channel(address, options=options) as channel:
        call = resolver_pb2_grpc.ResolverStub(channel).Watch(pb.WatchRequest())
        async for event in call:
            endpoints += len(event.snapshot.endpoints)
            if any(c.tunnel_presence.node == node for c in event.changes.changes):
                call.cancel()
                return endpoints
    raise AssertionError("the stream ended before the change")


async def test_a_storm_of_watchers_all_get_the_snapshot_and_the_change(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(resolver_server, "SNAPSHOT_SLOTS", 3)
    store = big_store()
    servicer = ResolverServicer(store)
    sent: list[int] = []
    original = servicer._snapshot_turn

    async def counted_turn() -> bool:
        got = await original()
        sent.append(3 - servicer._snapshot_slots._value)  # slots taken right now
        return got

    monkeypatch.setattr(servicer, "_snapshot_turn", counted_turn)
    server = GrpcServer(host="127.0.0.1", port=0, registrations=[servicer.registration()])
    port = await server.start()
    try:
        address = f"127.0.0.1:{port}"
        tasks = [asyncio.ensure_future(watcher(address, "storm-node")) for _ in range(WATCHERS)]
        # Every watcher has its snapshot's turn before the change is made.
        async with asyncio.timeout(60):
            while len(sent) < WATCHERS:
                await asyncio.sleep(0.05)
        store.set_tunnel_presence("storm-node", [TunnelServer("ts", "127.0.0.1:7004")])
        async with asyncio.timeout(60):
            counts = await asyncio.gather(*tasks)
        assert counts == [SERVICES * PER_SERVICE] * WATCHERS, "nobody lost, every snapshot whole"
        assert max(sent) <= 3, "never more large snapshots in flight than the slots"
        assert servicer._snapshot_slots._value == 3, "every slot given back"
    finally:
        await server.stop(0)


def test_the_wire_cache_serializes_a_shared_event_once_and_stays_bounded() -> None:
    cache = _WireCache(max_events=3, max_bytes=4096)
    shared = pb.WatchEvent(version=1, changes=pb.Changes(from_version=0))
    first = cache.bytes_of(shared)
    assert cache.bytes_of(shared) is first, "the same bytes for every stream"
    assert pb.WatchEvent.FromString(first) == shared
    others = [pb.WatchEvent(version=v) for v in range(2, 6)]
    for event in others:
        cache.bytes_of(event)
    assert len(cache._entries) == 3, "bounded by count, least recently used dropped"
    assert cache.bytes_of(shared) is not first  # dropped, made again
    big = pb.WatchEvent(source="x" * 2000)
    assert cache.bytes_of(big) is not cache.bytes_of(big), "too large to keep"
    assert cache._bytes <= 4096


async def test_watchers_behind_by_the_same_changes_share_one_serialized_backlog() -> None:
    store = Store()
    store.upsert_service(
        Service("storm", "web", ports=(ServicePort("http", 80, "8080"),)), source="t"
    )
    servicer = ResolverServicer(store)
    sent: list[bytes] = []
    original = servicer._wire.bytes_of

    def spied(event: pb.WatchEvent) -> bytes:
        data = original(event)
        if event.changes.coalesced:
            sent.append(data)
        return data

    servicer._wire.bytes_of = spied  # type: ignore[method-assign]
    server = GrpcServer(host="127.0.0.1", port=0, registrations=[servicer.registration()])
    port = await server.start()
    calls = []
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = resolver_pb2_grpc.ResolverStub(channel)
            for _ in range(WATCHERS):
                call = stub.Watch(pb.WatchRequest())
                calls.append(call)
                assert (await asyncio.wait_for(call.read(), 10)).HasField("snapshot")
            # Twenty versions land before any stream runs again: every watcher is
            # behind by the same twenty, and gets one event with the latest state.
            for i in range(20):
                store.set_endpoints(
                    "storm",
                    "web",
                    [
                        Endpoint(
                            "storm", "web", "10.9.0.1", (EndpointPort("http", 8080),), zone=f"z{i}"
                        )
                    ],
                    source="t",
                )
            for call in calls:
                event = await asyncio.wait_for(call.read(), 10)
                assert event.changes.coalesced and event.version == store.version
                assert [c.endpoint_upserted.zone for c in event.changes.changes] == ["z19"]
            assert len(sent) == WATCHERS
            assert all(data is sent[0] for data in sent), "serialized once, sent by every stream"
    finally:
        for call in calls:
            call.cancel()
        await server.stop(0)


async def test_a_watcher_that_stops_reading_gets_the_latest_state_and_holds_up_nobody() -> None:
    """One watcher reads nothing while 200 large changes land one by one (the loop
    runs between them), so its stream stalls on flow control; another reads
    along. The reader sees every change at once; the stalled one, once it reads
    again, gets coalesced events ending at the latest state, far fewer than 200,
    and its stream is not lost."""
    store = Store()
    store.upsert_service(
        Service("storm", "web", ports=(ServicePort("http", 80, "8080"),)), source="t"
    )
    # No pacing between events: the reader's 200 events come at once.
    servicer = ResolverServicer(store, watch_interval=0)
    server = GrpcServer(host="127.0.0.1", port=0, registrations=[servicer.registration()])
    port = await server.start()
    # No BDP probing: the stalled stream's window stays small, so the server's
    # write blocks after a few events instead of the client buffering them all.
    options = [("grpc.http2.bdp_probe", 0), ("grpc.use_local_subchannel_pool", 1)]
    changes = 200
    try:
        async with (
            grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=options) as slow_channel,
            grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=options) as fast_channel,
        ):
            slow = resolver_pb2_grpc.ResolverStub(slow_channel).Watch(pb.WatchRequest())
            fast = resolver_pb2_grpc.ResolverStub(fast_channel).Watch(pb.WatchRequest())
            for call in (slow, fast):
                assert (await asyncio.wait_for(call.read(), 10)).HasField("snapshot")
            for i in range(changes):
                # 64 KiB per change: 12.5 MiB in all, far past any window.
                zone = f"{i:04d}" + "z" * 65536
                endpoint = Endpoint(
                    "storm", "web", "10.9.0.1", (EndpointPort("http", 8080),), zone=zone
                )
                store.set_endpoints("storm", "web", [endpoint], source="t")
                event = await asyncio.wait_for(fast.read(), 10)
                assert event.changes.changes[0].endpoint_upserted.zone[:4] == f"{i:04d}"
            events, coalesced, last = 0, False, ""
            while last != f"{changes - 1:04d}":
                event = await asyncio.wait_for(slow.read(), 10)
                assert event is not grpc.aio.EOF, "the stalled stream was not lost"
                events += 1
                coalesced |= event.changes.coalesced
                last = event.changes.changes[-1].endpoint_upserted.zone[:4]
            assert coalesced and events < changes // 4, f"{events} events for {changes} changes"
            slow.cancel()
            fast.cancel()
    finally:
        await server.stop(0)


async def test_changes_that_land_within_a_streams_interval_go_out_as_one_event() -> None:
    """The first change after a quiet spell goes out alone; the ones that land
    while the stream waits out its interval (the loop running in between, each
    committed on its own) go out together, the latest state per key."""
    store = Store()
    store.upsert_service(
        Service("storm", "web", ports=(ServicePort("http", 80, "8080"),)), source="t"
    )
    servicer = ResolverServicer(store, watch_interval=2.0)
    server = GrpcServer(host="127.0.0.1", port=0, registrations=[servicer.registration()])
    port = await server.start()

    def zone(value: str) -> None:
        endpoint = Endpoint("storm", "web", "10.9.0.1", (EndpointPort("http", 8080),), zone=value)
        store.set_endpoints("storm", "web", [endpoint], source="t")

    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = resolver_pb2_grpc.ResolverStub(channel).Watch(pb.WatchRequest())
            assert (await asyncio.wait_for(call.read(), 10)).HasField("snapshot")
            # The snapshot's interval is over before this change.
            await asyncio.sleep(2.5)
            zone("first")
            first = await asyncio.wait_for(call.read(), 10)
            assert [c.endpoint_upserted.zone for c in first.changes.changes] == ["first"]
            for value in ("second", "third", "fourth"):
                await asyncio.sleep(0.01)
                zone(value)
            store.set_tunnel_presence("edge-1", [TunnelServer("ts", "127.0.0.1:7004")])
            paced = await asyncio.wait_for(call.read(), 10)
            assert paced.changes.coalesced and paced.version == store.version
            assert [c.endpoint_upserted.zone for c in paced.changes.changes[:1]] == ["fourth"]
            assert paced.changes.changes[1].tunnel_presence.node == "edge-1"
            call.cancel()
    finally:
        await server.stop(0)
