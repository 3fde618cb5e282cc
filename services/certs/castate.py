"""The CA state the authority keeps: CA records, how one is made, and their stored form.

A `CARecord` is one CA: key, certificate and its place in the rotation
(`CAState`, when it starts signing, when it retires, the bound on its leaves'
not_after). `make_ca` creates one (key and self-signed certificate; no lock,
no I/O); `encode_state` and `decode_state` turn the records, the bundle
version and the CA generation into a `CAStore`'s files and back.

Invariants:
- decoding refuses (FailedPrecondition, naming the file) anything it cannot
  use: a key that does not parse or does not match its certificate, an
  unknown format, not exactly one ACTIVE CA; it never guesses;
- encoding is a pure function of the records: the same state, the same files;
- a CA's subject names its generation, so old and new CA never share one.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import secrets
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

from cryptography import x509
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa
from cryptography.x509.oid import NameOID

from waygate.core.errors import FailedPrecondition, InvalidArgument

KEY_ALGORITHMS = ("ecdsa-p256", "rsa-2048", "rsa-3072", "ed25519")
STATE_FILE = "state.json"
STATE_FORMAT = 1

PrivateKey = ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey | ed25519.Ed25519PrivateKey


class CAState(enum.Enum):
    STAGED = "STAGED"
    ACTIVE = "ACTIVE"
    RETIRING = "RETIRING"


def utc_now() -> datetime:
    return datetime.now(UTC)


def generate_key(algorithm: str) -> PrivateKey:
    if algorithm == "ecdsa-p256":
        return ec.generate_private_key(ec.SECP256R1())
    if algorithm == "rsa-2048":
        return rsa.generate_private_key(public_exponent=65537, key_size=2048)
    if algorithm == "rsa-3072":
        return rsa.generate_private_key(public_exponent=65537, key_size=3072)
    if algorithm == "ed25519":
        return ed25519.Ed25519PrivateKey.generate()
    raise InvalidArgument(
        f"key algorithm must be one of {', '.join(KEY_ALGORITHMS)}, not {algorithm!r}"
    )


def signature_hash(key: PrivateKey) -> hashes.SHA256 | None:
    return None if isinstance(key, ed25519.Ed25519PrivateKey) else hashes.SHA256()


def fingerprint(cert: x509.Certificate) -> str:
    return hashlib.sha256(cert.public_bytes(serialization.Encoding.DER)).hexdigest()


def whole_seconds(moment: datetime) -> datetime:
    # Certificates carry whole seconds; keep every computed time comparable.
    return moment.replace(microsecond=0)


def iso(moment: datetime | None) -> str | None:
    return None if moment is None else moment.isoformat()


def parse_iso(text: str | None) -> datetime | None:
    return None if text is None else datetime.fromisoformat(text)


def random_serial() -> int:
    # 128 random bits, positive and non-zero (RFC 5280 4.1.2.2).
    while True:
        serial = secrets.randbits(128)
        if serial:
            return serial


@dataclasses.dataclass(frozen=True)
class CAView:
    certificate: x509.Certificate
    state: CAState
    fingerprint: str
    not_after: datetime

    @property
    def pem(self) -> str:
        return self.certificate.public_bytes(serialization.Encoding.PEM).decode()


@dataclasses.dataclass
class CARecord:
    """One CA: its key, its certificate and where it stands in a rotation."""

    name: str  # file stem in the store, "ca-<generation>"
    key: PrivateKey
    cert: x509.Certificate
    state: CAState
    activate_at: datetime | None = None  # STAGED: when it starts signing
    retire_after: datetime | None = None  # RETIRING: when it leaves the bundle
    leaf_bound: datetime | None = None  # persisted, >= every leaf's not_after
    leaf_max: datetime | None = None  # in memory: latest leaf not_after known
    fingerprint: str = dataclasses.field(init=False)
    aki: x509.AuthorityKeyIdentifier = dataclasses.field(init=False)  # what its leaves carry
    # Read once: each access to these on a certificate parses them anew.
    subject: x509.Name = dataclasses.field(init=False)
    not_before: datetime = dataclasses.field(init=False)
    not_after: datetime = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.fingerprint = fingerprint(self.cert)
        self.subject = self.cert.subject
        self.not_before = self.cert.not_valid_before_utc
        self.not_after = self.cert.not_valid_after_utc
        ski = self.cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
        self.aki = x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ski)

    def view(self) -> CAView:
        return CAView(self.cert, self.state, self.fingerprint, self.not_after)


def make_ca(
    *,
    generation: int,
    key_algorithm: str,
    organization: str,
    trust_domain: str,
    lifetime: timedelta,
    backdate: timedelta,
    state: CAState,
    now: datetime,
) -> CARecord:
    """A new CA key and self-signed certificate; changes nothing (needs no lock)."""
    now = whole_seconds(now)
    key = generate_key(key_algorithm)
    name = x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, organization),
            # A distinct name per generation: old and new CA never share a subject.
            x509.NameAttribute(NameOID.COMMON_NAME, f"{trust_domain} CA {generation}"),
        ]
    )
    ski = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(random_serial())
        .not_valid_before(now - backdate)
        .not_valid_after(now + lifetime)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False,
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
        .add_extension(ski, critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ski),
            critical=False,
        )
        .sign(key, signature_hash(key))
    )
    return CARecord(name=f"ca-{generation}", key=key, cert=cert, state=state)


@dataclasses.dataclass
class DecodedState:
    cas: list[CARecord]
    version: int
    generation: int
    #: What the rotation state machine persists beyond the CAs (`waygate.certs.rotation`).
    rotation: dict[str, Any]


def encode_state(
    cas: Sequence[CARecord], *, version: int, generation: int, rotation: dict[str, Any]
) -> dict[str, bytes]:
    """The store's files for `cas` at bundle `version` and CA `generation`."""
    files: dict[str, bytes] = {}
    entries = []
    for ca in cas:
        files[f"{ca.name}.key.pem"] = ca.key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        files[f"{ca.name}.cert.pem"] = ca.cert.public_bytes(serialization.Encoding.PEM)
        entries.append(
            {
                "name": ca.name,
                "state": ca.state.value,
                "fingerprint_sha256": ca.fingerprint,
                "activate_at": iso(ca.activate_at),
                "retire_after": iso(ca.retire_after),
                "leaf_bound": iso(ca.leaf_bound),
            }
        )
    state: dict[str, Any] = {
        "format": STATE_FORMAT,
        "version": version,
        "generation": generation,
        "authorities": entries,
    }
    if rotation:
        # Optional: a store written by an older certs has none, and reads the same.
        state["rotation"] = rotation
    files[STATE_FILE] = json.dumps(state, indent=2).encode() + b"\n"
    return files


def decode_state(files: dict[str, bytes], where: str) -> DecodedState:
    """The records stored in `files` (from the store described by `where`)."""
    if STATE_FILE not in files:
        raise FailedPrecondition(
            f"CA store {where} holds files but no {STATE_FILE}; refusing to create a new CA over it"
        )
    try:
        state = json.loads(files[STATE_FILE])
        if state.get("format") != STATE_FORMAT:
            raise ValueError(f"unknown format {state.get('format')!r}")
        entries = state["authorities"]
        version, generation = int(state["version"]), int(state["generation"])
        rotation = state.get("rotation") or {}
        if not isinstance(rotation, dict):
            raise ValueError("rotation is not an object")
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise FailedPrecondition(f"CA state {STATE_FILE} in {where} is unreadable: {exc}") from None
    cas: list[CARecord] = []
    for entry in entries:
        try:
            name = str(entry["name"])
            state_of = CAState(entry["state"])
            activate_at = parse_iso(entry.get("activate_at"))
            retire_after = parse_iso(entry.get("retire_after"))
            bound = parse_iso(entry.get("leaf_bound"))
        except (KeyError, ValueError, TypeError, AttributeError) as exc:
            raise FailedPrecondition(
                f"CA state {STATE_FILE} in {where} has a bad entry {entry!r}: {exc}"
            ) from None
        key_name, cert_name = f"{name}.key.pem", f"{name}.cert.pem"
        if key_name not in files or cert_name not in files:
            raise FailedPrecondition(f"CA store {where} lacks {key_name} or {cert_name}")
        try:
            key = serialization.load_pem_private_key(files[key_name], password=None)
        except (ValueError, TypeError, UnsupportedAlgorithm) as exc:
            raise FailedPrecondition(f"CA key {key_name} in {where} is unreadable: {exc}") from None
        try:
            cert = x509.load_pem_x509_certificate(files[cert_name])
        except ValueError as exc:
            raise FailedPrecondition(
                f"CA certificate {cert_name} in {where} is unreadable: {exc}"
            ) from None
        if not isinstance(key, PrivateKey):
            raise FailedPrecondition(f"CA key {key_name} in {where} is of an unsupported type")
        public = serialization.PublicFormat.SubjectPublicKeyInfo
        if key.public_key().public_bytes(
            serialization.Encoding.DER, public
        ) != cert.public_key().public_bytes(serialization.Encoding.DER, public):
            raise FailedPrecondition(f"CA key {key_name} does not match {cert_name} in {where}")
        cas.append(
            CARecord(
                name=name,
                key=key,
                cert=cert,
                state=state_of,
                activate_at=activate_at,
                retire_after=retire_after,
                leaf_bound=bound,
                leaf_max=bound,
            )
        )
    if sum(1 for c in cas if c.state is CAState.ACTIVE) != 1:
        raise FailedPrecondition(f"CA state in {where} must have exactly one ACTIVE CA")
    return DecodedState(cas, version, generation, rotation)
