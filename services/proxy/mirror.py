"""RequestMirror: send a copy of a request head to another backend, fire and forget.

The primary exchange never waits for a mirror: `Mirrors.send` starts a task
and returns. Each copy dials through the proxy's own dialer (so tunnelled
endpoints work), writes the head, waits at most `timeout` for the answer's
head and closes: the answer is dropped. A copy is a protocol on what the
dialer returned (a socket, or a tunnel's data connection as it is:
`upstream.start`), holding at most `MAX_ANSWER_HEAD` bytes of the answer.
Bounded: at most `limit` copies in
flight; beyond that a copy is dropped and counted, so a slow mirror backend
can neither slow the primary nor grow memory. Requests with a body are not
mirrored (the body streams once, to the primary).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from waygate.proxy.upstream import start

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
        transport: Any = None
        try:
            async with asyncio.timeout(self.timeout):
                connection = await self.dialer.connect(target, self.timeout, None)
                answer = _Answer(head)
                transport, _ = await start(connection, lambda: answer)
                answered = await answer.done
            if answered:
                self.sent += 1
            else:
                self.failed += 1
        except (OSError, TimeoutError):
            self.failed += 1
        except Exception as exc:  # a dialer's own error type (ConnectError)
            self.failed += 1
            log.debug("mirror copy to %s failed: %s", target, exc)
        finally:
            if transport is not None:
                transport.close()

    async def close(self) -> None:
        """Cancel the copies in flight (the proxy is stopping)."""
        for task in list(self.tasks):
            task.cancel()
        for task in list(self.tasks):
            with contextlib.suppress(asyncio.CancelledError):
                await task


class _Answer(asyncio.Protocol):
    """Writes the copy's head; `done` is True once the answer's head arrived, False
    when the backend closed first or sent more than `MAX_ANSWER_HEAD` bytes without one
    (a result, not an exception: nobody may be waiting for it any more)."""

    def __init__(self, head: bytes) -> None:
        self.head = head
        self.seen = bytearray()
        self.done: asyncio.Future[bool] = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: Any) -> None:
        transport.write(self.head)

    def data_received(self, data: bytes) -> None:
        if self.done.done():
            return
        # Only the tail of what came before can hold the start of the blank line.
        start_at = max(0, len(self.seen) - 3)
        self.seen += data
        if self.seen.find(b"\r\n\r\n", start_at) >= 0:
            self.done.set_result(True)
        elif len(self.seen) > MAX_ANSWER_HEAD:
            self.done.set_result(False)

    def eof_received(self) -> bool:
        self._ended()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._ended()

    def _ended(self) -> None:
        if not self.done.done():
            self.done.set_result(False)
