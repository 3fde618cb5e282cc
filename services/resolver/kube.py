"""The Kubernetes source: Services, EndpointSlices and Route custom resources,
by list + watch, into the resolver's store; with `gateway`, also the Gateway
API and Ingress kinds (`waygate.resolver.gateway.kube`), through the same
reflector, each kind optional (a missing CRD is "none").

Each of the three kinds runs one loop:
    list -> replace_source (the kind becomes exactly what the API holds now)
    watch from the list's resourceVersion -> apply each event
    watch ends (server timeout) -> watch again from the last resourceVersion
    connection lost -> back off with jitter, then watch again from the last
                       resourceVersion (no relist: nothing was missed)
    410 Gone (HTTP 410, or an ERROR event with code 410) -> relist at once
Watches ask for bookmarks, so the resourceVersion keeps moving on a quiet
cluster and a resume rarely meets 410.

Invariants:
- Never a stale endpoint after a reconnect: a resume replays every event
  after the last version applied, and when the API can no longer do that
  (410) the relist goes through `Store.replace_source`, which deletes whatever
  this source contributed before and is absent now (endpoints deleted while
  disconnected included).
- List, watch, resume, 410 and backoff are the shared reflector's
  (`waygate.core.kube.Reflector`, one per kind): the store is only touched
  from the event loop, in its callbacks, while the blocking calls and stream
  reads run on the reflector's own threads.
- A dead connection is noticed: every watch carries `timeoutSeconds`
  (`Timeouts.watch`, with jitter so replicas do not reconnect together) and a
  client-side read timeout `Timeouts.request` longer than that.
- Freshness is per kind: a list, a bookmark or any event confirms that kind
  up to that moment, and the store's last-sync time for "kubernetes" is the
  OLDEST of the kinds' confirmations, so a failing EndpointSlice watch is not
  hidden by fresh Service bookmarks. `synced` is set once every kind has
  listed (readiness).
- Bad objects never stop the watch: an object that fails validation is
  logged with the reason and left out (a modified object that became invalid
  is removed, so the store never keeps a state the API no longer has).
- A missing Route CRD (404) counts as "no routes" and is retried with backoff,
  so a cluster without the CRD still gets services and endpoints.

Edge endpoints: an endpoint is marked `tunnel=True` (reachable only through a
tunnel to its node) when its EndpointSlice carries the label
`waygate.io/tunnel: "true"` — the EndpointSlice controller copies a Service's
labels onto its slices, so label the Service — or when its `nodeName` is in the
configured `edge_nodes`. See `kube_convert` for the object mapping.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
from collections.abc import Callable, Iterable
from datetime import UTC, datetime
from typing import Any

from kubernetes import client as k8s

from waygate.core.backoff import Backoff
from waygate.core.errors import FailedPrecondition, InvalidArgument
from waygate.core.kube import KubeAPI, Reflector, load_configuration
from waygate.core.settings import SettingsError
from waygate.resolver import kube_convert as convert
from waygate.resolver.gateway import kube as gateway_kube
from waygate.resolver.gateway.kube import GatewayObjects
from waygate.resolver.model import Endpoint, Route
from waygate.resolver.schema import DEFAULT_MAX_ROUTES_PER_SOURCE
from waygate.resolver.status import SourceHealth
from waygate.resolver.store import Store

log = logging.getLogger(__name__)

SOURCE = "kubernetes"
ROUTE_GROUP, ROUTE_VERSION, ROUTE_PLURAL = "waygate.io", "v1", "routes"

JSON = dict[str, Any]


def kube_configuration(kubeconfig: str = "", context: str = "") -> k8s.Configuration:
    """Client configuration from a kubeconfig file, or the in-cluster service account."""
    try:
        return load_configuration(kubeconfig, context=context or None)
    except FailedPrecondition as exc:
        # "kubernetes: cannot load kubeconfig FILE: why", one line.
        reason = str(exc).partition("cannot configure the Kubernetes client: ")[2] or str(exc)
        raise SettingsError(f"kubernetes: {reason}") from None


def parse_node_list(text: str) -> frozenset[str]:
    """'edge-1, edge-2' (commas and/or spaces) -> {"edge-1", "edge-2"}."""
    return frozenset(name for name in text.replace(",", " ").split() if name)


# ---------------------------------------------------------------- per-kind handlers


class _Handler:
    """How one kind is listed, watched and written to the store."""

    name = ""
    optional = False  # a 404 on the list means "none" rather than an error

    def __init__(self, store: Store) -> None:
        self.store = store

    def path(self, namespace: str | None) -> str:
        raise NotImplementedError

    def relist(self, items: list[JSON]) -> None:
        raise NotImplementedError

    def apply(self, event_type: str, obj: JSON) -> None:
        raise NotImplementedError


class _Services(_Handler):
    name = "services"

    def __init__(self, store: Store, gateway: GatewayObjects | None = None) -> None:
        super().__init__(store)
        # Gateway API references resolve against services: translate again on a change.
        self._gateway = gateway

    def path(self, namespace: str | None) -> str:
        return _collection("/api/v1", "services", namespace)

    def relist(self, items: list[JSON]) -> None:
        self.store.replace_source(SOURCE, services=_valid(convert.service_from, items))
        if self._gateway is not None:
            self._gateway.changed()

    def apply(self, event_type: str, obj: JSON) -> None:
        _upsert_or_delete(
            event_type, obj, "Service", convert.service_from,
            self.store.upsert_service, self.store.delete_service,
        )  # fmt: skip
        if self._gateway is not None:
            self._gateway.changed()


class _GatewayKind(_Handler):
    """One Gateway API / Ingress kind (or Namespaces, TLS Secrets) into `GatewayObjects`."""

    optional = True

    def __init__(self, store: Store, gateway: GatewayObjects, kind: str) -> None:
        super().__init__(store)
        self.gateway = gateway
        self.kind = kind
        self.name = gateway_kube.KINDS[kind][1]

    def path(self, namespace: str | None) -> str:
        return gateway_kube.collection(self.kind, namespace)

    def relist(self, items: list[JSON]) -> None:
        self.gateway.replace(self.kind, items)

    def apply(self, event_type: str, obj: JSON) -> None:
        if event_type == "DELETED":
            self.gateway.delete(self.kind, obj)
        else:
            self.gateway.put(self.kind, obj)


def _upsert_or_delete(
    event_type: str,
    obj: JSON,
    kind: str,
    convert_object: Callable[[JSON], Any],
    upsert: Callable[..., None],
    delete: Callable[..., None],
) -> None:
    """Apply one watch event for a keyed kind. An object that became invalid is
    removed, so the store never keeps a state the API no longer has."""
    namespace, name = convert.object_key(obj)
    if event_type != "DELETED":
        try:
            upsert(convert_object(obj), source=SOURCE)
            return
        except InvalidArgument as exc:
            log.warning("skipping invalid %s: %s", kind, exc)
    delete(namespace, name, source=SOURCE)


def _oldest_first(routes: Iterable[Route]) -> list[Route]:
    """By creationTimestamp (unknown last), then namespace and name."""
    return sorted(routes, key=lambda r: (r.created is None, r.created or 0, r.key))


class _Routes(_Handler):
    name = "routes"
    optional = True

    def path(self, namespace: str | None) -> str:
        return _collection(f"/apis/{ROUTE_GROUP}/{ROUTE_VERSION}", ROUTE_PLURAL, namespace)

    def __init__(self, store: Store, max_routes: int = DEFAULT_MAX_ROUTES_PER_SOURCE) -> None:
        super().__init__(store)
        #: Route objects the resolver cannot serve, and why: their status says so
        #: (waygate.resolver.kube_status), as the routes file's state does for it.
        self.invalid: dict[tuple[str, str], str] = {}
        #: The source's route budget (--max-routes-per-source): the oldest Route
        #: objects are served; the ones past it wait, invalid and saying so, and
        #: the oldest waiting one takes a place another leaves.
        self.max_routes = max_routes
        self._served: set[tuple[str, str]] = set()
        self._waiting: dict[tuple[str, str], Route] = {}

    def _wait(self, route: Route) -> None:
        reason = (
            f"route {route.namespace}/{route.name}: not served: this cluster's Route objects "
            f"exceed the budget of {self.max_routes} routes per source "
            "(--max-routes-per-source); the oldest are served"
        )
        if route.key not in self._waiting:
            log.warning("skipping Route: %s", reason)
        self._waiting[route.key] = route
        self.invalid[route.key] = reason

    def relist(self, items: list[JSON]) -> None:
        self.invalid, self._waiting = {}, {}
        routes = _oldest_first(route for obj in items if (route := self._parse(obj)) is not None)
        for route in routes[self.max_routes :]:
            self._wait(route)
        routes = routes[: self.max_routes]
        self._served = {route.key for route in routes}
        self.store.replace_source(SOURCE, routes=routes)

    def apply(self, event_type: str, obj: JSON) -> None:
        key = convert.object_key(obj)
        route = None if event_type == "DELETED" else self._parse(obj)
        if event_type == "DELETED":
            self.invalid.pop(key, None)
        self._waiting.pop(key, None)
        if route is not None and (route.key in self._served or len(self._served) < self.max_routes):
            self._served.add(route.key)
            self.store.upsert_route(route, source=SOURCE)
            return
        if route is not None:
            self._wait(route)
        # Deleted, no longer valid or over budget: the store keeps no state the API lost.
        if key in self._served:
            self._served.discard(key)
            self.store.delete_route(*key, source=SOURCE)
            if self._waiting:
                # The place it leaves goes to the oldest route waiting for one.
                admitted = _oldest_first(self._waiting.values())[0]
                del self._waiting[admitted.key]
                self.invalid.pop(admitted.key, None)
                self._served.add(admitted.key)
                self.store.upsert_route(admitted, source=SOURCE)
        else:
            self.store.delete_route(*key, source=SOURCE)

    def _parse(self, obj: JSON) -> Route | None:
        """The route, or None when invalid (logged, and kept in `invalid` with why)."""
        key = convert.object_key(obj)
        try:
            route = convert.route_from(obj)
        except InvalidArgument as exc:
            log.warning("skipping invalid Route: %s", exc)
            self.invalid[key] = str(exc)
            return None
        self.invalid.pop(key, None)
        return route


class _EndpointSlices(_Handler):
    """Keeps every slice's endpoints, so a service's set is the merge of its slices."""

    name = "endpointslices"

    def __init__(self, store: Store, edge_nodes: frozenset[str]) -> None:
        super().__init__(store)
        self._edge_nodes = edge_nodes
        # service (namespace, name) -> slice name -> that slice's endpoints
        self._by_service: dict[tuple[str, str], dict[str, list[Endpoint]]] = {}
        # slice (namespace, name) -> the service it belonged to when last seen
        self._owner: dict[tuple[str, str], tuple[str, str]] = {}

    def path(self, namespace: str | None) -> str:
        return _collection("/apis/discovery.k8s.io/v1", "endpointslices", namespace)

    def _endpoints(self, obj: JSON) -> list[Endpoint]:
        problems: list[str] = []
        try:
            endpoints = convert.endpoints_from_slice(obj, self._edge_nodes, problems)
        except InvalidArgument as exc:
            log.warning("skipping invalid EndpointSlice: %s", exc)
            return []
        for problem in problems:
            log.warning("skipping invalid endpoint: %s", problem)
        return endpoints

    def _merged(self, service: tuple[str, str]) -> list[Endpoint]:
        return convert.merge_endpoints(list(self._by_service.get(service, {}).values()))

    def relist(self, items: list[JSON]) -> None:
        self._by_service.clear()
        self._owner.clear()
        for obj in items:
            self._remember(obj)
        endpoints = [ep for service in self._by_service for ep in self._merged(service)]
        self.store.replace_source(SOURCE, endpoints=endpoints)

    def _remember(self, obj: JSON) -> tuple[str, str] | None:
        owner = convert.slice_service(obj)
        if owner is None:
            return None
        key = convert.object_key(obj)
        self._owner[key] = owner
        self._by_service.setdefault(owner, {})[key[1]] = self._endpoints(obj)
        return owner

    def _forget(self, key: tuple[str, str]) -> tuple[str, str] | None:
        owner = self._owner.pop(key, None)
        if owner is not None:
            slices = self._by_service.get(owner, {})
            slices.pop(key[1], None)
            if not slices:
                self._by_service.pop(owner, None)
        return owner

    def apply(self, event_type: str, obj: JSON) -> None:
        affected = {self._forget(convert.object_key(obj))}
        if event_type != "DELETED":
            affected.add(self._remember(obj))
        for service in affected:
            if service is not None:
                self.store.set_endpoints(*service, self._merged(service), source=SOURCE)


def _collection(prefix: str, plural: str, namespace: str | None) -> str:
    return f"{prefix}/namespaces/{namespace}/{plural}" if namespace else f"{prefix}/{plural}"


def _valid(parse: Callable[[JSON], Any], items: Iterable[JSON]) -> list[Any]:
    valid = []
    for obj in items:
        try:
            valid.append(parse(obj))
        except InvalidArgument as exc:
            log.warning("skipping invalid object: %s", exc)
    return valid


# ---------------------------------------------------------------- the source


@dataclasses.dataclass(frozen=True)
class Timeouts:
    #: Server-side watch duration (timeoutSeconds); each watch draws from [watch, 2 x watch).
    watch: float = 300.0
    #: TCP connect to the API server.
    connect: float = 10.0
    #: A whole list call; also the read timeout's margin over a watch's duration.
    request: float = 60.0


class KubernetesSource:
    """List + watch Services, EndpointSlices and Routes into `store` until cancelled."""

    def __init__(
        self,
        store: Store,
        configuration: k8s.Configuration,
        *,
        namespace: str | None = None,
        edge_nodes: Iterable[str] = (),
        gateway: GatewayObjects | None = None,
        max_routes: int = DEFAULT_MAX_ROUTES_PER_SOURCE,
        timeouts: Timeouts = Timeouts(),
        backoff_initial: float = 0.5,
        backoff_maximum: float = 30.0,
        rng: random.Random | None = None,
    ) -> None:
        self._store = store
        self._configuration = configuration
        self._namespace = namespace or None
        self._timeouts = timeouts
        self._rng = rng or random.Random()
        self._backoff = (backoff_initial, backoff_maximum)
        self._handlers: list[_Handler] = [
            _Services(store, gateway),
            _EndpointSlices(store, frozenset(edge_nodes)),
            _Routes(store, max_routes),
        ]
        if gateway is not None:
            self._handlers += [_GatewayKind(store, gateway, kind) for kind in gateway_kube.KINDS]
        self._listed: set[str] = set()
        #: When each kind last proved its view current (list, bookmark or event).
        self._confirmed: dict[str, datetime] = {}
        #: Set once every kind has been listed (the resolver's readiness).
        self.synced = asyncio.Event()
        #: The source's published state; the kinds whose list/watch fails now.
        self.health = SourceHealth(SOURCE)
        self._failing: dict[str, str] = {}

    def invalid_routes(self) -> dict[tuple[str, str], str]:
        """Route objects that could not be served, and why (for their status)."""
        for handler in self._handlers:
            if isinstance(handler, _Routes):
                return dict(handler.invalid)
        return {}

    async def wait_synced(self) -> None:
        await self.synced.wait()

    async def run(self) -> None:
        api = KubeAPI(
            k8s.ApiClient(self._configuration),
            timeout=self._timeouts.request,
            connect_timeout=self._timeouts.connect,
            watch_read_margin=self._timeouts.request,
        )
        try:
            async with asyncio.TaskGroup() as group:
                for handler in self._handlers:
                    group.create_task(
                        self.reflector(api, handler).run(), name=f"kube-{handler.name}"
                    )
        finally:
            api.close()

    def reflector(self, api: KubeAPI, handler: _Handler) -> Reflector:
        """The list + watch of one kind, feeding `handler`."""

        def relisted(items: list[JSON]) -> None:
            handler.relist(items)
            self._note_listed(handler)

        def changed(event_type: str, obj: JSON) -> None:
            handler.apply(event_type, obj)
            self._confirm(handler)

        def missing() -> None:
            handler.relist([])
            self._note_listed(handler)

        return Reflector(
            api,
            handler.path(self._namespace),
            name=handler.name,
            on_list=relisted,
            on_event=changed,
            on_bookmark=lambda: self._confirm(handler),
            on_missing=missing if handler.optional else None,
            on_error=lambda message: self._failed(handler, message),
            watch_timeout=self._timeouts.watch,
            backoff=lambda: Backoff(*self._backoff, rng=self._rng),
            rng=self._rng,
        )

    def _note_listed(self, handler: _Handler) -> None:
        self._listed.add(handler.name)
        self._confirm(handler)
        if len(self._listed) == len(self._handlers):
            self.synced.set()
            self._publish()

    def _failed(self, handler: _Handler, message: str) -> None:
        """A kind's list or watch failed: the source is failing until it recovers."""
        self._failing[handler.name] = message
        self._publish()

    def _publish(self) -> None:
        if self._failing:
            self.health.failed("; ".join(f"{k}: {v}" for k, v in sorted(self._failing.items())))
        elif self.synced.is_set():
            self.health.loaded(self._store.version)
        self._store.set_source_state(self.health.state())

    def _confirm(self, handler: _Handler) -> None:
        """`handler`'s kind is current as of now; the source as of its stalest kind."""
        self._confirmed[handler.name] = datetime.now(UTC)
        if self._failing.pop(handler.name, None) is not None:
            self._publish()
        if len(self._confirmed) == len(self._handlers):
            self._store.mark_synced(SOURCE, min(self._confirmed.values()))
