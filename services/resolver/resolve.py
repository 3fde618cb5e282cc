"""Resolve one service port to its ready endpoints (kube-aggregator parity).

Rules, in the order they are checked:
- unknown service: NotFound;
- ExternalName or headless service: FailedPrecondition (nothing to proxy to);
- the port, by name or number; empty means the only port: NotFound when the
  service has no such port, InvalidArgument when it is empty and ambiguous;
- each endpoint's port: the endpoint port of the same name as the service
  port (the aggregator's rule), else the target port number, else the
  endpoint port named by target_port; an endpoint without a match is skipped;
- only ready endpoints count, and a terminating endpoint is never ready:
  none left -> Unavailable "no endpoints available for service NS/NAME".

Optional picks (RANDOM, ROUND_ROBIN, HASH of a key) use waygate.core.balancing,
the same library the proxy balances with; a picker per service port keeps its
round-robin position and hash ring while the endpoints stay the same.

Invariant: everything is read from the store in one synchronous call, so a
Resolution never mixes two versions and never contains an endpoint the store
has deleted. The sorted targets of a service port are cached under the
store's `service_revision` of that service, which changes with any change to
the service or its endpoints: a cached answer is never older than the store.
Repeated answers for an unchanged service port share one targets tuple.
"""

from __future__ import annotations

import enum
import random
from dataclasses import dataclass
from datetime import datetime

from waygate.core.balancing import Picker, new_picker
from waygate.core.errors import FailedPrecondition, InvalidArgument, NotFound, Unavailable, excerpt
from waygate.resolver.model import Endpoint, Service, ServicePort
from waygate.resolver.store import Store
from waygate.resolver.validation import shown

MAX_PICKERS = 10_000
# Service ports whose targets are kept; past this the cache starts over.
MAX_CACHED_PORTS = 10_000


class Pick(enum.Enum):
    NONE = "none"
    RANDOM = "random"
    ROUND_ROBIN = "roundrobin"
    HASH = "hash"


@dataclass(frozen=True)
class Target:
    address: str
    port: int
    node_name: str = ""
    zone: str = ""
    tunnel: bool = False


@dataclass(frozen=True)
class Resolution:
    service: Service
    targets: tuple[Target, ...]
    picked: Target | None
    version: int
    source: str
    last_sync: datetime | None


def select_port(service: Service, port: str) -> ServicePort:
    name = f"{service.namespace}/{service.name}"
    if not service.ports:
        raise NotFound(f"service {name} has no ports")
    if not port:
        if len(service.ports) > 1:
            names = ", ".join(p.name or str(p.port) for p in service.ports)
            raise InvalidArgument(f"service {name} has several ports ({names}); name one")
        return service.ports[0]
    for candidate in service.ports:
        if port == candidate.name or (
            port.isascii() and port.isdigit() and int(port) == candidate.port
        ):
            return candidate
    names = ", ".join(p.name or str(p.port) for p in service.ports)
    raise NotFound(f"service {name} has no port {excerpt(port)} (it has: {names})")


def endpoint_port(endpoint: Endpoint, service_port: ServicePort) -> int | None:
    """The port on `endpoint` that `service_port` maps to, or None."""
    for port in endpoint.ports:
        if port.name == service_port.name:
            return port.port
    target = service_port.target_port
    if target.isascii() and target.isdigit():
        number = int(target)
        if not endpoint.ports or any(p.port == number for p in endpoint.ports):
            return number
        return None
    for port in endpoint.ports:
        if port.name == target:
            return port.port
    return None


class Resolver:
    """Resolve against a store; keeps one picker per service port and policy, so
    round-robin positions survive endpoint changes (waygate.core.balancing)."""

    def __init__(self, store: Store, rng: random.Random | None = None) -> None:
        self._store = store
        self._rng = rng or random.Random()
        # Each picker with the targets tuple it was last given (identity check first).
        self._pickers: dict[
            tuple[str, str, str, Pick], tuple[Picker[Target], tuple[Target, ...]]
        ] = {}
        # (namespace, name, requested port) -> (service revision, port, sorted targets).
        self._targets: dict[tuple[str, str, str], tuple[int, ServicePort, tuple[Target, ...]]] = {}

    def resolve(
        self,
        namespace: str,
        name: str,
        port: str = "",
        *,
        pick: Pick = Pick.NONE,
        hash_key: str = "",
    ) -> Resolution:
        if not namespace or not name:
            raise InvalidArgument("namespace and name are required")
        if pick is Pick.HASH and not hash_key:
            raise InvalidArgument("hash_key is required with the HASH pick policy")
        service = self._store.get_service(namespace, name)
        if service is None:
            raise NotFound(f"service {shown(namespace)}/{shown(name)} not found")
        if service.type == "ExternalName":
            raise FailedPrecondition(
                f"service {namespace}/{name} is an ExternalName service "
                f"({service.external_name}); it has no endpoints to resolve"
            )
        if service.headless:
            raise FailedPrecondition(
                f"service {namespace}/{name} is headless (no cluster IP); it cannot be proxied"
            )
        service_port, targets = self._service_targets(service, port)
        if not targets:
            raise Unavailable(f"no endpoints available for service {namespace}/{name}")
        source, last_sync = self._store.last_sync()
        picked = None
        if pick is not Pick.NONE:
            picker = self._picker((namespace, name, service_port.name, pick), targets)
            picked = picker.pick(hash_key if pick is Pick.HASH else None)
        return Resolution(
            service=service,
            targets=targets,
            picked=picked,
            version=self._store.version,
            source=source,
            last_sync=last_sync,
        )

    def _service_targets(
        self, service: Service, port: str
    ) -> tuple[ServicePort, tuple[Target, ...]]:
        """The service port and its usable targets, sorted; cached per revision."""
        key = (service.namespace, service.name, port)
        revision = self._store.service_revision(service.namespace, service.name)
        cached = self._targets.get(key)
        if cached is not None and cached[0] == revision:
            return cached[1], cached[2]
        service_port = select_port(service, port)
        targets = []
        for endpoint in self._store.endpoints_of(service.namespace, service.name):
            if not endpoint.usable:
                continue
            number = endpoint_port(endpoint, service_port)
            if number is None:
                continue
            targets.append(
                Target(endpoint.address, number, endpoint.node_name, endpoint.zone, endpoint.tunnel)
            )
        targets.sort(key=lambda t: (t.address, t.port))
        if len(self._targets) >= MAX_CACHED_PORTS and key not in self._targets:
            # Entries of deleted services would otherwise pile up forever.
            self._targets.clear()
        self._targets[key] = (revision, service_port, tuple(targets))
        return service_port, self._targets[key][2]

    def _picker(
        self, key: tuple[str, str, str, Pick], targets: tuple[Target, ...]
    ) -> Picker[Target]:
        entry = self._pickers.get(key)
        if entry is None:
            if len(self._pickers) >= MAX_PICKERS:
                # Pickers of deleted services would otherwise pile up forever;
                # starting over only resets where each rotation begins.
                self._pickers.clear()
            picker = _new_picker(key[3], self._rng)
            picker.update(targets)
            self._pickers[key] = (picker, targets)
            return picker
        picker, given = entry
        if given is not targets:
            if picker.targets != targets:
                # Only on a change: the hash ring is rebuilt here, not per call.
                picker.update(targets)
            self._pickers[key] = (picker, targets)
        return picker


# Resolve's picks by their waygate.core.balancing policy name (HASH is "source").
_PICK_POLICIES = {Pick.HASH: "source", Pick.ROUND_ROBIN: "roundrobin", Pick.RANDOM: "random"}


def _new_picker(pick: Pick, rng: random.Random) -> Picker[Target]:
    return new_picker(_PICK_POLICIES[pick], rng=rng, name=lambda t: f"{t.address}:{t.port}")
