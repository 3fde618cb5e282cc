"""Throw-away PKI for tests: the one place tests make keys, CSRs and certificates.

Everything here signs with `cryptography` for real (no stubs): every leaf
chains to its CA and carries the SANs asked for, so TLS handshakes, `openssl
verify` and the rotation client treat it like certs' own output. Keys are made
here, in the test's process, and written 0600 when written at all.

- `general_names` / `make_csr`: "kind:value" SANs (dns, uri, ip, email) and CSRs.
- `self_signed`: a route certificate and key for a host (PEM text).
- `LocalCA`: a CA under a clock the test controls. It issues certificates
  (`issue`, `write_files`), signs CSRs (`sign`) and is an `Issuer` for the
  rotation client (`certify`); `fail_with` makes it fail like an unreachable certs.
  Its leaves are backdated 5 minutes by default, as certs' are (`--clock-skew`):
  a leaf's not_before is a whole second, and TLS libraries check it against
  time(2), which reads the kernel's coarse clock and lags the precise clock
  `datetime.now` reads by up to one tick (4 ms at HZ=250). Without a backdate, a
  leaf issued in a second's first few milliseconds and presented at once is "not
  yet valid": the peer aborts the handshake (gRPC's client sees UNAVAILABLE
  "Socket closed"), as test_write_access did once in CI.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from waygate.core import errors
from waygate.core.rotation import Issued, TrustBundle


def general_names(names: Sequence[str]) -> list[x509.GeneralName]:
    """x509 names from "dns:host", "uri:spiffe://...", "ip:127.0.0.1", "email:a@b"."""
    result: list[x509.GeneralName] = []
    for name in names:
        kind, _, value = name.partition(":")
        if kind == "dns":
            result.append(x509.DNSName(value))
        elif kind == "uri":
            result.append(x509.UniformResourceIdentifier(value))
        elif kind == "ip":
            result.append(x509.IPAddress(ipaddress.ip_address(value)))
        elif kind == "email":
            result.append(x509.RFC822Name(value))
        else:
            raise ValueError(f"unknown SAN kind in {name!r}")
    return result


def make_csr(
    names: Sequence[str] = (), key: object | None = None, *, critical: bool = True
) -> tuple[x509.CertificateSigningRequest, object]:
    """A CSR with an empty subject asking for `names`, signed by `key` (new P-256 if None)."""
    key = key or ec.generate_private_key(ec.SECP256R1())
    builder = x509.CertificateSigningRequestBuilder().subject_name(x509.Name([]))
    if names:
        builder = builder.add_extension(
            x509.SubjectAlternativeName(general_names(names)), critical=critical
        )
    algorithm = None if isinstance(key, ed25519.Ed25519PrivateKey) else hashes.SHA256()
    return builder.sign(key, algorithm), key  # type: ignore[arg-type]


def certificate_pem(certificate: x509.Certificate) -> bytes:
    return certificate.public_bytes(serialization.Encoding.PEM)


def private_key_pem(key: object) -> bytes:
    """Unencrypted PKCS#8 PEM (test keys only)."""
    return key.private_bytes(  # type: ignore[attr-defined]
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def self_signed(host: str = "web.example.com") -> tuple[str, str]:
    """(certificate PEM, unencrypted key PEM) of a self-signed certificate for `host`."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, host)])
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=1))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(host)]), critical=False)
        .sign(key, hashes.SHA256())
    )
    return certificate_pem(cert).decode(), private_key_pem(key).decode()


@dataclass(frozen=True)
class IdentityFiles:
    """Where `LocalCA.write_files` put a certificate, its key (0600) and the CA."""

    cert: Path
    key: Path
    ca: Path


_BOTH_USAGES = x509.ExtendedKeyUsage(
    [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
)
_CLIENT_USAGE = x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH])


class LocalCA:
    """A real CA for tests: issues leaves, signs CSRs, and certifies like certs does.

    `backdate` is how far before `now()` a leaf's validity starts (certs' default;
    see the module docstring for why 0 flakes); tests of renewal arithmetic under a
    fake clock may set it."""

    def __init__(
        self,
        now: Callable[[], dt.datetime] = lambda: dt.datetime.now(dt.UTC),
        *,
        lifetime: dt.timedelta = dt.timedelta(hours=24),
        backdate: dt.timedelta = dt.timedelta(minutes=5),
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
        return certificate_pem(self.certificate)

    def bundle(self, version: int = 1) -> TrustBundle:
        return TrustBundle(version=version, certificates=(self.certificate,))

    def _leaf(
        self,
        public_key: object,
        sans: x509.SubjectAlternativeName,
        lifetime: dt.timedelta | None = None,
        usages: x509.ExtendedKeyUsage = _BOTH_USAGES,
        subject: x509.Name | None = None,
        backdate: dt.timedelta | None = None,
    ) -> x509.Certificate:
        return (
            x509.CertificateBuilder()
            .subject_name(subject or x509.Name([]))
            .issuer_name(self.name)
            .public_key(public_key)  # type: ignore[arg-type]
            .serial_number(x509.random_serial_number())
            .not_valid_before(self.now() - (self.backdate if backdate is None else backdate))
            .not_valid_after(self.now() + (lifetime or self.lifetime))
            .add_extension(sans, critical=True)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(usages, critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(self.key.public_key()),
                critical=False,
            )
            .sign(self.key, hashes.SHA256())
        )

    def sign(
        self, csr: x509.CertificateSigningRequest, lifetime: dt.timedelta | None = None
    ) -> x509.Certificate:
        """A leaf for the CSR's key and SANs, with the extended key usages the CSR asks
        for (as certs does), server and client auth when it asks for none."""
        if not csr.is_signature_valid:
            raise errors.InvalidArgument("CSR signature does not verify")
        sans = csr.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        try:
            usages = csr.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
        except x509.ExtensionNotFound:
            usages = _BOTH_USAGES
        return self._leaf(csr.public_key(), sans, lifetime, usages)

    def issue(
        self,
        *,
        uris: Sequence[str] = (),
        dns: Sequence[str] = (),
        ips: Sequence[str] = (),
        client_only: bool = False,
        common_name: str = "",
        lifetime: dt.timedelta | None = None,
    ) -> tuple[bytes, bytes]:
        """(certificate PEM, key PEM) with these SANs, for client and server use, or with
        `client_only` for client use only (a tunnel agent's role); `common_name`: the
        subject's CN (else an empty subject); a negative `lifetime` makes it expired."""
        key = ec.generate_private_key(ec.SECP256R1())
        names = [f"uri:{u}" for u in uris] + [f"dns:{d}" for d in dns] + [f"ip:{i}" for i in ips]
        subject = (
            x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
            if common_name
            else None
        )
        leaf = self._leaf(
            key.public_key(),
            x509.SubjectAlternativeName(general_names(names)),
            lifetime,
            _CLIENT_USAGE if client_only else _BOTH_USAGES,
            subject,
            # Expired: valid from twice as long ago until `lifetime` ago.
            -2 * lifetime if lifetime is not None and lifetime < dt.timedelta(0) else None,
        )
        return certificate_pem(leaf), private_key_pem(key)

    def intermediate(self, name: str) -> LocalCA:
        """A CA whose certificate this CA signs (its `pem` is the intermediate's)."""
        child = LocalCA(self.now, lifetime=self.lifetime, backdate=self.backdate, name=name)
        child.certificate = (
            x509.CertificateBuilder()
            .subject_name(child.name)
            .issuer_name(self.name)
            .public_key(child.key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(child.certificate.not_valid_before_utc)
            .not_valid_after(child.certificate.not_valid_after_utc)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(
                child.certificate.extensions.get_extension_for_class(x509.KeyUsage).value,
                critical=True,
            )
            .add_extension(
                x509.SubjectKeyIdentifier.from_public_key(child.key.public_key()), critical=False
            )
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(self.key.public_key()),
                critical=False,
            )
            .sign(self.key, hashes.SHA256())
        )
        return child

    def revocation_list(self, revoked: Sequence[bytes] = ()) -> bytes:
        """A CRL (PEM) from this CA revoking the certificates (PEM) given."""
        now = self.now()
        builder = (
            x509.CertificateRevocationListBuilder()
            .issuer_name(self.name)
            .last_update(now - dt.timedelta(hours=1))
            .next_update(now + dt.timedelta(days=1))
        )
        for pem in revoked:
            serial = x509.load_pem_x509_certificate(pem).serial_number
            builder = builder.add_revoked_certificate(
                x509.RevokedCertificateBuilder()
                .serial_number(serial)
                .revocation_date(now - dt.timedelta(minutes=10))
                .build()
            )
        crl = builder.sign(self.key, hashes.SHA256())
        return crl.public_bytes(serialization.Encoding.PEM)

    def write_files(
        self,
        directory: Path,
        *,
        uris: Sequence[str] = (),
        dns: Sequence[str] = (),
        ips: Sequence[str] = (),
        prefix: str = "",
        client_only: bool = False,
    ) -> IdentityFiles:
        """Issue a certificate and write cert.pem, key.pem (0600) and ca.pem into `directory`."""
        cert, key = self.issue(uris=uris, dns=dns, ips=ips, client_only=client_only)
        files = IdentityFiles(
            cert=directory / f"{prefix}cert.pem",
            key=directory / f"{prefix}key.pem",
            ca=directory / f"{prefix}ca.pem",
        )
        directory.mkdir(parents=True, exist_ok=True)
        descriptor = os.open(files.key, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(descriptor, "wb") as out:
            out.write(key)
        files.cert.write_bytes(cert)
        files.ca.write_bytes(self.pem)
        return files

    async def certify(self, csr_der: bytes, identity: str) -> Issued:
        """The rotation client's `Issuer` call: sign the CSR, or fail with `fail_with`."""
        csr = x509.load_der_x509_csr(csr_der)
        self.requests.append((csr, identity, self.now()))
        if self.fail_with is not None:
            self.failures += 1
            raise self.fail_with
        leaf = self.sign(csr)
        return Issued(leaf.public_bytes(serialization.Encoding.DER), (), leaf.not_valid_after_utc)
