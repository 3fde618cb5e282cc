"""The peer of the watcher storm: the least a grpc.aio server can do for the same
Watch fan-out (bench/resolver_storm runs it beside the resolver, same clients).

It serves the resolver's Watch and ReportTunnels method paths with generic
handlers and nothing else: a snapshot of ENDPOINTS endpoints (made once,
serialized once, shared by every stream), then, for each tunnel report, one
pre-serialized Changes event that every stream sends as soon as its task runs
(a stream behind by several sends only the latest: the same coalescing the
resolver's watchers accept). No interceptors, spans, admission, pacing, store or
conversion per stream: what is left is grpc.aio's own cost per stream write, the
floor under the resolver's figure on this machine.

Run: python -m bench.resolver_storm.bare ENDPOINTS (prints the resolver's
"listening" JSON line with its port on stderr).
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import AsyncIterator

import grpc

from bench.resolver.common import MAX_MESSAGE
from waygate.cli import new_event_loop
from waygate.resolver.v1 import resolver_pb2 as pb

CHUNK_ENDPOINTS = 10_000


def snapshot(endpoints: int) -> list[bytes]:
    chunks = []
    for first in range(0, endpoints, CHUNK_ENDPOINTS):
        count = min(CHUNK_ENDPOINTS, endpoints - first)
        event = pb.WatchEvent(version=1, epoch=1)
        event.snapshot.endpoints.extend(
            pb.Endpoint(
                namespace="storm",
                service=f"svc-{(first + i) // 100}",
                address=f"10.{(first + i) // 25000}.{(first + i) // 100 % 250}.{i % 100 + 1}",
                ready=True,
                zone=f"z{i % 3}",
            )
            for i in range(count)
        )
        event.snapshot.more = first + count < endpoints
        chunks.append(event.SerializeToString())
    return chunks


class Fanout:
    def __init__(self, endpoints: int) -> None:
        self.snapshot = snapshot(endpoints)
        self.version = 1
        self.latest = b""
        # Set once, on the next change, then replaced: waiting costs no lock.
        self.changed = asyncio.Event()

    async def watch(
        self, request: bytes, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[bytes]:
        for chunk in self.snapshot:
            yield chunk
        sent = self.version
        while True:
            if self.version == sent:
                await self.changed.wait()
            sent = self.version
            yield self.latest

    async def report(
        self, reports: AsyncIterator[bytes], context: grpc.aio.ServicerContext
    ) -> bytes:
        async for raw in reports:
            report = pb.TunnelReport.FromString(raw)
            self.version += 1
            event = pb.WatchEvent(version=self.version, epoch=1)
            for node in report.nodes:
                event.changes.changes.add().tunnel_presence.CopyFrom(
                    pb.TunnelPresence(node=node, servers=[report.server])
                )
            self.latest = event.SerializeToString()
            self.changed.set()
            self.changed = asyncio.Event()
        return pb.ReportTunnelsResponse(version=self.version).SerializeToString()


async def main(endpoints: int) -> None:
    fanout = Fanout(endpoints)
    server = grpc.aio.server(
        options=[
            ("grpc.max_send_message_length", MAX_MESSAGE),
            ("grpc.max_concurrent_streams", 4000),
        ]
    )
    server.add_generic_rpc_handlers(
        [
            grpc.method_handlers_generic_handler(
                "waygate.resolver.v1.Resolver",
                {
                    "Watch": grpc.unary_stream_rpc_method_handler(fanout.watch),
                    "ReportTunnels": grpc.stream_unary_rpc_method_handler(fanout.report),
                },
            )
        ]
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(json.dumps({"event": "listening", "grpc_ports": [port]}), file=sys.stderr, flush=True)
    await server.wait_for_termination()


if __name__ == "__main__":
    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        runner.run(main(int(sys.argv[1])))
