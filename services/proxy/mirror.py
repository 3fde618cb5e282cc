"""RequestMirror: send a copy of a request head to another backend, fire and forget.

The primary exchange never waits for a mirror: `Mirrors.send` starts a task
and returns. Each copy dials through the proxy's own dialer (so tunnelled
endpoints work), writes the head, waits at most `timeout` for the answer's
head and closes: the answer is dropped. Bounded: at most `limit` copies in
flight; beyond that a copy is dropped and counted, so a slow mirror backend
can neither slow the primary nor grow memory. Requests with a body are not
mirrored (the body streams once, to the primary).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from typing import Any

log = logging.getLogger(__name__)

DEFAULT_LIMIT = 256
DEFAULT_TIMEOUT = 5.0
# An answer's head larger than this is not read further: it is dropped anyway.
MAX_ANSWER_HEAD = 16384


class Mirrors:
    def __init__(
        self, dialer: Any, *, limit: int = DEFAULT_LIMIT, timeout: float = DEFAULT_TIMEOUT
    ) -> None:
        self.dialer = dialer
        self.limit = limit
        self.timeout = timeout
        self.tasks: set[asyncio.Task[None]] = set()
        self.sent = 0
        self.dropped = 0
        self.failed = 0

    def send(self, target: Any, head: bytes) -> bool:
        """Start one copy; False when it was dropped (too many in flight)."""
        if len(self.tasks) >= self.limit:
            self.dropped += 1
            return False
        task = asyncio.get_running_loop().create_task(self._send(target, head))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return True

    async def _send(self, target: Any, head: bytes) -> None:
        sock: socket.socket | None = None
        writer: asyncio.StreamWriter | None = None
        try:
            async with asyncio.timeout(self.timeout):
                sock = await self.dialer.connect(target, self.timeout, None)
                reader, writer = await asyncio.open_connection(sock=sock, limit=MAX_ANSWER_HEAD)
                sock = None  # the writer owns it now
                writer.write(head)
                await writer.drain()
                await reader.readuntil(b"\r\n\r\n")
            self.sent += 1
        except (OSError, TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            self.failed += 1
        except Exception as exc:  # a dialer's own error type (ConnectError)
            self.failed += 1
            log.debug("mirror copy to %s failed: %s", target, exc)
        finally:
            if writer is not None:
                writer.close()
            if sock is not None:
                sock.close()

    async def close(self) -> None:
        """Cancel the copies in flight (the proxy is stopping)."""
        for task in list(self.tasks):
            task.cancel()
        for task in list(self.tasks):
            with contextlib.suppress(asyncio.CancelledError):
                await task
