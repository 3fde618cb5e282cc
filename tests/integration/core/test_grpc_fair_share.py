"""The unauthenticated streams' fair share, over real sockets from two addresses.

The server listens on both stacks; one client comes from 127.0.0.1, the other
from ::1 (two addresses on one machine). The first fills the unauthenticated
total; the second still gets its fair share, and the streams that made room
end with RESOURCE_EXHAUSTED naming the share (not a bare CANCELLED).
"""

from __future__ import annotations

import asyncio
import socket

import grpc
import pytest

from tests.integration.core.test_grpc_limits import Watches, running
from tests.support import demo_server
from tests.support.poll import until
from waygate.core.grpcclient import open_channel
from waygate.core.grpcserver import CallLimits, GrpcServer, ServiceRegistration


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.mark.skipif(not _has_ipv6_loopback(), reason="needs ::1 for a second client address")
async def test_a_second_address_gets_its_share_of_a_full_unauthenticated_total() -> None:
    limits = CallLimits(
        max_streams=10, max_unauthenticated_streams=4, max_streams_per_peer=4,
        max_streams_per_unauthenticated_peer=4,
    )  # fmt: skip
    server = GrpcServer(
        host="::",
        port=0,
        registrations=[ServiceRegistration(demo_server.SERVICE, demo_server._add, None)],
        limits=limits,
    )
    async with (
        running(server) as port,
        open_channel(f"127.0.0.1:{port}", retry=False) as first_channel,
        open_channel(f"[::1]:{port}", retry=False) as second_channel,
    ):
        first, second = Watches(first_channel), Watches(second_channel)
        try:
            for _ in range(4):
                await first.open()
            assert server.admission.unauthenticated_streams == 4
            # Before the fair share, this address would have been refused here.
            await second.open()
            await second.open()
            evicted = first.calls[:2]
            for call in evicted:
                with pytest.raises(grpc.aio.AioRpcError) as ended:
                    async with asyncio.timeout(10):
                        while True:
                            await call.read()
                assert ended.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert "fair share of 2" in (ended.value.details() or "")
            # Each now holds its share (2 of 4): neither may take more.
            assert sorted(server.admission.streams_by_peer.values()) == [2, 2]
            for watches in (first, second):
                refused = await watches.refusal()
                assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert "--max-unauthenticated-streams" in (refused.details() or "")
            # The streams that were not evicted still answer.
            assert first.calls[2].done() is False and first.calls[3].done() is False
        finally:
            first.close()
            second.close()
        await until(lambda: server.admission.streams == 0, "every stream released")
        assert server.admission.unauthenticated_streams == 0
