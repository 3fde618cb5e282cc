"""Which identity and SANs a caller may get (sans-IO; no grpc, no files).

Names are handled as "kind:value" strings: "dns:NAME", "uri:URI", "ip:ADDRESS".

Rules, by kind of caller:
- static caller (tokens file): exactly its `allowed` patterns. "dns:*.x" lets
  exactly one label stand for the star; "uri:spiffe://td/ns/a/*" lets any
  suffix stand for the trailing star; "ip:" matches the same address.
- ServiceAccount caller (namespace + service_account): uri
  spiffe://TRUST_DOMAIN/ns/NS/sa/SA, and dns NAME.NS.svc and
  NAME.NS.svc.cluster.local only for a Service NAME in its own namespace NS
  that serves as it (per-workload names, `SERVICE_NAME_RULE`): the Service's
  annotation `waygate.io/serving-service-account` names SA, or the Service
  has no such annotation and NAME equals SA. An annotation naming another
  ServiceAccount wins over a matching name: the Service's owner said who
  serves it. Services are read through a `ServiceDirectory` (the Kubernetes
  API); `authorize` checks the name's shape, `check_service_names` (async)
  the Service itself, at most `MAX_SERVICES_PER_CSR` of them per request.
- node caller (node): dns NODE.
- a ServiceAccount listed in `node_agents` ("NS/SA", e.g. the tunnel agent's
  DaemonSet) whose token is bound to a pod (`pod_node`): also dns NODE, the
  name of that pod's own node and no other.

The identity asked for (a spiffe:// URI, a DNS or node name, or an IP
address) must be one of the CSR's SANs, and every SAN must be allowed. A
refusal is `PermissionDenied` naming the first forbidden name; a CSR with a
kind of SAN Waygate never issues (e-mail, directory name, ...) is refused the
same way. The Kubernetes CSR approver uses the same checks.
"""

from __future__ import annotations

import asyncio
import dataclasses
import ipaddress
import re
from collections.abc import Iterable
from typing import Protocol

from cryptography import x509

from waygate.certs.auth import Caller
from waygate.core.errors import InvalidArgument, PermissionDenied, excerpt
from waygate.core.sans import identity_san

KINDS = ("dns", "uri", "ip")
#: The Service annotation naming the ServiceAccount that serves the Service.
SERVING_ACCOUNT_ANNOTATION = "waygate.io/serving-service-account"
SERVICE_NAME_RULE = (
    "a ServiceAccount gets dns:NAME.NS.svc[.cluster.local] only for a Service NAME in its "
    f"own namespace annotated {SERVING_ACCOUNT_ANNOTATION}: <its name>, or, without that "
    "annotation, named like the ServiceAccount"
)
#: Most distinct Services one request may name (each costs a Kubernetes API read).
MAX_SERVICES_PER_CSR = 16
_SERVICE_SUFFIXES = (".svc", ".svc.cluster.local")
#: A Service name (RFC 1035 label, as Kubernetes requires of Service names).
_DNS_LABEL = re.compile(r"[a-z]([-a-z0-9]{0,61}[a-z0-9])?")


@dataclasses.dataclass(frozen=True)
class ServiceInfo:
    """What the policy needs of one Service."""

    namespace: str
    name: str
    #: The `waygate.io/serving-service-account` annotation; None when absent.
    serving_account: str | None

    def served_by(self, service_account: str) -> bool:
        if self.serving_account is not None:
            return self.serving_account == service_account
        return self.name == service_account

    def why_not(self, service_account: str) -> str:
        if self.serving_account is not None:
            return (
                f"Service {self.namespace}/{self.name} names ServiceAccount "
                f"{excerpt(self.serving_account)} in {SERVING_ACCOUNT_ANNOTATION}"
            )
        return (
            f"Service {self.namespace}/{self.name} has no {SERVING_ACCOUNT_ANNOTATION} "
            f"annotation and is not named {service_account}"
        )


class ServiceDirectory(Protocol):
    async def service(self, namespace: str, name: str) -> ServiceInfo | None:
        """The Service, or None when it does not exist; Unavailable when it cannot be read."""
        ...


def requested_names(csr: x509.CertificateSigningRequest) -> list[str]:
    """The SANs of a CSR as "kind:value" strings, in CSR order."""
    try:
        extension = csr.extensions.get_extension_for_class(x509.SubjectAlternativeName)
    except x509.ExtensionNotFound:
        return []
    except (ValueError, x509.DuplicateExtension) as exc:
        raise InvalidArgument(f"the CSR's extensions do not parse: {exc}") from None
    names: list[str] = []
    for general_name in extension.value:
        if isinstance(general_name, x509.DNSName):
            names.append(f"dns:{general_name.value}")
        elif isinstance(general_name, x509.UniformResourceIdentifier):
            names.append(f"uri:{general_name.value}")
        elif isinstance(general_name, x509.IPAddress):
            names.append(f"ip:{general_name.value}")
        else:
            names.append(f"{type(general_name).__name__}:{general_name.value}")
    return names


def check_pattern(pattern: str) -> str | None:
    """Why a static `allowed` pattern is malformed, or None."""
    kind, sep, value = pattern.partition(":")
    if not sep or kind not in KINDS or not value:
        return f"allowed pattern {pattern!r} must be dns:NAME, uri:URI or ip:ADDRESS"
    if kind == "dns" and "*" in value.removeprefix("*."):
        return f"allowed pattern {pattern!r}: a DNS pattern may only start with '*.'"
    if kind == "uri" and "*" in value.removesuffix("*"):
        return f"allowed pattern {pattern!r}: a URI pattern may only end with '*'"
    if kind == "ip":
        try:
            ipaddress.ip_address(value)
        except ValueError:
            return f"allowed pattern {pattern!r}: {value!r} is not an IP address"
    return None


def pattern_matches(pattern: str, name: str) -> bool:
    """Does one "kind:value" name match one allowed pattern?"""
    pattern_kind, _, pattern_value = pattern.partition(":")
    kind, _, value = name.partition(":")
    if kind != pattern_kind:
        return False
    if kind == "dns":
        value, pattern_value = value.lower().rstrip("."), pattern_value.lower().rstrip(".")
        if pattern_value.startswith("*."):
            label, dot, rest = value.partition(".")
            return bool(label) and bool(dot) and "*" not in label and rest == pattern_value[2:]
        return value == pattern_value
    if kind == "uri":
        if pattern_value.endswith("*"):
            return value.startswith(pattern_value[:-1])
        return value == pattern_value
    if kind == "ip":
        try:
            return ipaddress.ip_address(value) == ipaddress.ip_address(pattern_value)
        except ValueError:
            return False
    return False


class Policy:
    """Decides identities and SANs for callers within one trust domain."""

    def __init__(
        self,
        trust_domain: str,
        services: ServiceDirectory | None = None,
        *,
        node_agents: Iterable[str] = (),
    ) -> None:
        self.trust_domain = trust_domain
        self.services = services
        self.node_agents = frozenset(node_agents)

    def allowed_patterns(self, caller: Caller) -> tuple[str, ...]:
        """The shapes of names `caller` may get; Service names are confirmed by
        `check_service_names`."""
        if caller.namespace is not None and caller.service_account is not None:
            ns, sa = caller.namespace, caller.service_account
            patterns = (
                f"uri:spiffe://{self.trust_domain}/ns/{ns}/sa/{sa}",
                f"dns:*.{ns}.svc",
                f"dns:*.{ns}.svc.cluster.local",
            )
            if caller.pod_node is not None and f"{ns}/{sa}" in self.node_agents:
                return (*patterns, f"dns:{caller.pod_node}")
            return patterns
        if caller.node is not None:
            return (f"dns:{caller.node}",)
        return caller.allowed

    def is_allowed(self, caller: Caller, name: str) -> bool:
        return any(pattern_matches(p, name) for p in self.allowed_patterns(caller))

    def authorize(self, caller: Caller, identity: str, names: Iterable[str]) -> None:
        """Raise PermissionDenied unless `identity` and every one of `names` is allowed.

        `names` are the CSR's SANs ("kind:value", see `requested_names`).
        """
        names = list(names)
        if not identity:
            raise InvalidArgument("identity is required (a spiffe:// ID or a DNS name)")
        if not names:
            raise InvalidArgument("the CSR asks for no subject alternative names")
        wanted = identity_san(identity)
        if not any(_same_name(wanted, n) for n in names):
            listed = ", ".join(excerpt(n) for n in names[:5])
            more = f" and {len(names) - 5} more" if len(names) > 5 else ""
            raise InvalidArgument(
                f"identity {excerpt(identity)} is not among the CSR's subject alternative names "
                f"({listed}{more})"
            )
        for name in names:
            if not self.is_allowed(caller, name):
                raise PermissionDenied(
                    f"{caller.name} may not get a certificate for {excerpt(name)}"
                )

    def authorize_csr(
        self, caller: Caller, identity: str, csr: x509.CertificateSigningRequest
    ) -> list[str]:
        """`authorize` with the names read from the CSR; returns those names."""
        names = requested_names(csr)
        self.authorize(caller, identity, names)
        return names

    def service_name(self, caller: Caller, name: str) -> str | None:
        """The Service NAME that the SAN `name` (dns:NAME.NS.svc[.cluster.local]) stands
        for when `caller` is a ServiceAccount of namespace NS; else None."""
        if caller.namespace is None or caller.service_account is None:
            return None
        kind, _, value = name.partition(":")
        if kind != "dns":
            return None
        value = value.lower().rstrip(".")
        for suffix in _SERVICE_SUFFIXES:
            label, dot, rest = value.partition(".")
            if dot and label and "*" not in label and rest == f"{caller.namespace}{suffix}":
                return label
        return None

    async def check_service_names(self, caller: Caller, names: Iterable[str]) -> None:
        """PermissionDenied unless every Service name among `names` serves as `caller`
        (`SERVICE_NAME_RULE`); Unavailable when a Service cannot be read."""
        wanted: dict[str, str] = {}
        for name in names:
            service = self.service_name(caller, name)
            if service is not None:
                wanted.setdefault(service, name)
        if not wanted:
            return
        assert caller.namespace is not None and caller.service_account is not None
        if len(wanted) > MAX_SERVICES_PER_CSR:
            raise InvalidArgument(
                f"the CSR names {len(wanted)} Services; at most {MAX_SERVICES_PER_CSR} "
                "per certificate"
            )
        for service, name in wanted.items():
            if not _DNS_LABEL.fullmatch(service):
                raise PermissionDenied(
                    f"{caller.name} may not get a certificate for {excerpt(name)}: "
                    f"{excerpt(service)} is not a Service name"
                )
        if self.services is None:
            service, name = next(iter(wanted.items()))
            raise PermissionDenied(
                f"{caller.name} may not get a certificate for {excerpt(name)}: "
                f"{SERVICE_NAME_RULE}; certs reads no Services (it runs without Kubernetes)"
            )
        # All at once: the check then takes one read's time (each bounded), not up to
        # MAX_SERVICES_PER_CSR of them in a row while the Certify holds a unary place.
        namespace = caller.namespace
        infos = await asyncio.gather(
            *(self.services.service(namespace, service) for service in wanted)
        )
        for (service, name), info in zip(wanted.items(), infos, strict=True):
            if info is not None and info.served_by(caller.service_account):
                continue
            why = (
                f"Service {caller.namespace}/{service} does not exist"
                if info is None
                else info.why_not(caller.service_account)
            )
            raise PermissionDenied(
                f"{caller.name} may not get a certificate for {excerpt(name)}: "
                f"{SERVICE_NAME_RULE}; {why}"
            )


def _same_name(a: str, b: str) -> bool:
    kind_a, _, value_a = a.partition(":")
    kind_b, _, value_b = b.partition(":")
    if kind_a != kind_b:
        return False
    if kind_a == "dns":
        return value_a.lower().rstrip(".") == value_b.lower().rstrip(".")
    if kind_a == "ip":
        try:
            return ipaddress.ip_address(value_a) == ipaddress.ip_address(value_b)
        except ValueError:
            return False
    return value_a == value_b
