"""Which identity and SANs a caller may get (sans-IO; no grpc, no files).

Names are handled as "kind:value" strings: "dns:NAME", "uri:URI", "ip:ADDRESS".

Rules, by kind of caller:
- static caller (tokens file): exactly its `allowed` patterns. "dns:*.x" lets
  exactly one label stand for the star; "uri:spiffe://td/ns/a/*" lets any
  suffix stand for the trailing star; "ip:" matches the same address.
- ServiceAccount caller (namespace + service_account): uri
  spiffe://TRUST_DOMAIN/ns/NS/sa/SA, and dns NAME.NS.svc and
  NAME.NS.svc.cluster.local for any single-label NAME.
- node caller (node): dns NODE.

The identity asked for (a spiffe:// URI, a DNS or node name, or an IP
address) must be one of the CSR's SANs, and every SAN must be allowed. A
refusal is `PermissionDenied` naming the first forbidden name; a CSR with a
kind of SAN Waygate never issues (e-mail, directory name, ...) is refused the
same way. The Kubernetes CSR approver uses the same checks.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable

from cryptography import x509

from waygate.certs.auth import Caller
from waygate.core.errors import InvalidArgument, PermissionDenied
from waygate.core.sans import identity_san

KINDS = ("dns", "uri", "ip")


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

    def __init__(self, trust_domain: str) -> None:
        self.trust_domain = trust_domain

    def allowed_patterns(self, caller: Caller) -> tuple[str, ...]:
        if caller.namespace is not None and caller.service_account is not None:
            ns, sa = caller.namespace, caller.service_account
            return (
                f"uri:spiffe://{self.trust_domain}/ns/{ns}/sa/{sa}",
                f"dns:*.{ns}.svc",
                f"dns:*.{ns}.svc.cluster.local",
            )
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
            raise InvalidArgument(
                f"identity {identity!r} is not among the CSR's subject alternative names "
                f"({', '.join(names)})"
            )
        for name in names:
            if not self.is_allowed(caller, name):
                raise PermissionDenied(f"{caller.name} may not get a certificate for {name}")

    def authorize_csr(
        self, caller: Caller, identity: str, csr: x509.CertificateSigningRequest
    ) -> list[str]:
        """`authorize` with the names read from the CSR; returns those names."""
        names = requested_names(csr)
        self.authorize(caller, identity, names)
        return names


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
