"""waygate.resolver.client.keep_reporting: the reconnect loop every report stream
(ReportListeners, ReportTunnels) runs. Stand-ins: a channel holder yielding a
marker object and a stream callable; no RPC is made."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator

import grpc
import pytest

from waygate.core.backoff import Backoff
from waygate.resolver.client import keep_reporting


class _Stop(Exception):
    """Ends the stand-in stream for good (what no report stream raises)."""


def _failed_rpc() -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(
        grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), "resolver away"
    )


@pytest.mark.asyncio
async def test_failed_streams_are_warned_about_and_retried_on_a_fresh_hold(
    caplog: pytest.LogCaptureFixture,
) -> None:
    holds: list[object] = []
    released: list[object] = []
    seen: list[object] = []

    @contextlib.asynccontextmanager
    async def hold() -> AsyncIterator[object]:
        channel = object()
        holds.append(channel)
        try:
            yield channel
        finally:
            released.append(channel)

    async def stream(channel: object) -> None:
        seen.append(channel)
        if len(seen) == 1:
            return  # the stream ended: reconnect, nothing to warn about
        if len(seen) <= 3:
            raise _failed_rpc()
        raise _Stop

    backoff = Backoff(initial=0.001, maximum=0.001)
    caplog.set_level(logging.WARNING, logger="waygate.resolver.client")
    with pytest.raises(_Stop):
        await keep_reporting(
            hold,  # type: ignore[arg-type]  # a stand-in channel
            stream,
            backoff,
            what="test report",
            extra={"resolver": "r:1"},
        )
    # Each attempt held its own channel, and every hold was released.
    assert seen == holds and len(set(map(id, holds))) == 4
    assert released == holds
    warnings = [r for r in caplog.records if r.getMessage() == "test report failed"]
    assert len(warnings) == 2
    assert all(
        getattr(r, "error", "") == "UNAVAILABLE: resolver away"
        and getattr(r, "resolver", "") == "r:1"
        for r in warnings
    )
    assert backoff.attempts == 3  # one delay after each of the three attempts that ended
