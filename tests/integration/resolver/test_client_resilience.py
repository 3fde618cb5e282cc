"""The resolver Watch client through what the soak did to it (issue 18).

- A Watch whose channel is closed under it reconnects. The proxy lends its shared, rotating client channel to the watch; after a
certificate renewal that channel is retired and closed, which cancels the
calls on it. The watch took that cancellation for its own, ended its task
without a word, and the proxy's view froze from then on.
- Tunnel presence a restarted resolver has not heard yet is kept for a grace.
"""

from __future__ import annotations

import grpc

from tests.integration.resolver.test_client import (
    SOURCE,
    Running,
    factory,
    quick_backoff,
    running,  # noqa: F401 - the fixture
    seeded_store,
    serve,
    start_watch,
    stop_watch,
)
from tests.support.poll import until as eventually
from tests.support.tcpforward import TcpForwarder
from waygate.resolver.client import ResolverWatch, View
from waygate.resolver.model import TunnelServer


async def test_a_channel_closed_under_the_stream_is_a_lost_stream_not_the_end(
    running: Running,  # noqa: F811 - the fixture
) -> None:
    channels: list[grpc.aio.Channel] = []

    def lend() -> grpc.aio.Channel:
        channel = grpc.aio.insecure_channel(running.address)
        channels.append(channel)
        return channel

    watch = ResolverWatch(lend, backoff=quick_backoff())
    task = await start_watch(watch)
    try:
        await channels[0].close()  # what the rotating channel does to a retired channel
        await eventually(lambda: len(channels) >= 2, "a new stream on a new channel")
        assert not task.done()
        running.store.set_endpoints("shop", "web", [], source=SOURCE)
        await eventually(
            lambda: watch.view is not None and ("shop", "web") not in watch.view.endpoints,
            "the change after the channel was closed",
        )
    finally:
        await stop_watch(task)
    assert all(c.get_state() == grpc.ChannelConnectivity.SHUTDOWN for c in channels)


async def test_presence_a_restarted_resolver_has_not_heard_yet_is_kept_for_the_grace() -> None:
    """A restarted resolver knows no tunnel presence until the tunnel servers report
    again; until then (at most the grace) the presence held before still serves,
    so tunnelled routes do not fail because the resolver came back (the soak saw
    every tunnelled request answered 502 for seconds after a resolver restart)."""
    first_store = seeded_store()
    first_store.set_tunnel_presence("edge-1", [TunnelServer("replica-a", "10.1.0.1:7004")])
    first_store.set_tunnel_presence("edge-2", [TunnelServer("replica-a", "10.1.0.1:7004")])
    first = await serve(first_store)
    forwarder = TcpForwarder(first.port)
    await forwarder.start()
    views: list[View] = []
    watch = ResolverWatch(
        factory(forwarder.address),
        backoff=quick_backoff(),
        on_view=views.append,
        on_disconnect=lambda r, d: None,
        presence_grace=2.0,
    )
    task = await start_watch(watch)
    try:
        assert set(watch.view.tunnels) == {"edge-1", "edge-2"}  # type: ignore[union-attr]
        await first.server.stop(0)
        await eventually(lambda: not watch.connected)
        store = seeded_store()  # a new process: its own epoch, no presence yet
        second = await serve(store)
        await forwarder.switch(second.port)
        try:
            await eventually(lambda: watch.view.epoch == store.epoch, timeout=15)  # type: ignore[union-attr]
            after = watch.view
            assert after is not None and after.from_snapshot
            assert set(after.tunnels) == {"edge-1", "edge-2"}, "kept for the grace"
            # What the new resolver says about a node replaces what was kept.
            store.set_tunnel_presence("edge-1", [TunnelServer("replica-b", "10.1.0.2:7004")])
            await eventually(
                lambda: [s.id for s in watch.view.tunnels["edge-1"].servers] == ["replica-b"]  # type: ignore[union-attr]
            )
            # After the grace, what nobody confirmed is gone; the rest stays.
            await eventually(lambda: "edge-2" not in watch.view.tunnels, timeout=10)  # type: ignore[union-attr]
            assert [s.id for s in watch.view.tunnels["edge-1"].servers] == ["replica-b"]  # type: ignore[union-attr]
            assert views[-1] is watch.view, "consumers heard of the change"
        finally:
            await second.server.stop(0)
    finally:
        await stop_watch(task)
        await forwarder.close()
