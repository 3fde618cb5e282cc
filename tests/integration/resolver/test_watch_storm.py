"""Many watchers of one large view at once (issue 18 item 5), in-process, real sockets.

Every watcher gets the whole snapshot and then the same change; the events
they share are serialized once (the same bytes object for every stream); at
most `SNAPSHOT_SLOTS` streams send a large snapshot at once, every slot is
given back, and none is lost. `make bench` (bench/resolver_storm) measures the
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
