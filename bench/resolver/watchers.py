"""One process holding many Watch streams, each on its own connection, like
that many proxies. Prints "ready" once every stream has its snapshot, then,
for every bench change it sees, notes when (CLOCK_MONOTONIC, comparable
across processes on one host). When every stream has seen the last change it
prints one JSON line: {change index: [latest arrival over its streams, streams]}.

Run: python -m bench.resolver.watchers ADDRESS CLIENTS CHANGES
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

import grpc

from waygate.resolver.v1 import resolver_pb2 as pb
from waygate.resolver.v1 import resolver_pb2_grpc

PREFIX = "bench-node-"


async def client(
    address: str, changes: int, snapshot: asyncio.Event, seen: dict[int, list[float]]
) -> None:
    async with grpc.aio.insecure_channel(
        address, options=[("grpc.max_receive_message_length", 64 * 1024 * 1024)]
    ) as channel:
        call = resolver_pb2_grpc.ResolverStub(channel).Watch(pb.WatchRequest())
        async for event in call:
            now = time.monotonic()
            if event.HasField("snapshot"):
                snapshot.set()
                continue
            last = False
            for change in event.changes.changes:
                presence = change.tunnel_presence
                if presence.servers and presence.node.startswith(PREFIX):
                    index = int(presence.node.removeprefix(PREFIX))
                    seen.setdefault(index, []).append(now)
                    last |= index == changes - 1
            if last:
                call.cancel()
                return


async def main(address: str, clients: int, changes: int) -> None:
    seen: dict[int, list[float]] = {}
    events = [asyncio.Event() for _ in range(clients)]
    tasks = [asyncio.create_task(client(address, changes, event, seen)) for event in events]
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), 300)
    print("ready", flush=True)
    await asyncio.gather(*tasks)
    print(json.dumps({i: [max(times), len(times)] for i, times in seen.items()}), flush=True)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3])))
