"""A real certificate authority for rotation tests, and checks that it is one.

`LocalCA` signs with `cryptography` (not a stub: every leaf really chains to
its CA and carries the CSR's SANs), under a clock the test controls. It is the
`Issuer` of the rotation unit tests and of the in-process TLS tests, where
certs itself is not the subject. `FakeClock` is a clock whose `sleep` moves
time instead of waiting.
"""

from __future__ import annotations

import asyncio
import datetime as dt
from collections.abc import Callable

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from waygate.core import errors
from waygate.core.rotation import CertificateRotator, Issued, TrustBundle

START = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)


class FakeClock:
    """Time that moves only when someone sleeps (or the test says so)."""

    def __init__(self, start: dt.datetime = START, until: dt.datetime | None = None) -> None:
        self.time = start
        self.until = until
        self.sleeps: list[float] = []

    def now(self) -> dt.datetime:
        return self.time

    def advance(self, seconds: float) -> None:
        self.time += dt.timedelta(seconds=seconds)

    async def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.advance(seconds)
        if self.until is not None and self.time >= self.until:
            raise TimeUp
        await asyncio.sleep(0)


class TimeUp(Exception):
    """Raised by FakeClock.sleep once the test's time has run out."""


class LocalCA:
    """A CA that signs CSRs; `fail_with` makes every call fail like an unreachable certs."""

    def __init__(
        self,
        now: Callable[[], dt.datetime] = lambda: dt.datetime.now(dt.UTC),
        *,
        lifetime: dt.timedelta = dt.timedelta(hours=24),
        backdate: dt.timedelta = dt.timedelta(0),
        name: str = "Waygate test CA",
    ) -> None:
        self.now = now
        self.lifetime = lifetime
        self.backdate = backdate
        self.key = ec.generate_private_key(ec.SECP256R1())
        self.name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        start = now() - dt.timedelta(days=1)
        self.certificate = (
            x509.CertificateBuilder()
            .subject_name(self.name)
            .issuer_name(self.name)
            .public_key(self.key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(start)
            .not_valid_after(start + dt.timedelta(days=3650))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(
                x509.SubjectKeyIdentifier.from_public_key(self.key.public_key()), critical=False
            )
            .sign(self.key, hashes.SHA256())
        )
        self.fail_with: errors.WaygateError | None = None
        self.requests: list[tuple[x509.CertificateSigningRequest, str, dt.datetime]] = []
        self.failures = 0

    @property
    def pem(self) -> bytes:
        return self.certificate.public_bytes(serialization.Encoding.PEM)

    def bundle(self, version: int = 1) -> TrustBundle:
        return TrustBundle(version=version, certificates=(self.certificate,))

    def sign(
        self, csr: x509.CertificateSigningRequest, lifetime: dt.timedelta | None = None
    ) -> x509.Certificate:
        if not csr.is_signature_valid:
            raise errors.InvalidArgument("CSR signature does not verify")
        sans = csr.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        not_before = self.now() - self.backdate
        return (
            x509.CertificateBuilder()
            .subject_name(x509.Name([]))
            .issuer_name(self.name)
            .public_key(csr.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(not_before)
            .not_valid_after(self.now() + (lifetime or self.lifetime))
            .add_extension(sans, critical=True)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.ExtendedKeyUsage(
                    [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
                ),
                critical=False,
            )
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(self.key.public_key()),
                critical=False,
            )
            .sign(self.key, hashes.SHA256())
        )

    async def certify(self, csr_der: bytes, identity: str) -> Issued:
        csr = x509.load_der_x509_csr(csr_der)
        self.requests.append((csr, identity, self.now()))
        if self.fail_with is not None:
            self.failures += 1
            raise self.fail_with
        leaf = self.sign(csr)
        return Issued(leaf.public_bytes(serialization.Encoding.DER), (), leaf.not_valid_after_utc)


# ---------------------------------------------------------------- the helper itself


async def test_local_ca_leaves_verify_against_its_certificate() -> None:
    ca = LocalCA()
    rotator = CertificateRotator(ca, "spiffe://waygate.local/ns/t/sa/a", ["ip:127.0.0.1"])
    held = await rotator.obtain()
    held.leaf.verify_directly_issued_by(ca.certificate)  # raises if the signature is wrong
    sans = held.leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.UniformResourceIdentifier) == [
        "spiffe://waygate.local/ns/t/sa/a"
    ]
    assert [str(ip) for ip in sans.get_values_for_type(x509.IPAddress)] == ["127.0.0.1"]


async def test_local_ca_refuses_while_failing() -> None:
    ca = LocalCA()
    ca.fail_with = errors.Unavailable("down")
    rotator = CertificateRotator(ca, "a.example")
    try:
        await rotator.renew_once()
    except errors.Unavailable:
        pass
    else:
        raise AssertionError("a failing CA issued a certificate")
    assert ca.failures == 1 and not rotator.has_certificate
