"""The store: versioning, ownership, replace_source diffs, history and coalescing."""

from __future__ import annotations

import asyncio
import dataclasses
from datetime import UTC, datetime
from typing import Any

import pytest

from waygate.resolver import store as store_module
from waygate.resolver.model import (
    Endpoint,
    EndpointPort,
    Kind,
    Route,
    RouteBackend,
    Service,
    ServicePort,
    TunnelServer,
)
from waygate.resolver.store import Batch, Snapshot, Store

FILE = "file:/tmp/routes.yaml"
KUBE = "kubernetes"


def svc(name: str = "web", ns: str = "default") -> Service:
    return Service(ns, name, "ClusterIP", ("10.0.0.1",), ports=(ServicePort("http", 80, "8080"),))


def ep(address: str, service: str = "web", ns: str = "default", **kw: object) -> Endpoint:
    return Endpoint(ns, service, address, (EndpointPort("http", 8080),), **kw)  # type: ignore[arg-type]


def route(name: str = "r", host: str = "a.example.com") -> Route:
    return Route("default", name, host, "/", (RouteBackend("web", 100),))


def test_version_bumps_once_per_effective_change_and_not_for_noops() -> None:
    store = Store(initial_version=10)
    store.upsert_service(svc(), source=FILE)
    assert store.version == 11
    store.upsert_service(svc(), source=FILE)
    assert store.version == 11, "writing the same value again must not bump the version"
    store.set_endpoints("default", "web", [ep("10.1.0.1"), ep("10.1.0.2")], source=FILE)
    assert store.version == 12, "one call, one version, however many endpoints"
    store.set_endpoints("default", "web", [ep("10.1.0.1"), ep("10.1.0.2")], source=FILE)
    assert store.version == 12
    store.delete_service("default", "missing", source=FILE)
    assert store.version == 12


def test_default_initial_version_is_clock_based_so_old_process_versions_are_too_old() -> None:
    store = Store()
    assert store.version > 1_600_000_000_000_000
    assert store.changes_since(57) is None


def test_set_endpoints_diffs_into_upserts_and_deletes() -> None:
    store = Store(initial_version=0)
    store.set_endpoints("default", "web", [ep("10.1.0.1"), ep("10.1.0.2")], source=KUBE)
    with store.subscribe(resume_from=store.version) as sub:
        store.set_endpoints(
            "default", "web", [ep("10.1.0.2", ready=False), ep("10.1.0.3")], source=KUBE
        )
        batch = sub.take()
    assert isinstance(batch, Batch)
    got = {(c.key, c.deleted) for c in batch.changes}
    assert got == {
        (("default", "web", "10.1.0.1"), True),
        (("default", "web", "10.1.0.2"), False),
        (("default", "web", "10.1.0.3"), False),
    }
    assert [e.address for e in store.endpoints_of("default", "web")] == ["10.1.0.2", "10.1.0.3"]


def test_set_endpoints_rejects_an_endpoint_of_another_service() -> None:
    store = Store()
    with pytest.raises(ValueError, match="does not belong"):
        store.set_endpoints("default", "web", [ep("10.1.0.1", service="api")], source=KUBE)


def test_replace_source_drops_whatever_the_source_no_longer_has() -> None:
    store = Store(initial_version=0)
    store.replace_source(
        KUBE,
        services=[svc("web"), svc("api")],
        endpoints=[ep("10.1.0.1"), ep("10.1.0.2"), ep("10.2.0.1", service="api")],
        routes=[],
    )
    before = store.version
    # A relist after a disconnect: api and one web endpoint were deleted meanwhile.
    store.replace_source(KUBE, services=[svc("web")], endpoints=[ep("10.1.0.2")])
    assert store.version == before + 1, "the whole diff is one version"
    assert store.get_service("default", "api") is None
    assert [e.address for e in store.endpoints_of("default", "web")] == ["10.1.0.2"]
    assert store.endpoints_of("default", "api") == ()
    batches = store.changes_since(before)
    assert batches is not None and len(batches) == 1
    deleted = {c.key for c in batches[0].changes if c.deleted}
    assert deleted == {
        ("default", "api"),
        ("default", "web", "10.1.0.1"),
        ("default", "api", "10.2.0.1"),
    }


def test_replace_source_leaves_other_sources_and_unnamed_kinds_alone() -> None:
    store = Store(initial_version=0)
    store.upsert_route(route("from-file"), source=FILE)
    store.upsert_service(svc("web"), source=FILE)
    store.replace_source(KUBE, services=[svc("api")], routes=[route("from-kube", "b.example.com")])
    store.replace_source(KUBE, services=[], routes=[])
    assert store.get_service("default", "web") is not None
    assert store.get_route("default", "from-file") is not None
    assert store.get_route("default", "from-kube") is None
    store.replace_source(FILE, services=[])
    assert store.get_route("default", "from-file") is not None, "routes=None leaves routes alone"
    assert store.get_service("default", "web") is None


def test_a_source_cannot_delete_what_another_source_owns() -> None:
    store = Store(initial_version=0)
    store.upsert_route(route(), source=KUBE)
    store.delete_route("default", "r", source=FILE)
    assert store.get_route("default", "r") is not None
    assert store.route_owner("default", "r") == KUBE


def test_tunnel_presence_replaces_and_empty_means_gone() -> None:
    store = Store(initial_version=0)
    a, b = TunnelServer("ts-a", "10.0.0.1:7004"), TunnelServer("ts-b", "10.0.0.2:7004")
    store.set_tunnel_presence("edge-1", [b, a])
    presence = store.tunnel_presence("edge-1")
    assert presence is not None and presence.servers == (a, b)
    version = store.version
    store.set_tunnel_presence("edge-1", [a, b])
    assert store.version == version
    store.set_tunnel_presence("edge-1", [])
    assert store.tunnel_presence("edge-1") is None
    assert store.version == version + 1


def test_history_is_bounded_and_too_old_resume_gets_a_snapshot() -> None:
    store = Store(history_limit=3, initial_version=0)
    for i in range(6):
        store.set_endpoints("default", "web", [ep(f"10.1.0.{i}")], source=KUBE)
    # 6 versions, 2 changes each after the first; only the last 3 changes are kept.
    assert store.changes_since(0) is None
    assert store.changes_since(store.version - 1) is not None
    sub = store.subscribe(resume_from=1)
    assert isinstance(sub.take(), Snapshot)
    sub.close()
    assert store.changes_since(store.version + 5) is None, "a version from the future is unknown"


def test_subscription_snapshot_then_ordered_batches() -> None:
    store = Store(initial_version=0)
    store.upsert_service(svc(), source=FILE)
    sub = store.subscribe()
    first = sub.take()
    assert isinstance(first, Snapshot) and first.version == 1
    assert first.services == (svc(),)
    assert sub.take() is None
    store.upsert_route(route(), source=FILE)
    batch = sub.take()
    assert isinstance(batch, Batch)
    assert (batch.from_version, batch.version, batch.coalesced) == (1, 2, False)
    published = batch.changes[0].value
    assert dataclasses.replace(published, status=None) == route()
    assert published.status is not None and published.status.admitted, "it travels with status"
    sub.close()
    assert store.subscriber_count == 0


def test_slow_subscriber_gets_latest_state_per_key_coalesced() -> None:
    store = Store(initial_version=0)
    sub = store.subscribe()
    assert isinstance(sub.take(), Snapshot)
    for i in range(100):
        store.set_endpoints("default", "web", [ep("10.1.0.1", zone=f"z{i}")], source=KUBE)
    store.upsert_route(route(), source=FILE)
    batch = sub.take()
    assert isinstance(batch, Batch)
    assert batch.coalesced
    assert (batch.from_version, batch.version) == (0, store.version)
    assert len(batch.changes) == 2
    endpoint = batch.changes[0].value
    assert isinstance(endpoint, Endpoint) and endpoint.zone == "z99"
    sub.close()


def test_coalesced_delete_after_upsert_keeps_the_delete() -> None:
    store = Store(initial_version=0)
    sub = store.subscribe()
    sub.take()
    store.set_endpoints("default", "web", [ep("10.1.0.1")], source=KUBE)
    store.set_endpoints("default", "web", [], source=KUBE)
    batch = sub.take()
    assert isinstance(batch, Batch)
    assert [(c.key, c.deleted) for c in batch.changes] == [(("default", "web", "10.1.0.1"), True)]


def test_backlog_over_the_bound_turns_into_a_snapshot() -> None:
    store = Store(initial_version=0)
    sub = store.subscribe(max_pending=5)
    sub.take()
    store.set_endpoints("default", "web", [ep(f"10.1.0.{i}") for i in range(10)], source=KUBE)
    item = sub.take()
    assert isinstance(item, Snapshot)
    assert len(item.endpoints) == 10
    assert sub.take() is None


def test_kinds_filter_only_delivers_wanted_kinds() -> None:
    store = Store(initial_version=0)
    sub = store.subscribe([Kind.ROUTES])
    snap = sub.take()
    assert isinstance(snap, Snapshot)
    store.upsert_service(svc(), source=FILE)
    assert sub.take() is None
    store.upsert_route(route(), source=FILE)
    batch = sub.take()
    assert isinstance(batch, Batch)
    assert [c.kind for c in batch.changes] == [Kind.ROUTES]
    assert (batch.from_version, batch.version) == (0, 2)


def test_resume_delivers_the_changes_after_the_version() -> None:
    store = Store(initial_version=0)
    store.upsert_service(svc("a"), source=FILE)
    store.upsert_service(svc("b"), source=FILE)
    store.delete_service("default", "a", source=FILE)
    sub = store.subscribe(resume_from=1)
    batch = sub.take()
    assert isinstance(batch, Batch)
    assert (batch.from_version, batch.version) == (1, 3)
    assert [(c.key, c.deleted) for c in batch.changes] == [
        (("default", "b"), False),
        (("default", "a"), True),
    ]
    assert not batch.coalesced


def test_resume_at_the_current_version_waits_for_the_next_change() -> None:
    store = Store(initial_version=0)
    store.upsert_service(svc("a"), source=FILE)
    sub = store.subscribe(resume_from=store.version)
    assert sub.take() is None


def test_last_sync_is_the_oldest_source_and_none_until_every_source_synced() -> None:
    store = Store()
    assert store.last_sync() == ("", None)
    early = datetime(2026, 1, 1, tzinfo=UTC)
    store.replace_source(FILE, routes=[])
    assert store.last_sync() == (FILE, None)
    store.mark_synced(FILE, early)
    assert store.last_sync() == (FILE, early)
    store.mark_synced(KUBE)
    source, when = store.last_sync()
    assert source == f"{FILE},{KUBE}" and when == early


async def test_next_waits_for_a_change() -> None:
    store = Store(initial_version=0)
    sub = store.subscribe()
    assert isinstance(await sub.next(), Snapshot)
    waiter = asyncio.ensure_future(sub.next())
    await asyncio.sleep(0)
    assert not waiter.done()
    store.upsert_service(svc(), source=FILE)
    batch = await asyncio.wait_for(waiter, 5)
    assert isinstance(batch, Batch) and batch.version == 1
    sub.close()


def test_up_to_date_subscribers_share_the_store_batch_and_laggards_share_their_backlog() -> None:
    store = Store(initial_version=0)
    first, second, routes_only = (
        store.subscribe(),
        store.subscribe(),
        store.subscribe([Kind.ROUTES]),
    )
    for sub in (first, second, routes_only):
        sub.take()
    store.upsert_service(svc(), source=FILE)
    a, b = first.take(), second.take()
    assert isinstance(a, Batch) and a is b, "one object, so its wire form is built once"
    assert routes_only.take() is None
    store.upsert_route(route(), source=FILE)
    store.upsert_service(svc("api"), source=FILE)
    merged = first.take()
    assert isinstance(merged, Batch) and merged is second.take(), "behind by the same: one object"
    assert merged.shared and merged.coalesced is False
    assert (merged.from_version, merged.version, len(merged.changes)) == (1, 3, 2)
    only_route = routes_only.take()
    assert isinstance(only_route, Batch) and [c.kind for c in only_route.changes] == [Kind.ROUTES]


def test_snapshots_of_one_version_are_shared_and_a_change_makes_a_new_one() -> None:
    store = Store(initial_version=0)
    store.upsert_service(svc(), source=FILE)
    first, second = store.subscribe(), store.subscribe()
    a, b = first.take(), second.take()
    assert isinstance(a, Snapshot) and a is b
    assert store.snapshot([Kind.ROUTES]) is not a
    store.upsert_service(svc("api"), source=FILE)
    fresh = store.snapshot()
    assert fresh is not a and len(fresh.services) == 2 and len(a.services) == 1


async def test_next_with_heartbeat_returns_an_empty_batch_when_quiet() -> None:
    store = Store(initial_version=0)
    store.upsert_service(svc(), source=FILE)
    sub = store.subscribe()
    snapshot = await sub.next(heartbeat=0.05)
    assert isinstance(snapshot, Snapshot)
    beat = await asyncio.wait_for(sub.next(heartbeat=0.05), 5)
    assert isinstance(beat, Batch) and beat.changes == ()
    assert beat.from_version == beat.version == snapshot.version
    store.upsert_route(route(), source=FILE)
    real = await asyncio.wait_for(sub.next(heartbeat=0.05), 5)
    assert isinstance(real, Batch) and len(real.changes) == 1
    sub.close()


async def test_end_subscriptions_wakes_waiting_consumers() -> None:
    from waygate.resolver.store import SubscriptionEnded

    store = Store(initial_version=0)
    sub = store.subscribe()
    await sub.next()
    waiter = asyncio.ensure_future(sub.next(heartbeat=60))
    await asyncio.sleep(0)
    assert store.end_subscriptions() == 1
    with pytest.raises(SubscriptionEnded):
        await asyncio.wait_for(waiter, 5)
    assert store.subscriber_count == 0


async def test_a_kind_filtered_subscription_advances_past_changes_it_does_not_watch() -> None:
    """Routes only; services change many times: the heartbeat used to report the
    old version, and a resume from it fell out of the history into a snapshot."""
    store = Store(initial_version=0, history_limit=5)
    sub = store.subscribe([Kind.ROUTES])
    snapshot = await sub.next()
    assert isinstance(snapshot, Snapshot)
    for index in range(10):
        store.upsert_service(svc(f"s{index}"), source=FILE)
    beat = await asyncio.wait_for(sub.next(heartbeat=0.05), 5)
    assert isinstance(beat, Batch) and beat.changes == ()
    assert (beat.from_version, beat.version) == (snapshot.version, store.version)
    sub.close()
    resumed = store.subscribe([Kind.ROUTES], resume_from=beat.version, resume_epoch=store.epoch)
    assert resumed.take() is None, "resumed within history: nothing new, no snapshot"
    resumed.close()


def test_a_commit_costs_each_subscription_no_walk_over_its_changes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 18's fan-out: offering a batch to 100 subscriptions walks none of its
    changes (each keeps the batch by reference); 100 laggards behind by the same
    batches coalesce them once, into one shared backlog."""
    walks: list[int] = []
    real = store_module._coalesce

    def counted(pending: Any, batches: Any, kinds: Any) -> bool:
        walks.append(len(pending))
        return real(pending, batches, kinds)

    monkeypatch.setattr(store_module, "_coalesce", counted)
    store = Store(initial_version=0)
    subs = [store.subscribe() for _ in range(100)]
    for sub in subs:
        sub.take()
    store.set_endpoints("default", "web", [ep(f"10.1.0.{i}") for i in range(50)], source=KUBE)
    assert walks == []
    taken = [sub.take() for sub in subs]
    assert walks == [], "up to date: the store's own batch, as is"
    assert all(batch is taken[0] for batch in taken)
    store.set_endpoints("default", "web", [ep("10.1.0.1")], source=KUBE)
    store.upsert_route(route(), source=FILE)
    assert walks == []
    backlogs = [sub.take() for sub in subs]
    assert len(walks) == 1, "one coalescing for a hundred laggards"
    assert all(batch is backlogs[0] for batch in backlogs)
    assert isinstance(backlogs[0], Batch) and backlogs[0].version == store.version


def test_a_backlog_past_the_bound_in_changes_but_not_in_keys_stays_a_batch() -> None:
    """Kept batches are coalesced once their changes outgrow max_pending: the same
    key changed 20 times is one key, not a reason for a snapshot."""
    store = Store(initial_version=0)
    sub = store.subscribe(max_pending=5)
    sub.take()
    for i in range(20):
        store.set_endpoints("default", "web", [ep("10.1.0.1", zone=f"z{i}")], source=KUBE)
        assert sub.backlog <= 5
    batch = sub.take()
    assert isinstance(batch, Batch) and batch.coalesced
    assert [c.value.zone for c in batch.changes] == ["z19"]
    assert (batch.from_version, batch.version) == (0, store.version)
