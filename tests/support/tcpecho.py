"""A TCP echo backend and a client for TCP service tests (real sockets)."""

from __future__ import annotations

import asyncio


class EchoBackend:
    """A TCP backend that echoes, its name first; it records the first bytes
    of each connection (where a PROXY header arrives)."""

    def __init__(self, name: str) -> None:
        self.name = name.encode()
        self.firsts: list[bytes] = []
        self.server: asyncio.AbstractServer | None = None
        self.port = 0

    async def __aenter__(self) -> EchoBackend:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()
        await self.server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        first = True
        try:
            while data := await reader.read(65536):
                if first:
                    self.firsts.append(data)
                    writer.write(self.name + b":")
                    first = False
                writer.write(data)
                await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()


async def talk(port: int, data: bytes, *, prefix: bytes = b"") -> bytes:
    """Send; read until the answer ends with `data` (the echo) or the proxy closes."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(prefix + data)
        await writer.drain()
        answer = b""
        async with asyncio.timeout(5):
            while not answer.endswith(data):
                piece = await reader.read(65536)
                if not piece:
                    break
                answer += piece
        return answer
    finally:
        writer.close()
