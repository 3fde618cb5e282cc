"""Who is on the other end: names from a peer certificate, and the agent role.

The agent role (issue 19, item 4). A certificate registers as the agent of
node NODE only when it was issued for that role:

- its subject alternative names are exactly one DNS name, NODE, and no URI
  (a URI SAN marks a workload: any ServiceAccount can get `dns:NAME.NS.svc`
  beside its SPIFFE ID), and
- its extended key usage is client authentication only: it does not carry
  serverAuth (nor anyExtendedKeyUsage, nor lack the extension). Every serving
  certificate does (the proxy's, a workload's, a tunnel server's), so a
  DNS-only serving certificate never passes as an agent, whatever name it
  carries. Certify issues a leaf exactly the usages its CSR asks for, the
  agent's rotation client asks for clientAuth only
  (`ProcessSettings.client_certificate_only`), and the `waygate.io/tunnel-agent`
  Kubernetes signer issues "client auth" only.

No grpc here: the gRPC face (server.py) and the data listener (datapath.py)
both ask `agent_node`.
"""

from __future__ import annotations

import datetime

from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID

from waygate.core import errors


def load(der_or_pem: bytes | None) -> x509.Certificate | None:
    if not der_or_pem:
        return None
    try:
        if der_or_pem.lstrip().startswith(b"-----"):
            return x509.load_pem_x509_certificate(der_or_pem)
        return x509.load_der_x509_certificate(der_or_pem)
    except ValueError:
        return None


def certificate_names(der_or_pem: bytes | None) -> tuple[list[str], list[str]]:
    """(URI SANs, DNS SANs) of a certificate; empty lists without one."""
    certificate = load(der_or_pem)
    if certificate is None:
        return [], []
    try:
        names = certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return [], []
    return (
        list(names.get_values_for_type(x509.UniformResourceIdentifier)),
        list(names.get_values_for_type(x509.DNSName)),
    )


def current(der_or_pem: bytes | None, now: datetime.datetime | None = None) -> bool:
    """True when the certificate is within its validity period. A resumed TLS session
    checks no certificate (and OpenSSL gives each resumption a fresh session lifetime),
    so the data listener asks this of every connection: a session outlives neither
    its certificate nor, with short-lived certificates, a CA taken out of the bundle
    for long."""
    certificate = load(der_or_pem)
    if certificate is None:
        return False
    now = now or datetime.datetime.now(datetime.UTC)
    return certificate.not_valid_before_utc <= now <= certificate.not_valid_after_utc


def serves(certificate: x509.Certificate) -> bool:
    """True when the certificate may authenticate a TLS server (no EKU: any use)."""
    try:
        usages = certificate.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    except x509.ExtensionNotFound:
        return True
    return (
        ExtendedKeyUsageOID.SERVER_AUTH in usages
        or ExtendedKeyUsageOID.ANY_EXTENDED_KEY_USAGE in usages
    )


def agent_node(uris: list[str], dns_names: list[str], der_or_pem: bytes | None) -> str:
    """The node an agent certificate names; PermissionDenied unless it is one (see above)."""
    if uris:
        raise errors.PermissionDenied(
            "an agent's client certificate names its node only (one DNS name); "
            "this one also carries a URI (a workload identity, not an agent's)"
        )
    if len(dns_names) != 1:
        raise errors.PermissionDenied(
            "an agent's client certificate must name exactly one node (one DNS name); "
            f"this one names {len(dns_names)}"
        )
    certificate = load(der_or_pem)
    if certificate is None or serves(certificate):
        raise errors.PermissionDenied(
            f"the certificate for {errors.excerpt(dns_names[0])} is not an agent's: an agent "
            "certificate's extended key usage is client authentication only (this one may "
            "also serve TLS, as a server's certificate does)"
        )
    return dns_names[0].lower().rstrip(".")
