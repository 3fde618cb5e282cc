"""Leaf bounds: how long the leaves each CA signed can live, as stored and as known.

Every CA record carries two moments: `leaf_max`, the latest not_after of any
leaf it signed that this process knows (in memory only), and `leaf_bound`, a
bound on it that is persisted with the CA. The rotation keeps a retiring CA in
the bundle until its leaves' latest not_after (`rotation`), so after a restart
or a leader change the stored bound is what it goes by.

Sans-IO: functions of the CA records and the time; the authority holds the
lock and has the store written (`waygate.certs.persistence`), the leader
raises the bounds ahead of signing (`waygate.certs.leader`).

Invariants:
- the stored bound is always >= every not_after signed under it: a leaf past
  the bound raises it (`leaf_bound_step` ahead, so the store is written about
  once an hour rather than on every issue) and the raise is stored before the
  leaf is handed out; a restart can only keep an old CA longer, never drop it
  early;
- a bound only moves forward, and a failed store write leaves it as it was
  (the writer puts the state back to its checkpoint);
- `leaf_max` only moves forward, also when another replica's state is adopted.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from datetime import datetime, timedelta
from typing import TypeVar

from waygate.certs.castate import CARecord

_T = TypeVar("_T")


def covers(ca: CARecord, not_after: datetime) -> bool:
    """A leaf of `ca` until `not_after` needs no store write: the stored bound holds it."""
    return ca.leaf_bound is not None and not_after <= ca.leaf_bound


def staged_bound(switch_at: datetime, max_lifetime: timedelta, step: timedelta) -> datetime:
    """A new CA's first bound: it covers the leaves of its first `step` of signing
    after `switch_at`, so they (every workload renewing after an immediate switch)
    need no store write under the lock; the rotation's own write carries it."""
    return switch_at + max_lifetime + step


def raise_past(ca: CARecord, not_after: datetime, step: timedelta) -> None:
    """Raise `ca`'s bound `step` past `not_after` (the caller stores it before the
    leaf is handed out, and puts it back if that fails: `persistence`)."""
    ca.leaf_bound = not_after + step


def record_leaf(ca: CARecord, not_after: datetime) -> None:
    """`ca` signed a leaf valid until `not_after`."""
    if ca.leaf_max is None or not_after > ca.leaf_max:
        ca.leaf_max = not_after


def below(cas: Iterable[CARecord], until: datetime) -> list[CARecord]:
    """The CAs whose bound is lower than `until` (or unset)."""
    return [ca for ca in cas if ca.leaf_bound is None or ca.leaf_bound < until]


def encoded_with_bounds(
    cas: Sequence[CARecord], until: datetime, encode: Callable[[], _T]
) -> _T | None:
    """What `encode()` makes of `cas` with every bound raised to at least `until`;
    None when every bound already is. The records are left as they were."""
    low = below(cas, until)
    if not low:
        return None
    saved = [(ca, ca.leaf_bound) for ca in low]
    try:
        for ca in low:
            ca.leaf_bound = until
        return encode()
    finally:
        for ca, bound in saved:
            ca.leaf_bound = bound


def raise_all(cas: Iterable[CARecord], until: datetime) -> None:
    """Every bound to at least `until` (the files saying so are stored)."""
    for ca in below(cas, until):
        ca.leaf_bound = until


def keep_known_leaves(adopted: Iterable[CARecord], known: Sequence[CARecord]) -> None:
    """Carry the latest leaf not_after this process knows into the records of another
    replica's state being adopted (it may not have seen our leaves yet)."""
    mine = {ca.name: ca for ca in known}
    for ca in adopted:
        own = mine.get(ca.name)
        if own is not None and own.leaf_max is not None:
            ca.leaf_max = max(own.leaf_max, ca.leaf_max or own.leaf_max)
