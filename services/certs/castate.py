"""The CA state the authority keeps: CA records, how one is made, and their stored form.

A `CARecord` is one CA: key, certificate and its place in the rotation
(`CAState`, when it starts signing, when it retires, the bound on its leaves'
not_after). `make_ca` creates one (key and self-signed certificate; no lock,
no I/O). `AuthorityState` is everything the authority keeps (the records, the
bundle version, the CA generation, the rotation's record), `first_state` a
new authority's; `encode_state` and `decode_state` turn it into a `CAStore`'s
files and back.

Invariants:
- a `Checkpoint` holds every field a change may touch (the records' rotation
  fields and leaf bounds, the rotation's record, version, generation):
  `restore` puts the state back exactly, so a store write that fails leaves
  memory as the store has it;
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
from typing import TYPE_CHECKING, Any

from cryptography import x509
from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa
from cryptography.x509.oid import NameOID

from waygate.core.errors import FailedPrecondition, InvalidArgument

if TYPE_CHECKING:
    # config reads defaults of modules that read this one: for the annotation only.
    from waygate.certs.config import AuthorityConfig

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
    #: An upstream authority's root above this (intermediate) CA: what the bundle
    #: publishes for it; None when this CA is its own root.
    anchor: x509.Certificate | None = None
    fingerprint: str = dataclasses.field(init=False)
    #: Fingerprint of what the bundle publishes for it (its anchor, or itself).
    published_fingerprint: str = dataclasses.field(init=False)
    aki: x509.AuthorityKeyIdentifier = dataclasses.field(init=False)  # what its leaves carry
    # Read once: each access to these on a certificate parses them anew.
    subject: x509.Name = dataclasses.field(init=False)
    not_before: datetime = dataclasses.field(init=False)
    not_after: datetime = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.fingerprint = fingerprint(self.cert)
        self.published_fingerprint = (
            self.fingerprint if self.anchor is None else fingerprint(self.anchor)
        )
        self.subject = self.cert.subject
        self.not_before = self.cert.not_valid_before_utc
        self.not_after = self.cert.not_valid_after_utc
        ski = self.cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
        self.aki = x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ski)

    @property
    def chain(self) -> tuple[x509.Certificate, ...]:
        """What is served with each leaf it signs: itself when it is an intermediate."""
        return () if self.anchor is None else (self.cert,)

    @property
    def signs_until(self) -> datetime:
        """No leaf it signs may outlive this: its own expiry, or its anchor's if sooner."""
        if self.anchor is None:
            return self.not_after
        return min(self.not_after, self.anchor.not_valid_after_utc)

    def view(self) -> CAView:
        """What the bundle publishes for it: its anchor (upstream mode), or itself."""
        if self.anchor is None:
            return CAView(self.cert, self.state, self.fingerprint, self.not_after)
        return CAView(
            self.anchor,
            self.state,
            self.published_fingerprint,
            self.anchor.not_valid_after_utc,
        )


@dataclasses.dataclass(frozen=True)
class Upstream:
    """An organisation's intermediate CA for certs to sign with (upstream authority)."""

    key: PrivateKey
    cert: x509.Certificate
    #: The organisation's root above it: what the trust bundle publishes.
    anchor: x509.Certificate
    #: Where it came from, for messages ("--ca-cert /etc/ca/intermediate.pem").
    source: str

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.cert)

    def check(self, *, now: datetime, needed_life: timedelta) -> None:
        """See `check_upstream`."""
        check_upstream(
            self.key, self.cert, self.anchor, now=now, needed_life=needed_life, what=self.source
        )

    def record(self, generation: int, state: CAState) -> CARecord:
        """The CA record certs keeps for it, as the CA of `generation`."""
        return CARecord(
            name=f"ca-{generation}", key=self.key, cert=self.cert, state=state, anchor=self.anchor
        )


def check_upstream(
    key: PrivateKey,
    cert: x509.Certificate,
    anchor: x509.Certificate,
    *,
    now: datetime,
    needed_life: timedelta,
    what: str,
) -> None:
    """An upstream authority's intermediate Waygate can sign with and rotate safely:
    a CA certificate for `key`, issued by `anchor`, with at least `needed_life` left
    (two maximum leaf lifetimes plus the least propagation delay). FailedPrecondition
    naming `what` (where it came from) otherwise."""
    public = serialization.PublicFormat.SubjectPublicKeyInfo
    der = serialization.Encoding.DER
    if key.public_key().public_bytes(der, public) != cert.public_key().public_bytes(der, public):
        raise FailedPrecondition(f"{what}: the CA key does not match the CA certificate")
    try:
        constraints = cert.extensions.get_extension_for_class(x509.BasicConstraints).value
    except x509.ExtensionNotFound:
        constraints = None
    if constraints is None or not constraints.ca:
        raise FailedPrecondition(f"{what}: the CA certificate is not a CA (basicConstraints)")
    try:
        cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier)
    except x509.ExtensionNotFound:
        raise FailedPrecondition(
            f"{what}: the CA certificate has no subjectKeyIdentifier (leaves need it)"
        ) from None
    try:
        cert.verify_directly_issued_by(anchor)
    except (ValueError, TypeError, InvalidSignature) as exc:
        raise FailedPrecondition(
            f"{what}: the CA certificate is not issued by the trust anchor "
            f"({anchor.subject.rfc4514_string()}): {exc or 'bad signature'}"
        ) from None
    until = min(cert.not_valid_after_utc, anchor.not_valid_after_utc)
    if until - now < needed_life:
        raise FailedPrecondition(
            f"{what}: the CA can sign until {until.isoformat()}, "
            f"{(until - now).total_seconds() / 86400:.1f} days from now; rotating safely "
            f"needs at least {needed_life.total_seconds() / 86400:.1f} days (two maximum leaf lifetimes "
            "plus the propagation delay): give a longer-lived intermediate, or shorten "
            "--max-leaf-lifetime"
        )


def make_ca(
    config: AuthorityConfig,
    *,
    generation: int,
    lifetime: timedelta,
    state: CAState,
    now: datetime,
) -> CARecord:
    """A new CA key and self-signed certificate, as `config` says; changes nothing
    (needs no lock: an RSA key takes seconds)."""
    now = whole_seconds(now)
    key = generate_key(config.key_algorithm)
    name = x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, config.organization),
            # A distinct name per generation: old and new CA never share a subject.
            x509.NameAttribute(NameOID.COMMON_NAME, f"{config.trust_domain} CA {generation}"),
        ]
    )
    ski = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(random_serial())
        .not_valid_before(now - config.backdate)
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


def first_state(
    config: AuthorityConfig, now: datetime, upstream: Upstream | None
) -> AuthorityState:
    """The state of a new authority (first start): one ACTIVE CA, made here or the
    upstream's intermediate, as generation 1 at bundle version 1."""
    if upstream is None:
        ca = make_ca(
            config, generation=1, lifetime=config.ca_lifetime, state=CAState.ACTIVE, now=now
        )
    else:
        ca = upstream.record(1, CAState.ACTIVE)
    return AuthorityState([ca], version=1, generation=1, rotation={})


@dataclasses.dataclass
class AuthorityState:
    """Everything the authority keeps and stores: its CAs, the bundle version, the CA
    generation (of the newest CA made) and the rotation's own record."""

    cas: list[CARecord]
    version: int
    generation: int
    #: What the rotation state machine persists beyond the CAs (`waygate.certs.rotation`).
    rotation: dict[str, Any]

    def files(self, *, adding: CARecord | None = None) -> dict[str, bytes]:
        """The store's files for this state; with `adding`, for this state plus that
        new CA, one version and one generation on (a rotation's write, made before
        the new CA is swapped in)."""
        if adding is None:
            return encode_state(
                self.cas, version=self.version, generation=self.generation, rotation=self.rotation
            )
        return encode_state(
            [*self.cas, adding],
            version=self.version + 1,
            generation=self.generation + 1,
            rotation=self.rotation,
        )

    def add(self, new: CARecord) -> None:
        """A rotation's new CA is in (the state `files(adding=new)` stored)."""
        self.cas.append(new)
        self.generation += 1
        self.version += 1

    def adopt(self, other: AuthorityState) -> bool:
        """Take another replica's stored state; True when its bundle differs, and then
        the version moves past both (watchers of either replica see a change)."""
        before = [(ca.name, ca.state) for ca in self.cas]
        self.cas, self.generation, self.rotation = other.cas, other.generation, other.rotation
        if [(ca.name, ca.state) for ca in self.cas] == before:
            return False
        self.version = max(self.version + 1, other.version)
        return True

    def checkpoint(self) -> Checkpoint:
        """What a change may touch, to put back when the store refuses the new state."""
        return Checkpoint(
            list(self.cas),
            [(c.state, c.activate_at, c.retire_after, c.leaf_bound) for c in self.cas],
            dict(self.rotation),
            self.version,
            self.generation,
        )

    def restore(self, checkpoint: Checkpoint) -> None:
        """Back to `checkpoint` (the records as they were, the same objects)."""
        for ca, fields in zip(checkpoint.cas, checkpoint.fields, strict=True):
            ca.state, ca.activate_at, ca.retire_after, ca.leaf_bound = fields
        self.cas, self.rotation = checkpoint.cas, checkpoint.rotation
        self.version, self.generation = checkpoint.version, checkpoint.generation


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """An `AuthorityState` as it was (see `AuthorityState.checkpoint`)."""

    cas: list[CARecord]
    fields: list[tuple[CAState, datetime | None, datetime | None, datetime | None]]
    rotation: dict[str, Any]
    version: int
    generation: int


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
        if ca.anchor is not None:
            files[f"{ca.name}.anchor.pem"] = ca.anchor.public_bytes(serialization.Encoding.PEM)
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


def decode_state(files: dict[str, bytes], where: str) -> AuthorityState:
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
        anchor = None
        anchor_name = f"{name}.anchor.pem"
        if anchor_name in files:
            try:
                anchor = x509.load_pem_x509_certificate(files[anchor_name])
            except ValueError as exc:
                raise FailedPrecondition(
                    f"CA trust anchor {anchor_name} in {where} is unreadable: {exc}"
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
                anchor=anchor,
            )
        )
    if sum(1 for c in cas if c.state is CAState.ACTIVE) != 1:
        raise FailedPrecondition(f"CA state in {where} must have exactly one ACTIVE CA")
    return AuthorityState(cas, version, generation, rotation)
