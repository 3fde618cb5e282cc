"""Resolver replica epochs (issue 12 item 6): two replicas behind one address.

The replicas' version numbers overlap on purpose (same start, one change
each), which is what makes a delta from the wrong replica dangerous: without
epochs, a client resuming at version 1001 on the other replica would be told
"nothing changed" and keep routes that replica never had. The address is a
TCP forwarder (tests.support.tcpforward, the stand-in for a load balancer)
that moves the client from one replica to the other.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator

import grpc
import pytest

from tests.support.poll import until
from tests.support.tcpforward import TcpForwarder
from waygate.core.backoff import Backoff
from waygate.core.grpcserver import GrpcServer
from waygate.resolver.client import ResolverWatch, Route, RouteBackend, View
from waygate.resolver.server import ResolverServicer
from waygate.resolver.store import Store

SOURCE = "test"


def replica(only: str) -> Store:
    store = Store(initial_version=1000)
    store.upsert_route(
        Route("shop", only, f"{only}.example.com", backends=(RouteBackend("web"),)), source=SOURCE
    )
    return store


async def serve(store: Store) -> GrpcServer:
    server = GrpcServer(
        host="127.0.0.1", port=0, registrations=[ResolverServicer(store).registration()]
    )
    await server.start()
    await server.set_serving()
    return server


@pytest.fixture
async def replicas() -> AsyncIterator[tuple[Store, GrpcServer, Store, GrpcServer]]:
    a, b = replica("a-only"), replica("b-only")
    server_a, server_b = await serve(a), await serve(b)
    try:
        yield a, server_a, b, server_b
    finally:
        await server_a.stop(0)
        await server_b.stop(0)


async def test_moving_to_another_replica_always_starts_from_its_snapshot(replicas) -> None:  # type: ignore[no-untyped-def]
    a, server_a, b, server_b = replicas
    assert a.version == b.version == 1001 and a.epoch != b.epoch
    balancer = TcpForwarder(server_a.port)
    await balancer.start()
    views: list[View] = []
    watch = ResolverWatch(
        lambda: grpc.aio.insecure_channel(balancer.address),
        on_view=views.append,
        backoff=Backoff(initial=0.05, maximum=0.2, rng=random.Random(3)),
        on_disconnect=lambda reason, delay: None,
    )
    task = asyncio.create_task(watch.run())
    try:
        first = await watch.wait_synced(10)
        assert set(first.routes) == {("shop", "a-only")} and first.epoch == a.epoch

        await balancer.switch(server_b.port)
        await until(
            lambda: watch.view is not None and watch.view.epoch == b.epoch, "replica b's view"
        )
        on_b = watch.view
        assert on_b is not None and on_b.from_snapshot and on_b.version == 1001
        assert set(on_b.routes) == {("shop", "b-only")}, "nothing of replica a survives"

        # Back to a, which moved on meanwhile: again a snapshot, never b's deltas.
        a.upsert_route(
            Route("shop", "a-two", "a-two.example.com", backends=(RouteBackend("web"),)),
            source=SOURCE,
        )
        await balancer.switch(server_a.port)
        await until(
            lambda: watch.view is not None and watch.view.epoch == a.epoch, "replica a again"
        )
        back = watch.view
        assert back is not None and back.from_snapshot
        assert set(back.routes) == {("shop", "a-only"), ("shop", "a-two")}
        assert balancer.connections >= 3
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await balancer.close()


async def test_a_resume_on_the_same_replica_is_a_delta(replicas) -> None:  # type: ignore[no-untyped-def]
    """The contrast: reconnecting to the same replica through the balancer resumes."""
    a, server_a, _b, _server_b = replicas
    balancer = TcpForwarder(server_a.port)
    await balancer.start()
    views: list[View] = []
    watch = ResolverWatch(
        lambda: grpc.aio.insecure_channel(balancer.address),
        on_view=views.append,
        backoff=Backoff(initial=0.05, maximum=0.2, rng=random.Random(3)),
        on_disconnect=lambda reason, delay: None,
    )
    task = asyncio.create_task(watch.run())
    try:
        await watch.wait_synced(10)
        await balancer.switch(server_a.port)  # cut the stream, same replica
        a.upsert_route(
            Route("shop", "a-two", "a-two.example.com", backends=(RouteBackend("web"),)),
            source=SOURCE,
        )
        await until(lambda: ("shop", "a-two") in views[-1].routes, "the change")
        assert not views[-1].from_snapshot
        assert balancer.connections >= 2
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await balancer.close()
