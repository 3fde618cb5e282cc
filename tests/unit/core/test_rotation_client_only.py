"""A client-only rotator (the tunnel agent's role) asks for clientAuth only and insists
on getting it: an issuer that ignores the request (an older certs) fails the renewal
instead of installing a certificate that could also serve TLS."""

from __future__ import annotations

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding
from cryptography.x509.oid import ExtendedKeyUsageOID

from tests.support.pki import LocalCA
from waygate.core import errors
from waygate.core.rotation import CertificateRotator, Issued

NODE = "edge-1"


def usages(leaf: x509.Certificate) -> list[x509.ObjectIdentifier]:
    return list(leaf.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value)


async def test_the_request_asks_for_client_auth_only_and_gets_it() -> None:
    ca = LocalCA()  # signs with the usages the CSR asks for, as certs does
    held = await CertificateRotator(ca, NODE, client_only=True).renew_once()
    ((csr, _identity, _when),) = ca.requests
    asked = csr.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(asked) == [ExtendedKeyUsageOID.CLIENT_AUTH]
    assert usages(held.leaf) == [ExtendedKeyUsageOID.CLIENT_AUTH]


async def test_an_issuer_that_ignores_the_request_is_refused() -> None:
    ca = LocalCA()

    class Ignoring:
        """Stands in for a certs that predates the request: both usages, always."""

        async def certify(self, csr_der: bytes, identity: str) -> Issued:
            csr = x509.load_der_x509_csr(csr_der)
            leaf = ca._leaf(  # the CSR's key and names, both usages
                csr.public_key(),
                csr.extensions.get_extension_for_class(x509.SubjectAlternativeName).value,
            )
            return Issued(leaf.public_bytes(Encoding.DER), (), leaf.not_valid_after_utc)

    rotator = CertificateRotator(Ignoring(), NODE, client_only=True)
    with pytest.raises(errors.InvalidArgument, match="client-only"):
        await rotator.renew_once()
    assert not rotator.has_certificate
