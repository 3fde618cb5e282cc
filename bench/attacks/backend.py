"""The attack runs' backend: a bare HTTP/1.1 server in its own process (uvloop).

    python -m bench.attacks.backend     # prints its port, serves until stdin closes

- `GET /big?n=N`: N bytes (a large body a hostile client asks for and never reads);
- `POST /upload` with a Content-Length: answered once its whole body is read, as an
  application does (the slow-upload attack's backend: a trickled body holds its
  connection);
- any other `POST`: answered at once (200, `Connection: close`); whatever body follows
  is read and dropped until the proxy closes (a body that never ends);
- anything else: a short 200 (the bystander's requests).

Its own process, so that serving a large body costs the test's event loop
(where the bystander is timed) nothing.
"""

from __future__ import annotations

import asyncio
import sys
from typing import Any

try:
    import uvloop
except ImportError:  # pragma: no cover (not on every platform)
    uvloop = None  # type: ignore[assignment]

SMALL = b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nContent-Type: text/plain\r\n\r\nok\n"
POSTED = b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nConnection: close\r\n\r\nok\n"
BLOCK = b"x" * (1 << 16)


class Backend(asyncio.Protocol):
    def __init__(self) -> None:
        self.transport: Any = None
        self.buffer = b""
        self.sink = False  # a POST was answered: what follows is dropped
        self.big = 0  # body bytes still to send
        self.paused = False
        self.upload = 0  # /upload body bytes still to read before answering

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        transport.set_write_buffer_limits(high=1 << 20)

    def data_received(self, data: bytes) -> None:
        if self.sink:
            return
        self.buffer += data
        while not self.sink and self.big == 0:
            if self.upload:
                taken = min(self.upload, len(self.buffer))
                self.upload -= taken
                self.buffer = self.buffer[taken:]
                if self.upload:
                    return
                assert self.transport is not None
                self.transport.write(SMALL)
            end = self.buffer.find(b"\r\n\r\n")
            if end < 0:
                return
            head, self.buffer = self.buffer[:end], self.buffer[end + 4 :]
            line = head.split(b"\r\n", 1)[0]
            method, _, rest = line.partition(b" ")
            target = rest.rpartition(b" ")[0]
            assert self.transport is not None
            if (
                method == b"POST"
                and target == b"/upload"
                and b"\r\ncontent-length: " in head.lower()
            ):
                self.upload = int(head.lower().split(b"\r\ncontent-length: ")[1].split(b"\r\n")[0])
                if not self.upload:
                    self.transport.write(SMALL)
            elif method == b"POST":
                self.sink = True
                self.buffer = b""
                self.transport.write(POSTED)
            elif target.startswith(b"/big?n="):
                self.big = int(target[7:])
                self.transport.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % self.big)
                self._send()
            else:
                self.transport.write(SMALL)

    def _send(self) -> None:
        transport = self.transport
        assert transport is not None
        while self.big and not self.paused and not transport.is_closing():
            piece = BLOCK if self.big >= len(BLOCK) else BLOCK[: self.big]
            self.big -= len(piece)
            transport.write(piece)
        if not self.big and self.buffer:
            self.data_received(b"")

    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self.paused = False
        self._send()

    def connection_lost(self, exc: Exception | None) -> None:
        self.big = 0


async def main() -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(Backend, "127.0.0.1", 0, backlog=1024)
    print(server.sockets[0].getsockname()[1], flush=True)
    await loop.run_in_executor(None, sys.stdin.read)
    server.close()


if __name__ == "__main__":
    if uvloop is not None:
        uvloop.install()
    asyncio.run(main())
