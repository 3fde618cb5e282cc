"""Issue 31 finding 9: slow uploads against a backend's connection slots, and a bystander POSTing to it.

- `slow_uploads(port, authority, deadline, connections, interval, declared)`:
  `connections` HTTP/1.1 clients each POST /upload declaring `declared` bytes
  and send one byte every `interval` seconds; a connection the proxy cuts (its
  minimum body rate, its client timeout) is reopened at once, as the audit's
  attacker did. Reports the uploads opened and cut.
- `PostBystander`: a well-behaved client POSTing a small body to the same
  host (the same backend), one request at a time, each allowed `timeout`
  seconds, timed.

Without request buffering every trickled upload holds one of the backend's
connection slots (`--max-connections-per-endpoint`) and the bystander waits
behind them; with it, the uploads hold only the proxy's memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

from tests.support.h2attack import Bystander


async def _one_upload(
    port: int, authority: bytes, deadline: float, interval: float, declared: int
) -> bool:
    """One trickled upload until the deadline; True when the proxy cut it first."""
    loop = asyncio.get_running_loop()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError:
        await asyncio.sleep(0.05)
        return True
    try:
        writer.write(
            b"POST /upload HTTP/1.1\r\nHost: %s\r\nContent-Length: %d\r\n\r\n"
            % (authority, declared)
        )
        while loop.time() < deadline:
            writer.write(b"x")
            await writer.drain()
            with contextlib.suppress(TimeoutError):
                # An answer (408, 413, ...) or the close means the proxy cut it.
                if await asyncio.wait_for(reader.read(4096), interval) or reader.at_eof():
                    return True
        return False
    except (OSError, asyncio.IncompleteReadError):
        return True
    finally:
        writer.transport.abort()


async def slow_uploads(
    port: int, authority: bytes, deadline: float, connections: int, interval: float, declared: int
) -> dict[str, int]:
    loop = asyncio.get_running_loop()
    counts = {"uploads": 0, "cut": 0}

    async def keep_one() -> None:
        while loop.time() < deadline:
            counts["uploads"] += 1
            if await _one_upload(port, authority, deadline, interval, declared):
                counts["cut"] += 1

    await asyncio.gather(*(keep_one() for _ in range(connections)))
    return counts


class PostBystander(Bystander):
    """POSTs of a small body to `authority`, one at a time, each on a new connection
    (timed and reported as `h2attack.Bystander`'s GETs are)."""

    def __init__(self, port: int, authority: str, body: bytes = b"b" * 512, timeout: float = 3.0):
        super().__init__(port, authority, "/upload", timeout)
        self.body = body

    async def _post(self) -> str | None:
        reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
        try:
            writer.write(
                b"POST /upload HTTP/1.1\r\nHost: %s\r\nContent-Length: %d\r\n"
                b"Connection: close\r\n\r\n" % (self.authority.encode(), len(self.body)) + self.body
            )
            head = await reader.readuntil(b"\r\n\r\n")
            status = head.split(b" ", 2)[1]
            return None if status == b"200" else "status " + status.decode()
        finally:
            writer.transport.abort()

    async def run(self, seconds: float) -> PostBystander:
        loop = asyncio.get_running_loop()
        end = loop.time() + seconds
        while loop.time() < end:
            started = time.perf_counter()
            try:
                failure = await asyncio.wait_for(self._post(), self.timeout)
            except (OSError, TimeoutError, asyncio.IncompleteReadError) as exc:
                failure = type(exc).__name__
            self.latencies.append(time.perf_counter() - started)
            if failure is None:
                self.ok += 1
            else:
                self.failures.append(failure)
            await asyncio.sleep(0.02)
        return self
