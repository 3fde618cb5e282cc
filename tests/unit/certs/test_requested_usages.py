"""Certify issues a leaf exactly the extended key usages its CSR asks for (issue 19 item 4).

The tunnel agent's role is a clientAuth-only certificate: its rotation client asks
for that in the CSR, certs issues it on both signing paths (on the event loop, and
in a signing thread behind an RSA CA), and a CSR that asks for a usage Waygate does
not issue is INVALID_ARGUMENT. A CSR that asks for none gets both usages, as before.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.x509.oid import ExtendedKeyUsageOID

from tests.unit.certs.helpers import open_authority
from waygate.certs.auth import Caller, StaticTokenAuthenticator
from waygate.certs.policy import Policy
from waygate.certs.service import CertsService, SigningExecutor
from waygate.core.errors import InvalidArgument
from waygate.core.rotation import build_csr, generate_key

TOKEN = "a" * 40
NODE = "edge-1"
SERVER, CLIENT = ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH


def make_service(tmp_path: Path, ca_algorithm: str) -> CertsService:
    service = CertsService(
        StaticTokenAuthenticator([(TOKEN, Caller(name="agent", allowed=(f"dns:{NODE}",)))]),
        Policy("waygate.local"),
        replica="here/1",
        executor=SigningExecutor(2, 8),
    )
    service.attach(open_authority(tmp_path / "ca", key_algorithm=ca_algorithm))
    return service


def usages(leaf: x509.Certificate) -> list[x509.ObjectIdentifier]:
    return list(leaf.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value)


async def certify(service: CertsService, der: bytes) -> x509.Certificate:
    issued = await service.certify(token=TOKEN, identity=NODE, csr_der=der, lifetime=None)
    return issued.leaf


@pytest.mark.parametrize("ca_algorithm", ["ecdsa-p256", "rsa-2048"])
async def test_a_client_only_csr_gets_a_client_only_leaf(tmp_path: Path, ca_algorithm: str) -> None:
    service = make_service(tmp_path, ca_algorithm)
    for _ in range(2):  # the first leaf writes the stored bound (a signing thread), then not
        leaf = await certify(service, build_csr(generate_key(), NODE, (), client_only=True))
        assert usages(leaf) == [CLIENT]
    assert usages(await certify(service, build_csr(generate_key(), NODE, ()))) == [SERVER, CLIENT]


async def test_a_usage_waygate_does_not_issue_is_invalid(tmp_path: Path) -> None:
    service = make_service(tmp_path, "ecdsa-p256")
    key = generate_key()
    csr = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(x509.Name([]))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(NODE)]), critical=True)
        .add_extension(
            x509.ExtendedKeyUsage([CLIENT, ExtendedKeyUsageOID.CODE_SIGNING]), critical=False
        )
        .sign(key, hashes.SHA256())
    )
    with pytest.raises(InvalidArgument, match="codeSigning"):
        await certify(service, csr.public_bytes(serialization.Encoding.DER))
    assert service.authority.list_issued() == []
