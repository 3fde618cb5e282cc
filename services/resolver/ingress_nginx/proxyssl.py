"""ingress-nginx's proxy-ssl-secret -> the TLS material of an Ingress's HTTPS backend.

Sans-IO: `read_secret(namespace, reference, secrets)` reads the Secret the
annotation names (ingress-nginx internal/ingress/annotations/proxyssl/main.go
and the store's getPemCertificate, controller v1.15.1): `tls.crt` and `tls.key`,
the client certificate the proxy presents to the backend; `ca.crt`, the CAs the
backend's certificate is verified against (nginx's proxy_ssl_trusted_certificate).
A Secret with `ca.crt` alone is valid (verification only, no client certificate),
as ingress-nginx's.

Invariants (ingress-nginx denies the location, answering 503, whenever it cannot
read the Secret; here the Ingress is refused, naming why):
- the Secret is in the Ingress's namespace (ingress-nginx refuses other
  namespaces unless --allow-cross-namespace-resources, which Waygate has not);
- it exists, its data is base64, and it holds a key pair, `ca.crt`, or both;
- a key pair is whole (tls.crt and tls.key), PEM, unencrypted, and the key is
  the first certificate's; `ca.crt` is PEM certificates.
The key goes into the route only (RouteTLS.backend_client_key), withheld from
everyone but route readers exactly as a serving key is.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from cryptography import x509
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization

from waygate.resolver.ingress_nginx.access import annotated_secret

JSON = dict[str, Any]
Lookup = Callable[[str, str], "JSON | None"]


@dataclass(frozen=True)
class BackendTLS:
    """What a proxy-ssl-secret gives the backend's TLS ("" : not in the Secret)."""

    secret: str  # "namespace/name", for verdicts
    certificate: str = ""  # PEM chain presented to the backend
    key: str = ""  # its PEM key
    ca: str = ""  # PEM CAs the backend's certificate must chain to


def read_secret(namespace: str, reference: str, secrets: Lookup) -> tuple[str, BackendTLS | None]:
    """(problem, None) when the Secret cannot be used, else ("", its material)."""
    problem, name, data = annotated_secret(namespace, reference, secrets)
    if data is None:
        return problem, None
    where = f"{namespace}/{name}"
    certificate, key, ca = data.get("tls.crt", ""), data.get("tls.key", ""), data.get("ca.crt", "")
    if not (certificate or key or ca):
        return f"Secret {where} holds neither tls.crt and tls.key nor ca.crt", None
    if bool(certificate) != bool(key):
        missing = "tls.key" if certificate else "tls.crt"
        return f"Secret {where} has no {missing} to go with its other half", None
    if certificate:
        problem = _pair_problem(certificate, key)
        if problem:
            return f"Secret {where}: {problem}", None
    if ca:
        try:
            x509.load_pem_x509_certificates(ca.encode())
        except ValueError:
            return f"Secret {where}: ca.crt is not PEM certificates", None
    return "", BackendTLS(where, certificate, key, ca)


def _pair_problem(certificate: str, key: str) -> str:
    try:
        chain = x509.load_pem_x509_certificates(certificate.encode())
    except ValueError:
        return "tls.crt is not PEM certificates"
    try:
        private = serialization.load_pem_private_key(key.encode(), password=None)
    except TypeError:
        return "tls.key is encrypted (nginx would ask for a passphrase)"
    except (ValueError, UnsupportedAlgorithm):
        return "tls.key is not a PEM private key"
    if _spki(private.public_key()) != _spki(chain[0].public_key()):
        return "tls.key is not the key of tls.crt's first certificate"
    return ""


def _spki(public_key: Any) -> bytes:
    return public_key.public_bytes(  # type: ignore[no-any-return]
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
