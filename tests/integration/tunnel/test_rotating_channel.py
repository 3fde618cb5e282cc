"""A long-lived stream on a RotatingChannel survives rotations (core/grpctls.py `hold`)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.integration.tunnel.harness import NODE, Tunnel, credentials, echo_server
from tests.support.poll import until
from waygate.core.grpctls import RotatingChannel
from waygate.tunnel.v1 import tunnel_pb2 as pb
from waygate.tunnel.v1 import tunnel_pb2_grpc


class Rotations:
    """Stands for a rotator's subscribe(): the test calls `rotate()` to announce one."""

    def __init__(self) -> None:
        self.callbacks: list[Callable[[Any], None]] = []

    def subscribe(self, callback: Callable[[Any], None]) -> Callable[[], None]:
        self.callbacks.append(callback)
        return lambda: self.callbacks.remove(callback)

    def rotate(self) -> None:
        for callback in list(self.callbacks):
            callback(None)


async def test_a_held_stream_outlives_rotation_and_its_channel_closes_after(
    tmp_path: Path,
) -> None:
    t = Tunnel(tmp_path)
    await t.start_server()
    await t.start_agent()
    rotations = Rotations()
    rotating = RotatingChannel(
        f"127.0.0.1:{t.dial_port}",
        lambda: credentials(t.dialer_files),
        (rotations.subscribe,),
        server_name="tunnel-server",
        close_grace=0.05,
    )
    echo, port = await echo_server()
    try:
        async with echo, rotating.hold() as held:
            call = tunnel_pb2_grpc.TunnelStub(held).Dial()
            await call.write(pb.DialFrame(target=pb.DialTarget(node=NODE, port=port)))
            assert (await call.read()).WhichOneof("frame") == "accepted"
            rotations.rotate()
            await asyncio.sleep(0.3)  # well past close_grace
            assert rotating.channel() is not held  # new calls get the new channel
            await call.write(pb.DialFrame(data=b"after rotation"))
            assert (await call.read()).data == b"after rotation"
            await call.done_writing()
            assert (await call.read()).eof
        # Released: the old channel closes now.
        await until(lambda: not rotating._closing, "the old channel to close")
        with pytest.raises(Exception):  # noqa: B017 (grpc raises UsageError on a closed channel)
            await tunnel_pb2_grpc.TunnelStub(held).ListAgents(pb.ListAgentsRequest(), timeout=2)
    finally:
        await rotating.close()
        await t.close()


async def test_an_unheld_channel_still_closes_after_the_grace(tmp_path: Path) -> None:
    rotations = Rotations()
    rotating = RotatingChannel(
        "127.0.0.1:1", lambda: None, (rotations.subscribe,), close_grace=0.05
    )
    first = rotating.channel()
    rotations.rotate()
    await until(lambda: not rotating._closing, "the old channel to close")
    assert rotating.channel() is not first
    await rotating.close()
