"""One process holding many resolver Watch streams, each on its own connection,
like that many proxies (bench/resolver and bench/resolver_storm).

Run: python -m bench.resolver.watchers ADDRESS STREAMS SNAPSHOT_BYTES CHANGES PREFIX

Snapshot chunks are not parsed (a client here stands for a proxy's connection,
not its CPU): a stream is ready once it has received SNAPSHOT_BYTES of events,
what one full snapshot serializes to. Prints "ready N LOST" once every stream
is ready or lost, then, for each bench change (tunnel presence of node
PREFIX-I, made by bench.resolver.common.ChangeReporter) the latest arrival over its streams (CLOCK_MONOTONIC) and how
many streams saw it, and how many events the streams received after their
snapshots, as one JSON line once every live stream saw the last one. A change
has reached a stream once the stream's view holds it or a later one (a
coalesced event carries only the latest state).
A stream that ends with an error is lost: its reason is printed.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

import grpc

from bench.resolver.common import MAX_MESSAGE
from waygate.resolver.v1 import resolver_pb2 as pb

WATCH = "/waygate.resolver.v1.Resolver/Watch"
SMALL = 64 * 1024  # events smaller than this are parsed (changes, heartbeats)


async def stream(
    address: str,
    snapshot_bytes: int,
    changes: int,
    prefix: str,
    ready: asyncio.Event,
    seen: dict[int, list[float]],
    lost: list[str],
    counts: list[int],
) -> None:
    options = [
        ("grpc.max_receive_message_length", MAX_MESSAGE),
        # A connection of its own, like a proxy: channels to one target otherwise
        # share one (gRPC's global subchannel pool), and its HTTP/2 stream limit
        # (100) would hold every stream past the hundredth client-side.
        ("grpc.use_local_subchannel_pool", 1),
    ]
    try:
        async with grpc.aio.insecure_channel(address, options=options) as channel:
            call = channel.unary_stream(
                WATCH,
                request_serializer=pb.WatchRequest.SerializeToString,
                response_deserializer=lambda raw: raw,
            )(pb.WatchRequest())
            received, reached = 0, -1
            async for raw in call:
                now = time.monotonic()
                if not ready.is_set():
                    received += len(raw)
                    if received >= snapshot_bytes:
                        ready.set()
                    continue
                counts[0] += 1  # events after the snapshot: how far changes were coalesced
                if len(raw) >= SMALL:
                    continue
                event = pb.WatchEvent.FromString(raw)
                # Change I names node I and retires node I-1: a coalesced event may
                # carry only the latest node, which says every earlier change arrived.
                latest = reached
                for change in event.changes.changes:
                    node = change.tunnel_presence.node
                    if change.tunnel_presence.servers and node.startswith(prefix):
                        latest = max(latest, int(node.removeprefix(prefix)))
                for index in range(reached + 1, latest + 1):
                    seen.setdefault(index, []).append(now)
                reached = latest
                if reached == changes - 1:
                    call.cancel()
                    return
    except grpc.aio.AioRpcError as exc:
        if exc.code() != grpc.StatusCode.CANCELLED:
            lost.append(f"{exc.code().name}: {exc.details()}")
    finally:
        ready.set()


async def main(address: str, streams: int, snapshot_bytes: int, changes: int, prefix: str) -> None:
    seen: dict[int, list[float]] = {}
    lost: list[str] = []
    counts = [0]
    events = [asyncio.Event() for _ in range(streams)]
    tasks = [
        asyncio.create_task(stream(address, snapshot_bytes, changes, prefix, e, seen, lost, counts))
        for e in events
    ]
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), 600)
    print(f"ready {streams} {len(lost)}", flush=True)
    await asyncio.wait_for(asyncio.gather(*tasks), 600)
    print(
        json.dumps(
            {"seen": {i: [max(t), len(t)] for i, t in seen.items()}, "lost": lost[:20],
             "lost_count": len(lost), "events": counts[0]}
        ),
        flush=True,
    )  # fmt: skip


if __name__ == "__main__":
    address, streams, snapshot_bytes, changes, prefix = sys.argv[1:6]
    asyncio.run(main(address, int(streams), int(snapshot_bytes), int(changes), prefix))
