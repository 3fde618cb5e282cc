"""A fault-injecting TCP relay: what a bad network or a sick peer does, on demand.

`FaultRelay(port)` listens on 127.0.0.1 (port 0) and relays every connection
to 127.0.0.1:PORT, applying the `Fault` in force when the connection was
accepted (set `relay.fault` between connections; `relay.cut()` acts on the
open ones at once):
- `latency`: each chunk waits this long before it is passed on (both ways);
- `reset_after`: once this many bytes came back from the target, both sides
  are reset (RST, not FIN), as a crashed peer or a middlebox does;
- `blackhole`: accept, never connect to the target, never answer, never close
  (a half-open connection: SYN-ACKed by something that then vanished);
- `stop_reading`: relay the target's answers but stop reading what the client
  sends after `stop_reading_after` bytes (a peer whose receive window fills);
- `trickle`: pass the target's answers on one byte every `trickle` seconds.
It counts connections accepted and open, and closes everything it holds on
`close()` (every relay task is awaited: the relay itself leaks nothing).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from dataclasses import dataclass

CHUNK = 65536


@dataclass(frozen=True, kw_only=True)
class Fault:
    latency: float = 0.0
    reset_after: int | None = None
    blackhole: bool = False
    stop_reading: bool = False
    stop_reading_after: int = 0
    trickle: float = 0.0


NONE = Fault()


def reset(writer: asyncio.StreamWriter) -> None:
    """Close with RST: SO_LINGER 0, then close."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


class FaultRelay:
    def __init__(self, target_port: int, target_host: str = "127.0.0.1") -> None:
        self.target = (target_host, target_port)
        self.fault = NONE
        self.port = 0
        self.accepted = 0
        self.to_client = 0  # bytes relayed from the target, all connections
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._writers: set[asyncio.StreamWriter] = set()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def open_connections(self) -> int:
        return len(self._tasks)

    async def start(self) -> FaultRelay:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aenter__(self) -> FaultRelay:
        return await self.start()

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    def cut(self) -> None:
        """Reset every open connection now (both sides)."""
        for writer in list(self._writers):
            reset(writer)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for writer in list(self._writers):
            writer.transport.abort()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)  # type: ignore[arg-type]
        self._writers.add(writer)
        self.accepted += 1
        fault = self.fault
        upstream: asyncio.StreamWriter | None = None
        try:
            if fault.blackhole:
                # Read and drop whatever comes, answer nothing, until the client leaves.
                while await reader.read(CHUNK):
                    pass
                return
            target_reader, upstream = await asyncio.wait_for(
                asyncio.open_connection(*self.target), 5
            )
            self._writers.add(upstream)
            both = (writer, upstream)
            ended = asyncio.Event()  # the target's side ended: a stalled reader gives up
            await asyncio.gather(
                self._pipe(reader, upstream, fault, both, ended, upward=True),
                self._pipe(target_reader, writer, fault, both, ended, upward=False),
            )
        except (OSError, TimeoutError, asyncio.IncompleteReadError):
            pass
        except asyncio.CancelledError:
            pass  # close() cancels us; the task ends here either way
        finally:
            for end in (writer, upstream):
                if end is not None:
                    self._writers.discard(end)
                    end.transport.abort()
            self._tasks.discard(task)  # type: ignore[arg-type]

    async def _pipe(
        self,
        source: asyncio.StreamReader,
        sink: asyncio.StreamWriter,
        fault: Fault,
        both: tuple[asyncio.StreamWriter, asyncio.StreamWriter],
        ended: asyncio.Event,
        *,
        upward: bool,
    ) -> None:
        try:
            await self._move(source, sink, fault, both, ended, upward=upward)
        finally:
            if not upward:
                ended.set()

    async def _move(
        self,
        source: asyncio.StreamReader,
        sink: asyncio.StreamWriter,
        fault: Fault,
        both: tuple[asyncio.StreamWriter, asyncio.StreamWriter],
        ended: asyncio.Event,
        *,
        upward: bool,
    ) -> None:
        moved = 0
        try:
            while True:
                if upward and fault.stop_reading and moved >= fault.stop_reading_after:
                    # Stop reading what the client sends: its writes back up
                    # (kernel buffers fill), the connection stays open until
                    # the target's side ends (or `cut`).
                    await ended.wait()
                    return
                size = CHUNK
                if upward and fault.stop_reading:
                    size = max(1, min(CHUNK, fault.stop_reading_after - moved))
                data = await source.read(size)
                if not data:
                    with contextlib.suppress(OSError):
                        if sink.can_write_eof():
                            sink.write_eof()
                    return
                if fault.latency:
                    await asyncio.sleep(fault.latency)
                if not upward and fault.trickle:
                    for index in range(len(data)):
                        sink.write(data[index : index + 1])
                        await sink.drain()
                        await asyncio.sleep(fault.trickle)
                else:
                    if not upward and fault.reset_after is not None:
                        data = data[: fault.reset_after - moved]
                    sink.write(data)
                    await sink.drain()
                moved += len(data)
                if not upward:
                    self.to_client += len(data)
                    if fault.reset_after is not None and moved >= fault.reset_after:
                        await asyncio.sleep(0.05)  # what was relayed leaves first
                        for end in both:
                            reset(end)
                        return
        except (OSError, ConnectionError):
            for end in both:
                end.transport.abort()
