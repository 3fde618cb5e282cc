"""Watch events of bounded size (waygate.resolver.events) and replica epochs (Store)."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from waygate.core.errors import ResourceExhausted
from waygate.resolver import events as wire
from waygate.resolver.model import (
    Endpoint,
    EndpointPort,
    Route,
    RouteBackend,
    RouteTLS,
    Service,
    ServicePort,
    TLSTermination,
)
from waygate.resolver.store import Batch, Snapshot, Store

SOURCE = "test"


def filled_store(endpoints: int = 3000) -> Store:
    store = Store(initial_version=1)
    store.upsert_service(
        Service("big", "svc", ports=(ServicePort("http", 80, "8080"),)), source=SOURCE
    )
    store.set_endpoints(
        "big",
        "svc",
        [
            Endpoint("big", "svc", f"10.0.{i >> 8}.{i & 255}", (EndpointPort("http", 8080),))
            for i in range(endpoints)
        ],
        source=SOURCE,
    )
    store.upsert_route(
        Route(
            "big",
            "r",
            "r.example.com",
            backends=(RouteBackend("svc"),),
            tls=RouteTLS(TLSTermination.EDGE, certificate="CERT", key="SECRET KEY"),
        ),
        source=SOURCE,
    )
    return store


@pytest.mark.parametrize("chunk_bytes", [512, 4096, 65536, 1 << 20])
def test_chunks_are_bounded_ordered_and_complete(chunk_bytes: int) -> None:
    store = filled_store()
    snapshot = store.snapshot()
    events = wire.watch_events(
        snapshot, "file:x", None, store.epoch, with_keys=True, chunk_bytes=chunk_bytes
    )
    assert events is not None
    assert all(e.ByteSize() <= chunk_bytes for e in events)
    assert [e.snapshot.more for e in events] == [True] * (len(events) - 1) + [False]
    assert {(e.version, e.epoch) for e in events} == {(store.version, store.epoch)}
    # The source and its sync time travel on the last chunk, which the view is
    # published with.
    assert events[-1].source == "file:x"
    whole = wire.snapshot_to_proto(snapshot)
    assert [a for e in events for a in e.snapshot.endpoints] == list(whole.endpoints)
    assert [s for e in events for s in e.snapshot.services] == list(whole.services)
    assert [r.tls.key for e in events for r in e.snapshot.routes] == ["SECRET KEY"]
    if chunk_bytes >= 1 << 20:
        assert len(events) == 1


def test_an_empty_view_is_one_snapshot_event() -> None:
    store = Store()
    (event,) = wire.watch_events(store.snapshot(), "", None, store.epoch, with_keys=False)  # type: ignore[misc]
    assert event.WhichOneof("event") == "snapshot" and not event.snapshot.more


def test_keys_are_redacted_for_non_readers_in_snapshots_and_changes() -> None:
    store = filled_store(1)
    events = wire.watch_events(store.snapshot(), "", None, store.epoch, with_keys=False)
    assert events is not None
    assert [r.tls.key for e in events for r in e.snapshot.routes] == [""]
    with store.subscribe(resume_from=store.version, resume_epoch=store.epoch) as subscription:
        store.upsert_route(
            Route(
                "big",
                "r",
                "r.example.com",
                backends=(RouteBackend("svc"),),
                tls=RouteTLS(TLSTermination.EDGE, certificate="CERT2", key="KEY2"),
            ),
            source=SOURCE,
        )
        batch = subscription.take()
        assert isinstance(batch, Batch)
        for with_keys, key in ((False, ""), (True, "KEY2")):
            (event,) = wire.watch_events(batch, "", None, store.epoch, with_keys=with_keys)  # type: ignore[misc]
            assert event.changes.changes[0].route_upserted.tls.key == key


def test_a_batch_over_the_event_limit_is_not_sent() -> None:
    store = filled_store(10)
    with store.subscribe(resume_from=store.version, resume_epoch=store.epoch) as subscription:
        store.set_endpoints(
            "big",
            "svc",
            [Endpoint("big", "svc", f"10.1.{i >> 8}.{i & 255}") for i in range(500)],
            source=SOURCE,
        )
        batch = subscription.take()
        assert isinstance(batch, Batch)
        assert wire.watch_events(batch, "", None, 1, with_keys=True, max_event_bytes=1000) is None
        assert wire.watch_events(batch, "", None, 1, with_keys=True) is not None
        subscription.resync()
        assert isinstance(subscription.take(), Snapshot)


def test_one_object_over_the_event_limit_is_resource_exhausted() -> None:
    store = Store()
    store.upsert_route(
        Route("a", "b", "b.example.com", tls=RouteTLS(TLSTermination.EDGE, certificate="C" * 5000)),
        source=SOURCE,
    )
    with pytest.raises(ResourceExhausted, match="limit of one Watch event"):
        wire.watch_events(
            store.snapshot(), "", None, 1, with_keys=True, chunk_bytes=512, max_event_bytes=2000
        )


def test_epochs_are_random_nonzero_and_gate_resumes() -> None:
    stores = [Store(initial_version=10) for _ in range(5)]
    assert len({s.epoch for s in stores}) == 5 and all(0 < s.epoch < 2**63 for s in stores)
    store = stores[0]
    store.upsert_route(Route("a", "b", "b.example.com"), source=SOURCE)
    for epoch, snapshot in (
        (store.epoch, False),
        (stores[1].epoch, True),
        (0, True),
        (None, False),
    ):
        with store.subscribe(resume_from=10, resume_epoch=epoch) as subscription:
            assert isinstance(subscription.take(), Snapshot) is snapshot, epoch


def test_a_view_is_converted_once_whatever_the_sync_time() -> None:
    """The file source refreshes last_sync every poll: keyed on it, watchers that
    arrived in different seconds each reconverted 100,000 endpoints."""
    store = filled_store()
    snapshot = store.snapshot()
    first_sync = datetime(2026, 1, 1, tzinfo=UTC)
    later_sync = datetime(2026, 1, 1, 0, 0, 5, tzinfo=UTC)
    first = wire.watch_events(
        snapshot, "file:x", first_sync, store.epoch, with_keys=True, chunk_bytes=512
    )
    later = wire.watch_events(
        snapshot, "file:x", later_sync, store.epoch, with_keys=True, chunk_bytes=512
    )
    assert first is not None and later is not None and len(first) == len(later) > 1
    assert all(a is b for a, b in zip(first[:-1], later[:-1], strict=True)), "shared chunks"
    assert first[-1].last_sync.ToDatetime(tzinfo=UTC) == first_sync
    assert later[-1].last_sync.ToDatetime(tzinfo=UTC) == later_sync
    assert first[-1].snapshot == later[-1].snapshot
    # Subscribers with the same sync time share the stamped copy as well.
    again = wire.watch_events(
        snapshot, "file:x", later_sync, store.epoch, with_keys=True, chunk_bytes=512
    )
    assert again is not None and again[-1] is later[-1]
    # A store batch likewise: one conversion, each sync time stamped.
    store.upsert_service(Service("shop", "extra"), source=SOURCE)
    (batch,) = store.changes_since(store.version - 1) or []
    (one,) = wire.watch_events(batch, "file:x", first_sync, store.epoch, with_keys=True) or ()
    (two,) = wire.watch_events(batch, "file:x", later_sync, store.epoch, with_keys=True) or ()
    assert one.changes == two.changes and one.last_sync != two.last_sync


def test_only_the_stores_shared_batches_take_cache_slots() -> None:
    """Per-subscriber (coalesced) batches and heartbeats evicted the batches every
    subscriber shares, and an oversized event was held although never sent."""
    store = filled_store()
    wire._shared_changes.cache_clear()
    mine = Batch(1, 2, (), coalesced=True)
    heartbeat = Batch(store.version, store.version, ())
    assert wire.watch_events(heartbeat, "s", None, 1, with_keys=True) is not None
    store.upsert_service(Service("shop", "extra"), source=SOURCE)
    (shared,) = store.changes_since(store.version - 1) or []
    own = Batch(shared.from_version, shared.version, shared.changes, coalesced=True)
    assert wire.watch_events(own, "s", None, 1, with_keys=True) is not None
    assert wire.watch_events(mine, "s", None, 1, with_keys=True) is not None
    assert wire._shared_changes.cache_info().currsize == 0
    assert wire.watch_events(shared, "s", None, 1, with_keys=True) is not None
    assert wire._shared_changes.cache_info().currsize == 1
    # Oversized: refused, and what stays cached holds no event.
    store.upsert_service(Service("shop", "more"), source=SOURCE)
    (big,) = store.changes_since(store.version - 1) or []
    assert wire.watch_events(big, "s", None, 1, with_keys=True, max_event_bytes=10) is None
    assert wire._shared_changes(big, 1, True, 10) is None


def test_the_client_imports_neither_the_store_nor_the_event_builders() -> None:
    """Consumers import waygate.resolver.client; the server's store and Watch event
    building are no part of what they load."""
    import subprocess
    import sys

    code = (
        "import sys, waygate.resolver.client; "
        "print(sorted(m for m in sys.modules if m.startswith('waygate.resolver')))"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    ).stdout
    assert "waygate.resolver.store" not in loaded and "waygate.resolver.events" not in loaded
    assert "waygate.resolver.convert" in loaded
