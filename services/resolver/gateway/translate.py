"""Gateway API and Ingress objects -> the resolver's routes, and every object's status.

Sans-IO and pure: `translate(objects)` is a function of one consistent set of
objects (from a manifests file or from the Kubernetes reflectors: both call it,
so there is one way an object becomes Waygate's model). It answers the routes
the proxy serves and the status each object should carry.

Semantics (the Gateway API specification v1.x and its conformance suite):
- GatewayClasses whose `controllerName` is `waygate.io/gateway-controller`
  are Waygate's; Gateways of other classes, and routes only attached to them,
  are left alone (no status written for them).
- Listeners: HTTP, HTTPS (TLS terminated with certificateRefs Secrets of type
  kubernetes.io/tls) and TLS (mode Passthrough). Listeners of one Gateway on
  one port with different protocols conflict (ProtocolConflict), with the same
  protocol and hostname too (HostnameConflict); conflicted listeners attach
  nothing. A proxy serving every Gateway merges them by port and hostname, so
  across Gateways (`sharing`): listeners of one port with clashing protocols,
  and HTTPS listeners of one hostname with different certificates, conflict;
  with "exclusive" so do listeners of one port, protocol and hostname; with
  "separate" (each proxy serves one Gateway) nothing does. The older Gateway
  (creationTimestamp, then namespace/name) keeps the port and the younger
  one's listener is Conflicted (ProtocolConflict, HostnameConflict).
- A route attaches to a listener when its parentRef names the Gateway (and
  the listener by sectionName and/or port, when given), the listener allows
  the route's namespace (Same, All, Selector) and kind, and their hostnames
  intersect. Otherwise its parent status says why: NoMatchingParent,
  NotAllowedByListeners, NoMatchingListenerHostname.
- backendRefs: kind Service only (InvalidKind), cross-namespace only with a
  ReferenceGrant (RefNotPermitted), the Service and port must exist
  (BackendNotFound). An unusable backend keeps its weight and is marked
  invalid: its share of requests is answered 500.
- Hostnames: "*.example.com" matches any number of labels in front; the
  effective host of a route on a listener is the more specific of the two.
- BackendTLSPolicy (v1): a policy targeting a Service (and port, by
  sectionName) turns the rules whose backends use it into reencrypt routes:
  the CA from its ConfigMaps' `ca.crt` (or the system's, for
  wellKnownCACertificates System), its hostname as the SNI and name verified,
  or its subjectAltNames. A policy whose CA cannot be used still applies: its
  backends answer 500 with the reason (never plaintext to a TLS backend). Of
  two policies on the same Service and sectionName the older wins (Conflicted).
  The backends of one rule must agree on their policy (Waygate's route has
  one upstream TLS setting); one that does not is marked invalid and says so.
  Status: per Gateway whose routes use it (`ancestors`), Accepted and
  ResolvedRefs with the spec's reasons.
- Ingress: IngressClass with controller `waygate.io/ingress-controller`
  (or no class and a default class of ours); Prefix and ImplementationSpecific
  are PathPrefix, Exact is Exact; hosts in `tls` are also served on 443 with
  the Secret's certificate. With `ingress_nginx`, also the Ingresses
  ingress-nginx would serve, their annotations as route fields
  (waygate.resolver.ingress_nginx); one refused is refused alone. An Ingress of
  Waygate's class with annotations of that prefix is judged the same way.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from waygate.core.errors import InvalidArgument
from waygate.resolver.gateway import spec as specs
from waygate.resolver.gateway.spec import (
    CONTROLLER_NAME,
    GATEWAY_GROUP,
    INGRESS_CONTROLLER,
    JSON,
    BackendRef,
    ListenerSpec,
    ParentRef,
    RouteSpec,
    SpecError,
)
from waygate.resolver.ingress_nginx import annotations as nginx_annotations
from waygate.resolver.ingress_nginx import config as nginx_compat
from waygate.resolver.ingress_nginx import tcpservices as nginx_tcp
from waygate.resolver.model import (
    HostClaim,
    InsecureEdgePolicy,
    PathMatchType,
    Route,
    RouteBackend,
    RouteMatch,
    RouteTLS,
    Service,
    StickySessions,
    TLSTermination,
)
from waygate.resolver.validation import validate_tls

log = logging.getLogger(__name__)

Key = tuple[str, str]
#: One rule of one route: (kind, namespace, name, rule index); stable across a
#: translation, unlike id() of a RuleSpec (reused once the object is freed).
_RuleKey = tuple[str, str, str, int]

#: The kinds this module reads, by the name `kind` has in a manifest.
GATEWAY_KINDS = (
    "GatewayClass",
    "Gateway",
    "HTTPRoute",
    "GRPCRoute",
    "TLSRoute",
    "ReferenceGrant",
    "IngressClass",
    "Ingress",
    "BackendTLSPolicy",
)
ROUTE_KINDS = ("HTTPRoute", "GRPCRoute", "TLSRoute")
#: The kinds that carry a status of Waygate's (written in Kubernetes, listed by
#: `waygate gateways`).
STATUS_KINDS = (
    "GatewayClass",
    "Gateway",
    *ROUTE_KINDS,
    "Ingress",
    "BackendTLSPolicy",
)
#: How listeners of different Gateways on one port are judged (see `translate`).
LISTENER_SHARING = ("share", "exclusive", "separate")
_DEFAULT_KINDS = {
    "HTTP": ("HTTPRoute", "GRPCRoute"),
    "HTTPS": ("HTTPRoute", "GRPCRoute"),
    "TLS": ("TLSRoute",),
}
# The proxy's weights are 0..256 (smooth weighted round robin); the Gateway
# API allows up to 1,000,000: larger sets are scaled down proportionally.
MAX_WEIGHT = 256
# What one object, and one source (a manifests load, a cluster's objects), may add to
# every proxy's routing table, in entries (each match of each route): the CRDs bound
# one object's lists, not what they multiply to over hostnames and listeners.
MAX_ENTRIES_PER_OBJECT = 4096
MAX_ENTRIES_PER_SOURCE = 50_000


@dataclass
class Objects:
    """One consistent set of the objects a translation reads."""

    namespaces: dict[str, JSON] = field(default_factory=dict)
    services: Mapping[Key, Service] = field(default_factory=dict)
    secrets: dict[Key, JSON] = field(default_factory=dict)
    # kind -> (namespace, name) -> object; cluster-scoped kinds use namespace "".
    kinds: dict[str, dict[Key, JSON]] = field(default_factory=dict)

    def of(self, kind: str) -> dict[Key, JSON]:
        if kind == "Secret":
            return self.secrets
        return self.kinds.setdefault(kind, {})


@dataclass(frozen=True)
class ObjectStatus:
    """The status one object should carry (its `status` as the API spells it)."""

    kind: str
    namespace: str
    name: str
    generation: int
    status: JSON
    # A Gateway's listeners by name -> port (where proxies' listener reports apply).
    listener_ports: tuple[tuple[str, int], ...] = ()

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.kind, self.namespace, self.name)


@dataclass(frozen=True)
class Rejected:
    """An object its schema refuses: skipped, its status saying why."""

    kind: str
    namespace: str
    name: str
    error: SpecError


@dataclass(frozen=True)
class Ignored:
    """An object of a class that is not Waygate's (a Gateway, an Ingress, a route
    attached to no Gateway of Waygate's): not served, no status written (another
    controller owns it); listed by `waygate gateways` and `waygate check`."""

    kind: str
    namespace: str
    name: str
    reason: str


# Objects already logged as ignored, with the reason: once per process and reason
# (up to this many remembered; past it, each is logged once more).
MAX_IGNORED_LOGGED = 10_000
_IGNORED_LOGGED: set[tuple[str, Key, str]] = set()


def _ignored_reason(class_name: str, has_default: bool) -> str:
    if class_name:
        return (
            f"its class {class_name!r} is not an IngressClass with controller {INGRESS_CONTROLLER}"
        )
    if has_default:
        return "no ingressClassName"  # unreachable: the default class applies
    return (
        "no ingressClassName and no IngressClass of controller "
        f"{INGRESS_CONTROLLER} is marked ingressclass.kubernetes.io/is-default-class"
    )


def _log_ignored_once(item: Ignored) -> None:
    seen = (item.kind, (item.namespace, item.name), item.reason)
    if seen in _IGNORED_LOGGED:
        return
    if len(_IGNORED_LOGGED) >= MAX_IGNORED_LOGGED:
        _IGNORED_LOGGED.clear()  # bounded: objects deleted long ago are forgotten
    _IGNORED_LOGGED.add(seen)
    log.info("%s %s/%s ignored: %s", item.kind, item.namespace, item.name, item.reason)


@dataclass
class Translation:
    routes: list[Route] = field(default_factory=list)
    statuses: list[ObjectStatus] = field(default_factory=list)
    rejected: list[Rejected] = field(default_factory=list)
    ignored: list[Ignored] = field(default_factory=list)
    # Usable listeners' hostnames, each a claim on its host for the Gateway's
    # namespace (waygate.resolver.status), routes attached or not.
    claims: list[tuple[str, HostClaim]] = field(default_factory=list)


def condition(kind: str, ok: bool, reason: str, message: str, generation: int) -> JSON:
    """One metav1.Condition (lastTransitionTime is set when it is recorded)."""
    return {
        "type": kind,
        "status": "True" if ok else "False",
        "reason": reason,
        "message": message,
        "observedGeneration": generation,
    }


# ---------------------------------------------------------------- BackendTLSPolicy


@dataclass
class _Policy:
    """One BackendTLSPolicy as translated: what it asks for, or why it cannot serve."""

    key: Key
    generation: int
    spec: specs.BackendTLSPolicySpec
    ca_pem: str = ""
    # Set: its backends cannot be reached as it asks (answered 500 with this).
    problem: str = ""
    conditions: list[JSON] = field(default_factory=list)
    # Gateways whose routes use it (its status.ancestors), in order of first use.
    ancestors: dict[Key, None] = field(default_factory=dict)
    # Younger policies on the same targets (Conflicted): they report the same
    # ancestors, so their status says why they are not used.
    shadowed: list[_Policy] = field(default_factory=list)

    def upstream(self, listener_tls: RouteTLS | None) -> RouteTLS:
        """The reencrypt settings of a route on a listener (`listener_tls`: HTTPS's)."""
        spec = self.spec
        fields: dict[str, Any] = {
            "termination": TLSTermination.REENCRYPT,
            "destination_ca_certificate": self.ca_pem,
            "destination_server_name": spec.hostname,
            "destination_system_ca": not self.ca_pem,
            "destination_san_hostnames": spec.san_hostnames,
            "destination_san_uris": spec.san_uris,
        }
        if listener_tls is None:
            # An HTTP listener: served on the plain port, TLS only to the backend.
            return RouteTLS(insecure_edge_termination_policy=InsecureEdgePolicy.ALLOW, **fields)
        return dataclasses.replace(listener_tls, **fields)


def _ca_bundle(value: Any) -> str:
    """The PEM certificates of a ConfigMap's ca.crt ("" : none that parse)."""
    from cryptography import x509

    if not isinstance(value, str) or "-----BEGIN CERTIFICATE-----" not in value:
        return ""
    try:
        x509.load_pem_x509_certificates(value.encode())
    except ValueError:
        return ""
    return value.strip() + "\n"


# ---------------------------------------------------------------- listeners


@dataclass
class Listener:
    gateway: Key
    spec: ListenerSpec
    kinds: tuple[str, ...]
    tls: RouteTLS | None
    conditions: list[JSON]
    usable: bool
    attached: int = 0


def _hostname_intersection(listener: str, route_hosts: tuple[str, ...]) -> list[str]:
    """Effective hosts of a route on a listener ("" : any host); empty: none intersect."""
    if not route_hosts:
        return [listener]
    if not listener:
        return list(route_hosts)
    out = []
    for host in route_hosts:
        if host == listener or (listener.startswith("*.") and _under(host, listener[1:])):
            out.append(host)
        elif host.startswith("*.") and _under(listener, host[1:]):
            out.append(listener)
    return out


def _under(host: str, suffix: str) -> bool:
    """`host` (maybe a wildcard itself) lies under `.suffix` by at least one label."""
    name = host[2:] if host.startswith("*.") else host
    if host.startswith("*."):
        # "*.a.b" lies under "*.b"; "*.b" under "*.b" too (equal wildcards).
        return ("." + name).endswith(suffix)
    return name.endswith(suffix) and len(name) > len(suffix)


def _selector_matches(selector: JSON, found: Mapping[str, str]) -> bool:
    for key, value in (selector.get("matchLabels") or {}).items():
        if found.get(str(key)) != str(value):
            return False
    for expression in selector.get("matchExpressions") or []:
        key = str(expression.get("key", ""))
        operator = expression.get("operator")
        values = [str(v) for v in expression.get("values") or []]
        if operator == "In" and found.get(key) not in values:
            return False
        if operator == "NotIn" and found.get(key) in values:
            return False
        if operator == "Exists" and key not in found:
            return False
        if operator == "DoesNotExist" and key in found:
            return False
    return True


class _Translator:
    def __init__(
        self,
        objects: Objects,
        addresses: tuple[str, ...],
        sharing: str,
        ingress_nginx: nginx_compat.IngressNginx | None = None,
    ) -> None:
        self.objects = objects
        self.ingress_nginx = ingress_nginx
        self.addresses = addresses
        if sharing not in LISTENER_SHARING:
            raise ValueError(f"listener sharing {sharing!r} is not one of {LISTENER_SHARING}")
        self.sharing = sharing
        self.out = Translation()
        self.grants: list[specs.Grant] = []
        # Gateway key -> its listeners (only Gateways of Waygate's classes).
        self.listeners: dict[Key, list[Listener]] = {}
        self.gateway_status: dict[Key, JSON] = {}
        # A rule's filters with its mirrors' ports resolved, by its _RuleKey.
        self.mirrors: dict[_RuleKey, Any] = {}
        # BackendTLSPolicies by (namespace, service, sectionName); a rule's policy
        # (by its _RuleKey), and every policy by its key.
        self.policy_by_target: dict[tuple[str, str, str], _Policy] = {}
        self.rule_policy: dict[_RuleKey, _Policy] = {}
        self.policies: dict[Key, _Policy] = {}
        # Route entries (routes times matches) translated so far: the source's budget.
        self.entries = 0

    # ------------------------------------------------------------ helpers

    def reject(self, kind: str, key: Key, obj: JSON, error: SpecError) -> None:
        self.out.rejected.append(Rejected(kind, key[0], key[1], error))

    def granted(
        self, from_: tuple[str, str, str], to: tuple[str, str, str], namespace: str
    ) -> bool:
        group, kind, name = to
        for grant in self.grants:
            if grant.namespace != namespace or from_ not in grant.from_:
                continue
            for to_group, to_kind, to_name in grant.to:
                if to_group == group and to_kind == kind and to_name in ("", name):
                    return True
        return False

    def secret_tls(self, namespace: str, name: str, what: str) -> tuple[RouteTLS | None, str]:
        secret = self.objects.secrets.get((namespace, name))
        if secret is None:
            return None, f"Secret {namespace}/{name} does not exist"
        if secret.get("type", "kubernetes.io/tls") != "kubernetes.io/tls":
            return None, f"Secret {namespace}/{name} is not of type kubernetes.io/tls"
        data = secret.get("data") or {}
        string_data = secret.get("stringData") or {}
        try:
            cert = _secret_value(data, string_data, "tls.crt")
            key = _secret_value(data, string_data, "tls.key")
        except ValueError as exc:
            return None, f"Secret {namespace}/{name}: {exc}"
        try:
            tls = validate_tls(RouteTLS(TLSTermination.EDGE, cert, key), what)
        except InvalidArgument as exc:
            return None, f"Secret {namespace}/{name}: {exc}"
        return tls, ""

    def ignore(self, kind: str, key: Key, reason: str) -> None:
        item = Ignored(kind, key[0], key[1], reason)
        self.out.ignored.append(item)
        _log_ignored_once(item)

    # ------------------------------------------------------------ classes and gateways

    def classes(self) -> set[str]:
        ours = set()
        for key, obj in sorted(self.objects.of("GatewayClass").items()):
            spec = obj.get("spec") or {}
            if spec.get("controllerName") != CONTROLLER_NAME:
                continue
            ours.add(key[1])
            generation = specs.generation(obj)
            self.out.statuses.append(
                ObjectStatus(
                    "GatewayClass",
                    "",
                    key[1],
                    generation,
                    {
                        "conditions": [
                            condition(
                                "Accepted", True, "Accepted", "Waygate serves it", generation
                            ),
                            condition(
                                "SupportedVersion",
                                True,
                                "SupportedVersion",
                                "Gateway API v1",
                                generation,
                            ),
                        ]
                    },
                )
            )
        return ours

    def gateways(self, ours: set[str]) -> None:
        for key, obj in sorted(self.objects.of("Gateway").items()):
            class_name = str((obj.get("spec") or {}).get("gatewayClassName", ""))
            if class_name not in ours:
                self.ignore(
                    "Gateway",
                    key,
                    f"its gatewayClassName {class_name!r} is not a GatewayClass of "
                    f"controller {CONTROLLER_NAME}",
                )
                continue
            generation = specs.generation(obj)
            try:
                _, listener_specs = specs.gateway_listeners(obj)
            except SpecError as exc:
                self.reject("Gateway", key, obj, exc)
                self.gateway_status[key] = {
                    "conditions": [
                        condition("Accepted", False, "Invalid", str(exc), generation),
                        condition("Programmed", False, "Invalid", str(exc), generation),
                    ],
                    "listeners": [],
                }
                continue
            listeners = [self.listener(key, item, generation) for item in listener_specs]
            self.conflicts(listeners, generation)
            self.listeners[key] = listeners
        if self.sharing != "separate":
            self.cross_gateway_conflicts()
        for key, listeners in self.listeners.items():
            generation = specs.generation(self.objects.of("Gateway")[key])
            usable = any(listener.usable for listener in listeners)
            message = "" if usable else "no listener is valid"
            self.gateway_status[key] = {
                "conditions": [
                    condition(
                        "Accepted",
                        usable,
                        "Accepted" if usable else "ListenersNotValid",
                        message or "Waygate serves it",
                        generation,
                    ),
                    condition(
                        "Programmed",
                        usable,
                        "Programmed" if usable else "Invalid",
                        message or "sent to the proxies",
                        generation,
                    ),
                ],
            }
            if self.addresses:
                self.gateway_status[key]["addresses"] = [
                    {"type": _address_type(a), "value": a} for a in self.addresses
                ]

    def listener(self, gateway: Key, item: ListenerSpec, generation: int) -> Listener:
        def conditions(accepted: tuple[bool, str, str], refs: tuple[bool, str, str]) -> list[JSON]:
            ok = accepted[0] and refs[0]
            return [
                condition("Accepted", *accepted, generation),
                condition("ResolvedRefs", *refs, generation),
                condition(
                    "Programmed",
                    ok,
                    "Programmed" if ok else "Invalid",
                    "sent to the proxies" if ok else "the listener is not valid",
                    generation,
                ),
                condition("Conflicted", False, "NoConflicts", "", generation),
            ]

        protocol = item.protocol
        defaults = _DEFAULT_KINDS.get(protocol)
        if defaults is None or (protocol == "TLS" and item.tls_mode != "Passthrough"):
            why = f"protocol {protocol} is not supported (HTTP, HTTPS, TLS with mode Passthrough)"
            return Listener(
                gateway,
                item,
                (),
                None,
                conditions((False, "UnsupportedProtocol", why), (True, "ResolvedRefs", "")),
                False,
            )
        kinds: tuple[str, ...] = defaults
        refs_ok: tuple[bool, str, str] = (True, "ResolvedRefs", "")
        if item.kinds:
            wanted = [k.kind for k in item.kinds if k.group == GATEWAY_GROUP and k.kind in defaults]
            kinds = tuple(dict.fromkeys(wanted))
            if len(kinds) != len(item.kinds):
                bad = [
                    f"{k.group}/{k.kind}"
                    for k in item.kinds
                    if not (k.group == GATEWAY_GROUP and k.kind in defaults)
                ]
                refs_ok = (
                    False,
                    "InvalidRouteKinds",
                    f"route kinds {', '.join(bad)} cannot attach to a {protocol} listener",
                )
        tls = None
        if protocol == "HTTPS":
            if item.tls_mode == "Passthrough":
                why = "HTTPS listeners terminate TLS; use protocol TLS for Passthrough"
                return Listener(
                    gateway,
                    item,
                    kinds,
                    None,
                    conditions((False, "UnsupportedProtocol", why), refs_ok),
                    False,
                )
            tls, problem, reason = self.listener_certificate(gateway, item)
            if tls is None:
                refs_ok = (False, reason, problem)
        usable = refs_ok[0] or (refs_ok[1] == "InvalidRouteKinds" and bool(kinds))
        listener = Listener(
            gateway,
            item,
            kinds,
            tls,
            conditions((True, "Accepted", ""), refs_ok),
            usable,
        )
        if usable and not refs_ok[0]:
            # Some kinds are invalid but others remain: it serves those.
            listener.conditions[2] = condition(
                "Programmed", True, "Programmed", "sent to the proxies", generation
            )
        return listener

    def listener_certificate(
        self, gateway: Key, item: ListenerSpec
    ) -> tuple[RouteTLS | None, str, str]:
        if not item.certificate_refs:
            return None, "an HTTPS listener needs tls.certificateRefs", "InvalidCertificateRef"
        ref = item.certificate_refs[0]
        if ref.group not in ("", "core") or ref.kind != "Secret":
            return None, f"{ref.group}/{ref.kind} is not a Secret", "InvalidCertificateRef"
        if ref.namespace != gateway[0] and not self.granted(
            (GATEWAY_GROUP, "Gateway", gateway[0]), ("", "Secret", ref.name), ref.namespace
        ):
            return (
                None,
                f"no ReferenceGrant in {ref.namespace} allows Gateways of {gateway[0]} "
                f"to use Secret {ref.name}",
                "RefNotPermitted",
            )
        tls, problem = self.secret_tls(
            ref.namespace, ref.name, f"Gateway {gateway[0]}/{gateway[1]} listener {item.name}"
        )
        return tls, problem, "InvalidCertificateRef"

    def conflicts(self, listeners: list[Listener], generation: int) -> None:
        by_port: dict[int, list[Listener]] = {}
        for listener in listeners:
            by_port.setdefault(listener.spec.port, []).append(listener)
        for group in by_port.values():
            protocols = {listener.spec.protocol for listener in group}
            for listener in group:
                reason = ""
                if len(protocols) > 1 and not protocols <= {"HTTPS", "TLS"}:
                    reason = "ProtocolConflict"
                elif any(
                    other is not listener
                    and other.spec.hostname == listener.spec.hostname
                    and other.spec.protocol == listener.spec.protocol
                    for other in group
                ):
                    reason = "HostnameConflict"
                if reason:
                    self.conflicted(
                        listener,
                        reason,
                        f"another listener on port {listener.spec.port} conflicts with it",
                        generation,
                    )

    def cross_gateway_conflicts(self) -> None:
        """Listeners of different Gateways that one proxy would serve on the same port
        (proxies merge every Gateway by port and hostname): the older Gateway's listener
        keeps the port, the younger one is Conflicted, as within one Gateway."""
        gateways = self.objects.of("Gateway")

        def age(key: Key) -> tuple[float, Key]:
            created = specs.created(gateways[key])
            return (created.timestamp() if created is not None else 0.0, key)

        claimed: dict[int, list[Listener]] = {}
        for key in sorted(self.listeners, key=age):
            mine = self.listeners[key]
            generation = specs.generation(gateways[key])
            for listener in mine:
                if not listener.usable:
                    continue
                for other in claimed.get(listener.spec.port, ()):
                    protocols = {listener.spec.protocol, other.spec.protocol}
                    same_host = (
                        other.spec.protocol == listener.spec.protocol
                        and other.spec.hostname == listener.spec.hostname
                    )
                    what = f"hostname {other.spec.hostname or '(any)'}"
                    if len(protocols) > 1 and not protocols <= {"HTTPS", "TLS"}:
                        reason = "ProtocolConflict"
                        what = f"protocol {other.spec.protocol}"
                    elif same_host and self.sharing == "exclusive":
                        reason = "HostnameConflict"
                    elif (
                        same_host
                        and listener.spec.protocol == "HTTPS"
                        and other.spec.certificate_refs != listener.spec.certificate_refs
                    ):
                        # One name, two certificates: a proxy can present only one.
                        reason = "HostnameConflict"
                        what += " and another certificate"
                    else:
                        continue
                    self.conflicted(
                        listener,
                        reason,
                        f"listener {other.spec.name} of the older Gateway "
                        f"{other.gateway[0]}/{other.gateway[1]} has port "
                        f"{listener.spec.port} with {what} (proxies merge Gateways by port)",
                        generation,
                    )
                    break
            for listener in mine:
                if listener.usable:
                    claimed.setdefault(listener.spec.port, []).append(listener)

    def conflicted(self, listener: Listener, reason: str, message: str, generation: int) -> None:
        listener.usable = False
        listener.conditions[2] = condition(
            "Programmed", False, "Invalid", "the listener conflicts", generation
        )
        listener.conditions[3] = condition("Conflicted", True, reason, message, generation)

    # ------------------------------------------------------------ routes

    def routes(self) -> None:
        for kind in ROUTE_KINDS:
            parse = {
                "HTTPRoute": specs.http_route,
                "GRPCRoute": specs.grpc_route,
                "TLSRoute": specs.tls_route,
            }[kind]
            for key, obj in sorted(self.objects.of(kind).items()):
                generation = specs.generation(obj)
                try:
                    route = parse(obj)
                except SpecError as exc:
                    self.reject(kind, key, obj, exc)
                    self.invalid_route_status(kind, key, obj, generation, str(exc))
                    continue
                self.route(kind, key, obj, route, generation)

    def invalid_route_status(
        self, kind: str, key: Key, obj: JSON, generation: int, message: str
    ) -> None:
        try:
            parents = specs.parent_refs(obj, key[0])
        except SpecError:
            parents = ()
        statuses = [
            {
                "parentRef": parent.as_status(),
                "controllerName": CONTROLLER_NAME,
                "conditions": [
                    condition("Accepted", False, "UnsupportedValue", message, generation),
                    condition("ResolvedRefs", False, "UnsupportedValue", message, generation),
                ],
            }
            for parent in parents
            if self.ours(parent)
        ]
        if statuses:
            self.out.statuses.append(
                ObjectStatus(kind, key[0], key[1], generation, {"parents": statuses})
            )

    def ours(self, parent: ParentRef) -> bool:
        return (
            parent.group == GATEWAY_GROUP
            and parent.kind == "Gateway"
            and (parent.namespace, parent.name) in self.gateway_status
        )

    def route(self, kind: str, key: Key, obj: JSON, route: RouteSpec, generation: int) -> None:
        if not any(self.ours(parent) for parent in route.parents):
            parents = ", ".join(f"{p.namespace}/{p.name}" for p in route.parents) or "none"
            self.ignore(
                kind,
                key,
                f"none of its parentRefs ({parents}) is a Gateway of a GatewayClass of "
                f"controller {CONTROLLER_NAME}",
            )
        backends, refs_problem = self.backends(kind, key, route)
        parents_status = []
        made: dict[str, Route] = {}
        attached_to: list[Listener] = []
        for parent in route.parents:
            if not self.ours(parent):
                continue
            gateway = (parent.namespace, parent.name)
            attached, accepted = self.attach(kind, key, route, parent, gateway)
            conditions = [condition("Accepted", *accepted, generation)]
            if refs_problem is None:
                conditions.append(condition("ResolvedRefs", True, "ResolvedRefs", "", generation))
            else:
                conditions.append(condition("ResolvedRefs", False, *refs_problem, generation))
            parents_status.append(
                {
                    "parentRef": parent.as_status(),
                    "controllerName": CONTROLLER_NAME,
                    "conditions": conditions,
                }
            )
            for listener, hosts in attached:
                attached_to.append(listener)
                for route_out in self.make_routes(
                    kind, key, obj, route, backends, gateway, listener, hosts
                ):
                    made.setdefault(route_out.name, route_out)
        problem = self.over_budget(made.values())
        if problem is not None:
            for listener in attached_to:
                listener.attached -= 1  # refused: attached to nothing after all
            self.reject(kind, key, obj, SpecError(("spec",), problem))
            self.invalid_route_status(kind, key, obj, generation, problem)
            return
        self.out.routes.extend(made.values())
        if parents_status:
            self.out.statuses.append(
                ObjectStatus(kind, key[0], key[1], generation, {"parents": parents_status})
            )

    def over_budget(self, routes: Iterable[Route]) -> str | None:
        """Why one object's routes do not fit (None: they do, and are counted): each
        match of each route is an entry of every proxy's routing table."""
        cost = sum(max(1, len(route.matches)) for route in routes)
        if cost > MAX_ENTRIES_PER_OBJECT:
            return (
                f"amounts to {cost:,} route entries (routes times matches, over its "
                f"hostnames and listeners); at most {MAX_ENTRIES_PER_OBJECT:,} per object"
            )
        if self.entries + cost > MAX_ENTRIES_PER_SOURCE:
            return (
                f"its {cost:,} route entries would take this source past "
                f"{MAX_ENTRIES_PER_SOURCE:,} (the objects before it hold {self.entries:,})"
            )
        self.entries += cost
        return None

    def attach(
        self, kind: str, key: Key, route: RouteSpec, parent: ParentRef, gateway: Key
    ) -> tuple[list[tuple[Listener, list[str]]], tuple[bool, str, str]]:
        listeners = self.listeners.get(gateway, [])
        candidates = [
            listener
            for listener in listeners
            if (not parent.section_name or listener.spec.name == parent.section_name)
            and (not parent.port or listener.spec.port == parent.port)
        ]
        if not candidates:
            what = " ".join(
                part
                for part in (
                    f"sectionName {parent.section_name}" if parent.section_name else "",
                    f"port {parent.port}" if parent.port else "",
                )
                if part
            )
            return [], (False, "NoMatchingParent", f"the Gateway has no listener with {what}")
        allowed = [
            listener
            for listener in candidates
            if listener.usable and kind in listener.kinds and self.allows(listener, key[0])
        ]
        if not allowed:
            return [], (
                False,
                "NotAllowedByListeners",
                f"no listener of Gateway {gateway[0]}/{gateway[1]} allows {kind}s "
                f"from namespace {key[0]}",
            )
        attached = []
        for listener in allowed:
            hosts = _hostname_intersection(listener.spec.hostname, route.hostnames)
            if hosts:
                attached.append((listener, hosts))
                listener.attached += 1
        if not attached:
            return [], (
                False,
                "NoMatchingListenerHostname",
                "no hostname of the route intersects a listener's hostname",
            )
        return attached, (True, "Accepted", "")

    def allows(self, listener: Listener, namespace: str) -> bool:
        rule = listener.spec.namespaces_from
        if rule == "All":
            return True
        if rule == "Same":
            return namespace == listener.gateway[0]
        found = specs.labels(self.objects.namespaces.get(namespace, {}))
        found.setdefault("kubernetes.io/metadata.name", namespace)
        return _selector_matches(listener.spec.selector, found)

    def backends(
        self, kind: str, key: Key, route: RouteSpec
    ) -> tuple[list[list[RouteBackend]], tuple[str, str] | None]:
        """Per rule, its RouteBackends; and the first problem (reason, message)."""
        namespace = key[0]
        problem: tuple[str, str] | None = None
        per_rule: list[list[RouteBackend]] = []
        for index, rule in enumerate(route.rules):
            rule_key = (kind, key[0], key[1], index)
            out = []
            chosen: list[_Policy | None] = []
            for ref in rule.backends:
                backend, issue = self.backend(kind, namespace, ref)
                if issue is None and kind != "TLSRoute":
                    backend, policy = self.backend_policy(backend, ref, chosen)
                    if policy is not None:
                        self.rule_policy[rule_key] = policy
                out.append(backend)
                if issue is not None and problem is None:
                    problem = issue
            mirrors = []
            for ref in rule.mirror_refs:
                mirror, issue = self.backend(kind, namespace, ref)
                if issue is not None and problem is None:
                    problem = issue
                if issue is None and self.policy_for(ref) is not None:
                    # Mirrors are sent in clear: never to a backend that asks for TLS.
                    mirror = dataclasses.replace(mirror, invalid="it has a BackendTLSPolicy")
                mirrors.append(mirror)
            if rule.filters is not None and rule.filters.mirrors:
                # The mirrors' ports as the backends' are (the name the EndpointSlices
                # use); a mirror that cannot be used is left out.
                self.mirrors[rule_key] = dataclasses.replace(
                    rule.filters,
                    mirrors=tuple(
                        dataclasses.replace(m, port=resolved.port)
                        for m, resolved in zip(rule.filters.mirrors, mirrors, strict=True)
                        if not resolved.invalid
                    ),
                )
            per_rule.append(_scaled(out))
        return per_rule, problem

    def backend(
        self, kind: str, namespace: str, ref: BackendRef
    ) -> tuple[RouteBackend, tuple[str, str] | None]:
        def invalid(reason: str, message: str) -> tuple[RouteBackend, tuple[str, str]]:
            return (
                RouteBackend(ref.name, ref.weight, ref.namespace, str(ref.port or ""), message),
                (reason, message),
            )

        if ref.group not in ("", "core") or ref.kind != "Service":
            return invalid("InvalidKind", f"backend kind {ref.group}/{ref.kind} is not supported")
        if ref.namespace != namespace and not self.granted(
            (GATEWAY_GROUP, kind, namespace), ("", "Service", ref.name), ref.namespace
        ):
            return invalid(
                "RefNotPermitted",
                f"no ReferenceGrant in {ref.namespace} allows {kind}s of {namespace} "
                f"to use Service {ref.name}",
            )
        service = self.objects.services.get((ref.namespace, ref.name))
        if service is None:
            return invalid("BackendNotFound", f"Service {ref.namespace}/{ref.name} does not exist")
        port = next((p for p in service.ports if p.port == ref.port), None)
        if port is None:
            return invalid(
                "BackendNotFound", f"Service {ref.namespace}/{ref.name} has no port {ref.port}"
            )
        return RouteBackend(
            ref.name, ref.weight, ref.namespace, _port_as_sliced(service, port)
        ), None

    def policy_for(self, ref: BackendRef) -> _Policy | None:
        """The BackendTLSPolicy for a Service port: its sectionName's, else the Service's."""
        service = self.objects.services.get((ref.namespace, ref.name))
        port = next((p for p in service.ports if p.port == ref.port), None) if service else None
        section = port.name if port is not None else ""
        return self.policy_by_target.get((ref.namespace, ref.name, section)) or (
            self.policy_by_target.get((ref.namespace, ref.name, ""))
        )

    def backend_policy(
        self, backend: RouteBackend, ref: BackendRef, chosen: list[_Policy | None]
    ) -> tuple[RouteBackend, _Policy | None]:
        """The BackendTLSPolicy of a usable backend, and the backend as it must be
        served: invalid when the policy cannot be used, or when it differs from the
        one the rule's first backend set (`chosen`, filled here)."""
        policy = self.policy_for(ref)
        if not chosen:
            chosen.append(policy)
        elif chosen[0] is not policy:

            def name(p: _Policy | None) -> str:
                return "none" if p is None else f"BackendTLSPolicy {p.key[0]}/{p.key[1]}"

            why = (
                f"Service {ref.namespace}/{ref.name} has {name(policy)} and the rule's first "
                f"backend {name(chosen[0])}: Waygate needs one upstream TLS setting per rule"
            )
            return dataclasses.replace(backend, invalid=why), None
        if policy is not None and policy.problem:
            why = f"BackendTLSPolicy {policy.key[0]}/{policy.key[1]}: {policy.problem}"
            return dataclasses.replace(backend, invalid=why), policy
        return backend, policy

    def backend_tls_policies(self) -> None:
        """Every BackendTLSPolicy: its CA resolved and its targets claimed, oldest first."""
        found = []
        for key, obj in self.objects.of("BackendTLSPolicy").items():
            try:
                spec = specs.backend_tls_policy(obj)
            except SpecError as exc:
                self.reject("BackendTLSPolicy", key, obj, exc)
                continue
            created = specs.created(obj)
            found.append((created.timestamp() if created else 0.0, key, obj, spec))
        for _, key, obj, spec in sorted(found, key=lambda item: (item[0], item[1])):
            generation = specs.generation(obj)
            policy = _Policy(key, generation, spec)
            self.policies[key] = policy
            problems: list[tuple[str, str]] = []
            bundles = []
            for ref in spec.ca_refs:
                what = f"caCertificateRef {ref.group or 'core'}/{ref.kind} {ref.name}"
                if ref.group not in ("", "core") or ref.kind != "ConfigMap":
                    problems.append(("InvalidKind", f"{what}: only a ConfigMap is supported"))
                    continue
                config_map = self.objects.of("ConfigMap").get((key[0], ref.name))
                if config_map is None:
                    problems.append(
                        ("InvalidCACertificateRef", f"ConfigMap {key[0]}/{ref.name} does not exist")
                    )
                    continue
                bundle = _ca_bundle((config_map.get("data") or {}).get("ca.crt"))
                if not bundle:
                    problems.append(
                        (
                            "InvalidCACertificateRef",
                            f"ConfigMap {key[0]}/{ref.name} has no ca.crt of PEM certificates",
                        )
                    )
                    continue
                bundles.append(bundle)
            policy.ca_pem = "".join(bundles)
            accepted: tuple[bool, str, str] = (True, "Accepted", "")
            if spec.well_known and spec.well_known != "System":
                accepted = (
                    False,
                    "Invalid",
                    f"wellKnownCACertificates {spec.well_known!r} is not supported (System)",
                )
            elif spec.ca_refs and not bundles:
                accepted = (False, "NoValidCACertificate", problems[0][1])
            if not accepted[0]:
                policy.problem = accepted[2]
            resolved = (False, *problems[0]) if problems else (True, "ResolvedRefs", "")
            for target in spec.targets:
                if target.group not in ("", "core") or target.kind != "Service":
                    continue  # no Service of ours: nothing to apply to
                claim = (key[0], target.name, target.section_name)
                holder = self.policy_by_target.get(claim)
                if holder is not None:
                    section = f" port {target.section_name}" if target.section_name else ""
                    accepted = (
                        False,
                        "Conflicted",
                        f"BackendTLSPolicy {holder.key[0]}/{holder.key[1]} is older and "
                        f"targets Service {target.name}{section} too",
                    )
                    if policy not in holder.shadowed:
                        holder.shadowed.append(policy)
                    continue
                self.policy_by_target[claim] = policy
            policy.conditions = [
                condition("Accepted", *accepted, generation),
                condition("ResolvedRefs", *resolved, generation),
            ]

    def finish_policies(self) -> None:
        for key, policy in self.policies.items():
            ancestors = [
                {
                    "ancestorRef": {
                        "group": GATEWAY_GROUP,
                        "kind": "Gateway",
                        "namespace": gateway[0],
                        "name": gateway[1],
                    },
                    "controllerName": CONTROLLER_NAME,
                    "conditions": policy.conditions,
                }
                for gateway in policy.ancestors
            ]
            self.out.statuses.append(
                ObjectStatus(
                    "BackendTLSPolicy", key[0], key[1], policy.generation, {"ancestors": ancestors}
                )
            )

    def make_routes(
        self,
        kind: str,
        key: Key,
        obj: JSON,
        route: RouteSpec,
        backends: list[list[RouteBackend]],
        gateway: Key,
        listener: Listener,
        hosts: list[str],
    ) -> Iterable[Route]:
        tls = listener.tls
        if kind == "TLSRoute":
            tls = RouteTLS(TLSTermination.PASSTHROUGH)
        # A listener that names its hostname claims it for the Gateway's namespace
        # (waygate.resolver.status); the routes it lets in share that claim.
        claim = None
        if listener.spec.hostname:
            claim = HostClaim(
                gateway[0],
                gateway[1],
                listener.spec.name,
                specs.created(self.objects.of("Gateway")[gateway]),
            )
        for index, rule in enumerate(route.rules):
            rule_key = (kind, key[0], key[1], index)
            policy = self.rule_policy.get(rule_key)
            rule_tls = tls
            if policy is not None:
                for used in (policy, *policy.shadowed):
                    used.ancestors.setdefault(gateway)
                rule_tls = policy.upstream(tls)
            for host in hosts:
                if kind == "TLSRoute" and not host:
                    # Passthrough routes by SNI: without a hostname there is nothing to match.
                    continue
                name = (
                    f"{kind.lower()}:{key[1]}:r{index}:{gateway[0]}/{gateway[1]}:"
                    f"{listener.spec.port}:{host or '*'}"
                )
                yield Route(
                    namespace=key[0],
                    name=name,
                    host=host,
                    backends=tuple(backends[index]),
                    tls=rule_tls,
                    sticky=StickySessions(disable_cookies=True),
                    matches=rule.matches,
                    filters=self.mirrors.get(rule_key, rule.filters),
                    request_timeout=rule.request_timeout,
                    backend_request_timeout=rule.backend_request_timeout,
                    listener_port=listener.spec.port,
                    listener_protocol=listener.spec.protocol,
                    gateway=f"{gateway[0]}/{gateway[1]}",
                    origin=f"{kind} {key[0]}/{key[1]}",
                    created=specs.created(obj),
                    rule_index=index,
                    host_claim=claim,
                    # GRPCRoute backends speak HTTP/2 (h2c here; h2 when reencrypted).
                    upstream_protocol="grpc" if kind == "GRPCRoute" else "",
                )

    def finish_gateways(self) -> None:
        for key, status in self.gateway_status.items():
            listeners = self.listeners.get(key, [])
            created = specs.created(self.objects.of("Gateway")[key])
            self.out.claims.extend(
                (listener.spec.hostname, HostClaim(key[0], key[1], listener.spec.name, created))
                for listener in listeners
                if listener.usable and listener.spec.hostname
            )
            status["listeners"] = [
                {
                    "name": listener.spec.name,
                    "supportedKinds": [{"group": GATEWAY_GROUP, "kind": k} for k in listener.kinds],
                    "attachedRoutes": listener.attached,
                    "conditions": listener.conditions,
                }
                for listener in listeners
            ]
            obj = self.objects.of("Gateway")[key]
            self.out.statuses.append(
                ObjectStatus(
                    "Gateway",
                    key[0],
                    key[1],
                    specs.generation(obj),
                    status,
                    tuple((listener.spec.name, listener.spec.port) for listener in listeners),
                )
            )

    # ------------------------------------------------------------ Ingress

    def ingresses(self) -> None:
        classes = {
            key[1]: obj
            for key, obj in self.objects.of("IngressClass").items()
            if (obj.get("spec") or {}).get("controller") == INGRESS_CONTROLLER
        }
        nginx = nginx_compat.classes(self.objects.of("IngressClass"), self.ingress_nginx)
        default = nginx_compat.default_class({**classes, **nginx})
        self.nginx_canaries: list[tuple[nginx_annotations.Plan, list[Route]]] = []
        self.nginx_routes: set[str] = set()
        for key, obj in sorted(self.objects.of("Ingress").items()):
            if self.ingress_nginx is not None and (nginx_compat.class_of(obj) or default) in nginx:
                self.nginx_ingress(key, obj, self.ingress_nginx)
                continue
            compat = self.ingress_nginx or nginx_compat.IngressNginx()
            if (nginx_compat.class_of(obj) or default) in classes and compat.annotated(obj):
                # Waygate's own class with ingress-nginx annotations: judged as the
                # nginx class's are (honoured, reported or refused), never ignored.
                self.nginx_ingress(key, obj, compat)
                continue
            try:
                ingress = specs.ingress(obj)
            except SpecError as exc:
                declared = str((obj.get("spec") or {}).get("ingressClassName", ""))
                if declared in classes:
                    self.reject("Ingress", key, obj, exc)
                continue
            class_name = ingress.class_name or default
            if class_name not in classes:
                self.ignore(
                    "Ingress", key, _ignored_reason(ingress.class_name, default is not None)
                )
                continue
            self.ingress(key, obj, ingress)
        if self.nginx_canaries:
            self.out.routes = nginx_annotations.merge_canaries(self.out.routes, self.nginx_canaries)
        if self.nginx_routes:
            self.out.routes = nginx_annotations.regex_hosts(self.out.routes, self.nginx_routes)
            self.out.routes = nginx_annotations.client_certificate_hosts(
                self.out.routes, self.nginx_routes
            )

    def nginx_ingress(self, key: Key, obj: JSON, settings: nginx_compat.IngressNginx) -> None:
        """An Ingress of the ingress-nginx class: its annotations planned, its rules
        translated as every Ingress's, then shaped (or refused alone)."""
        plan, ingress = nginx_annotations.judge(
            obj, settings, self.objects.of("ConfigMap"), self.objects.secrets
        )
        if ingress is None:
            self.out.routes.append(nginx_annotations.placeholder(key, obj, plan))
            return
        self.ingress(key, obj, ingress, plan, settings.default_certificate)

    def ingress(
        self,
        key: Key,
        obj: JSON,
        ingress: specs.IngressSpec,
        plan: nginx_annotations.Plan | None = None,
        default_certificate: Key | None = None,
    ) -> None:
        namespace = key[0]
        certificates: dict[str, RouteTLS] = {}
        for hosts, secret in ingress.tls:
            where = (namespace, secret)
            if not secret:
                if default_certificate is None:
                    continue
                # ingress-nginx's --default-ssl-certificate for TLS hosts without a Secret.
                where = default_certificate
            tls, problem = self.secret_tls(*where, f"Ingress {namespace}/{key[1]}")
            if tls is None:
                log.warning("Ingress %s/%s: %s", namespace, key[1], problem)
                continue
            for host in hosts or tuple(rule.host for rule in ingress.rules):
                certificates.setdefault(host, tls)
        index = 0
        routes: list[Route] = []
        paths: list[tuple[str, specs.IngressPath]] = [
            (rule.host, path) for rule in ingress.rules for path in rule.paths
        ]
        if ingress.default_backend is not None:
            paths.append(
                ("", specs.IngressPath(PathMatchType.PREFIX, "/", ingress.default_backend))
            )
        for host, path in paths:
            backend = path.backend
            service_port = backend.port
            service = self.objects.services.get((namespace, backend.service))
            if service is not None:
                found = next(
                    (
                        p
                        for p in service.ports
                        if p.name == service_port or str(p.port) == service_port
                    ),
                    None,
                )
                if found is not None:
                    service_port = _port_as_sliced(service, found)
            route_backend = RouteBackend(
                backend.service, 1, namespace, service_port, backend.invalid
            )
            match = RouteMatch(path.path_type, path.path)
            for port, tls in ((80, None), (443, certificates.get(host))):
                if port == 443 and tls is None:
                    continue
                routes.append(
                    Route(
                        namespace=namespace,
                        name=f"ingress:{key[1]}:p{index}:{port}:{host or '*'}",
                        host=host,
                        backends=(route_backend,),
                        tls=tls,
                        sticky=StickySessions(disable_cookies=True),
                        matches=(match,),
                        listener_port=port,
                        origin=f"Ingress {namespace}/{key[1]}",
                        created=specs.created(obj),
                        rule_index=index,
                    )
                )
            index += 1
        if plan is not None:
            routes = nginx_annotations.shape(plan, routes, certificates)
            if not routes and plan.refusal_reason:
                routes = [nginx_annotations.placeholder(key, obj, plan)]
            elif plan.canary and not plan.refusal_reason:
                # Folded into its main Ingress's routes once every Ingress is translated.
                self.nginx_canaries.append((plan, routes))
                routes = []
        too_many = self.over_budget(routes)
        if too_many is not None:
            self.reject("Ingress", key, obj, SpecError(("spec",), too_many))
            return
        if plan is not None:
            self.nginx_routes.update(r.name for r in routes)
        self.out.routes.extend(routes)
        served = plan is None or not plan.refusal_reason
        self.out.statuses.append(
            ObjectStatus(
                "Ingress",
                namespace,
                key[1],
                specs.generation(obj),
                {
                    "loadBalancer": {
                        "ingress": [
                            {"ip": a} if _address_type(a) == "IPAddress" else {"hostname": a}
                            for a in (self.addresses if served else ())
                        ]
                    }
                },
            )
        )

    # ------------------------------------------------------------ all

    def run(self) -> Translation:
        for key, obj in sorted(self.objects.of("ReferenceGrant").items()):
            try:
                self.grants.append(specs.reference_grant(obj))
            except SpecError as exc:
                self.reject("ReferenceGrant", key, obj, exc)
        self.gateways(self.classes())
        self.backend_tls_policies()
        self.routes()
        self.finish_gateways()
        self.finish_policies()
        self.ingresses()
        if self.ingress_nginx is not None and self.ingress_nginx.tcp_services is not None:
            self.tcp_services(self.ingress_nginx.tcp_services)
        return self.out

    def tcp_services(self, key: Key) -> None:
        """ingress-nginx's TCP services ConfigMap: one route per entry (none while it
        does not exist, as ingress-nginx)."""
        obj = self.objects.of("ConfigMap").get(key)
        data = (obj or {}).get("data") or {}
        if not isinstance(data, dict):
            return
        for route in nginx_tcp.routes(key[0], key[1], data):
            backend = route.backends[0] if route.backends else None
            service = (
                self.objects.services.get((backend.namespace, backend.service)) if backend else None
            )
            found = next(
                (
                    p
                    for p in (service.ports if service else ())
                    if backend and backend.port in (p.name, str(p.port))
                ),
                None,
            )
            if backend and service and found:
                # The service port as the proxy finds it on the endpoints.
                sliced = dataclasses.replace(backend, port=_port_as_sliced(service, found))
                route = dataclasses.replace(route, backends=(sliced,))
            self.out.routes.append(route)


def _port_as_sliced(service: Service, port: Any) -> str:
    """A service port as the proxy finds it on endpoints: by name, as EndpointSlices
    name theirs; a single unnamed port: "" (the only one); else its number."""
    return str(port.name or ("" if len(service.ports) == 1 else port.port))


def _address_type(address: str) -> str:
    import ipaddress

    try:
        ipaddress.ip_address(address)
    except ValueError:
        return "Hostname"
    return "IPAddress"


def _secret_value(data: JSON, string_data: JSON, key: str) -> str:
    import base64
    import binascii

    if key in string_data:
        return str(string_data[key])
    if key not in data:
        raise ValueError(f"has no {key}")
    try:
        return base64.b64decode(str(data[key]), validate=True).decode("ascii")
    except (binascii.Error, UnicodeDecodeError):
        raise ValueError(f"{key} is not base64 of a PEM text") from None


def _scaled(backends: list[RouteBackend]) -> list[RouteBackend]:
    top = max((b.weight for b in backends), default=0)
    if top <= MAX_WEIGHT:
        return backends
    return [
        dataclasses.replace(b, weight=max(1, round(b.weight * MAX_WEIGHT / top)) if b.weight else 0)
        for b in backends
    ]


def translate(
    objects: Objects,
    *,
    addresses: tuple[str, ...] = (),
    sharing: str = "share",
    ingress_nginx: nginx_compat.IngressNginx | None = None,
) -> Translation:
    """The routes and statuses `objects` amount to (see the module docstring).

    `sharing` (LISTENER_SHARING): how listeners of different Gateways on one port,
    which a proxy serving every Gateway merges, are judged. `ingress_nginx`: also
    serve the Ingresses ingress-nginx would (waygate.resolver.ingress_nginx)."""
    return _Translator(objects, addresses, sharing, ingress_nginx).run()


def is_gateway_object(kind: str, api_version: str) -> bool:
    group = api_version.split("/")[0] if "/" in api_version else ""
    if kind in ("Ingress", "IngressClass"):
        return group == "networking.k8s.io"
    return kind in GATEWAY_KINDS and group == GATEWAY_GROUP


def describe(obj: Any) -> str:
    namespace, name = specs.meta(obj)
    return f"{obj.get('kind')} {namespace + '/' if namespace else ''}{name}"
