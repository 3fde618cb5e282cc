"""Balancing policies: distributions, weights, state kept across updates, bounded load."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest

from waygate.core.balancing import (
    LeastConnPicker,
    RandomPicker,
    RoundRobinPicker,
    SourceHashPicker,
    new_picker,
)


def picks(picker, n, key=None):
    return Counter(picker.pick(key) for _ in range(n))


def test_weighted_random_follows_weights_1_to_3():
    picker = RandomPicker(["a", "b"], [1, 3], rng=random.Random(7))
    counts = picks(picker, 4000)
    assert set(counts) == {"a", "b"}
    assert 0.22 < counts["a"] / 4000 < 0.28


def test_random_is_deterministic_under_a_seed():
    one = RandomPicker("abcd", rng=random.Random(1))
    two = RandomPicker("abcd", rng=random.Random(1))
    sequence = [one.pick() for _ in range(50)]
    assert sequence == [two.pick() for _ in range(50)]
    assert set(sequence) == set("abcd")


@pytest.mark.parametrize("policy", ["random", "roundrobin", "leastconn", "source"])
def test_zero_weight_is_never_picked_and_all_zero_picks_nothing(policy):
    picker = new_picker(policy, ["a", "b", "c"], [0, 5, 5], rng=random.Random(3))
    seen = {picker.pick(f"client-{i}") for i in range(500)}
    assert seen == {"b", "c"}
    picker.update(["a", "b"], [0, 0])
    assert picker.pick("client") is None
    picker.update([])
    assert picker.pick("client") is None


def test_weights_outside_0_to_256_and_duplicates_are_refused():
    with pytest.raises(ValueError, match="outside 0..256"):
        RandomPicker(["a"], [257])
    with pytest.raises(ValueError, match="unique"):
        RandomPicker(["a", "a"])
    with pytest.raises(ValueError, match="unknown balancing policy"):
        new_picker("fastest")


def test_weighted_round_robin_is_exact_and_smooth():
    picker = RoundRobinPicker(["a", "b"], [1, 3], rng=random.Random(0))
    sequence = [picker.pick() for _ in range(4000)]
    assert Counter(sequence) == {"a": 1000, "b": 3000}
    # Smooth: "a" is spread out, never bunched (every window of 4 holds exactly one).
    assert all(sequence[i : i + 4].count("a") == 1 for i in range(0, 4000, 4))


def test_round_robin_keeps_its_position_when_targets_change():
    picker = RoundRobinPicker(["a", "b", "c", "d"], rng=random.Random(0))
    first = picker.pick()
    order = ["a", "b", "c", "d"]
    assert picker.pick() == order[(order.index(first) + 1) % 4]
    last = order[(order.index(first) + 1) % 4]
    # A target that is not next is removed, and one is added: rotation continues after `last`.
    remaining = [t for t in order if t != order[(order.index(last) + 2) % 4]] + ["e"]
    picker.update(remaining)
    expected_next = remaining[(remaining.index(last) + 1) % len(remaining)]
    assert picker.pick() == expected_next
    # A full cycle over the new set visits each target exactly once.
    cycle = [picker.pick() for _ in range(len(remaining))]
    assert sorted(cycle) == sorted(remaining)


def test_leastconn_picks_the_idle_target_and_counts_survive_updates():
    picker = LeastConnPicker(["a", "b", "c"], rng=random.Random(0))
    for target in ("a", "a", "b"):
        picker.acquire(target)
    assert picker.pick() == "c"
    picker.acquire("c")
    picker.acquire("c")
    assert picker.pick() == "b"
    picker.update(["a", "b", "d"])
    assert picker.inflight("a") == 2 and picker.inflight("b") == 1
    assert picker.pick() == "d"
    picker.release("c")  # removed meanwhile: a no-op, never negative or resurrected
    assert picker.inflight("c") == 0 and "c" not in picker.targets


def test_leastconn_honours_weights_and_rotates_ties():
    picker = LeastConnPicker(["a", "b"], [1, 3])
    held = []
    for _ in range(8):
        target = picker.pick()
        picker.acquire(target)
        held.append(target)
    assert Counter(held) == {"a": 2, "b": 6}
    idle = LeastConnPicker(["a", "b", "c"])
    assert {idle.pick() for _ in range(3)} == {"a", "b", "c"}


def test_lease_counts_a_request_while_it_runs():
    picker = LeastConnPicker(["a", "b"])
    with picker.lease() as first:
        assert picker.inflight(first) == 1
        with picker.lease() as second:
            assert second != first
    assert picker.inflight("a") == picker.inflight("b") == 0


def test_source_hash_is_stable_for_a_key_and_spreads_keys():
    picker = SourceHashPicker([f"10.0.0.{i}" for i in range(10)])
    assert all(picker.pick("192.0.2.7") == picker.pick("192.0.2.7") for _ in range(20))
    counts = picks_by_keys(picker, [f"client-{i}" for i in range(5000)])
    assert len(counts) == 10
    assert max(counts.values()) < 2 * 5000 / 10  # no target takes double its share


def picks_by_keys(picker, keys):
    return Counter(picker.pick(k) for k in keys)


def test_source_hash_moves_few_keys_when_an_unrelated_target_goes():
    targets = [f"10.0.0.{i}" for i in range(10)]
    keys = [f"client-{i}" for i in range(5000)]
    picker = SourceHashPicker(targets)
    before = {k: picker.pick(k) for k in keys}
    picker.update([t for t in targets if t != "10.0.0.3"])
    after = {k: picker.pick(k) for k in keys}
    unrelated = [k for k in keys if before[k] != "10.0.0.3"]
    moved = sum(1 for k in unrelated if after[k] != before[k])
    assert moved / len(unrelated) < 0.05
    assert all(after[k] != "10.0.0.3" for k in keys)


def test_source_hash_bounded_load_never_exceeds_its_cap():
    targets = [f"10.0.0.{i}" for i in range(10)]
    picker = SourceHashPicker(targets, load_factor=1.25)
    keys = [f"client-{i % 37}" for i in range(1000)]  # few hot keys: plain hashing would pile up
    for key in keys:
        picker.acquire(picker.pick(key))
    average = len(keys) / len(targets)
    loads = [picker.inflight(t) for t in targets]
    assert sum(loads) == 1000
    assert max(loads) <= math.ceil(1.25 * average) + 1


def test_source_hash_weights_shift_share():
    picker = SourceHashPicker(["a", "b"], [1, 3])
    counts = picks_by_keys(picker, [f"client-{i}" for i in range(4000)])
    assert 0.15 < counts["a"] / 4000 < 0.35


def test_source_hash_needs_a_key():
    with pytest.raises(ValueError, match="needs a key"):
        SourceHashPicker(["a"]).pick()


# ---------------------------------------------------------------- subsets
# ingress-nginx's upstream-hash-by-subset (rootfs/etc/nginx/lua/balancer/chashsubset.lua):
# a key always goes to the same subset, the request to one of its endpoints at random.

NINE = [f"10.0.0.{i:02}" for i in range(9)]


def chunks(targets, size):
    return [tuple(targets[i : i + size]) for i in range(0, len(targets), size)]


def test_subset_hash_keeps_a_key_within_one_subset_of_the_size():
    picker = SourceHashPicker(
        [*NINE, "10.0.0.09"][::-1], subset_size=3, rng=random.Random(5)
    )  # given in any order: subsets follow the names
    ordered = sorted([*NINE, "10.0.0.09"])
    # The last subset is filled up from the first endpoints, as ingress-nginx's.
    assert picker._subsets == [*chunks(ordered[:9], 3), (ordered[9], ordered[0], ordered[1])]
    for key in [f"client-{i}" for i in range(50)]:
        subset = picker.subset_of(key)
        assert len(subset) == 3
        seen = {picker.pick(key) for _ in range(60)}
        assert seen == set(subset)  # every member, never another endpoint


def test_subset_hash_spreads_keys_over_the_subsets():
    picker = SourceHashPicker([*NINE, "10.0.0.09", "10.0.0.10", "10.0.0.11"], subset_size=3)
    counts = Counter(picker.subset_of(f"client-{i}") for i in range(4000))
    assert len(counts) == 4
    assert max(counts.values()) < 2 * 4000 / 4  # no subset takes double its share
    hits = picks_by_keys(picker, [f"client-{i}" for i in range(4000)])
    assert len(hits) == 12


def test_subset_membership_and_keys_stay_when_an_endpoint_is_added():
    keys = [f"client-{i}" for i in range(3000)]

    def places(picker):  # each key's subset, by its place ("set1", ...)
        return {k: picker._subsets.index(picker.subset_of(k)) for k in keys}

    picker = SourceHashPicker(NINE, subset_size=3)
    before = places(picker)
    # One more endpoint (named last): a fourth subset, the first three unchanged.
    picker.update([*NINE, "10.0.0.09"])
    assert picker._subsets[:3] == chunks(NINE, 3)
    after = places(picker)
    moved = [k for k in keys if after[k] != before[k]]
    assert all(after[k] == 3 for k in moved)  # only to the new subset
    assert 0.1 < len(moved) / len(keys) < 0.4  # about a quarter, as a ring of 4 gives
    # Another one while the number of subsets stays: no key changes place, and only
    # the last subset's members change (filled up before, now holding the newcomer).
    filled = picker._subsets[3]
    picker.update([*NINE, "10.0.0.09", "10.0.0.10"])
    assert places(picker) == after
    assert picker._subsets[:3] == chunks(NINE, 3)
    assert (filled, picker._subsets[3]) == (
        ("10.0.0.09", "10.0.0.00", "10.0.0.01"),
        ("10.0.0.09", "10.0.0.10", "10.0.0.00"),
    )


def test_subset_hash_passes_over_avoided_endpoints_then_subsets():
    picker = SourceHashPicker(NINE, subset_size=3, rng=random.Random(2))
    key = "client-7"
    subset = picker.subset_of(key)
    # One member avoided: the others of the subset take the key.
    assert {picker.pick(key, lambda t: t == subset[0]) for _ in range(40)} == set(subset[1:])
    # The whole subset avoided: the next subset clockwise, the same one every time.
    spilled = {picker.pick(key, lambda t: t in subset) for _ in range(40)}
    assert spilled and not spilled & set(subset)
    assert len({next(s for s in picker._subsets if t in s) for t in spilled}) == 1
    assert picker.pick(key, lambda t: True) is None


def test_source_hash_passes_over_avoided_targets():
    picker = SourceHashPicker(NINE)
    first = picker.pick("client-1")
    other = picker.pick("client-1", lambda t: t == first)
    assert other not in (None, first)
    assert picker.pick("client-1", lambda t: t == first) == other  # still consistent
    assert picker.pick("client-1", lambda t: True) is None


def test_subset_size_edges():
    # No more endpoints than the size: one subset of them all (no padding).
    picker = SourceHashPicker(["a", "b"], subset_size=1000)
    assert picker._subsets == [("a", "b")]
    assert {picker.pick("k") for _ in range(50)} == {"a", "b"}
    # Weight 0: never in a subset.
    assert SourceHashPicker(["a", "b", "c"], [1, 0, 1], subset_size=2)._subsets == [("a", "c")]
    assert SourceHashPicker([], subset_size=3).pick("k") is None
    for bad in (-1, True, 1.5):
        with pytest.raises(ValueError, match="subset_size"):
            SourceHashPicker(["a"], subset_size=bad)
    with pytest.raises(ValueError, match="subsets are for source hashing"):
        new_picker("roundrobin", ["a"], subset_size=3)
    assert new_picker("source", ["a"], subset_size=3).subset_size == 3
