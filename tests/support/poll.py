"""Wait until something holds, with a deadline: the one poll-until helper of the tests.

Every wait in a test has a timeout; when it runs out the test fails with an
AssertionError naming what it waited for, never a hang. `until` is for code on
an event loop (its predicate may be a coroutine function: a check that makes a
call), `until_blocking` for tests that drive processes synchronously.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable

TIMEOUT = 20.0  # generous: CI runs two workers on two loaded cores
INTERVAL = 0.02


async def until(
    predicate: Callable[[], object | Awaitable[object]],
    what: str = "the condition",
    *,
    timeout: float = TIMEOUT,
    interval: float = INTERVAL,
) -> None:
    """Return once `predicate()` (awaited when it returns an awaitable) is truthy;
    AssertionError after `timeout` seconds, a check in progress included."""
    try:
        async with asyncio.timeout(timeout):
            while True:
                result = predicate()
                if inspect.isawaitable(result):
                    result = await result
                if result:
                    return
                await asyncio.sleep(interval)
    except TimeoutError:
        raise AssertionError(f"timed out after {timeout:g}s waiting for {what}") from None


def until_blocking(
    predicate: Callable[[], object],
    what: str = "the condition",
    *,
    timeout: float = TIMEOUT,
    interval: float = INTERVAL,
) -> None:
    """`until` for synchronous code: sleeps between checks instead of yielding."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(interval)
