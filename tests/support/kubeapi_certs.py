"""certificates.k8s.io helpers for certs' Kubernetes tests.

Builds real PKCS#10 requests (keys generated here) and the
CertificateSigningRequest objects that carry them, as the API server stores
them: `spec.username` and `spec.groups` are what the API server would fill in
from the creator's credentials. The stand-in API server
(`tests.support.kubeapi`) has no admission, so tests set them directly.
"""

from __future__ import annotations

import base64
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from tests.support import pki

CSR_API_VERSION = "certificates.k8s.io/v1"
CSR_KIND = "CertificateSigningRequest"


def make_csr(*names: str, key: ec.EllipticCurvePrivateKey | None = None) -> bytes:
    """A PEM CSR signed by a new P-256 key (or `key`) asking for "kind:value" SANs."""
    csr, _ = pki.make_csr(names, key, critical=False)
    return csr.public_bytes(serialization.Encoding.PEM)


def node_user(node: str) -> dict[str, Any]:
    return {
        "username": f"system:node:{node}",
        "groups": ["system:nodes", "system:authenticated"],
    }


def service_account_user(namespace: str, name: str) -> dict[str, Any]:
    return {
        "username": f"system:serviceaccount:{namespace}:{name}",
        "groups": [
            "system:serviceaccounts",
            f"system:serviceaccounts:{namespace}",
            "system:authenticated",
        ],
    }


def csr_object(
    name: str,
    *,
    signer: str,
    request: bytes,
    user: dict[str, Any],
    usages: tuple[str, ...] = ("digital signature", "client auth"),
    expiration_seconds: int | None = None,
    conditions: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "signerName": signer,
        "request": base64.b64encode(request).decode(),
        "usages": list(usages),
        "uid": f"uid-{user['username']}",
        **user,
    }
    if expiration_seconds is not None:
        spec["expirationSeconds"] = expiration_seconds
    obj: dict[str, Any] = {
        "apiVersion": CSR_API_VERSION,
        "kind": CSR_KIND,
        "metadata": {"name": name, "uid": f"uid-{name}", "resourceVersion": "7"},
        "spec": spec,
    }
    if conditions is not None:
        obj["status"] = {"conditions": conditions}
    return obj


def certificate_chain(obj: dict[str, Any]) -> list[x509.Certificate]:
    """The certificates in a CSR object's status.certificate (PEM), leaf first."""
    pem = base64.b64decode(obj["status"]["certificate"])
    return x509.load_pem_x509_certificates(pem)


def conditions(obj: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """status.conditions by type."""
    return {c["type"]: c for c in (obj.get("status") or {}).get("conditions") or ()}
