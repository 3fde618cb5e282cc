"""Exponential backoff with jitter, for reconnect and retry loops.

Each delay is drawn from the upper half of the current ceiling, so many
clients that failed together spread out without any of them retrying at once.

Sans-IO: `next_delay()` only computes; the caller sleeps. Deterministic when
given a seeded `random.Random`, so loops that use it can be tested exactly.
"""

from __future__ import annotations

import random


class Backoff:
    def __init__(
        self,
        initial: float = 0.1,
        maximum: float = 30.0,
        multiplier: float = 2.0,
        rng: random.Random | None = None,
    ) -> None:
        if not 0 < initial <= maximum or multiplier < 1:
            raise ValueError("backoff needs 0 < initial <= maximum and multiplier >= 1")
        self._initial, self._maximum, self._multiplier = initial, maximum, multiplier
        self._rng = rng or random.Random()
        self._ceiling = initial
        self.attempts = 0

    def next_delay(self) -> float:
        """A delay drawn uniformly from [ceiling/2, ceiling]; the ceiling then grows."""
        delay = self._rng.uniform(self._ceiling / 2, self._ceiling)
        self._ceiling = min(self._ceiling * self._multiplier, self._maximum)
        self.attempts += 1
        return delay

    def reset(self) -> None:
        """After a success: the next failure starts from the initial delay again."""
        self._ceiling = self._initial
        self.attempts = 0
