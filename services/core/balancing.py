"""Load balancing: pick one target out of many, by policy, with weights.

Used by the proxy (route backends -> endpoints) and the tunnel dialer (node ->
tunnel-server replicas). Pure domain code: no I/O, no clock, no grpc.

Policies (`new_picker(policy, ...)`, or the classes directly):
- "random": weighted random choice.
- "roundrobin": smooth weighted round robin (nginx's algorithm: with weights
  1:3 every window of 4 picks holds exactly 1 and 3); equal weights take a
  plain rotation that costs O(1) per pick.
- "leastconn": the target with the fewest in-flight requests per unit of
  weight; ties rotate, so idle targets share the load.
- "source": consistent hashing of a key (the client address) with bounded
  loads (Mirrokni, Thorup, Zadimoghaddam 2016): a key goes to the first target
  clockwise on a hash ring whose in-flight load is under
  ceil(load_factor * (total + 1) * weight / total_weight), so no target ever
  carries more than about `load_factor` times its share while keys still
  mostly stay where they were.
  With `subset_size` (ingress-nginx's upstream-hash-by-subset, its
  chashsubset balancer) the ring holds subsets instead of targets: the targets
  in the order of their names, cut into subsets of that size (the last one
  filled up from the first targets, so every subset has the size; one subset
  of all when there are no more targets than that), the subsets named by their
  place ("set1", "set2", ...). A key goes to one subset, the request to one of
  its targets at random; weights only tell which targets are pickable, and no
  load bound applies (the subset spreads its keys' load). Naming subsets by
  place keeps a key on its subset while the number of subsets stays; a target
  added or removed changes the members of the subsets from its place on.
- `pick(key, avoid)` (source only): targets for which `avoid` is true are
  passed over, walking the ring on (a subset whose targets are all avoided
  gives the key to the next subset); None when every target is avoided.

Invariants:
- Weights are integers 0..256 (as in OpenShift routes and HAProxy); a target
  of weight 0 is never picked. `pick` returns None when nothing is pickable
  (no targets, or every weight is 0): the caller answers 503.
- `update(targets, weights)` swaps the target set in place: a target that
  stays keeps its in-flight count and its round-robin position, so a resolver
  update does not reset the balance or leak counts. Targets are compared by
  equality (use hashable values such as (address, port) tuples); duplicates
  are refused.
- In-flight counts change only through `acquire`/`release` (or `lease`);
  releasing a target that has since been removed is a no-op, so a request
  that outlives an update never corrupts the counts of the new set.
- Deterministic: every random choice comes from the `random.Random` given
  (seeded in tests); hashing uses BLAKE2b of `name(target)`, so two processes
  agree on where a key goes.
- Not thread-safe: use from one event loop thread.
"""

from __future__ import annotations

import bisect
import contextlib
import hashlib
import math
import random
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Generic, TypeVar

T = TypeVar("T", bound=Hashable)

MAX_WEIGHT = 256
DEFAULT_WEIGHT = 1
#: Ring points for a target of the highest weight in the set; lighter targets
#: get proportionally fewer (at least one).
RING_POINTS = 160
DEFAULT_LOAD_FACTOR = 1.25

#: The one list of policy names: route `balance` values (waygate.resolver.model
#: BalancePolicy, the Route CRD) and Resolve's picks name these.
POLICIES = ("random", "roundrobin", "leastconn", "source")


class Picker(Generic[T]):
    """Shared state: the targets, their weights and in-flight counts."""

    policy = ""
    #: Targets per subset of a source-hash picker (0: none; the others have none).
    subset_size = 0

    def __init__(
        self,
        targets: Sequence[T] = (),
        weights: Sequence[int] | None = None,
        *,
        rng: random.Random | None = None,
    ) -> None:
        self._rng = rng or random.Random()
        self._targets: list[T] = []
        self._weights: dict[T, int] = {}
        self._inflight: dict[T, int] = {}
        self.update(targets, weights)

    # ------------------------------------------------------------ target set

    def update(self, targets: Sequence[T], weights: Sequence[int] | None = None) -> None:
        """Replace the target set; state of targets that stay is kept."""
        targets = list(targets)
        if weights is None:
            weights = [DEFAULT_WEIGHT] * len(targets)
        weights = list(weights)
        if len(weights) != len(targets):
            raise ValueError(f"{len(targets)} targets but {len(weights)} weights")
        for weight in weights:
            if isinstance(weight, bool) or not isinstance(weight, int):
                raise ValueError(f"weight {weight!r} is not an integer")
            if not 0 <= weight <= MAX_WEIGHT:
                raise ValueError(f"weight {weight} is outside 0..{MAX_WEIGHT}")
        new_weights = dict(zip(targets, weights, strict=True))
        if len(new_weights) != len(targets):
            raise ValueError("targets must be unique")
        self._targets = targets
        self._weights = new_weights
        self._inflight = {t: self._inflight.get(t, 0) for t in targets}
        self._rebuild()

    def _rebuild(self) -> None:
        """Recompute policy state after the target set changed."""

    @property
    def targets(self) -> tuple[T, ...]:
        return tuple(self._targets)

    def weight(self, target: T) -> int:
        return self._weights.get(target, 0)

    def __len__(self) -> int:
        return len(self._targets)

    def _pickable(self) -> list[T]:
        return [t for t in self._targets if self._weights[t] > 0]

    # ------------------------------------------------------------ in-flight

    def inflight(self, target: T) -> int:
        return self._inflight.get(target, 0)

    def acquire(self, target: T) -> None:
        """A request to `target` started."""
        if target in self._inflight:
            self._inflight[target] += 1

    def release(self, target: T) -> None:
        """A request to `target` ended (no-op if it left the set meanwhile)."""
        if self._inflight.get(target, 0) > 0:
            self._inflight[target] -= 1

    @contextlib.contextmanager
    def lease(self, key: str | bytes | None = None) -> Iterator[T | None]:
        """Pick a target and count the request as in flight until the block ends."""
        target = self.pick(key)
        if target is None:
            yield None
            return
        self.acquire(target)
        try:
            yield target
        finally:
            self.release(target)

    # ------------------------------------------------------------ picking

    def pick(self, key: str | bytes | None = None) -> T | None:
        raise NotImplementedError


class RandomPicker(Picker[T]):
    """Weighted random choice."""

    policy = "random"

    def _rebuild(self) -> None:
        self._cumulative: list[int] = []
        self._choices: list[T] = []
        total = 0
        for target in self._pickable():
            total += self._weights[target]
            self._cumulative.append(total)
            self._choices.append(target)

    def pick(self, key: str | bytes | None = None) -> T | None:
        if not self._choices:
            return None
        point = self._rng.randrange(self._cumulative[-1])
        return self._choices[bisect.bisect_right(self._cumulative, point)]


class RoundRobinPicker(Picker[T]):
    """Smooth weighted round robin; a plain rotation when the weights are equal."""

    policy = "roundrobin"

    def __init__(
        self,
        targets: Sequence[T] = (),
        weights: Sequence[int] | None = None,
        *,
        rng: random.Random | None = None,
    ) -> None:
        self._current: dict[T, int] = {}
        self._last: T | None = None
        self._cursor: int | None = None
        super().__init__(targets, weights, rng=rng)

    def _rebuild(self) -> None:
        self._order = self._pickable()
        self._uniform = len({self._weights[t] for t in self._order}) <= 1
        self._total = sum(self._weights[t] for t in self._order)
        self._current = {t: self._current.get(t, 0) for t in self._order}
        # Continue after the last target picked, wherever it now sits.
        if self._last is not None and self._last in self._current:
            self._cursor = self._order.index(self._last) + 1
        elif self._order and self._cursor is not None:
            self._cursor %= len(self._order)
        else:
            self._cursor = None

    def pick(self, key: str | bytes | None = None) -> T | None:
        if not self._order:
            return None
        if self._uniform:
            if self._cursor is None:
                # A random start, so many proxies started together do not all
                # send their first request to the same target.
                self._cursor = self._rng.randrange(len(self._order))
            chosen = self._order[self._cursor % len(self._order)]
            self._cursor = (self._cursor % len(self._order)) + 1
        else:
            chosen = self._order[0]
            for target in self._order:
                self._current[target] += self._weights[target]
                if self._current[target] > self._current[chosen]:
                    chosen = target
            self._current[chosen] -= self._total
        self._last = chosen
        return chosen


class LeastConnPicker(Picker[T]):
    """Fewest in-flight requests per unit of weight; ties rotate."""

    policy = "leastconn"

    def __init__(
        self,
        targets: Sequence[T] = (),
        weights: Sequence[int] | None = None,
        *,
        rng: random.Random | None = None,
    ) -> None:
        self._start = 0
        super().__init__(targets, weights, rng=rng)

    def _rebuild(self) -> None:
        self._order = self._pickable()

    def pick(self, key: str | bytes | None = None) -> T | None:
        count = len(self._order)
        if not count:
            return None
        best: T | None = None
        best_load = math.inf
        best_index = 0
        for offset in range(count):
            index = (self._start + offset) % count
            target = self._order[index]
            # (n + 1) / w: the load this target would carry with one more request.
            load = (self._inflight[target] + 1) / self._weights[target]
            if load < best_load:
                best, best_load, best_index = target, load, index
        self._start = best_index + 1
        return best


class SourceHashPicker(Picker[T]):
    """Consistent hashing of a key with bounded loads, to a target or to a subset."""

    policy = "source"

    def __init__(
        self,
        targets: Sequence[T] = (),
        weights: Sequence[int] | None = None,
        *,
        rng: random.Random | None = None,
        load_factor: float = DEFAULT_LOAD_FACTOR,
        name: Callable[[T], str] = str,
        subset_size: int = 0,
    ) -> None:
        if load_factor < 1:
            raise ValueError("load_factor must be >= 1")
        if isinstance(subset_size, bool) or not isinstance(subset_size, int) or subset_size < 0:
            raise ValueError(f"subset_size {subset_size!r} is not a count (0: no subsets)")
        self._load_factor = load_factor
        self._name = name
        self.subset_size = subset_size
        super().__init__(targets, weights, rng=rng)

    def _rebuild(self) -> None:
        pickable = self._pickable()
        # Ring nodes: (label, points). Targets get points by weight; subsets,
        # named by their place, equal points.
        nodes: list[tuple[str, int]]
        if self.subset_size:
            self._subsets = _subsets(sorted(pickable, key=self._name), self.subset_size)
            nodes = [(f"set{index + 1}", RING_POINTS) for index in range(len(self._subsets))]
        else:
            self._subsets = []
            heaviest = max((self._weights[t] for t in pickable), default=0)
            nodes = [
                (self._name(t), max(1, round(RING_POINTS * self._weights[t] / heaviest)))
                for t in pickable
            ]
        ring = sorted(
            (_hash(f"{label}#{point}"), index)
            for index, (label, points) in enumerate(nodes)
            for point in range(points)
        )
        self._ring_hashes = [h for h, _ in ring]
        self._ring_nodes = [i for _, i in ring]
        self._ring_targets = [] if self._subsets else [pickable[i] for _, i in ring]
        self._total_weight = sum(self._weights[t] for t in pickable)
        self._members = pickable
        self._distinct = len(nodes)

    def pick(
        self, key: str | bytes | None = None, avoid: Callable[[T], bool] | None = None
    ) -> T | None:
        if key is None:
            raise ValueError("source hashing needs a key (the client address)")
        if not self._ring_nodes:
            return None
        start = bisect.bisect(self._ring_hashes, _hash(key))
        if self._subsets:
            return self._pick_in_subset(start, avoid)
        total_load = sum(self._inflight[t] for t in self._members)
        size = len(self._ring_targets)
        seen: set[T] = set()
        first: T | None = None
        for step in range(size):
            target = self._ring_targets[(start + step) % size]
            if target in seen:
                continue
            seen.add(target)
            if avoid is None or not avoid(target):
                first = first if first is not None else target
                capacity = math.ceil(
                    self._load_factor
                    * (total_load + 1)
                    * self._weights[target]
                    / self._total_weight
                )
                if self._inflight[target] < capacity:
                    return target
            if len(seen) == self._distinct:
                break
        # Unreachable while load_factor >= 1 (the capacities sum to more than
        # the load), kept so a rounding surprise degrades to plain hashing.
        return first

    def _pick_in_subset(self, start: int, avoid: Callable[[T], bool] | None) -> T | None:
        """One target at random of the key's subset (the ring's node at `start`),
        or of the next subset clockwise whose targets are not all avoided."""
        size = len(self._ring_nodes)
        if avoid is None:
            subset = self._subsets[self._ring_nodes[start % size]]
            return subset[self._rng.randrange(len(subset))]
        seen: set[int] = set()
        for step in range(size):
            node = self._ring_nodes[(start + step) % size]
            if node in seen:
                continue
            seen.add(node)
            subset = self._subsets[node]
            count = len(subset)
            offset = self._rng.randrange(count)
            for place in range(count):
                target = subset[(offset + place) % count]
                if not avoid(target):
                    return target
            if len(seen) == self._distinct:
                break
        return None

    def subset_of(self, key: str | bytes) -> tuple[T, ...]:
        """The subset `key` hashes to (() without subsets or targets)."""
        if not self._subsets:
            return ()
        start = bisect.bisect(self._ring_hashes, _hash(key))
        return self._subsets[self._ring_nodes[start % len(self._ring_nodes)]]


def _subsets(ordered: list[T], size: int) -> list[tuple[T, ...]]:
    """`ordered` cut into subsets of `size`, the last filled up from the first
    targets (ingress-nginx's build_subset_map); one subset of all when there are
    no more targets than `size` (so a huge size costs nothing)."""
    if len(ordered) <= size:
        return [tuple(ordered)] if ordered else []
    count = math.ceil(len(ordered) / size)
    padded = ordered + ordered[: count * size - len(ordered)]
    return [tuple(padded[index * size : (index + 1) * size]) for index in range(count)]


def _hash(value: str | bytes) -> int:
    data = value.encode() if isinstance(value, str) else value
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


_CLASSES: dict[str, type[Picker]] = {
    "random": RandomPicker,
    "roundrobin": RoundRobinPicker,
    "leastconn": LeastConnPicker,
    "source": SourceHashPicker,
}


def new_picker(
    policy: str,
    targets: Sequence[T] = (),
    weights: Sequence[int] | None = None,
    *,
    rng: random.Random | None = None,
    name: Callable[[T], str] | None = None,
    subset_size: int = 0,
) -> Picker[T]:
    """A picker for one of POLICIES ("random", "roundrobin", "leastconn", "source").

    `name` labels targets on the source-hash ring (default `str`), so processes
    that name targets alike agree on where a key goes; `subset_size` (source
    only) hashes keys to subsets of that many targets.
    """
    try:
        cls = _CLASSES[policy]
    except KeyError:
        raise ValueError(
            f"unknown balancing policy {policy!r} (one of: {', '.join(POLICIES)})"
        ) from None
    if cls is SourceHashPicker:
        return SourceHashPicker(
            targets, weights, rng=rng, name=name or str, subset_size=subset_size
        )
    if subset_size:
        raise ValueError(f"subsets are for source hashing, not {policy!r}")
    return cls(targets, weights, rng=rng)
