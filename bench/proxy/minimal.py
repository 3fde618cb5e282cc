"""The floor under Waygate's proxy: a minimal uvloop + httptools HTTP pass-through.

    python -m bench.proxy.minimal LISTEN_PORT UPSTREAM_PORT [BURN_US]

Each client connection gets its own upstream connection (opened on accept,
kept alive); request and response bytes are relayed as they arrive, with
httptools parsing both directions only to find where each message ends. No
routing, no header rules, no pool, no limits or timeouts: the least any
Python HTTP proxy does per request, so Waygate / minimal shows what the
rules cost. Reading pauses when the other side's write buffer is full, so a
1 GiB body streams through it too. Serves until stdin closes. With BURN_US
(`bench/proxy/ab.py --burn-us`) it busy-waits that many microseconds per
read, to show how the system time per request follows the Python time.
"""

from __future__ import annotations

import asyncio
import sys
import time

import httptools
import uvloop


class Side(asyncio.Protocol):
    """One end of the relay; `peer` is the other end."""

    def __init__(self, parser_factory: type) -> None:
        self.parser = parser_factory(self)
        self.peer: Side | None = None
        self.transport: asyncio.Transport | None = None
        self.pending: list[bytes] = []  # bytes received before the peer connected

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if BURN:
            until = time.perf_counter() + BURN
            while time.perf_counter() < until:
                pass
        try:
            self.parser.feed_data(data)  # framing only: validates and finds message ends
        except httptools.HttpParserError:
            self.close()
            return
        if self.peer is None or self.peer.transport is None:
            self.pending.append(data)
        else:
            self.peer.transport.write(data)

    def pause_writing(self) -> None:  # our write buffer is full: stop reading the peer
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.resume_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.close()

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


async def main(listen_port: int, upstream_port: int) -> None:
    loop = asyncio.get_running_loop()
    connecting: set[asyncio.Task[None]] = set()

    def accept() -> Side:
        client = Side(httptools.HttpRequestParser)

        async def connect() -> None:
            try:
                _, upstream = await loop.create_connection(
                    lambda: Side(httptools.HttpResponseParser), "127.0.0.1", upstream_port
                )
            except OSError:
                client.close()
                return
            if client.transport is None or client.transport.is_closing():
                upstream.close()  # the client left while we connected
                return
            upstream.peer, client.peer = client, upstream
            for data in client.pending:
                upstream.transport.write(data)  # type: ignore[union-attr]
            client.pending.clear()

        task = loop.create_task(connect())
        connecting.add(task)
        task.add_done_callback(connecting.discard)
        return client

    server = await loop.create_server(accept, "127.0.0.1", listen_port, reuse_port=True)
    print(server.sockets[0].getsockname()[1], flush=True)
    await loop.run_in_executor(None, sys.stdin.read)
    server.close()


BURN = float(sys.argv[3]) / 1e6 if __name__ == "__main__" and len(sys.argv) > 3 else 0.0

if __name__ == "__main__":
    uvloop.run(main(int(sys.argv[1]), int(sys.argv[2])))
