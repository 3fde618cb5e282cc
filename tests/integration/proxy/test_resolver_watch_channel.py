"""The proxy's resolver Watch borrows its rotating channel (issue 18): a certificate
renewal retires the channel for new calls; the stream moves to the renewed one
(make-before-break, resuming from the view held), so the proxy neither re-syncs
at every renewal nor keeps the retired channel open; with several resolver
replicas a lost stream reconnects to the next one. Real gRPC, in-process
resolvers; the rotation is announced the way the certificate rotator does."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import grpc

from tests.support.poll import until
from waygate.core.grpcserver import GrpcServer
from waygate.core.grpctls import RotatingChannel
from waygate.proxy.app import resolver_watch
from waygate.resolver.model import Service, ServicePort
from waygate.resolver.server import ResolverServicer
from waygate.resolver.store import Store


async def test_a_renewal_moves_the_watch_stream_and_the_old_channel_closes() -> None:
    store = Store()
    server = GrpcServer(
        host="127.0.0.1", port=0, registrations=[ResolverServicer(store).registration()]
    )
    port = await server.start()
    renewals: list[Callable[[Any], None]] = []

    def subscribe(callback: Callable[[Any], None]) -> Callable[[], None]:
        renewals.append(callback)
        return lambda: renewals.remove(callback)

    rotating = RotatingChannel(f"127.0.0.1:{port}", lambda: None, (subscribe,), close_grace=0.05)
    lent: list[grpc.aio.Channel] = []
    lend = rotating.lend

    def counted() -> grpc.aio.Channel:
        lent.append(lend())
        return lent[-1]

    rotating.lend = counted  # type: ignore[method-assign]
    views: list[Any] = []
    watch = resolver_watch([rotating], views.append)
    disconnects: list[str] = []
    watch._on_disconnect = lambda reason, _delay: disconnects.append(reason)
    task = asyncio.create_task(watch.run())
    try:
        await watch.wait_synced(10)
        old = rotating.channel()
        for renewal in renewals:
            renewal(None)
        assert rotating.channel() is not old, "new calls get the renewed channel"
        # The stream moved: nothing holds the old channel, which closes after the grace.
        await until(
            lambda: old.get_state() == grpc.ChannelConnectivity.SHUTDOWN, "the old channel to close"
        )
        store.upsert_service(
            Service("shop", "after", ports=(ServicePort("http", 80, "8080"),)), source="t"
        )
        await until(
            lambda: ("shop", "after") in watch.view.services,  # type: ignore[union-attr]
            "the change made after the renewal",
        )
        assert len(lent) == 2, "a stream on the old channel, then one on the renewed"
        assert disconnects == [], "moved, not reconnected"
        assert not any(view.from_snapshot for view in views[1:]), "resumed, never re-synced"
        assert rotating._holders == {rotating.channel(): 1}
        assert watch.connected
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    try:
        # The watch closed what it was lent: the hold is let go, the old channel closes.
        await until(lambda: not rotating._closing, "the old channel to close")
        assert not rotating._holders
    finally:
        await rotating.close()
        await server.stop(0)


async def test_a_watch_over_two_replicas_moves_to_the_other_when_its_replica_stops() -> None:
    """Two resolver replicas (own stores, so their views tell them apart): the watch
    starts on the first; stopped, the next attempt goes to the second, not back to
    the dead one for ever."""
    stores, servers, ports = [], [], []
    for name in ("first", "second"):
        store = Store()
        store.upsert_service(
            Service("shop", name, ports=(ServicePort("http", 80, "8080"),)), source="t"
        )
        server = GrpcServer(
            host="127.0.0.1", port=0, registrations=[ResolverServicer(store).registration()]
        )
        stores.append(store)
        servers.append(server)
        ports.append(await server.start())
    channels = [RotatingChannel(f"127.0.0.1:{port}", lambda: None) for port in ports]
    watch = resolver_watch(channels, lambda view: None)
    task = asyncio.create_task(watch.run())

    def serves(name: str) -> bool:
        return watch.view is not None and ("shop", name) in watch.view.services

    try:
        await watch.wait_synced(10)
        assert serves("first") and not serves("second")
        await servers[0].stop(0)
        await until(lambda: serves("second"), "the view from the other replica", timeout=20)
        assert not serves("first"), "a fresh snapshot from the other replica, not a merge"
        # A change on the replica now watched arrives.
        stores[1].upsert_service(
            Service("shop", "later", ports=(ServicePort("http", 80, "8080"),)), source="t"
        )
        await until(lambda: serves("later"), "a change on the second replica")
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        for channel in channels:
            await channel.close()
        await servers[1].stop(0)
