"""Kubernetes objects (JSON as the API sends it) -> the resolver's domain model.

Sans-IO: pure functions of the decoded objects, used by `kube.KubernetesSource`.

Invariants:
- Services: `spec.type` defaults to ClusterIP; `clusterIP: None` is headless
  (no cluster IPs); a port's `targetPort` defaults to its `port`.
- EndpointSlices (discovery.k8s.io/v1): an endpoint is its first address
  (as kube-proxy does); `conditions.ready` and `serving` default to true when
  unset (the API's "unknown means ready"), `terminating` to false, and a
  terminating endpoint is never ready, whatever the slice says. Slices belong
  to the service named by their `kubernetes.io/service-name` label; a service's
  endpoints are the merge of all its slices (an address listed by several
  slices, as during a slice rebalance, appears once: ready if any slice says
  so, with the union of the ports).
- Tunnel: an endpoint is reachable only through a tunnel when its slice has
  the label `waygate.io/tunnel: "true"` (the EndpointSlice controller copies a
  Service's labels onto its slices, so labelling the Service is enough), or
  when its `nodeName` is one of the configured edge nodes.
- Route custom resources (waygate.io/v1, kind Route): `spec` is the routes
  file's route format (`waygate.resolver.schema`, which reads both), with
  unknown keys refused as the file refuses them; `metadata` gives namespace
  and name. Everything goes through `validation`, so an invalid object raises
  InvalidArgument naming the object and the field, and never reaches the store.
"""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime
from typing import Any

from waygate.core.errors import InvalidArgument, excerpt
from waygate.resolver import schema
from waygate.resolver.model import (
    Endpoint,
    EndpointPort,
    Route,
    Service,
    ServicePort,
)
from waygate.resolver.validation import (
    shown,
    validate_endpoint,
    validate_service,
)

JSON = dict[str, Any]

SERVICE_NAME_LABEL = "kubernetes.io/service-name"
TUNNEL_LABEL = "waygate.io/tunnel"
DEFAULT_WEIGHT = 100


def object_key(obj: JSON) -> tuple[str, str]:
    meta = obj.get("metadata") or {}
    return (meta.get("namespace") or "", meta.get("name") or "")


def _what(kind: str, obj: JSON) -> str:
    namespace, name = object_key(obj)
    return f"{kind} {shown(namespace)}/{shown(name)}"


def _mapping(value: Any, what: str, field: str) -> JSON:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InvalidArgument(f"{what}: {field}: must be an object")
    return value


def _text(fields: JSON, key: str, what: str, default: str = "") -> str:
    value = fields.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, str | int):
        raise InvalidArgument(f"{what}: {key}: must be a string, not {excerpt(repr(value))}")
    return str(value)


def _integer(fields: JSON, key: str, what: str, default: int) -> int:
    value = fields.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgument(f"{what}: {key}: must be an integer, not {excerpt(repr(value))}")
    return value


def _flag(fields: JSON, key: str, what: str, default: bool) -> bool:
    value = fields.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise InvalidArgument(f"{what}: {key}: must be true or false, not {excerpt(repr(value))}")
    return value


# ---------------------------------------------------------------- services


def service_from(obj: JSON) -> Service:
    """A v1 Service -> Service (validated)."""
    namespace, name = object_key(obj)
    what = _what("service", obj)
    spec = _mapping(obj.get("spec"), what, "spec")
    service_type = _text(spec, "type", what, "ClusterIP")
    cluster_ip = _text(spec, "clusterIP", what)
    cluster_ips = [str(ip) for ip in spec.get("clusterIPs") or ([cluster_ip] if cluster_ip else [])]
    headless = cluster_ip == "None" or "None" in cluster_ips
    ports = []
    for index, port in enumerate(spec.get("ports") or []):
        port = _mapping(port, what, f"ports[{index}]")
        number = _integer(port, "port", f"{what}: ports[{index}]", 0)
        ports.append(
            ServicePort(
                name=_text(port, "name", what),
                port=number,
                target_port=_text(port, "targetPort", f"{what}: ports[{index}]", str(number)),
                protocol=_text(port, "protocol", what, "TCP"),
                node_port=_integer(port, "nodePort", f"{what}: ports[{index}]", 0),
                app_protocol=_text(port, "appProtocol", f"{what}: ports[{index}]"),
            )
        )
    return validate_service(
        Service(
            namespace=namespace,
            name=name,
            type=service_type,
            cluster_ips=() if headless or service_type == "ExternalName" else tuple(cluster_ips),
            headless=headless,
            external_name=_text(spec, "externalName", what),
            ports=tuple(ports),
        )
    )


# ---------------------------------------------------------------- endpoint slices


def slice_service(obj: JSON) -> tuple[str, str] | None:
    """(namespace, service) the slice belongs to, or None for an unowned slice."""
    labels = (obj.get("metadata") or {}).get("labels") or {}
    service = labels.get(SERVICE_NAME_LABEL)
    if not service:
        return None
    return (object_key(obj)[0], service)


def endpoints_from_slice(
    obj: JSON, edge_nodes: frozenset[str] = frozenset(), problems: list[str] | None = None
) -> list[Endpoint]:
    """The valid endpoints one EndpointSlice lists.

    An invalid endpoint is left out and its reason appended to `problems`; an
    invalid slice-level field (its ports) raises InvalidArgument.
    """
    owner = slice_service(obj)
    if owner is None:
        return []
    namespace, service = owner
    what = _what("endpointslice", obj)
    labels = (obj.get("metadata") or {}).get("labels") or {}
    tunnelled_slice = str(labels.get(TUNNEL_LABEL, "")).lower() == "true"
    ports = []
    for index, port in enumerate(obj.get("ports") or []):
        port = _mapping(port, what, f"ports[{index}]")
        if port.get("port") is None:
            # A nil port means "all ports" (only for selector-less slices); nothing to dial.
            continue
        ports.append(
            EndpointPort(
                name=_text(port, "name", what),
                port=_integer(port, "port", f"{what}: ports[{index}]", 0),
                protocol=_text(port, "protocol", what, "TCP"),
            )
        )
    endpoints = []
    for index, entry in enumerate(obj.get("endpoints") or []):
        try:
            endpoints.append(
                _endpoint(
                    entry,
                    namespace,
                    service,
                    tuple(ports),
                    tunnelled_slice,
                    edge_nodes,
                    f"{what}: endpoints[{index}]",
                )
            )
        except InvalidArgument as exc:
            if problems is None:
                raise
            problems.append(str(exc))
    return endpoints


def _endpoint(
    entry: Any,
    namespace: str,
    service: str,
    ports: tuple[EndpointPort, ...],
    tunnelled_slice: bool,
    edge_nodes: frozenset[str],
    what: str,
) -> Endpoint:
    entry = _mapping(entry, what, "endpoint")
    addresses = entry.get("addresses") or []
    if not addresses:
        raise InvalidArgument(f"{what}: addresses: is required")
    conditions = _mapping(entry.get("conditions"), what, "conditions")
    ready = _flag(conditions, "ready", what, True)
    serving = _flag(conditions, "serving", what, ready)
    terminating = _flag(conditions, "terminating", what, False)
    node_name = _text(entry, "nodeName", what)
    return validate_endpoint(
        Endpoint(
            namespace=namespace,
            service=service,
            address=str(addresses[0]),
            ports=ports,
            ready=ready and not terminating,
            serving=serving,
            terminating=terminating,
            zone=_text(entry, "zone", what),
            node_name=node_name,
            # Validation refuses a tunnel endpoint without a node: it could not be dialled.
            tunnel=tunnelled_slice or (bool(node_name) and node_name in edge_nodes),
            hostname=_text(entry, "hostname", what),
        )
    )


def merge_endpoints(groups: list[list[Endpoint]]) -> list[Endpoint]:
    """One service's endpoints from all its slices, one per address."""
    merged: dict[str, Endpoint] = {}
    for group in groups:
        for endpoint in group:
            seen = merged.get(endpoint.address)
            if seen is None:
                merged[endpoint.address] = endpoint
                continue
            preferred = endpoint if endpoint.usable and not seen.usable else seen
            ports = {(p.name, p.port, p.protocol): p for p in (*seen.ports, *endpoint.ports)}
            merged[endpoint.address] = dataclasses.replace(
                preferred, ports=tuple(sorted(ports.values(), key=lambda p: (p.name, p.port)))
            )
    return sorted(merged.values(), key=lambda e: e.address)


# ---------------------------------------------------------------- routes


def route_from(obj: JSON) -> Route:
    """A waygate.io/v1 Route custom resource -> Route (validated).

    Read through the Route schema, as the routes file is: an unknown key, a
    wrong type or a value over its bound raises a `schema.SchemaError` whose
    `where` is the path from the object's root (for a manifest's line).
    """
    namespace, name = object_key(obj)
    what = _what("route", obj)
    spec = obj.get("spec")
    if not isinstance(spec, dict):
        raise schema.SchemaError(what, ("spec",), spec, "must be an object")
    try:
        return schema.read_route(
            schema.JsonTree(), spec, identity=(namespace, name), created=creation_time(obj)
        )
    except schema.SchemaError as exc:
        raise schema.SchemaError(
            what, ("spec", *exc.where), exc.node, exc.reason, ("spec", *exc.at)
        ) from None
    except InvalidArgument as exc:
        # validation's: its attribute path as the path of keys in the object.
        field = getattr(exc, "field", None)
        exc.at = ("spec", *schema.key_path(field)) if field else ("spec",)  # type: ignore[attr-defined]
        raise


def creation_time(obj: JSON) -> datetime | None:
    """metadata.creationTimestamp (RFC 3339, "Z"), which decides a route's age for
    host claims; None when absent or unreadable (the resolver's first sight decides)."""
    raw = (obj.get("metadata") or {}).get("creationTimestamp")
    if not isinstance(raw, str):
        return None
    try:
        parsed = datetime.fromisoformat(raw.replace("Z", "+00:00"))
    except ValueError:
        return None
    return parsed if parsed.tzinfo is not None else parsed.replace(tzinfo=UTC)
