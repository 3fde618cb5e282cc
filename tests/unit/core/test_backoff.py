"""Backoff: growth, ceiling, jitter range and determinism under a seed."""

import random

import pytest

from waygate.core.backoff import Backoff


def test_delays_grow_to_the_ceiling_within_the_jitter_band():
    backoff = Backoff(initial=1.0, maximum=8.0, multiplier=2.0, rng=random.Random(1))
    ceilings = [1, 2, 4, 8, 8, 8]
    for ceiling in ceilings:
        delay = backoff.next_delay()
        assert ceiling / 2 <= delay <= ceiling
    assert backoff.attempts == len(ceilings)


def test_reset_starts_over():
    backoff = Backoff(initial=0.5, maximum=30.0, rng=random.Random(2))
    for _ in range(6):
        backoff.next_delay()
    backoff.reset()
    assert backoff.next_delay() <= 0.5
    assert backoff.attempts == 1


def test_same_seed_same_delays():
    a = Backoff(rng=random.Random(7))
    b = Backoff(rng=random.Random(7))
    assert [a.next_delay() for _ in range(10)] == [b.next_delay() for _ in range(10)]


@pytest.mark.parametrize(("initial", "maximum", "multiplier"), [(0, 1, 2), (2, 1, 2), (1, 2, 0.5)])
def test_bad_parameters(initial, maximum, multiplier):
    with pytest.raises(ValueError):
        Backoff(initial, maximum, multiplier)
