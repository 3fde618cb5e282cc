"""Helpers for the certs tests: CSRs of every key type, a movable clock, a CA in a temp dir."""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import serialization

from tests.support import pki
from waygate.certs.auth import Caller
from waygate.certs.authority import Authority, AuthorityConfig
from waygate.certs.castate import generate_key
from waygate.certs.issuing import Issued, leaf_request
from waygate.certs.store import DirectoryCAStore

START = dt.datetime(2026, 3, 1, 12, 0, tzinfo=dt.UTC)
TRUST_DOMAIN = "waygate.local"
RESOLVER_ID = f"spiffe://{TRUST_DOMAIN}/ns/local/sa/resolver"
RESOLVER_SANS = (f"uri:{RESOLVER_ID}", "dns:resolver.waygate.local", "ip:127.0.0.1")
RESOLVER = Caller(name="resolver", allowed=RESOLVER_SANS)


class Clock:
    """A clock that moves only when the test moves it."""

    def __init__(self, start: dt.datetime = START) -> None:
        self.time = start

    def __call__(self) -> dt.datetime:
        return self.time

    def advance(self, delta: dt.timedelta) -> None:
        self.time += delta


def make_csr(
    names: tuple[str, ...] | list[str] = RESOLVER_SANS,
    key_algorithm: str = "ecdsa-p256",
    key: object | None = None,
) -> tuple[x509.CertificateSigningRequest, object]:
    return pki.make_csr(names, key or generate_key(key_algorithm))


def csr_der(
    names: tuple[str, ...] | list[str] = RESOLVER_SANS, key_algorithm: str = "ecdsa-p256"
) -> bytes:
    return make_csr(names, key_algorithm)[0].public_bytes(serialization.Encoding.DER)


def tampered_csr_der(names: tuple[str, ...] | list[str] = RESOLVER_SANS) -> bytes:
    """A CSR whose signature does not verify: one byte of the signature flipped."""
    der = bytearray(csr_der(names))
    der[-5] ^= 0x01
    return bytes(der)


def open_authority(directory: Path, clock: Clock | None = None, **config: object) -> Authority:
    return Authority.open(
        DirectoryCAStore(directory),
        AuthorityConfig(**config),  # type: ignore[arg-type]
        now=clock or (lambda: dt.datetime.now(dt.UTC)),
    )


def sign(
    authority: Authority,
    csr: x509.CertificateSigningRequest,
    *,
    identity: str,
    requested_by: str,
    **options: Any,
) -> Issued:
    """`authority.issue` of the checked request for `csr` (`leaf_request`'s options)."""
    return authority.issue(
        leaf_request(csr, authority.config, identity=identity, requested_by=requested_by, **options)
    )


def pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def snapshot(directory: Path) -> dict[str, tuple[bytes, int]]:
    """Every file under `directory` with its bytes and mtime_ns (to prove nothing was written)."""
    return {
        str(p.relative_to(directory)): (p.read_bytes(), p.stat().st_mtime_ns)
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def duplicate_san_csr_der(san: x509.GeneralName | None = None) -> bytes:
    """A correctly signed CSR whose extension list holds the SAN extension twice.

    `cryptography` refuses to build one, so the DER is edited with pyasn1 (a
    pkilint dependency) and signed again with the CSR's own key.
    """
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from pyasn1.codec.der import decoder, encoder
    from pyasn1.type import univ
    from pyasn1_alt_modules import rfc2986, rfc5280

    key = ec.generate_private_key(ec.SECP256R1())
    csr = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(x509.Name([]))
        .add_extension(
            x509.SubjectAlternativeName([san or x509.UniformResourceIdentifier(RESOLVER_ID)]),
            critical=False,
        )
        .sign(key, hashes.SHA256())
    )
    request, _ = decoder.decode(
        csr.public_bytes(serialization.Encoding.DER), asn1Spec=rfc2986.CertificationRequest()
    )
    info = request["certificationRequestInfo"]
    attribute = info["attributes"][0]
    extensions, _ = decoder.decode(bytes(attribute["values"][0]), asn1Spec=rfc5280.Extensions())
    extensions.append(extensions[0])
    attribute["values"][0] = univ.Any(encoder.encode(extensions))
    request["signature"] = univ.BitString.fromOctetString(
        key.sign(encoder.encode(info), ec.ECDSA(hashes.SHA256()))
    )
    der = encoder.encode(request)
    assert x509.load_der_x509_csr(der).is_signature_valid
    return der
