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
- Route custom resources (waygate.io/v1, kind Route): `spec` uses the same
  field names as the routes file (host, path, to | backends, targetPort, tls,
  balance, sticky, timeouts, authProxyHeaders, forwardedHeaders); `metadata`
  gives namespace and
  name. Everything goes through `validation`, so an invalid object raises
  InvalidArgument naming the object and the field, and never reaches the store.
"""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime
from typing import Any

from waygate.core.errors import InvalidArgument, excerpt
from waygate.core.settings import parse_duration
from waygate.resolver.model import (
    HSTS,
    TIMEOUT_KEYS,
    BalancePolicy,
    Endpoint,
    EndpointPort,
    ForwardedHeadersMode,
    InsecureEdgePolicy,
    Route,
    RouteBackend,
    RouteTimeouts,
    RouteTLS,
    SameSite,
    Service,
    ServicePort,
    StickySessions,
    TLSTermination,
)
from waygate.resolver.validation import (
    shown,
    validate_endpoint,
    validate_route,
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
    """A waygate.io/v1 Route custom resource -> Route (validated)."""
    namespace, name = object_key(obj)
    what = _what("route", obj)
    spec = _mapping(obj.get("spec"), what, "spec")
    if spec.get("to") is not None and spec.get("backends") is not None:
        raise InvalidArgument(f"{what}: spec: give either 'to' or 'backends', not both")
    backends = []
    if spec.get("to") is not None:
        backends.append(RouteBackend(_text(spec, "to", what), DEFAULT_WEIGHT))
    raw_backends = spec.get("backends") or []
    if not isinstance(raw_backends, list):
        raise InvalidArgument(f"{what}: backends: must be a list")
    for index, backend in enumerate(raw_backends):
        backend = _mapping(backend, what, f"backends[{index}]")
        field = f"{what}: backends[{index}]"
        backends.append(
            RouteBackend(
                _text(backend, "service", field), _integer(backend, "weight", field, DEFAULT_WEIGHT)
            )
        )
    tls = None
    if spec.get("tls") is not None:
        tls_fields = _mapping(spec["tls"], what, "tls")
        hsts = None
        if tls_fields.get("hsts") is not None:
            hsts_fields = _mapping(tls_fields["hsts"], what, "tls.hsts")
            max_age = _duration(hsts_fields, "maxAge", f"{what}: tls.hsts")
            if max_age is None:
                raise InvalidArgument(f"{what}: tls.hsts.maxAge: is required")
            hsts = HSTS(
                max_age=max_age,
                include_subdomains=_flag(
                    hsts_fields, "includeSubdomains", f"{what}: tls.hsts", False
                ),
                preload=_flag(hsts_fields, "preload", f"{what}: tls.hsts", False),
            )
        tls = RouteTLS(
            termination=_enum(tls_fields, "termination", TLSTermination, None, f"{what}: tls"),
            certificate=_text(tls_fields, "certificate", what),
            key=_text(tls_fields, "key", what),
            ca_certificate=_text(tls_fields, "caCertificate", what),
            destination_ca_certificate=_text(tls_fields, "destinationCACertificate", what),
            insecure_edge_termination_policy=_enum(
                tls_fields,
                "insecureEdgeTerminationPolicy",
                InsecureEdgePolicy,
                InsecureEdgePolicy.NONE,
                f"{what}: tls",
            ),
            hsts=hsts,
            client_ca_certificate=_text(tls_fields, "clientCACertificate", what),
            destination_server_name=_text(tls_fields, "destinationServerName", what),
            present_client_certificate=_flag(
                tls_fields, "presentClientCertificate", f"{what}: tls", False
            ),
        )
    sticky_fields = _mapping(spec.get("sticky"), what, "sticky")
    timeout_fields = _mapping(spec.get("timeouts"), what, "timeouts")
    timeouts = RouteTimeouts(
        **{
            attr: _duration(timeout_fields, key, f"{what}: timeouts")
            for key, attr in TIMEOUT_KEYS.items()
        }
    )
    return validate_route(
        Route(
            namespace=namespace,
            name=name,
            host=_text(spec, "host", what),
            path=_text(spec, "path", what, "/") or "/",
            backends=tuple(backends),
            target_port=_text(spec, "targetPort", what),
            tls=tls,
            balance=_enum(spec, "balance", BalancePolicy, BalancePolicy.DEFAULT, what),
            sticky=StickySessions(
                disable_cookies=_flag(sticky_fields, "disableCookies", f"{what}: sticky", False),
                cookie_name=_text(sticky_fields, "cookieName", f"{what}: sticky"),
                same_site=_enum(
                    sticky_fields, "sameSite", SameSite, SameSite.LAX, f"{what}: sticky"
                ),
            ),
            timeouts=timeouts,
            auth_proxy_headers=_flag(spec, "authProxyHeaders", what, False),
            forwarded_headers=_enum(
                spec,
                "forwardedHeaders",
                ForwardedHeadersMode,
                ForwardedHeadersMode.APPEND,
                what,
            ),
            upstream_protocol=_text(spec, "upstreamProtocol", what),
            created=creation_time(obj),
        )
    )


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


def _enum(fields: JSON, key: str, enum: Any, default: Any, what: str) -> Any:
    text = _text(fields, key, what)
    if not text:
        if default is None:
            raise InvalidArgument(f"{what}.{key}: is required")
        return default
    try:
        return enum(text)
    except ValueError:
        allowed = ", ".join(member.value for member in enum if member.value)
        raise InvalidArgument(f"{what}.{key}: {excerpt(text)} is not one of {allowed}") from None


def _duration(fields: JSON, key: str, what: str) -> float | None:
    value = fields.get(key)
    if value is None:
        return None
    if isinstance(value, bool):
        raise InvalidArgument(
            f"{what}.{key}: must be a duration such as 5s, not {excerpt(repr(value))}"
        )
    if isinstance(value, int | float):
        return float(value)
    try:
        return parse_duration(str(value))
    except ValueError as exc:
        raise InvalidArgument(f"{what}.{key}: {exc}") from None
