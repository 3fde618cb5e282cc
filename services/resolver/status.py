"""Route status: the conditions the resolver computes for every route it holds.

Sans-IO domain logic (no grpc, no store): the store feeds `RouteStatusBook` the
routes, services and endpoints that changed in one version and publishes the
statuses that changed with that version, so they travel in Watch and ListRoutes
like any other route change.

Conditions, each with a reason, a message for people and the time its status
last changed (a new reason or message with the same status keeps the time):
- Admitted: True unless another route owns the route's host or host and path
  (then False, reason HostAlreadyClaimed). The proxy serves admitted routes only.
- ResolvedRefs: every backend service exists, has the route's target port, and
  at least one backend of non-zero weight has a ready endpoint. Otherwise
  False with ServiceNotFound, PortNotFound, NoReadyEndpoints or NoBackends.
- Conflicted: True (reason HostAlreadyClaimed) exactly when Admitted is False.

Claims, as the OpenShift router's defaults, over every route kind:
- A host belongs to the namespace of the oldest claim on it, whatever makes the
  claim: a Route (routes file, Route CRD, ApplyRoute), an Ingress rule, an
  HTTPRoute/GRPCRoute/TLSRoute hostname, or a Gateway listener's hostname (a
  claim of its own, `set_listener_claims`, routes attached or not; a route
  attached through such a listener claims for the Gateway's namespace, at the
  Gateway's age: the Gateway's owner let it in through allowedRoutes, so routes
  of several namespaces share the host under it). A claim of another namespace
  for that host is Conflicted (HostAlreadyClaimed) and not served, unless
  `share_hosts` (OpenShift's ROUTER_DISABLE_NAMESPACE_OWNERSHIP_CHECK) lets
  namespaces share. A route without a host (a listener and route without
  hostnames, an Ingress default backend) claims nothing.
- Within the owning namespace, Gateway API and Ingress routes share a host and
  its paths by the specification's precedence; among Routes, one host and path
  is served by the oldest route that claims it, younger ones are Conflicted.
- Age: the source's creation time (the Route CRD's creationTimestamp) when it
  has one, else when the store first saw the route; routes first seen in the
  same load keep their order (the routes file: an earlier entry is older).
  Equal ages fall back to namespace/name order, so the answer never depends on
  dictionary order. A host's claims are recomputed whenever a route on it
  changes; a route's references whenever one of its services or their
  endpoints change.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Mapping
from datetime import UTC, datetime
from typing import NamedTuple

from waygate.resolver.backendcerts import BackendCertificateState, condition
from waygate.resolver.model import (
    ADMITTED,
    CONFLICTED,
    FALSE,
    RESOLVED_REFS,
    TRUE,
    Endpoint,
    HostClaim,
    Route,
    RouteCondition,
    RouteKey,
    RouteStatus,
    Service,
    ServiceKey,
    SourceState,
)

# A condition ListRoutes and ApplyRoute add (never stored, not in Watch): False, NotMTLS
# or NoRouteReaders, on a route with its own private key that no Watch client (no
# proxy) can receive. Absent otherwise.
PRIVATE_KEY_DELIVERED = "PrivateKeyDelivered"
HOST_ALREADY_CLAIMED = "HostAlreadyClaimed"
SERVICE_NOT_FOUND = "ServiceNotFound"
PORT_NOT_FOUND = "PortNotFound"
NO_READY_ENDPOINTS = "NoReadyEndpoints"
NO_BACKENDS = "NoBackends"
ANNOTATIONS_HONOURED = "AnnotationsHonoured"

_EPOCH = datetime.min.replace(tzinfo=UTC)


class HostConflict(NamedTuple):
    """An object some of whose routes lose their host to an older claim."""

    every: bool  # none of its routes is served
    message: str  # the first lost route's HostAlreadyClaimed message
    listeners: tuple[str, ...] = ()  # a Gateway: the listeners whose routes lost


# (creation time, order of first sight, namespace, name): smaller is older.
Age = tuple[datetime, int, str, str]
# A Gateway listener's claim: (source, host, the claim).
ListenerKey = tuple[str, str, HostClaim]


def route_references(
    route: Route,
    service: Callable[[str, str], Service | None],
    endpoints: Callable[[str, str], tuple[Endpoint, ...]],
) -> tuple[str, str]:
    """(reason, message) of the ResolvedRefs condition; reason "" when resolved."""
    if not route.backends or all(b.weight <= 0 for b in route.backends):
        return NO_BACKENDS, "the route has no backend of non-zero weight"
    ready = False
    first_weighted = ""
    for backend in route.backends:
        # Gateway API backends may name their namespace and port (waygate.resolver.gateway).
        namespace = backend.namespace or route.namespace
        found = service(namespace, backend.service)
        name = f"{namespace}/{backend.service}"
        if found is None:
            return SERVICE_NOT_FOUND, f"service {name} not found"
        backend_endpoints = endpoints(namespace, backend.service)
        port = backend.port or route.target_port
        if port and not _has_port(found, backend_endpoints, port):
            return PORT_NOT_FOUND, f"service {name} has no port {port!r}"
        if backend.weight > 0:
            first_weighted = first_weighted or name
            ready = ready or any(e.usable for e in backend_endpoints)
    if not ready:
        return NO_READY_ENDPOINTS, f"service {first_weighted} has no ready endpoints"
    return "", ""


def _has_port(service: Service, endpoints: tuple[Endpoint, ...], port: str) -> bool:
    """The route's target port names a port of the service (by name or number), or
    one the endpoints carry (what the proxy also accepts); a service that declares
    no ports at all cannot be judged, and passes."""
    if not service.ports:
        return True
    if any(p.name == port or str(p.port) == port for p in service.ports):
        return True
    return any(p.name == port or str(p.port) == port for e in endpoints for p in e.ports)


class RouteStatusBook:
    """Every route's status, kept current from the changes of each store version."""

    def __init__(self, *, share_hosts: bool = False) -> None:
        self.share_hosts = share_hosts
        self._status: dict[RouteKey, RouteStatus] = {}
        self._age: dict[RouteKey, Age] = {}
        self._host: dict[RouteKey, str] = {}
        self._path: dict[RouteKey, str] = {}
        self._by_host: dict[str, set[RouteKey]] = {}
        self._services: dict[RouteKey, tuple[ServiceKey, ...]] = {}
        self._by_service: dict[ServiceKey, set[RouteKey]] = {}
        # Why a route is not admitted (None: it is); the routes that are not.
        self._conflict: dict[RouteKey, str | None] = {}
        self._lost: set[RouteKey] = set()
        # Gateway API and Ingress routes (with matches): within the owning
        # namespace they share paths by the specification's precedence.
        self._merged: set[RouteKey] = set()
        # Whose claim each route is: (namespace, age, what, for people).
        self._claims: dict[RouteKey, tuple[str, Age, str]] = {}
        # Gateway listeners' hostnames: claims of their own, routes attached or not.
        self._listener_claims: dict[ListenerKey, tuple[HostClaim, Age]] = {}
        self._listeners_by_host: dict[str, set[ListenerKey]] = {}
        self._listener_conflict: dict[ListenerKey, str] = {}
        self._sightings = itertools.count()
        # Proxies' reports of backend certificates needing attention (BackendCertificate).
        self._backend: dict[RouteKey, tuple[BackendCertificateState, ...]] = {}

    def status(self, key: RouteKey) -> RouteStatus | None:
        return self._status.get(key)

    def update(
        self,
        routes: Mapping[RouteKey, Route],
        service: Callable[[str, str], Service | None],
        endpoints: Callable[[str, str], tuple[Endpoint, ...]],
        *,
        changed_routes: Iterable[RouteKey] = (),
        changed_services: Iterable[ServiceKey] = (),
        changed_hosts: Iterable[str] = (),
        recheck: Iterable[RouteKey] = (),
        now: datetime,
    ) -> dict[RouteKey, RouteStatus]:
        """Recompute what the changes can affect; the statuses that changed
        (every route new to the book included). `routes` is every route now;
        `changed_hosts`: hosts whose listener claims changed (`set_listener_claims`);
        `recheck`: routes whose backend certificates changed (`set_backend_certificates`)."""
        dirty: set[RouteKey] = {key for key in recheck if key in self._status}
        hosts: set[str] = set(changed_hosts)
        for key in changed_routes:
            old_host = self._forget(key)
            if old_host is not None:
                hosts.add(old_host)
            route = routes.get(key)
            if route is None:
                self._status.pop(key, None)
                self._age.pop(key, None)
                continue
            self._index(route, now)
            hosts.add(route.host)
            dirty.add(key)
        for host in hosts:
            dirty |= self._claim(host)
        for service_key in changed_services:
            dirty |= self._by_service.get(service_key, set())
        changed: dict[RouteKey, RouteStatus] = {}
        for key in dirty:
            route = routes.get(key)
            if route is None:
                continue
            status = self._compute(route, service, endpoints, now)
            if status != self._status.get(key):
                self._status[key] = changed[key] = status
        return changed

    def set_listener_claims(
        self, source: str, claims: Iterable[tuple[str, HostClaim]], now: datetime
    ) -> set[str]:
        """Make `source`'s Gateway listener claims (host, claim) exactly these; the
        hosts whose claims changed (pass them to `update` as `changed_hosts`)."""
        wanted = {(source, host, claim) for host, claim in claims}
        hosts: set[str] = set()
        for key in [k for k in self._listener_claims if k[0] == source and k not in wanted]:
            del self._listener_claims[key]
            self._listener_conflict.pop(key, None)
            on_host = self._listeners_by_host[key[1]]
            on_host.discard(key)
            if not on_host:
                del self._listeners_by_host[key[1]]
            hosts.add(key[1])
        for key in wanted - set(self._listener_claims):
            claim = key[2]
            age = (claim.created or now, next(self._sightings), claim.namespace, claim.gateway)
            self._listener_claims[key] = (claim, age)
            self._listeners_by_host.setdefault(key[1], set()).add(key)
            hosts.add(key[1])
        return hosts

    def set_backend_certificates(
        self, findings: dict[RouteKey, tuple[BackendCertificateState, ...]]
    ) -> set[RouteKey]:
        """Make the proxies' backend-certificate findings exactly these; the routes
        whose findings changed (pass them to `update` as `recheck`)."""
        changed = {
            k
            for k in findings.keys() | self._backend.keys()
            if findings.get(k) != self._backend.get(k)
        }
        self._backend = dict(findings)
        return changed

    def any_lost(self) -> bool:
        """Whether any route or listener claim is not admitted for its host (the
        common answer, no, is had without looking at every route)."""
        return bool(self._lost or self._listener_conflict)

    def listener_conflicts(self) -> dict[tuple[str, str], dict[str, str]]:
        """Gateway (namespace, name) -> its listeners whose hostname claim lost to an
        older claim of another namespace -> why."""
        out: dict[tuple[str, str], dict[str, str]] = {}
        for (_, _, claim), message in sorted(
            self._listener_conflict.items(), key=lambda item: (item[0][1], item[0][2].what)
        ):
            out.setdefault((claim.namespace, claim.gateway), {}).setdefault(claim.listener, message)
        return out

    # ------------------------------------------------------------ internals

    def _forget(self, key: RouteKey) -> str | None:
        """Drop a route's index entries (its age stays while it exists); its old host.

        Also called for a route that is only updated: `_index` adds it back."""
        host = self._host.pop(key, None)
        if host is not None:
            claims = self._by_host[host]
            claims.discard(key)
            if not claims:
                del self._by_host[host]
        for service_key in self._services.pop(key, ()):
            users = self._by_service[service_key]
            users.discard(key)
            if not users:
                del self._by_service[service_key]
        self._conflict.pop(key, None)
        self._lost.discard(key)
        self._path.pop(key, None)
        self._merged.discard(key)
        self._claims.pop(key, None)
        return host

    def _index(self, route: Route, now: datetime) -> None:
        key = route.key
        created = route.created or self._age.get(key, (now,))[0]
        sighting = self._age[key][1] if key in self._age else next(self._sightings)
        self._age[key] = (created, sighting, route.namespace, route.name)
        self._host[key] = route.host
        self._path[key] = route.path or "/"
        self._by_host.setdefault(route.host, set()).add(key)
        if route.matches:
            self._merged.add(key)
        claim = route.host_claim
        if claim is None:
            what = route.origin or f"route {route.namespace}/{route.name}"
            self._claims[key] = (route.namespace, self._age[key], what)
        else:
            age = (claim.created or created, sighting, claim.namespace, route.name)
            self._claims[key] = (claim.namespace, age, claim.what)
        services = tuple(
            dict.fromkeys((b.namespace or route.namespace, b.service) for b in route.backends)
        )
        self._services[key] = services
        for service_key in services:
            self._by_service.setdefault(service_key, set()).add(key)

    def _claim(self, host: str) -> set[RouteKey]:
        """Decide who is admitted on `host`; the routes whose verdict may have changed."""
        if not host:
            # Routes without a host (Gateway API and Ingress only) claim nothing.
            anywhere = set(self._by_host.get(host, ()))
            for key in anywhere:
                self._conflict[key] = None
                self._lost.discard(key)
            return anywhere
        claims = sorted(self._by_host.get(host, ()), key=lambda key: self._claims[key][1])
        listeners = sorted(
            self._listeners_by_host.get(host, ()), key=lambda k: self._listener_claims[k][1]
        )
        owner_namespace = owner_what = ""
        owner_age: Age | None = None
        if claims:
            owner_namespace, owner_age, owner_what = self._claims[claims[0]]
        if listeners:
            claim, age = self._listener_claims[listeners[0]]
            if owner_age is None or age < owner_age:
                owner_namespace, owner_what = claim.namespace, claim.what
        for listener in listeners:
            if not self.share_hosts and listener[2].namespace != owner_namespace:
                self._listener_conflict[listener] = (
                    f"host {host} belongs to namespace {owner_namespace} "
                    f"(its {owner_what} claimed it first)"
                )
            else:
                self._listener_conflict.pop(listener, None)
        if not claims:
            return set()
        taken: dict[str, RouteKey] = {}
        for key in claims:
            path = self._path[key]
            if not self.share_hosts and self._claims[key][0] != owner_namespace:
                verdict: str | None = (
                    f"host {host} belongs to namespace {owner_namespace} "
                    f"(its {owner_what} claimed it first)"
                )
            elif key in self._merged:
                verdict = None
            elif path in taken:
                winner = taken[path]
                verdict = (
                    f"host {host} path {path} is claimed by the older route {winner[0]}/{winner[1]}"
                )
            else:
                taken[path] = key
                verdict = None
            self._conflict[key] = verdict
            if verdict is None:
                self._lost.discard(key)
            else:
                self._lost.add(key)
        return set(claims)

    def _compute(
        self,
        route: Route,
        service: Callable[[str, str], Service | None],
        endpoints: Callable[[str, str], tuple[Endpoint, ...]],
        now: datetime,
    ) -> RouteStatus:
        previous = self._status.get(route.key)
        conflict = self._conflict.get(route.key)
        if route.ingress_refusal is not None:
            conflict = route.ingress_refusal[1]
        reason, message = route_references(route, service, endpoints)
        conditions: tuple[RouteCondition, ...] = (
            RouteCondition(ADMITTED, TRUE, "Admitted")
            if conflict is None
            else RouteCondition(
                ADMITTED,
                FALSE,
                route.ingress_refusal[0] if route.ingress_refusal else HOST_ALREADY_CLAIMED,
                conflict,
            ),
            RouteCondition(RESOLVED_REFS, TRUE, "ResolvedRefs")
            if not reason
            else RouteCondition(RESOLVED_REFS, FALSE, reason, message),
            RouteCondition(CONFLICTED, FALSE, "NoConflicts")
            if conflict is None or route.ingress_refusal
            else RouteCondition(CONFLICTED, TRUE, HOST_ALREADY_CLAIMED, conflict),
        )
        if route.ingress_verdicts:
            # ingress-nginx annotations not honoured exactly (waygate.resolver.ingress_nginx).
            lacking = any(": not-honoured" in line for line in route.ingress_verdicts)
            conditions += (
                RouteCondition(
                    ANNOTATIONS_HONOURED,
                    FALSE if lacking else TRUE,
                    "NotHonoured" if lacking else "HonouredWithDifferences",
                    "; ".join(route.ingress_verdicts),
                ),
            )
        backend = self._backend.get(route.key)
        if backend:
            conditions += (condition(backend),)
        return RouteStatus(tuple(_stamped(c, previous, now) for c in conditions))


def _stamped(
    condition: RouteCondition, previous: RouteStatus | None, now: datetime
) -> RouteCondition:
    before = previous.condition(condition.type) if previous is not None else None
    since = (
        before.last_transition if before is not None and before.status == condition.status else now
    )
    return RouteCondition(
        condition.type,
        condition.status,
        condition.reason,
        condition.message,
        since,
        condition.observed_generation,
    )


class SourceHealth:
    """A route source's own state as it changes: the last load, the current error
    and since when it has failed. `state()` is what the store publishes
    (ListRoutes, Watch, ListGateways, the status page, the metrics)."""

    def __init__(self, source: str, clock: Callable[[], datetime] | None = None) -> None:
        self.source = source
        self._clock = clock or (lambda: datetime.now(UTC))
        self.error: str | None = None
        self.error_since: datetime | None = None
        self.loaded_version = 0
        self.loaded_at: datetime | None = None

    def loaded(self, version: int) -> None:
        self.error = None
        self.error_since = None
        self.loaded_version = version
        self.loaded_at = self._clock()

    def failed(self, message: str) -> bool:
        """Record an error; True when it is new (not the one already reported)."""
        new = message != self.error
        if self.error is None:
            self.error_since = self._clock()
        self.error = message
        return new

    def state(self) -> SourceState:
        return SourceState(
            source=self.source,
            valid=self.error is None and self.loaded_at is not None,
            error=self.error or "",
            loaded_version=self.loaded_version,
            loaded_at=self.loaded_at,
            error_since=self.error_since,
        )
