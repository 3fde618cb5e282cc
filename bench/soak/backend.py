"""The soak's backend: an HTTP/1.1 + WebSocket server whose answers can be checked end to end.

Run: python -m bench.soak.backend --host 127.0.0.1 --port P --name NAME

- `GET /small`: a short body naming this backend;
- `POST /sum`: the SHA-256 and length of the body it received (the client
  checks them against what it sent);
- `GET /blob?size=N&seed=S`: N bytes derived from S (the client recomputes them);
- `GET /ws`: a WebSocket that echoes every message;
- with `--grpc-port`, a gRPC service `soak.Echo` on that port (raw bytes):
  `Unary` answers the request with this backend's name after it, and
  `ServerStream` answers a request `ID:N` with N messages `ID:0` .. `ID:N-1`
  (the client checks every one, in order).
Every answer carries `x-backend: NAME`. Each request's `x-soak-id` is
remembered: a second request with the same id (a request answered twice, e.g.
retried by the proxy after the body was sent) is counted. `GET /__stats`, asked
directly (not through the proxy), answers {"requests", "duplicates", "ids",
"duplicate_ids"}.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
from typing import Any

from aiohttp import WSMsgType, web

MAX_BLOB = 4 * 1024 * 1024


def blob(size: int, seed: str) -> bytes:
    """N bytes derived from the seed (cheap to make and to check on both sides)."""
    block = hashlib.sha256(seed.encode()).digest() * 2048  # 64 KiB
    return (block * (size // len(block) + 1))[:size]


class Backend:
    def __init__(self, name: str) -> None:
        self.name = name
        self.requests = 0
        self.duplicates = 0
        self.seen: set[str] = set()
        self.duplicate_ids: list[str] = []  # the first few, for the report

    def note(self, request: web.Request) -> None:
        self.requests += 1
        rid = request.headers.get("x-soak-id")
        if rid is not None:
            if rid in self.seen:
                self.duplicates += 1
                if len(self.duplicate_ids) < 1000:
                    self.duplicate_ids.append(f"{rid} {request.method} {request.path}")
            self.seen.add(rid)

    def headers(self) -> dict[str, str]:
        return {"x-backend": self.name}

    async def small(self, request: web.Request) -> web.Response:
        self.note(request)
        return web.Response(text=f"ok {self.name}\n", headers=self.headers())

    async def sum(self, request: web.Request) -> web.Response:
        self.note(request)
        digest, size = hashlib.sha256(), 0
        async for chunk in request.content.iter_any():
            digest.update(chunk)
            size += len(chunk)
        return web.json_response(
            {"sha256": digest.hexdigest(), "size": size}, headers=self.headers()
        )

    async def blob(self, request: web.Request) -> web.Response:
        self.note(request)
        size = min(int(request.query.get("size", "0")), MAX_BLOB)
        return web.Response(body=blob(size, request.query.get("seed", "")), headers=self.headers())

    async def ws(self, request: web.Request) -> web.WebSocketResponse:
        self.note(request)
        socket = web.WebSocketResponse(heartbeat=None)
        socket.headers.update(self.headers())
        await socket.prepare(request)
        async for message in socket:
            if message.type == WSMsgType.TEXT:
                await socket.send_str(message.data)
            elif message.type == WSMsgType.BINARY:
                await socket.send_bytes(message.data)
        return socket

    async def stats(self, request: web.Request) -> web.Response:
        return web.Response(
            text=json.dumps(
                {
                    "requests": self.requests,
                    "duplicates": self.duplicates,
                    "ids": len(self.seen),
                    "duplicate_ids": self.duplicate_ids,
                }
            )
        )


async def serve_grpc(host: str, port: int, name: str) -> Any:
    import grpc

    async def unary(request: bytes, context: Any) -> bytes:
        return request + b"|" + name.encode()

    async def server_stream(request: bytes, context: Any) -> Any:
        rid, _, count = request.partition(b":")
        for index in range(min(int(count or b"0"), 1000)):
            yield rid + b":" + str(index).encode()

    handler = grpc.method_handlers_generic_handler(
        "soak.Echo",
        {
            "Unary": grpc.unary_unary_rpc_method_handler(unary),
            "ServerStream": grpc.unary_stream_rpc_method_handler(server_stream),
        },
    )
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((handler,))
    server.add_insecure_port(f"{host}:{port}")
    await server.start()
    return server


async def main(host: str, port: int, name: str, grpc_port: int | None) -> None:
    backend = Backend(name)
    app = web.Application(client_max_size=MAX_BLOB + 1024)
    app.router.add_get("/small", backend.small)
    app.router.add_post("/sum", backend.sum)
    app.router.add_get("/blob", backend.blob)
    app.router.add_get("/ws", backend.ws)
    app.router.add_get("/__stats", backend.stats)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port, backlog=1024).start()
    grpc_server = None if grpc_port is None else await serve_grpc(host, grpc_port, name)
    print(f"backend {name} listening on {host}:{port}", flush=True)
    await asyncio.Event().wait()
    del grpc_server


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--name", required=True)
    parser.add_argument("--grpc-port", type=int)
    arguments = parser.parse_args()
    asyncio.run(main(arguments.host, arguments.port, arguments.name, arguments.grpc_port))
