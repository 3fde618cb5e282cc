"""A Watch whose channel is closed under it reconnects (found by the soak, issue 18).

The proxy lends its shared, rotating client channel to the watch; after a
certificate renewal that channel is retired and closed, which cancels the
calls on it. The watch took that cancellation for its own, ended its task
without a word, and the proxy's view froze from then on.
"""

from __future__ import annotations

import grpc

from tests.integration.resolver.test_client import (
    SOURCE,
    Running,
    quick_backoff,
    running,  # noqa: F401 - the fixture
    start_watch,
    stop_watch,
)
from tests.support.poll import until as eventually
from waygate.resolver.client import ResolverWatch


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
