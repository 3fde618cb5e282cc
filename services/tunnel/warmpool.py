"""A warm pool: data connections opened ahead of need, so a dial does not wait for a handshake.

One mechanism for both ends of the data path: the agent keeps one per server
replica (idle data connections, `waygate.tunnel.agent.DataPool`), the dialer
one per replica data listener (raw-dial connections, `waygate.tunnel.client`).

Invariants: at most `size` idle connections; each is closed once it has
waited `idle` seconds (or as soon as it is found closing); one refill task,
started by the first `take` (or `start`), which opens one connection at a time,
backs off (0.2 s .. 10 s, jittered) while opening fails, and is woken
`REFILL_DELAY` after a take (a timer armed by the take: the task itself stays
asleep, so a dial pays no task wake-ups for the refill) before opening the
replacement, so the dial that took a connection finishes before the
replacement's handshake takes the CPU it waits on. `on_demand` pools refill only while they are used (a take
within the last `idle` seconds): a dialer that stopped dialling keeps no
connections and makes no handshakes. No grpc here.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from collections.abc import Awaitable, Callable

from waygate.core.backoff import Backoff
from waygate.tunnel.relay import REFILL_DELAY, Link


class WarmPool:
    """Idle `Link`s from `opener` (which returns None when it placed the link elsewhere)."""

    def __init__(
        self,
        opener: Callable[[], Awaitable[Link | None]],
        *,
        size: int,
        idle: float,
        on_demand: bool = False,
        on_failure: Callable[[Exception], None] | None = None,
    ) -> None:
        self._opener = opener
        self.size = size
        self.idle_time = idle
        self._on_demand = on_demand
        self._on_failure = on_failure
        self.idle: collections.deque[tuple[Link, float]] = collections.deque()
        self.used_at = time.monotonic()
        self.closed = False
        self._wanted = asyncio.Event()
        self._waking: asyncio.TimerHandle | None = None  # `_want`'s timer, while armed
        self.task: asyncio.Task[None] | None = None

    def _usable(self, link: Link, opened: float, now: float) -> bool:
        return not link.is_closing() and now - opened < self.idle_time

    def start(self) -> None:
        """Start filling (the first `take` does too)."""
        if self.task is None and not self.closed and self.size > 0:
            self.task = asyncio.ensure_future(self._fill())

    def take(self) -> Link | None:
        """The oldest usable idle connection, or None; either way the pool refills."""
        now = self.used_at = time.monotonic()
        found = None
        idle = self.idle
        while idle:
            link, opened = idle.popleft()
            if self._usable(link, opened, now):
                found = link
                break
            link.abort()
        self.start()
        self._want()
        return found

    def _want(self) -> None:
        """Wake the refill task REFILL_DELAY from now (once, however many takes)."""
        if self._waking is None and not self.closed:
            self._waking = asyncio.get_running_loop().call_later(REFILL_DELAY, self._wake)

    def _wake(self) -> None:
        self._waking = None
        self._wanted.set()

    def add(self, link: Link) -> bool:
        """Keep `link` (opened elsewhere) when there is room; False: the caller keeps it."""
        if self.closed or len(self.idle) >= self.size:
            return False
        self.idle.append((link, time.monotonic()))
        return True

    def discard(self, link: Link) -> None:
        """`link` left the pool by another way (the server took a parked one): refill."""
        for index, (held, _opened) in enumerate(self.idle):
            if held is link:
                del self.idle[index]
                break
        self.used_at = time.monotonic()
        self._want()

    async def _fill(self) -> None:
        idle = self.idle
        backoff = Backoff(initial=0.2, maximum=10.0)
        while not self.closed:
            now = time.monotonic()
            while idle and not self._usable(*idle[0], now):
                idle.popleft()[0].close()
            in_use = not self._on_demand or now - self.used_at < self.idle_time
            if not in_use or len(idle) >= self.size:
                self._wanted.clear()
                wait = self.idle_time
                if idle:
                    wait = max(0.05, idle[0][1] + self.idle_time - now)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wanted.wait(), wait)
                continue
            try:
                link = await self._opener()
            except Exception as exc:  # any failure to open: back off, retry
                if self._on_failure is not None:
                    self._on_failure(exc)
                await asyncio.sleep(backoff.next_delay())
                continue
            backoff.reset()
            if link is None:
                continue
            if self.closed:
                link.abort()
                return
            idle.append((link, time.monotonic()))

    def close(self) -> None:
        """Close every idle connection and stop refilling (taken ones are not affected)."""
        self.closed = True
        if self._waking is not None:
            self._waking.cancel()
            self._waking = None
        if self.task is not None:
            self.task.cancel()
        while self.idle:
            self.idle.popleft()[0].abort()

    async def wait_closed(self) -> None:
        if self.task is not None:
            await asyncio.gather(self.task, return_exceptions=True)
