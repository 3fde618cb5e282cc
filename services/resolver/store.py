"""The resolver's versioned in-memory view, and the subscriptions that stream it.

Sources (the YAML file, Kubernetes, tunnel reports) write here; the gRPC
boundary reads snapshots and subscribes to changes.

Invariants:
- `version` bumps by exactly one per effective mutation call; a write that
  changes nothing (same value again) does not bump it. A multi-object call
  (`replace_source`, `set_endpoints`) is one version with many changes.
- Once the store has applied a deletion, no read and no subscription ever
  returns the deleted object again (the anchors' "stale endpoint" failure).
- `replace_source` makes a kind exactly what one source contributes now:
  whatever that source had before and is absent now is deleted in the same
  version, so a relist or reload leaves nothing stale behind.
- Each object has one owning source (the last writer). A source deletes only
  what it owns, so a file reload cannot delete what Kubernetes contributed.
- `service_revision` changes whenever a service or any of its endpoints
  changes (resolve caches per service port under it).
- History is bounded (`history_limit` changes); a resume from a version older
  than the history gets a full snapshot instead.
- A subscription never queues without bound: pending changes are coalesced to
  the latest state per key, and past `max_pending` keys the subscriber is
  given a fresh snapshot instead.
- Offering a batch costs each subscription constant work (issue 18's fan-out:
  a change to 1,000 streams must not cost 1,000 walks over its changes): it
  keeps a reference to the batch (kinds checked against the batch's own kinds,
  computed once), and the changes are coalesced only when the backlog is taken
  (once per distinct backlog, shared) or when it outgrows `max_pending`
  changes (then once, to bound it).
- A backlog is a function of (the subscriber's version, its kinds, the store's
  version): subscribers that are behind by the same changes get one shared
  coalesced Batch object, so a storm of slow watchers costs one conversion
  and one serialization per distinct backlog, not one per watcher (issue 18's
  fan-out: a thousand streams that fall behind together stay together).
- The first version is derived from the wall clock (microseconds), so a
  client resuming with a version from a previous resolver process is older
  than this process's history and gets a snapshot, not someone else's deltas.
- `epoch` is random per store (per process) and never 0: a resume is honoured
  only when it names this epoch, so a client that moved to another replica
  (whose versions may overlap this one's) always starts from a snapshot.
- A source that turns valid or invalid (or whose error changes) wakes every
  subscriber with an empty Batch, at once: its health travels with every event.
- Every route read or streamed carries its status (waygate.resolver.status),
  computed in the same version as the change that caused it: a route's own
  change, or a change to a service or endpoints it uses, publishes the route
  again when its status changed. Sources write routes without status; a
  status they pass in is ignored.

Mutations are synchronous and must be called from the event loop's thread;
subscriptions wake their consumer with an asyncio.Event.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import secrets
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from waygate.resolver.backendcerts import BackendCertificateState
from waygate.resolver.model import (
    ADMITTED,
    Change,
    Endpoint,
    EndpointKey,
    HostClaim,
    Kind,
    Route,
    RouteKey,
    Service,
    ServiceKey,
    SourceState,
    TunnelPresence,
    TunnelServer,
)
from waygate.resolver.status import HOST_ALREADY_CLAIMED, HostConflict, RouteStatusBook

log = logging.getLogger(__name__)

ALL_KINDS = frozenset(Kind)
DEFAULT_HISTORY_LIMIT = 10_000
DEFAULT_MAX_PENDING = 100_000


# Batches and snapshots compare by identity: one Batch object delivered to many
# subscribers is recognisably the same, so its wire form is built once.
@dataclass(frozen=True, eq=False)
class Batch:
    """Changes taking the view from `from_version` to `version`, in order."""

    from_version: int
    version: int
    changes: tuple[Change, ...]
    # True when older states of some keys were dropped (latest state per key kept).
    coalesced: bool = False
    # Handed as is to many subscribers (so its wire form is worth caching): the
    # store's own batch for the up-to-date ones, or the coalesced backlog that
    # every subscriber at one version and of the same kinds shares.
    shared: bool = False

    @functools.cached_property
    def kind_bits(self) -> int:
        """The kinds its changes are of, as `kinds_mask` bits (computed once: every
        subscription checks it, with integer operations, not Enum hashing)."""
        return kinds_mask(change.kind for change in self.changes)


_KIND_BITS = {kind: 1 << index for index, kind in enumerate(Kind)}


def kinds_mask(kinds: Iterable[Kind]) -> int:
    """Kinds as bits of an int (one per Kind)."""
    mask = 0
    for kind in kinds:
        mask |= _KIND_BITS[kind]
    return mask


def _coalesce(
    pending: dict[tuple[Kind, Any], Change], batches: Iterable[Batch], kinds: frozenset[Kind]
) -> bool:
    """Fold `batches`' changes of `kinds` into `pending` (latest state per key, in the
    order of the last changes); True when an older state of some key was dropped."""
    coalesced = False
    for batch in batches:
        for change in batch.changes:
            if change.kind not in kinds:
                continue
            slot = (change.kind, change.key)
            if slot in pending:
                del pending[slot]
                coalesced = True
            pending[slot] = change
    return coalesced


@dataclass(frozen=True, eq=False)
class Snapshot:
    version: int
    services: tuple[Service, ...] = ()
    endpoints: tuple[Endpoint, ...] = ()
    routes: tuple[Route, ...] = ()
    tunnels: tuple[TunnelPresence, ...] = ()


class SubscriptionEnded(Exception):
    """The store ended this subscription (the process is shutting down)."""


class Subscription:
    """One consumer's position in the change stream, with a bounded backlog.

    `next()` returns a Snapshot first when the consumer needs one (a new
    watch, a resume from a version outside the history, or a backlog that
    outgrew `max_pending`), then Batches. A consumer that reads slower than
    the store changes gets one coalesced Batch covering everything it missed.
    """

    def __init__(self, store: Store, kinds: frozenset[Kind], max_pending: int) -> None:
        self._store = store
        self.kinds = kinds
        self._max_pending = max_pending
        # Version of the last Snapshot or Batch handed out (what the consumer holds).
        self.version = 0
        self._mask = kinds_mask(kinds)
        self._needs_snapshot = True
        # The backlog: `_pending` (changes already coalesced, only once the batches
        # outgrew max_pending) then the batches offered since, kept as they are.
        self._pending: dict[tuple[Kind, Any], Change] = {}
        self._coalesced = False
        self._behind: list[Batch] = []
        self._behind_changes = 0
        self._wakeup = asyncio.Event()
        self._wakeup.set()
        self.closed = False
        # A source's health changed since the consumer last heard from us.
        self._sources_news = False

    def _offer(self, batch: Batch) -> None:
        """Constant work (one store commit reaches every subscription): the batch is
        kept by reference and coalesced only when taken, or to bound the backlog."""
        if self._needs_snapshot or not self._mask & batch.kind_bits:
            return
        self._behind.append(batch)
        self._behind_changes += len(batch.changes)
        if self._behind_changes > self._max_pending:
            self._fold()
        self._wakeup.set()

    def _fold(self) -> None:
        """Coalesce the batches kept into `_pending`; past `max_pending` keys, the
        subscriber gets a fresh snapshot instead."""
        if _coalesce(self._pending, self._behind, self.kinds):
            self._coalesced = True
        self._behind = []
        self._behind_changes = len(self._pending)
        if len(self._pending) > self._max_pending:
            log.info(
                "watch backlog over %d keys; the subscriber gets a fresh snapshot",
                self._max_pending,
            )
            self._clear()
            self._needs_snapshot = True

    def _clear(self) -> None:
        self._pending = {}
        self._coalesced = False
        self._behind = []
        self._behind_changes = 0

    def _sources_changed(self) -> None:
        if not self._needs_snapshot:
            self._sources_news = True
            self._wakeup.set()

    def _resume(self, batches: list[Batch], from_version: int) -> None:
        self._needs_snapshot = False
        self.version = from_version
        for batch in batches:
            self._offer(batch)

    @property
    def backlog(self) -> int:
        """Changes waiting for the consumer, before coalescing (never more than
        `max_pending`)."""
        return self._behind_changes

    def ready(self) -> bool:
        """True when `next()` would return without waiting."""
        return self._needs_snapshot or bool(self._behind) or bool(self._pending)

    def take(self) -> Snapshot | Batch | None:
        """The next item if one is ready, else None (never waits)."""
        if self.closed:
            raise SubscriptionEnded("subscription is closed")
        if self._needs_snapshot:
            snapshot = self._store.snapshot(self.kinds)
            self._sources_news = False  # every event carries the sources' states
            self._needs_snapshot = False
            self._clear()
            self.version = snapshot.version
            return snapshot
        behind = self._behind
        if not behind and not self._pending:
            return None
        self._sources_news = False
        store = self._store
        whole = behind[0] if len(behind) == 1 and not self._pending else None
        if (
            whole is not None
            and whole.from_version == self.version
            and whole.version == store.version
            and not whole.kind_bits & ~self._mask
        ):
            # Exactly the store's own batch: handed out as is, so every
            # up-to-date subscriber shares one object.
            self._clear()
            self.version = whole.version
            return whole
        # Every subscriber at this version and of these kinds has exactly this
        # backlog (it is what the batches since its version make of its kinds),
        # so the first to ask builds the Batch and the others share it.
        key = (self.version, self.kinds)
        batch = store._backlogs.get(key)
        if batch is None:
            pending = self._pending
            coalesced = _coalesce(pending, behind, self.kinds) or self._coalesced
            batch = store._backlogs[key] = Batch(
                from_version=self.version,
                version=store.version,
                changes=tuple(pending.values()),
                coalesced=coalesced,
                shared=True,
            )
        self._clear()
        self.version = batch.version
        return batch

    def resync(self) -> None:
        """Give the consumer a fresh snapshot next (what it holds cannot be continued)."""
        self._needs_snapshot = True
        self._clear()
        self._wakeup.set()

    def heartbeat(self) -> Batch:
        """An empty Batch taking the consumer to the store's version: nothing new
        for it in between (only nothing is ready calls this). Changes of kinds it
        did not ask for advance it too, so its version, and a resume from it, stay
        within the store's history."""
        batch = Batch(self.version, self._store.version, ())
        self.version = batch.version
        self._sources_news = False  # the heartbeat carries the sources' states
        return batch

    async def next(self, heartbeat: float | None = None) -> Snapshot | Batch:
        """The next item; after `heartbeat` seconds with nothing new, an empty
        Batch at the consumer's version (so it hears the view is still current)."""
        item = self.take()
        if item is not None:
            return item
        beat = False
        timer = None
        if heartbeat:

            def due() -> None:
                nonlocal beat
                beat = True
                self._wakeup.set()

            # A timer, not asyncio.wait_for: no extra task per event on a busy stream.
            timer = asyncio.get_running_loop().call_later(heartbeat, due)
        try:
            while True:
                if self._sources_news:
                    # Nothing new in the view, but a source's health changed.
                    self._sources_news = False
                    return self.heartbeat()
                self._wakeup.clear()
                await self._wakeup.wait()
                # take() raises SubscriptionEnded once the store ended this subscription.
                item = self.take()
                if item is not None:
                    return item
                if beat:
                    return self.heartbeat()
        finally:
            if timer is not None:
                timer.cancel()

    def close(self) -> None:
        """Stop receiving; a consumer waiting in `next()` gets SubscriptionEnded."""
        if not self.closed:
            self.closed = True
            self._clear()
            self._store._subscriptions.discard(self)
            self._wakeup.set()

    def __enter__(self) -> Subscription:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class Store:
    """Versioned services, endpoints, routes and tunnel presence."""

    def __init__(
        self,
        *,
        history_limit: int = DEFAULT_HISTORY_LIMIT,
        initial_version: int | None = None,
        share_hosts: bool = False,
        clock: Callable[[], datetime] | None = None,
    ) -> None:
        if history_limit < 1:
            raise ValueError("history_limit must be at least 1")
        self.version = time.time_ns() // 1000 if initial_version is None else initial_version
        # This replica's version space: random, non-zero, fits a uint64.
        self.epoch = secrets.randbits(63) | 1
        self._history: deque[Batch] = deque()
        self._history_changes = 0
        self._history_limit = history_limit
        # The oldest version a consumer can resume from with deltas alone.
        self._history_floor = self.version
        self._services: dict[ServiceKey, Service] = {}
        self._endpoints: dict[ServiceKey, dict[str, Endpoint]] = {}
        # Routes as their sources wrote them, and as served (with status).
        self._routes: dict[RouteKey, Route] = {}
        self._served: dict[RouteKey, Route] = {}
        self._status = RouteStatusBook(share_hosts=share_hosts)
        self._clock = clock or (lambda: datetime.now(UTC))
        self._source_states: dict[str, SourceState] = {}
        self._tunnels: dict[str, TunnelPresence] = {}
        self._owners: dict[Kind, dict[Any, str]] = {
            Kind.SERVICES: {},
            Kind.ENDPOINTS: {},
            Kind.ROUTES: {},
        }
        self._sources: list[str] = []
        self._synced: dict[str, datetime] = {}
        self._subscriptions: set[Subscription] = set()
        # Snapshots of the current version, by the kinds they hold.
        self._snapshots: dict[frozenset[Kind], Snapshot] = {}
        # Coalesced backlogs up to the current version, by (the subscriber's
        # version, its kinds); cleared with every commit, like the snapshots.
        self._backlogs: dict[tuple[int, frozenset[Kind]], Batch] = {}
        # Version of the last change to each service or to its endpoints.
        self._service_revisions: dict[ServiceKey, int] = {}
        self._route_listeners: list[Callable[[], None]] = []

    # ------------------------------------------------------------ reads

    def get_service(self, namespace: str, name: str) -> Service | None:
        return self._services.get((namespace, name))

    def endpoints_of(self, namespace: str, service: str) -> tuple[Endpoint, ...]:
        return tuple(self._endpoints.get((namespace, service), {}).values())

    def service_revision(self, namespace: str, name: str) -> int:
        """The version of the last change to this service or any of its endpoints
        (0: none known). Equal revisions mean equal service and endpoints, so a
        reader may cache what it derives from them under the revision."""
        return self._service_revisions.get((namespace, name), 0)

    def get_route(self, namespace: str, name: str) -> Route | None:
        """The route with its status."""
        return self._served.get((namespace, name))

    def routes(self, namespace: str = "") -> list[Route]:
        """Routes (with status) sorted by (namespace, name); empty namespace: every one."""
        return sorted(
            (r for r in self._served.values() if not namespace or r.namespace == namespace),
            key=lambda r: r.key,
        )

    def source_states(self) -> tuple[SourceState, ...]:
        """What each route source reported about itself, by source name."""
        return tuple(self._source_states[name] for name in sorted(self._source_states))

    def route_owner(self, namespace: str, name: str) -> str | None:
        return self._owners[Kind.ROUTES].get((namespace, name))

    def host_conflicts(self) -> dict[tuple[str, str, str], HostConflict]:
        """The Gateway API and Ingress objects some of whose routes lose their host to
        another namespace's older claim, by (kind, namespace, name); a Gateway when a
        route through one of its listeners' hostnames does. The status board shows it
        in the object's status."""
        if not self._status.any_lost():
            return {}
        verdicts: dict[tuple[str, str, str], list[str | None]] = {}
        listeners: dict[tuple[str, str, str], dict[str, str]] = {}
        for route in self._served.values():
            kind, _, where = route.origin.partition(" ")
            namespace, _, name = where.partition("/")
            if not route.matches or not name:
                continue
            why = route.status.condition(ADMITTED) if route.status is not None else None
            lost = why.message if why is not None and why.reason == HOST_ALREADY_CLAIMED else None
            verdicts.setdefault((kind, namespace, name), []).append(lost)
            claim = route.host_claim
            if lost is not None and claim is not None:
                gateway = listeners.setdefault(("Gateway", claim.namespace, claim.gateway), {})
                gateway.setdefault(claim.listener, lost)
        for (namespace, name), lost_listeners in self._status.listener_conflicts().items():
            gateway = listeners.setdefault(("Gateway", namespace, name), {})
            for listener, reason in lost_listeners.items():
                gateway.setdefault(listener, reason)
        found = {
            key: HostConflict(all(v is not None for v in lost), next(v for v in lost if v))
            for key, lost in verdicts.items()
            if any(lost)
        }
        for key, by_listener in listeners.items():
            first = next(iter(by_listener.values()))
            found[key] = HostConflict(False, first, tuple(sorted(by_listener)))
        return found

    def on_route_changes(self, callback: Callable[[], None]) -> None:
        """Call `callback` after every version that changes a route or its status."""
        self._route_listeners.append(callback)

    def tunnel_presence(self, node: str) -> TunnelPresence | None:
        return self._tunnels.get(node)

    def counts(self) -> dict[Kind, int]:
        return {
            Kind.SERVICES: len(self._services),
            Kind.ENDPOINTS: sum(len(e) for e in self._endpoints.values()),
            Kind.ROUTES: len(self._routes),
            Kind.TUNNELS: len(self._tunnels),
        }

    def snapshot(self, kinds: Iterable[Kind] | None = None) -> Snapshot:
        """The view now. Subscribers that ask at the same version share one object
        (e.g. every proxy reconnecting after a resolver restart), so its wire
        form is built once."""
        wanted = ALL_KINDS if kinds is None else frozenset(kinds)
        cached = self._snapshots.get(wanted)
        if cached is None:
            cached = self._snapshots[wanted] = self._build_snapshot(wanted)
        return cached

    def _build_snapshot(self, wanted: frozenset[Kind]) -> Snapshot:
        return Snapshot(
            version=self.version,
            services=tuple(sorted(self._services.values(), key=lambda s: s.key))
            if Kind.SERVICES in wanted
            else (),
            endpoints=tuple(
                endpoint
                for key in sorted(self._endpoints)
                for endpoint in self._endpoints[key].values()
            )
            if Kind.ENDPOINTS in wanted
            else (),
            routes=tuple(self.routes()) if Kind.ROUTES in wanted else (),
            tunnels=tuple(self._tunnels[node] for node in sorted(self._tunnels))
            if Kind.TUNNELS in wanted
            else (),
        )

    def changes_since(self, version: int) -> list[Batch] | None:
        """The batches after `version`, or None when the history no longer reaches it."""
        if version < self._history_floor or version > self.version:
            return None
        return [batch for batch in self._history if batch.from_version >= version]

    def last_sync(self) -> tuple[str, datetime | None]:
        """(the sources, comma-separated; the oldest of their last-sync times).

        The time is None while any source has not completed a sync: the view is
        then of unknown freshness, and consumers are told so.
        """
        if not self._sources:
            return ("", None)
        times = [self._synced.get(source) for source in self._sources]
        oldest = None if any(t is None for t in times) else min(t for t in times if t)
        return (",".join(self._sources), oldest)

    # ------------------------------------------------------------ subscriptions

    def subscribe(
        self,
        kinds: Iterable[Kind] | None = None,
        *,
        resume_from: int = 0,
        resume_epoch: int | None = None,
        max_pending: int = DEFAULT_MAX_PENDING,
    ) -> Subscription:
        """A new subscription: a snapshot first, or deltas after `resume_from` when
        the history still reaches back that far and `resume_epoch` is this store's
        (None: the caller vouches for the version space, as in-process readers do).
        Close it (or use `with`) when done."""
        wanted = frozenset(kinds) if kinds else ALL_KINDS
        subscription = Subscription(self, wanted, max_pending)
        if resume_from and (resume_epoch is None or resume_epoch == self.epoch):
            batches = self.changes_since(resume_from)
            if batches is not None:
                subscription._resume(batches, resume_from)
        self._subscriptions.add(subscription)
        return subscription

    def end_subscriptions(self) -> int:
        """Close every subscription (shutdown): each waiting consumer wakes up with
        SubscriptionEnded. Returns how many were open."""
        subscriptions = list(self._subscriptions)
        for subscription in subscriptions:
            subscription.close()
        return len(subscriptions)

    @property
    def subscriber_count(self) -> int:
        return len(self._subscriptions)

    # ------------------------------------------------------------ writes

    def set_source_state(self, state: SourceState) -> None:
        """Record a source's own health (served beside the routes; no version bump:
        it describes the source, not the view). A source that turned valid or
        invalid, or whose error changed, wakes every subscriber: each hears it at
        once in an empty Batch (a rejected routes file was seen only with the next
        change or heartbeat, 30 s later)."""
        before = self._source_states.get(state.source)
        self._source_states[state.source] = state
        if before is None or (before.valid, before.error) != (state.valid, state.error):
            for subscription in self._subscriptions:
                subscription._sources_changed()

    def mark_synced(self, source: str, when: datetime | None = None) -> None:
        """Record that `source` confirmed its data at `when` (default: now)."""
        self._note_source(source)
        self._synced[source] = when or datetime.now(UTC)

    def upsert_service(self, svc: Service, *, source: str) -> None:
        changes: list[Change] = []
        self._put_service(svc, source, changes)
        self._commit(changes, source)

    def delete_service(self, namespace: str, name: str, *, source: str) -> None:
        changes: list[Change] = []
        self._drop_service((namespace, name), source, changes)
        self._commit(changes, source)

    def set_endpoints(
        self, namespace: str, service: str, endpoints: Iterable[Endpoint], *, source: str
    ) -> None:
        """Make `source`'s endpoints of that service exactly `endpoints`."""
        wanted: dict[str, Endpoint] = {}
        for endpoint in endpoints:
            if endpoint.service_key != (namespace, service):
                raise ValueError(
                    f"endpoint {endpoint.key} does not belong to service {namespace}/{service}"
                )
            wanted[endpoint.address] = endpoint
        changes: list[Change] = []
        owners = self._owners[Kind.ENDPOINTS]
        for address in list(self._endpoints.get((namespace, service), {})):
            if address not in wanted and owners.get((namespace, service, address)) == source:
                self._drop_endpoint((namespace, service, address), source, changes)
        for endpoint in wanted.values():
            self._put_endpoint(endpoint, source, changes)
        self._commit(changes, source)

    def upsert_route(self, route: Route, *, source: str) -> None:
        changes: list[Change] = []
        self._put_route(route, source, changes)
        self._commit(changes, source)

    def delete_route(self, namespace: str, name: str, *, source: str) -> None:
        changes: list[Change] = []
        self._drop_route((namespace, name), source, changes)
        self._commit(changes, source)

    def set_tunnel_presence(self, node: str, servers: Iterable[TunnelServer]) -> None:
        """Replace which tunnel servers hold `node`; no servers: the node is gone."""
        self.set_tunnel_presences({node: servers})

    def set_tunnel_presences(self, presences: Mapping[str, Iterable[TunnelServer]]) -> None:
        """`set_tunnel_presence` for many nodes, in one version."""
        changes: list[Change] = []
        for node in sorted(presences):
            unique = {server.id: server for server in presences[node]}
            presence = TunnelPresence(node, tuple(unique[i] for i in sorted(unique)))
            old = self._tunnels.get(node)
            if presence.servers:
                if old != presence:
                    self._tunnels[node] = presence
                    changes.append(Change(Kind.TUNNELS, node, presence))
            elif old is not None:
                del self._tunnels[node]
                changes.append(Change(Kind.TUNNELS, node, None))
        self._commit(changes, None)

    def replace_source(
        self,
        source: str,
        *,
        services: Iterable[Service] | None = None,
        endpoints: Iterable[Endpoint] | None = None,
        routes: Iterable[Route] | None = None,
        claims: Iterable[tuple[str, HostClaim]] | None = None,
    ) -> None:
        """Make each given kind exactly what `source` contributes (None: leave it).

        Whatever `source` owned before and is absent now is deleted; all of it
        lands in one version. `claims`: the source's Gateway listeners' hostname
        claims (host, claim), which own hosts like routes (waygate.resolver.status).
        """
        changes: list[Change] = []
        if services is not None:
            new_services = {svc.key: svc for svc in services}
            for key in self._owned(Kind.SERVICES, source):
                if key not in new_services:
                    self._drop_service(key, source, changes)
            for svc in new_services.values():
                self._put_service(svc, source, changes)
        if endpoints is not None:
            new_endpoints = {ep.key: ep for ep in endpoints}
            for key in self._owned(Kind.ENDPOINTS, source):
                if key not in new_endpoints:
                    self._drop_endpoint(key, source, changes)
            for endpoint in new_endpoints.values():
                self._put_endpoint(endpoint, source, changes)
        if routes is not None:
            new_routes = {route.key: route for route in routes}
            for key in self._owned(Kind.ROUTES, source):
                if key not in new_routes:
                    self._drop_route(key, source, changes)
            for route in new_routes.values():
                self._put_route(route, source, changes)
        hosts = None
        if claims is not None:
            hosts = self._status.set_listener_claims(source, claims, self._clock())
        self._note_source(source)
        self._commit(changes, source, hosts)

    def set_backend_certificates(
        self, findings: dict[RouteKey, tuple[BackendCertificateState, ...]]
    ) -> None:
        """The proxies' backend-certificate findings (waygate.resolver.backendcerts):
        routes whose findings changed get their BackendCertificate condition, in one version."""
        recheck = self._status.set_backend_certificates(findings)
        if recheck:
            self._commit([], None, recheck=recheck)

    # ------------------------------------------------------------ internals

    def _owned(self, kind: Kind, source: str) -> list[Any]:
        return [key for key, owner in self._owners[kind].items() if owner == source]

    def _note_source(self, source: str) -> None:
        if source not in self._sources:
            self._sources.append(source)
            self._sources.sort()

    def _put_service(self, svc: Service, source: str, changes: list[Change]) -> None:
        self._owners[Kind.SERVICES][svc.key] = source
        if self._services.get(svc.key) != svc:
            self._services[svc.key] = svc
            changes.append(Change(Kind.SERVICES, svc.key, svc))

    def _drop_service(self, key: ServiceKey, source: str, changes: list[Change]) -> None:
        if not self._may_delete(Kind.SERVICES, key, source):
            return
        del self._owners[Kind.SERVICES][key]
        del self._services[key]
        changes.append(Change(Kind.SERVICES, key, None))

    def _put_endpoint(self, endpoint: Endpoint, source: str, changes: list[Change]) -> None:
        self._owners[Kind.ENDPOINTS][endpoint.key] = source
        by_address = self._endpoints.setdefault(endpoint.service_key, {})
        if by_address.get(endpoint.address) != endpoint:
            by_address[endpoint.address] = endpoint
            changes.append(Change(Kind.ENDPOINTS, endpoint.key, endpoint))

    def _drop_endpoint(self, key: EndpointKey, source: str, changes: list[Change]) -> None:
        if not self._may_delete(Kind.ENDPOINTS, key, source):
            return
        del self._owners[Kind.ENDPOINTS][key]
        service_key = (key[0], key[1])
        by_address = self._endpoints[service_key]
        del by_address[key[2]]
        if not by_address:
            del self._endpoints[service_key]
        changes.append(Change(Kind.ENDPOINTS, key, None))

    def _put_route(self, route: Route, source: str, changes: list[Change]) -> None:
        if route.status is not None:
            route = dataclasses.replace(route, status=None)
        self._owners[Kind.ROUTES][route.key] = source
        if self._routes.get(route.key) != route:
            self._routes[route.key] = route
            changes.append(Change(Kind.ROUTES, route.key, route))

    def _drop_route(self, key: RouteKey, source: str, changes: list[Change]) -> None:
        if not self._may_delete(Kind.ROUTES, key, source):
            return
        del self._owners[Kind.ROUTES][key]
        del self._routes[key]
        changes.append(Change(Kind.ROUTES, key, None))

    def _may_delete(self, kind: Kind, key: Any, source: str) -> bool:
        owner = self._owners[kind].get(key)
        if owner is None:
            return False
        if owner != source:
            log.debug("%s %s belongs to %s; %s may not delete it", kind.value, key, owner, source)
            return False
        return True

    def _commit(
        self,
        changes: list[Change],
        source: str | None,
        hosts: set[str] | None = None,
        recheck: set[RouteKey] | None = None,
    ) -> None:
        if source is not None:
            self._note_source(source)
        if not changes and not hosts and not recheck:
            return
        changes = self._with_status(changes, hosts or set(), recheck or set())
        if not changes:
            # Only listener claims moved: no route changed, but a Gateway's may have.
            self._notify_route_listeners()
            return
        batch = Batch(self.version, self.version + 1, tuple(changes), shared=True)
        self.version = batch.version
        self._snapshots.clear()
        self._backlogs.clear()
        revisions = self._service_revisions
        for change in changes:
            if change.kind is Kind.SERVICES or change.kind is Kind.ENDPOINTS:
                service_key = (change.key[0], change.key[1])
                if service_key in self._services or service_key in self._endpoints:
                    revisions[service_key] = batch.version
                else:
                    # Gone entirely: a service made again later gets a newer
                    # version, so nothing derived from the old one is reused.
                    revisions.pop(service_key, None)
        self._history.append(batch)
        self._history_changes += len(batch.changes)
        while self._history_changes > self._history_limit and len(self._history) > 1:
            dropped = self._history.popleft()
            self._history_changes -= len(dropped.changes)
            self._history_floor = dropped.version
        for subscription in list(self._subscriptions):
            subscription._offer(batch)
        if hosts or any(c.kind is Kind.ROUTES for c in changes):
            self._notify_route_listeners()

    def _notify_route_listeners(self) -> None:
        for callback in list(self._route_listeners):
            callback()

    def _with_status(
        self, changes: list[Change], hosts: set[str], recheck: set[RouteKey]
    ) -> list[Change]:
        """`changes` with routes carrying their status, plus the routes whose status
        these changes changed (published in the same version)."""
        route_keys: list[RouteKey] = [
            (c.key[0], c.key[1]) for c in changes if c.kind is Kind.ROUTES
        ]
        service_keys = {
            (c.key[0], c.key[1]) for c in changes if c.kind in (Kind.SERVICES, Kind.ENDPOINTS)
        }
        if not route_keys and not service_keys and not hosts and not recheck:
            return changes
        updated = self._status.update(
            self._routes,
            self.get_service,
            self.endpoints_of,
            changed_routes=route_keys,
            changed_services=service_keys,
            changed_hosts=hosts,
            recheck=recheck,
            now=self._clock(),
        )
        result: list[Change] = []
        for change in changes:
            if change.kind is Kind.ROUTES:
                if isinstance(change.value, Route):
                    change = Change(Kind.ROUTES, change.key, self._serve(change.value))
                else:
                    self._served.pop((change.key[0], change.key[1]), None)
            result.append(change)
        seen = set(route_keys)
        for key in sorted(updated):
            if key not in seen:
                result.append(Change(Kind.ROUTES, key, self._serve(self._routes[key])))
        return result

    def _serve(self, route: Route) -> Route:
        served = dataclasses.replace(route, status=self._status.status(route.key))
        self._served[route.key] = served
        return served
