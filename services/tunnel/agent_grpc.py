"""The tunnel agent's gRPC face: its `AgentTunnel.Connect` streams, as `agent.PacketStream`s.

The agent's packet pump (`waygate.tunnel.agent`) never imports grpc: it asks a
`Connector` for a stream and reads and writes `tunnel_pb2.Packet`s. This
module is that connector over gRPC: each `open` is a new channel (a local
subchannel pool, so a new TCP connection a load balancer may send to another
replica), with keepalives, no retries, and in the metadata the agent's id and
the replicas it holds streams to (`mux.HELD_METADATA`);
without credentials (plaintext, development only) the node is named in
metadata too, since there is no certificate to take it from. gRPC's errors
become `agent.StreamFailed` carrying the status and its details.

Invariants: `close` cancels the call and closes its channel, whatever state the
stream is in; no grpc type crosses into the pump.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import grpc

from waygate.core.grpcclient import open_channel
from waygate.tunnel import mux
from waygate.tunnel.agent import StreamFailed
from waygate.tunnel.v1 import tunnel_pb2 as pb
from waygate.tunnel.v1 import tunnel_pb2_grpc

Credentials = Callable[[], grpc.ChannelCredentials | None]


def _failed(exc: grpc.aio.AioRpcError) -> StreamFailed:
    return StreamFailed(f"{exc.code().name}: {exc.details()}")


class GrpcPacketStream:
    """One Connect call: packets in and out, gRPC's errors as `StreamFailed`."""

    __slots__ = ("_call", "_channel")

    def __init__(self, channel: grpc.aio.Channel, call: Any) -> None:
        self._channel = channel
        self._call = call

    async def read(self) -> pb.Packet | None:
        """The next packet; None once the server ended the stream."""
        try:
            packet = await self._call.read()
        except grpc.aio.AioRpcError as exc:
            raise _failed(exc) from None
        return None if packet is grpc.aio.EOF else packet

    async def write(self, packet: pb.Packet) -> None:
        try:
            await self._call.write(packet)
        except grpc.aio.AioRpcError as exc:
            raise _failed(exc) from None

    async def done_writing(self) -> None:
        try:
            await self._call.done_writing()
        except grpc.aio.AioRpcError as exc:
            raise _failed(exc) from None

    async def close(self) -> None:
        self._call.cancel()
        await self._channel.close()


class GrpcConnector:
    """Opens Connect streams to the tunnel servers at `server_address`."""

    def __init__(
        self, server_address: str, credentials: Credentials, *, server_name: str | None = None
    ) -> None:
        self.server_address = server_address
        self._credentials = credentials
        self._server_name = server_name

    def open(self, agent_id: str, node: str, held: Iterable[str] = ()) -> GrpcPacketStream:
        # Read at every attempt: a renewed certificate is used for new streams.
        credentials = self._credentials()
        metadata = [(mux.AGENT_ID_METADATA, agent_id), (mux.HELD_METADATA, ",".join(held))]
        if credentials is None:
            metadata.append(("waygate-node", node))
        channel = open_channel(
            self.server_address,
            credentials=credentials,
            server_name=self._server_name,
            retry=False,
            # Untraced: an intercepted call held its connection after close(), so
            # every attempt a balancer refused (ALREADY_EXISTS) left one open.
            traced=False,
            options=(
                ("grpc.use_local_subchannel_pool", 1),
                ("grpc.max_receive_message_length", 4 * 1024 * 1024),
            ),
        )
        call = tunnel_pb2_grpc.AgentTunnelStub(channel).Connect(metadata=tuple(metadata))
        return GrpcPacketStream(channel, call)
