"""A TCP forwarder: the tests' stand-in for a load balancer in front of replicas.

Kubernetes puts a Service (kube-proxy or a cloud load balancer) in front of
the resolver's replicas; a client reconnecting may land on another replica.
Here one listening address forwards each new connection to the current
backend, and `switch()` moves new connections to another backend and cuts the
open ones, as a replica going away or a load balancer rebalancing does. A
byte relay only (HAProxy in TCP mode would do the same); nothing is parsed.
"""

from __future__ import annotations

import asyncio
import contextlib


class TcpForwarder:
    def __init__(self, backend_port: int, host: str = "127.0.0.1") -> None:
        self.host = host
        self.backend_port = backend_port
        self.port = 0
        self.connections = 0
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._writers: set[asyncio.StreamWriter] = set()

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, self.host, 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def switch(self, backend_port: int) -> None:
        """New connections go to `backend_port`; open ones are cut."""
        self.backend_port = backend_port
        await self._cut_all()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        await self._cut_all()

    async def _cut_all(self) -> None:
        for writer in list(self._writers):
            writer.close()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _accept(
        self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter
    ) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)  # type: ignore[arg-type]
        self._writers.add(client_writer)
        self.connections += 1
        upstream_writer = None
        try:
            upstream_reader, upstream_writer = await asyncio.wait_for(
                asyncio.open_connection(self.host, self.backend_port), 5
            )
            self._writers.add(upstream_writer)
            await asyncio.gather(
                self._pipe(client_reader, upstream_writer),
                self._pipe(upstream_reader, client_writer),
            )
        except (OSError, TimeoutError, asyncio.CancelledError):
            pass
        finally:
            for writer in (client_writer, upstream_writer):
                if writer is not None:
                    self._writers.discard(writer)
                    writer.close()
            self._tasks.discard(task)  # type: ignore[arg-type]

    @staticmethod
    async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        finally:
            with contextlib.suppress(OSError, RuntimeError):
                if writer.can_write_eof():
                    writer.write_eof()
