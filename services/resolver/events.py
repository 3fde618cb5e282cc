"""Watch events: the store's snapshots and batches as bounded WatchEvent messages.

The server's side of Watch (the client never imports it, nor the store).
Invariants:
- A snapshot goes out as a sequence of WatchEvents, each at most `chunk_bytes`
  serialized (a single larger object travels alone in its chunk, up to
  `max_event_bytes`), all but the last with `snapshot.more = true`; a Changes
  event larger than `max_event_bytes` is not sent at all (the caller sends a
  snapshot instead).
- What many subscribers share is converted once per item, keys and bounds, not
  per sync time: `source`, `last_sync` and the route sources' states are
  stamped on (a copy of) the last event only. Callers never modify what they get.
- Only shared batches are cached (the store's own, and the coalesced backlog
  every subscriber at one version shares); heartbeats are converted for their
  subscriber alone.
- Stamping what many streams share costs one comparison per stream when the
  stamp is unchanged (no proto conversion per stream).
"""

from __future__ import annotations

import functools
from datetime import datetime
from typing import Any

from google.protobuf import timestamp_pb2

from waygate.core.errors import ResourceExhausted
from waygate.resolver.convert import (
    change_to_proto,
    endpoint_to_proto,
    route_to_proto,
    service_to_proto,
    source_state_to_proto,
    timestamp,
    tunnel_to_proto,
)
from waygate.resolver.model import SourceState
from waygate.resolver.store import Batch, Snapshot
from waygate.resolver.v1 import resolver_pb2 as pb

#: Bound of one snapshot chunk (serialized WatchEvent), well under gRPC's 4 MiB default.
DEFAULT_CHUNK_BYTES = 1024 * 1024
#: Largest Changes event sent as such; a larger batch is replaced by a chunked snapshot.
DEFAULT_MAX_EVENT_BYTES = 3 * 1024 * 1024
# Per-field overhead of a repeated message inside Snapshot: tag plus length varint.
_FIELD_OVERHEAD = 6
# Room for the source name (bounded by the sources' own names) and the sync time
# stamped on a snapshot's last chunk after it was cut.
_STAMP_BYTES = 1024


def snapshot_to_proto(snapshot: Snapshot, *, with_keys: bool = True) -> pb.Snapshot:
    """The whole snapshot as one message (tests and small views; Watch chunks it)."""
    return pb.Snapshot(
        services=[service_to_proto(s) for s in snapshot.services],
        endpoints=[endpoint_to_proto(e) for e in snapshot.endpoints],
        routes=[route_to_proto(r, with_key=with_keys) for r in snapshot.routes],
        tunnels=[tunnel_to_proto(t) for t in snapshot.tunnels],
    )


def watch_events(
    item: Snapshot | Batch,
    source: str,
    last_sync: datetime | None,
    epoch: int,
    *,
    with_keys: bool,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    max_event_bytes: int = DEFAULT_MAX_EVENT_BYTES,
    states: tuple[SourceState, ...] = (),
) -> tuple[pb.WatchEvent, ...] | None:
    """The events that carry `item`; None when `item` is a Batch too large to send
    as one event (the caller gives that subscriber a snapshot instead).

    The content is converted once per item, keys and bounds, whatever the
    source's sync time (which moves with every poll): `source` and `last_sync`
    go on the last event only (the one a client publishes its view with), on a
    copy when the cached one carries other values. Callers must not modify the
    result: what many subscribers share is reused.
    """
    if isinstance(item, Batch):
        if not item.changes:
            # A heartbeat: one per subscriber, never worth a cache slot.
            event = _changes_event(item, epoch, with_keys)
            return restamp((event,), source, last_sync, states)
        build = _shared_changes if item.shared else _changes
        stamps = build(item, epoch, with_keys, max_event_bytes)
        return None if stamps is None else stamps.stamped(source, last_sync, states)
    snapshot = _snapshot_events(item, epoch, with_keys, chunk_bytes, max_event_bytes)
    return snapshot.stamped(source, last_sync, states)


def restamp(
    events: tuple[pb.WatchEvent, ...],
    source: str,
    last_sync: datetime | None,
    states: tuple[SourceState, ...] = (),
) -> tuple[pb.WatchEvent, ...]:
    """`events` with `source`, `last_sync` and the sources' `states` on the last one
    (a copy of that one when it carries other values; the others are shared as
    they are)."""
    last = events[-1]
    stamp = timestamp(last_sync)
    state_messages = [source_state_to_proto(state) for state in states]
    if _stamped_with(last, source, stamp, state_messages):
        return events
    copy = pb.WatchEvent()
    copy.CopyFrom(last)
    copy.source = source
    if stamp is None:
        copy.ClearField("last_sync")
    else:
        copy.last_sync.CopyFrom(stamp)
    del copy.sources[:]
    copy.sources.extend(state_messages)
    return (*events[:-1], copy)


def _stamped_with(
    event: pb.WatchEvent,
    source: str,
    stamp: timestamp_pb2.Timestamp | None,
    states: list[pb.RouteSourceState],
) -> bool:
    if event.source != source or list(event.sources) != states:
        return False
    if stamp is None:
        return not event.HasField("last_sync")
    return event.HasField("last_sync") and event.last_sync == stamp


class _Stamps:
    """Converted events and their latest stamped form, so the subscribers that
    share one sync time share one copy too."""

    __slots__ = ("_events", "_latest")

    def __init__(self, events: tuple[pb.WatchEvent, ...]) -> None:
        self._events = events
        # (the stamp, the events stamped with it): one tuple, so a worker thread
        # stamping at once never sees a stamp paired with other events.
        self._latest: tuple[object, tuple[pb.WatchEvent, ...]] = (None, events)

    def stamped(
        self, source: str, last_sync: datetime | None, states: tuple[SourceState, ...] = ()
    ) -> tuple[pb.WatchEvent, ...]:
        stamp = (source, last_sync, states)
        known, events = self._latest
        if known == stamp:
            # A thousand streams sending one event: compared, not converted, per stream.
            return events
        latest = restamp(events, source, last_sync, states)
        # A plain reference swap: safe against a worker thread stamping at once.
        self._latest = (stamp, latest)
        return latest


# The caches are keyed by identity (Batch and Snapshot compare by identity).
# Few snapshots are kept: they are large, and one per version is shared.
@functools.lru_cache(maxsize=4)
def _snapshot_events(
    snapshot: Snapshot,
    epoch: int,
    with_keys: bool,
    chunk_bytes: int,
    max_event_bytes: int,
) -> _Stamps:
    header = pb.WatchEvent(version=snapshot.version, epoch=epoch)
    # Room left for objects once the header fields and the snapshot wrapper are
    # paid, the source and sync time the last chunk is stamped with included.
    stamp_room = min(_STAMP_BYTES, chunk_bytes // 8)
    budget = max(chunk_bytes - header.ByteSize() - stamp_room - 16, 1)

    def new_event() -> pb.WatchEvent:
        event = pb.WatchEvent()
        event.CopyFrom(header)
        event.snapshot.SetInParent()
        return event

    events = [new_event()]
    size = 0
    parts: tuple[tuple[str, list[Any]], ...] = (
        ("services", [service_to_proto(s) for s in snapshot.services]),
        ("endpoints", [endpoint_to_proto(e) for e in snapshot.endpoints]),
        ("routes", [route_to_proto(r, with_key=with_keys) for r in snapshot.routes]),
        ("tunnels", [tunnel_to_proto(t) for t in snapshot.tunnels]),
    )
    for field_name, messages in parts:
        batch: list[Any] = []
        for message in messages:
            cost = message.ByteSize() + _FIELD_OVERHEAD
            if cost > max_event_bytes:
                raise ResourceExhausted(
                    f"one of the view's {field_name} is {cost} bytes serialized, over the "
                    f"{max_event_bytes}-byte limit of one Watch event; it cannot be sent"
                )
            if size and size + cost > budget:
                getattr(events[-1].snapshot, field_name).extend(batch)
                events.append(new_event())
                batch, size = [], 0
            batch.append(message)
            size += cost
        getattr(events[-1].snapshot, field_name).extend(batch)
    for event in events[:-1]:
        event.snapshot.more = True
    return _Stamps(tuple(events))


def _changes(batch: Batch, epoch: int, with_keys: bool, max_event_bytes: int) -> _Stamps | None:
    """A subscriber's own (coalesced, filtered) batch: converted for it alone."""
    event = _changes_event(batch, epoch, with_keys)
    return None if event.ByteSize() > max_event_bytes else _Stamps((event,))


# Only the store's own batches, which every up-to-date subscriber shares; an
# oversized one is kept as None (nothing large held for nothing).
_shared_changes = functools.lru_cache(maxsize=64)(_changes)


def _changes_event(batch: Batch, epoch: int, with_keys: bool) -> pb.WatchEvent:
    return pb.WatchEvent(
        version=batch.version,
        epoch=epoch,
        changes=pb.Changes(
            from_version=batch.from_version,
            changes=[change_to_proto(c, with_keys) for c in batch.changes],
            coalesced=batch.coalesced,
        ),
    )
