"""The certificate authority: CA keys, leaf signing, trust bundle, CA rotation.

No grpc and no sockets here; the clock is injected (`now`), so rotation is
tested by moving time rather than sleeping.

CA life cycle (one rotation at a time):

    ACTIVE ──RotateCA──> ACTIVE (old) + STAGED (new)     both published
           ──switch_at──> RETIRING (old) + ACTIVE (new)   new signs leaves
           ──last old leaf expired──> ACTIVE (new)        old leaves the bundle

Invariants:
- every CA that signed a leaf still valid is in the published bundle: a CA is
  published before it signs (STAGED for the propagation delay) and stays
  published until `retire_after`, the latest not_after of any leaf it signed;
- a leaf never outlives its CA: not_after is capped at the signing CA's
  not_after (the CA not_after gauge shows the cap coming);
- the latest not_after per CA is persisted as a bound that is always >= the
  true value (it is moved `leaf_bound_step` ahead whenever a leaf passes it),
  so the store is written about once an hour rather than on every issue, and
  a restart can only keep an old CA longer, never drop it early;
- errors raise domain errors before anything is signed, recorded or written;
- the bundle version increases with every change and survives restarts;
- a CSR is bounded before it costs anything: at most `max_sans` SANs, each
  DNS name at most 253 characters and each URI at most 2048, RSA keys of
  2048..4096 bits, ECDSA P-256/P-384 or Ed25519 and nothing else;
- what ListIssued shows is all that is kept of an issued leaf (no certificate,
  no CSR), in `IssuedRecords`, bounded by count and by bytes;
- the authority is thread-safe: signing runs on the event loop when that is
  quick and waits for nothing (`issue_at_once`), else in worker threads (the
  service's executor), while the event loop serves bundles; every public
  method holds one lock, except that a rotation makes its key and writes the
  store without it (it holds the lock only to check and to swap the new CA
  in); every store write is serialised by a second lock, taken inside the
  first, and a rotation never writes files older than the last write; bundle
  listeners and watchers are called on the event loop given to
  `deliver_changes_on`, whichever thread made the change.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import bisect
import collections
import dataclasses
import enum
import functools
import hashlib
import itertools
import json
import logging
import re
import secrets
import threading
from collections.abc import Callable, Iterator, Sequence
from datetime import UTC, datetime, timedelta
from typing import Concatenate, ParamSpec, TypeVar

from cryptography import x509
from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from waygate.certs.store import CAStore
from waygate.core.errors import FailedPrecondition, InvalidArgument, excerpt

log = logging.getLogger(__name__)

KEY_ALGORITHMS = ("ecdsa-p256", "rsa-2048", "rsa-3072", "ed25519")
STATE_FILE = "state.json"
STATE_FORMAT = 1
#: Records of issued leaves kept in memory for ListIssued (this process's life, not
#: persisted), by count and by estimated bytes; past either, expired ones go first.
ISSUED_RECORDS = 100_000
ISSUED_RECORDS_BYTES = 64 * 1024 * 1024
#: What `list_issued` returns without a limit (the newest matching records).
LIST_LIMIT = 10_000
#: Most subject alternative names one CSR may ask for (setting max_sans_per_csr).
MAX_SANS = 100
#: RSA key sizes a CSR may carry: below is weak; above costs every peer's handshake and
#: certs' signature check for nothing (an 8192-bit key verifies ~4x slower than 4096).
MIN_RSA_BITS = 2048
MAX_RSA_BITS = 4096
#: Longest DNS name SAN (RFC 1035) and URI SAN (the SPIFFE ID maximum), in characters.
MAX_DNS_NAME_LENGTH = 253
MAX_URI_LENGTH = 2048
#: What a record costs beyond its strings (objects, tuples, datetimes), for the byte bound.
_RECORD_OVERHEAD = 512
_STRING_OVERHEAD = 64

PrivateKey = ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey | ed25519.Ed25519PrivateKey
CertificatePublicKey = ec.EllipticCurvePublicKey | rsa.RSAPublicKey | ed25519.Ed25519PublicKey


_P = ParamSpec("_P")
_R = TypeVar("_R")


def _locked(
    method: Callable[Concatenate[Authority, _P], _R],
) -> Callable[Concatenate[Authority, _P], _R]:
    """Run an Authority method under its lock, then republish what `trust_bundle` reads
    without it."""

    @functools.wraps(method)
    def locked(self: Authority, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        with self._lock:
            try:
                return method(self, *args, **kwargs)
            finally:
                self._publish()

    return locked


def _leaf_key_usage(*, key_encipherment: bool) -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=True,
        content_commitment=False,
        key_encipherment=key_encipherment,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=False,
        crl_sign=False,
        encipher_only=False,
        decipher_only=False,
    )


# The leaf profile's fixed parts, built once rather than per issue.
_EMPTY_NAME = x509.Name([])
_LEAF_BASIC_CONSTRAINTS = x509.BasicConstraints(ca=False, path_length=None)
_LEAF_KEY_USAGE = _leaf_key_usage(key_encipherment=False)
_RSA_LEAF_KEY_USAGE = _leaf_key_usage(key_encipherment=True)  # RSA key transport (TLS 1.2)
_LEAF_EXTENDED_KEY_USAGE = x509.ExtendedKeyUsage(
    [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
)
#: CA keys whose signature costs little (about 0.05 ms; RSA: 0.5 to 2 ms): `issue_at_once`.
_QUICK_SIGNING_KEYS = (ec.EllipticCurvePrivateKey, ed25519.Ed25519PrivateKey)


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


def _signature_hash(key: PrivateKey) -> hashes.SHA256 | None:
    return None if isinstance(key, ed25519.Ed25519PrivateKey) else hashes.SHA256()


def fingerprint(cert: x509.Certificate) -> str:
    return hashlib.sha256(cert.public_bytes(serialization.Encoding.DER)).hexdigest()


def _whole_seconds(moment: datetime) -> datetime:
    # Certificates carry whole seconds; keep every computed time comparable.
    return moment.replace(microsecond=0)


def _iso(moment: datetime | None) -> str | None:
    return None if moment is None else moment.isoformat()


def _parse_iso(text: str | None) -> datetime | None:
    return None if text is None else datetime.fromisoformat(text)


@dataclasses.dataclass(frozen=True)
class AuthorityConfig:
    trust_domain: str = "waygate.local"
    organization: str = "Waygate"
    key_algorithm: str = "ecdsa-p256"
    ca_lifetime: timedelta = timedelta(days=365)
    default_lifetime: timedelta = timedelta(hours=24)
    max_lifetime: timedelta = timedelta(days=7)
    #: not_before is this far in the past, so peers with a slow clock accept the leaf.
    backdate: timedelta = timedelta(minutes=5)
    #: RotateCA's default wait between publishing a new CA and signing with it.
    propagation_delay: timedelta = timedelta(hours=1)
    leaf_bound_step: timedelta = timedelta(hours=1)
    #: Most SANs one CSR may ask for; more is INVALID_ARGUMENT naming this bound.
    max_sans: int = MAX_SANS
    #: Bounds of the in-memory ListIssued records (count, estimated bytes).
    issued_records: int = ISSUED_RECORDS
    issued_records_bytes: int = ISSUED_RECORDS_BYTES

    @property
    def auto_rotate_before(self) -> timedelta:
        """Rotate by itself when the active CA has this much life left: room for the
        propagation delay and for two full leaf lifetimes, so leaves never get shortened
        by an expiring CA and the old CA can retire before it expires."""
        return self.propagation_delay + 2 * self.max_lifetime


@dataclasses.dataclass(frozen=True)
class Issued:
    leaf: x509.Certificate
    chain: tuple[x509.Certificate, ...]  # intermediates, leaf's issuer first; empty for a root
    valid_until: datetime
    serial: str


@dataclasses.dataclass(frozen=True, slots=True)
class IssuedRecord:
    """What ListIssued shows of one issued leaf, and nothing more."""

    #: Issue order within this process (1, 2, ...): page tokens point at it.
    sequence: int
    serial: str
    identity: str
    dns_names: tuple[str, ...]
    uris: tuple[str, ...]
    not_before: datetime
    not_after: datetime
    issuer_fingerprint: str
    requested_by: str
    #: Estimated bytes, in memory and in a reply (an over-estimate of both).
    size: int


@dataclasses.dataclass(frozen=True)
class IssuedPage:
    records: tuple[IssuedRecord, ...]
    #: Sequence of the last record returned when more may follow; None: the last page.
    next_after: int | None


class IssuedRecords:
    """Records of issued leaves, oldest first, bounded by count and by estimated bytes.

    Past a bound, every expired record is dropped first; if that is not enough,
    the oldest records go, down to 90% of the bound, so room is made rarely
    rather than one O(n) sweep per issue. Not thread-safe: the authority's lock
    guards it.
    """

    def __init__(self, max_count: int, max_bytes: int) -> None:
        self.max_count = max_count
        self.max_bytes = max_bytes
        self._records: collections.deque[IssuedRecord] = collections.deque()
        self._bytes = 0
        self._sequence = 0
        #: <= the earliest not_after held: no record has expired before it.
        self._earliest: datetime | None = None

    def __len__(self) -> int:
        return len(self._records)

    @property
    def bytes(self) -> int:
        return self._bytes

    def add(
        self,
        *,
        serial: str,
        identity: str,
        dns_names: tuple[str, ...],
        uris: tuple[str, ...],
        not_before: datetime,
        not_after: datetime,
        issuer_fingerprint: str,
        requested_by: str,
        now: datetime,
    ) -> IssuedRecord:
        strings = (serial, identity, *dns_names, *uris, issuer_fingerprint, requested_by)
        # UTF-8 bytes, as a reply carries them (names are ASCII; requested_by may not be).
        size = _RECORD_OVERHEAD + sum(len(text.encode()) + _STRING_OVERHEAD for text in strings)
        self._sequence += 1
        record = IssuedRecord(
            sequence=self._sequence,
            serial=serial,
            identity=identity,
            dns_names=dns_names,
            uris=uris,
            not_before=not_before,
            not_after=not_after,
            issuer_fingerprint=issuer_fingerprint,
            requested_by=requested_by,
            size=size,
        )
        self._records.append(record)
        self._bytes += size
        if self._earliest is None or not_after < self._earliest:
            self._earliest = not_after
        if len(self._records) > self.max_count or self._bytes > self.max_bytes:
            self._make_room(now)
        return record

    def _make_room(self, now: datetime) -> None:
        if self._earliest is not None and self._earliest < now:
            kept = [r for r in self._records if r.not_after >= now]
            self._records = collections.deque(kept)
            self._bytes = sum(r.size for r in kept)
            self._earliest = min((r.not_after for r in kept), default=None)
        if len(self._records) > self.max_count or self._bytes > self.max_bytes:
            count_goal, bytes_goal = self.max_count * 9 // 10, self.max_bytes * 9 // 10
            while self._records and (len(self._records) > count_goal or self._bytes > bytes_goal):
                self._bytes -= self._records.popleft().size

    def newest(
        self, *, identity: str, include_expired: bool, limit: int, now: datetime
    ) -> list[IssuedRecord]:
        """Matching records, oldest first; at most the newest `limit` of them."""
        newest_first = (
            r
            for r in reversed(self._records)
            if (not identity or r.identity == identity) and (include_expired or r.not_after >= now)
        )
        return list(reversed(list(itertools.islice(newest_first, limit))))

    def page(
        self,
        *,
        identity: str,
        include_expired: bool,
        after: int,
        size: int,
        max_bytes: int,
        now: datetime,
    ) -> IssuedPage:
        """Matching records issued after sequence `after`, oldest first: at most `size`
        of them and at most `max_bytes` (estimated; at least one record per page)."""
        start = bisect.bisect_right(self._records, after, key=lambda r: r.sequence)
        records: list[IssuedRecord] = []
        used = 0
        for record in itertools.islice(self._records, start, None):
            if identity and record.identity != identity:
                continue
            if not include_expired and record.not_after < now:
                continue
            if records and (len(records) >= size or used + record.size > max_bytes):
                return IssuedPage(tuple(records), records[-1].sequence)
            records.append(record)
            used += record.size
        return IssuedPage(tuple(records), None)


@dataclasses.dataclass(frozen=True)
class CAView:
    certificate: x509.Certificate
    state: CAState
    fingerprint: str
    not_after: datetime

    @property
    def pem(self) -> str:
        return self.certificate.public_bytes(serialization.Encoding.PEM).decode()


@dataclasses.dataclass(frozen=True)
class TrustBundleView:
    version: int
    authorities: tuple[CAView, ...]

    @property
    def pem(self) -> str:
        return "".join(a.pem for a in self.authorities)

    @property
    def certificates(self) -> tuple[x509.Certificate, ...]:
        return tuple(a.certificate for a in self.authorities)


@dataclasses.dataclass(frozen=True)
class Rotation:
    new_authority: CAView
    signing_switch_at: datetime
    old_retire_after: datetime  # at the latest: the old CA may sign until the switch
    bundle: TrustBundleView


@dataclasses.dataclass
class _CA:
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


class Authority:
    """Signs leaves with the active CA and keeps the trust bundle, persisted in a CAStore."""

    def __init__(
        self,
        store: CAStore,
        config: AuthorityConfig,
        cas: list[_CA],
        *,
        version: int,
        generation: int,
        now: Callable[[], datetime],
    ) -> None:
        self.store = store
        self.config = config
        self._now = now
        self._cas = cas
        self._version = version
        self._generation = generation
        self._issued = IssuedRecords(config.issued_records, config.issued_records_bytes)
        self._listeners: list[Callable[[TrustBundleView], None]] = []
        self._changed: asyncio.Event | None = None
        # Every public method holds it: signing runs in worker threads.
        self._lock = threading.RLock()
        # Every store write holds it (inside `_lock` where both are held, never the
        # other way round), and `_saves` counts them: a rotation writes the store
        # without `_lock` and needs to know whether another write came between.
        self._store_lock = threading.Lock()
        self._saves = 0
        # One rotation at a time; taken before `_lock`, never while holding it.
        self._rotating = threading.Lock()
        # Where listeners and watchers hear of changes made in worker threads.
        self._loop: asyncio.AbstractEventLoop | None = None
        # What the event loop reads without the lock (a signing thread holds it across
        # signing and store writes): the bundle, until when it holds (the next
        # bundle transition) and the next transition of any kind (the timer's). One
        # tuple, replaced whole, so a reader never pairs a bundle with another's deadline.
        self._published = self._snapshot()
        # The newest bundle version listeners were told of: a change made in a thread
        # is delivered later than one made on the loop, and must not overwrite it.
        self._delivered_version = version

    # ------------------------------------------------------------ opening

    @classmethod
    def open(
        cls,
        store: CAStore,
        config: AuthorityConfig | None = None,
        *,
        now: Callable[[], datetime] = utc_now,
    ) -> Authority:
        """Load the CA from `store`, or create and save one on first start.

        Raises FailedPrecondition when what is stored cannot be used (unsafe or
        unreadable key, key and certificate that do not match, bad state).
        """
        config = config or AuthorityConfig()
        files = store.load()
        if files is None:
            authority = cls(store, config, [], version=0, generation=0, now=now)
            ca = authority._new_ca(config.ca_lifetime, CAState.ACTIVE)
            authority._cas.append(ca)
            authority._version = 1
            authority._save()
            authority._publish()
            log.info(
                "created CA",
                extra={"store": store.description, "fingerprint": ca.fingerprint},
            )
            return authority
        authority = cls._from_files(store, config, files, now)
        authority.advance()
        log.info(
            "loaded CA",
            extra={
                "store": store.description,
                "authorities": [(c.name, c.state.value, c.fingerprint) for c in authority._cas],
            },
        )
        return authority

    @classmethod
    def _from_files(
        cls,
        store: CAStore,
        config: AuthorityConfig,
        files: dict[str, bytes],
        now: Callable[[], datetime],
    ) -> Authority:
        where = store.description
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
        except (ValueError, KeyError, TypeError) as exc:
            raise FailedPrecondition(
                f"CA state {STATE_FILE} in {where} is unreadable: {exc}"
            ) from None
        cas: list[_CA] = []
        for entry in entries:
            try:
                name = str(entry["name"])
                state_of = CAState(entry["state"])
                activate_at = _parse_iso(entry.get("activate_at"))
                retire_after = _parse_iso(entry.get("retire_after"))
                bound = _parse_iso(entry.get("leaf_bound"))
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
                raise FailedPrecondition(
                    f"CA key {key_name} in {where} is unreadable: {exc}"
                ) from None
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
                _CA(
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
        return cls(store, config, cas, version=version, generation=generation, now=now)

    # ------------------------------------------------------------ persistence

    def _files(
        self,
        cas: Sequence[_CA] | None = None,
        *,
        version: int | None = None,
        generation: int | None = None,
    ) -> dict[str, bytes]:
        """The store's files for the state in memory, or for `cas` at `version` and
        `generation` (a rotation's, before it is swapped in)."""
        files: dict[str, bytes] = {}
        entries = []
        for ca in self._cas if cas is None else cas:
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
                    "activate_at": _iso(ca.activate_at),
                    "retire_after": _iso(ca.retire_after),
                    "leaf_bound": _iso(ca.leaf_bound),
                }
            )
        state = {
            "format": STATE_FORMAT,
            "version": self._version if version is None else version,
            "generation": self._generation if generation is None else generation,
            "authorities": entries,
        }
        files[STATE_FILE] = json.dumps(state, indent=2).encode() + b"\n"
        return files

    def _save(self) -> None:
        """Write the state in memory (under `_lock`)."""
        self._write(self._files())

    def _write(self, files: dict[str, bytes]) -> int:
        """Write `files` to the store; returns the number of this write."""
        with self._store_lock:
            return self._write_holding_store_lock(files)

    def _write_holding_store_lock(self, files: dict[str, bytes]) -> int:
        try:
            self.store.save(files)
        except OSError as exc:
            raise FailedPrecondition(
                f"cannot save the CA to {self.store.description}: {exc.strerror or exc}"
            ) from None
        self._saves += 1
        return self._saves

    # ------------------------------------------------------------ CA creation

    def _new_ca(self, lifetime: timedelta, state: CAState) -> _CA:
        self._generation += 1
        return self._make_ca(self._generation, lifetime, state)

    def _make_ca(self, generation: int, lifetime: timedelta, state: CAState) -> _CA:
        """A new CA key and self-signed certificate; changes nothing (needs no lock)."""
        now = _whole_seconds(self._now())
        key = generate_key(self.config.key_algorithm)
        name = x509.Name(
            [
                x509.NameAttribute(NameOID.ORGANIZATION_NAME, self.config.organization),
                # A distinct name per generation: old and new CA never share a subject.
                x509.NameAttribute(
                    NameOID.COMMON_NAME,
                    f"{self.config.trust_domain} CA {generation}",
                ),
            ]
        )
        ski = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
        cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(key.public_key())
            .serial_number(_random_serial())
            .not_valid_before(now - self.config.backdate)
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
            .sign(key, _signature_hash(key))
        )
        return _CA(name=f"ca-{generation}", key=key, cert=cert, state=state)

    # ------------------------------------------------------------ time

    @_locked
    def advance(self) -> bool:
        """Apply the transitions due by now (switch, retirement); True when the bundle changed.

        Persists and notifies on change. Called by every public operation and
        by the server's timer, so watchers see a change when it is due. If the
        store refuses the new state, memory is put back as it was and the error
        raised: the transition is tried again on the next call.
        """
        now = self._now()
        changed = False
        before = (list(self._cas), [(c.state, c.activate_at, c.retire_after) for c in self._cas])
        staged = self._find(CAState.STAGED)
        if staged is not None and staged.activate_at is not None and now >= staged.activate_at:
            active = self._find(CAState.ACTIVE)
            if active is not None:
                active.state = CAState.RETIRING
                # Nothing signed by the old CA outlives its latest leaf; no leaf: retire now.
                active.retire_after = active.leaf_max or _whole_seconds(now)
            staged.state, staged.activate_at = CAState.ACTIVE, None
            changed = True
            log.info("CA rotation: new CA signs", extra={"fingerprint": staged.fingerprint})
        for ca in list(self._cas):
            if (
                ca.state is CAState.RETIRING
                and ca.retire_after is not None
                and now > ca.retire_after
            ):
                self._cas.remove(ca)
                changed = True
                log.info("CA rotation: old CA retired", extra={"fingerprint": ca.fingerprint})
        if changed:
            self._version += 1
            try:
                self._save()
            except BaseException:
                self._version -= 1
                self._cas = before[0]
                for ca, (state, activate_at, retire_after) in zip(*before, strict=True):
                    ca.state, ca.activate_at, ca.retire_after = state, activate_at, retire_after
                raise
            self._notify()
        return changed

    def rotate_if_expiring(self) -> Rotation | None:
        """Start a rotation when the active CA nears its end and none is in progress.

        The CA rotates itself: nobody has to remember a yearly RotateCA, and an
        expiring CA never shortens leaves or stops signing.
        """
        if not self._expiring():
            return None
        try:
            return self.rotate()
        except FailedPrecondition:
            if self._rotation_started():
                return None  # a RotateCA came first
            raise

    @_locked
    def _expiring(self) -> bool:
        self.advance()
        if len(self._cas) != 1:
            return False
        active = self._active()
        if active.not_after - self._now() > self.config.auto_rotate_before:
            return False
        log.warning(
            "CA expires soon; rotating it",
            extra={"fingerprint": active.fingerprint, "not_after": _iso(active.not_after)},
        )
        return True

    @_locked
    def _rotation_started(self) -> bool:
        return len(self._cas) != 1

    def next_transition(self) -> datetime | None:
        """When `advance` (or `rotate_if_expiring`) will next change something; read
        without the lock (the timer asks on the event loop)."""
        return self._published[2]

    def _next_transition(self) -> datetime | None:
        moments = [c.activate_at for c in self._cas if c.state is CAState.STAGED]
        if len(self._cas) == 1:
            moments.append(self._cas[0].not_after - self.config.auto_rotate_before)
        moments += [
            c.retire_after + timedelta(seconds=1)
            for c in self._cas
            if c.state is CAState.RETIRING and c.retire_after is not None
        ]
        return min((m for m in moments if m is not None), default=None)

    def _find(self, state: CAState) -> _CA | None:
        return next((c for c in self._cas if c.state is state), None)

    def _active(self) -> _CA:
        active = self._find(CAState.ACTIVE)
        if active is None:  # _from_files and advance keep exactly one
            raise FailedPrecondition("the CA has no active signing key")
        return active

    # ------------------------------------------------------------ signing

    @_locked
    def issue(
        self,
        csr: x509.CertificateSigningRequest,
        *,
        identity: str,
        requested_by: str,
        lifetime: timedelta | None = None,
        public_key: CertificatePublicKey | None = None,
        extended_usages: Sequence[x509.ObjectIdentifier] = (),
    ) -> Issued:
        """Sign `csr` with the active CA. Policy checks are the caller's (see policy.py).

        `public_key`: what `check_csr(csr)` returned, when the caller already ran
        it (parsing and verifying the key twice is a third of the signing cost).
        `extended_usages`: the leaf's extended key usages; empty: those the CSR asks
        for (`requested_usages`), serverAuth and clientAuth (what every Waygate process
        needs) when it asks for none.
        """
        issued = self._sign(
            csr,
            identity=identity,
            requested_by=requested_by,
            lifetime=lifetime,
            public_key=public_key,
            extended_usages=extended_usages,
            at_once=False,
        )
        assert issued is not None  # only the at-once path declines
        return issued

    def issue_at_once(
        self,
        csr: x509.CertificateSigningRequest,
        *,
        identity: str,
        requested_by: str,
        lifetime: timedelta | None = None,
        public_key: CertificatePublicKey | None = None,
        extended_usages: Sequence[x509.ObjectIdentifier] = (),
    ) -> Issued | None:
        """`issue`, when it can be done at once on the calling thread (the event loop):
        the lock is free, the active CA signs quickly (ECDSA or Ed25519; an RSA
        signature takes 0.5 to 2 ms), no CA transition is due and the leaf stays
        within the stored leaf bound (no store write). Otherwise None, with nothing
        done: the caller runs `issue` in a signing thread, which may wait and write.
        Errors are `issue`'s.
        """
        if not self._lock.acquire(blocking=False):
            return None
        try:
            # Nothing published changes when nothing is due (checked first): no _publish.
            return self._sign(
                csr,
                identity=identity,
                requested_by=requested_by,
                lifetime=lifetime,
                public_key=public_key,
                extended_usages=extended_usages,
                at_once=True,
            )
        finally:
            self._lock.release()

    def _sign(
        self,
        csr: x509.CertificateSigningRequest,
        *,
        identity: str,
        requested_by: str,
        lifetime: timedelta | None,
        public_key: CertificatePublicKey | None,
        extended_usages: Sequence[x509.ObjectIdentifier],
        at_once: bool,
    ) -> Issued | None:
        """Under the lock: `issue`, or with `at_once` None when it would wait or write."""
        if at_once:
            due = self._advance_due()
            if due is not None and self._now() >= due:
                return None
            if not isinstance(self._active().key, _QUICK_SIGNING_KEYS):
                return None
        if lifetime is None:
            lifetime = self.config.default_lifetime
        if lifetime <= timedelta(0):
            raise InvalidArgument(f"lifetime must be positive, not {lifetime}")
        if lifetime > self.config.max_lifetime:
            raise InvalidArgument(
                f"lifetime {_human(lifetime)} exceeds the maximum {_human(self.config.max_lifetime)}"
            )
        if public_key is None:
            public_key = check_csr(csr, max_sans=self.config.max_sans)
        names = _csr_names(csr, self.config.max_sans)
        if not extended_usages:
            extended_usages = requested_usages(csr)
        if not at_once:
            self.advance()
        ca = self._active()
        now = _whole_seconds(self._now())
        not_after = min(now + lifetime, ca.not_after)
        if not_after <= now:
            raise FailedPrecondition("the active CA has expired; rotate the CA")
        raise_bound = ca.leaf_bound is None or not_after > ca.leaf_bound
        if raise_bound and at_once:
            return None
        not_before = max(now - self.config.backdate, ca.not_before)
        serial = _random_serial()
        builder = (
            x509.CertificateBuilder()
            .subject_name(_EMPTY_NAME)
            .issuer_name(ca.subject)
            .public_key(public_key)
            .serial_number(serial)
            .not_valid_before(not_before)
            .not_valid_after(not_after)
            .add_extension(_LEAF_BASIC_CONSTRAINTS, critical=True)
            .add_extension(
                _RSA_LEAF_KEY_USAGE
                if isinstance(public_key, rsa.RSAPublicKey)
                else _LEAF_KEY_USAGE,
                critical=True,
            )
            .add_extension(
                x509.ExtendedKeyUsage(list(extended_usages))
                if extended_usages
                else _LEAF_EXTENDED_KEY_USAGE,
                critical=False,
            )
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), critical=False)
            .add_extension(ca.aki, critical=False)
            # The subject is empty (identities live in the SANs), so RFC 5280 makes the SAN critical.
            .add_extension(x509.SubjectAlternativeName(names.general_names), critical=True)
        )
        leaf = builder.sign(ca.key, _signature_hash(ca.key))
        if raise_bound:
            previous = ca.leaf_bound
            ca.leaf_bound = not_after + self.config.leaf_bound_step
            try:
                self._save()
            except BaseException:
                ca.leaf_bound = previous
                raise
        if ca.leaf_max is None or not_after > ca.leaf_max:
            ca.leaf_max = not_after
        serial_hex = format(serial, "x")
        self._issued.add(
            serial=serial_hex,
            identity=identity,
            dns_names=names.dns,
            uris=names.uris,
            not_before=not_before,
            not_after=not_after,
            issuer_fingerprint=ca.fingerprint,
            requested_by=requested_by,
            now=now,
        )
        return Issued(leaf=leaf, chain=(), valid_until=not_after, serial=serial_hex)

    @_locked
    def list_issued(
        self, *, identity: str = "", include_expired: bool = False, limit: int = LIST_LIMIT
    ) -> list[IssuedRecord]:
        """Matching records, oldest first; at most the newest `limit` of them."""
        return self._issued.newest(
            identity=identity, include_expired=include_expired, limit=limit, now=self._now()
        )

    @_locked
    def issued_page(
        self, *, identity: str, include_expired: bool, after: int, size: int, max_bytes: int
    ) -> IssuedPage:
        """One page of ListIssued: see `IssuedRecords.page`."""
        return self._issued.page(
            identity=identity,
            include_expired=include_expired,
            after=after,
            size=size,
            max_bytes=max_bytes,
            now=self._now(),
        )

    @property
    def issued_records(self) -> IssuedRecords:
        return self._issued

    # ------------------------------------------------------------ bundle and rotation

    def trust_bundle(self) -> TrustBundleView:
        """The bundle now, read without the lock so a signing or a store write in
        progress never holds up a bundle reader.

        On the event loop the published bundle is returned even once a transition
        is due: the rotation timer applies it in a worker thread within moments,
        and until then the stale bundle holds every CA the new one does (a switch
        keeps both, a retirement only drops one). Elsewhere (a thread, a CLI) a
        due transition is applied first.
        """
        published, due, _ = self._published
        if due is None or self._now() < due:
            return published
        loop = self._loop
        if loop is not None and _running_on(loop):
            return published
        return self._advanced_bundle()

    @_locked
    def _advanced_bundle(self) -> TrustBundleView:
        self.advance()
        return self._bundle()

    def _publish(self) -> None:
        # Under the lock, after every locked call and before every notification.
        self._published = self._snapshot()

    def _snapshot(self) -> tuple[TrustBundleView, datetime | None, datetime | None]:
        return (self._bundle(), self._advance_due(), self._next_transition())

    def _advance_due(self) -> datetime | None:
        """When `advance` next changes the bundle (a switch or a retirement)."""
        moments = [c.activate_at for c in self._cas if c.state is CAState.STAGED]
        moments += [
            c.retire_after + timedelta(seconds=1)
            for c in self._cas
            if c.state is CAState.RETIRING and c.retire_after is not None
        ]
        return min((m for m in moments if m is not None), default=None)

    def _bundle(self) -> TrustBundleView:
        return TrustBundleView(self._version, tuple(ca.view() for ca in self._cas))

    @property
    def version(self) -> int:
        return self._version

    @_locked
    def active_authority(self) -> CAView:
        return self._active().view()

    def rotate(
        self,
        *,
        propagation_delay: timedelta | None = None,
        ca_lifetime: timedelta | None = None,
    ) -> Rotation:
        """Stage a new CA; FailedPrecondition while an earlier rotation has not finished.

        The slow parts hold no lock that signing needs: the new key and certificate
        are made first, then the store is written with the new CA added (RSA key
        generation takes seconds, a Secret write a round trip to the API server).
        The lock is held only to check the rotation (again just before the write,
        which must carry the state of the last write) and to swap the new CA in.
        """
        with self._rotating:
            switch_at, lifetime, generation = self._plan_rotation(propagation_delay, ca_lifetime)
            new = self._make_ca(generation, lifetime, CAState.STAGED)
            new.activate_at = switch_at
            # Its bound already covers the leaves of its first `leaf_bound_step` of
            # signing, so they (every workload renewing after an immediate switch) need
            # no store write under the lock: this write, off the lock, carries it.
            new.leaf_bound = switch_at + self.config.max_lifetime + self.config.leaf_bound_step
            while True:
                files, saves = self._rotation_files(new, generation)
                with self._store_lock:
                    # Another write since the files were made would be undone by
                    # these: make them again from the state it wrote.
                    if saves == self._saves:
                        written = self._write_holding_store_lock(files)
                        break
            return self._swap_in(new, generation, written)

    @_locked
    def _plan_rotation(
        self, propagation_delay: timedelta | None, ca_lifetime: timedelta | None
    ) -> tuple[datetime, timedelta, int]:
        """Check a rotation can start: (switch_at, CA lifetime, new CA's generation)."""
        self.advance()
        delay = self.config.propagation_delay if propagation_delay is None else propagation_delay
        lifetime = self.config.ca_lifetime if ca_lifetime is None else ca_lifetime
        if delay < timedelta(0):
            raise InvalidArgument(f"propagation delay must not be negative, not {delay}")
        if lifetime <= self.config.max_lifetime:
            raise InvalidArgument(
                f"CA lifetime {_human(lifetime)} must exceed the maximum leaf lifetime "
                f"{_human(self.config.max_lifetime)}"
            )
        self._check_no_rotation()
        old = self._active()
        switch_at = _whole_seconds(self._now()) + delay
        if switch_at >= old.not_after:
            raise InvalidArgument(
                f"propagation delay {_human(delay)} ends after the active CA expires "
                f"({_iso(old.not_after)}): signing would stop"
            )
        return switch_at, lifetime, self._generation + 1

    def _check_no_rotation(self) -> None:
        busy = next((c for c in self._cas if c.state is not CAState.ACTIVE), None)
        if busy is not None:
            when = busy.activate_at if busy.state is CAState.STAGED else busy.retire_after
            raise FailedPrecondition(
                f"a CA rotation is still in progress: {busy.name} is {busy.state.value} "
                f"until {_iso(when)}"
            )

    def _check_unchanged(self, generation: int) -> None:
        """The state a rotation was planned on is still the one in memory."""
        self._check_no_rotation()
        if self._generation != generation - 1:
            raise FailedPrecondition(
                "the CA state changed while the new CA was made (another replica's "
                "rotation?); retry RotateCA"
            )

    @_locked
    def _rotation_files(self, new: _CA, generation: int) -> tuple[dict[str, bytes], int]:
        """The files of the state in memory plus `new`, and the number of the last
        write they follow."""
        self._check_unchanged(generation)
        files = self._files([*self._cas, new], version=self._version + 1, generation=generation)
        return files, self._saves

    @_locked
    def _swap_in(self, new: _CA, generation: int, written: int) -> Rotation:
        """Serve with `new` (stored as write number `written`) from now on."""
        if any(ca.name == new.name for ca in self._cas):
            # The store's watch brought our own write back first (`adopt`): it is in.
            new = next(ca for ca in self._cas if ca.name == new.name)
        else:
            self._check_unchanged(generation)
            saved = (self._generation, self._version)
            self._cas.append(new)
            self._generation = generation
            self._version += 1
            if self._saves != written:
                # A write came between ours and this swap, made without the new CA.
                try:
                    self._save()
                except BaseException:
                    self._cas.remove(new)
                    self._generation, self._version = saved
                    raise
            self._notify()
        old = self._active()
        assert new.activate_at is not None
        switch_at = new.activate_at
        latest_old_leaf = min(switch_at + self.config.max_lifetime, old.not_after)
        old_retire_after = max(latest_old_leaf, old.leaf_max or latest_old_leaf)
        log.info(
            "CA rotation: new CA staged",
            extra={"fingerprint": new.fingerprint, "signing_switch_at": _iso(switch_at)},
        )
        # An immediate switch (delay 0) happens here, so the reply shows it.
        self.advance()
        return Rotation(new.view(), switch_at, old_retire_after, self._bundle())

    # ------------------------------------------------------------ replicas (cluster mode)

    @_locked
    def adopt(self, files: dict[str, bytes]) -> bool:
        """Take the CA state another replica stored (the leader's, seen through the
        store's watch); True when the bundle changed, and then listeners hear of it.

        Issued records and the latest leaf not_after this replica knows are kept;
        FailedPrecondition (and nothing changed) when the files cannot be used.
        """
        other = type(self)._from_files(self.store, self.config, files, self._now)
        known = {ca.name: ca for ca in self._cas}
        for ca in other._cas:
            mine = known.get(ca.name)
            if mine is not None and mine.leaf_max is not None:
                ca.leaf_max = max(mine.leaf_max, ca.leaf_max or mine.leaf_max)
        before = [(ca.name, ca.state) for ca in self._cas]
        self._cas, self._generation = other._cas, other._generation
        if [(ca.name, ca.state) for ca in self._cas] == before:
            return False
        self._version = max(self._version + 1, other._version)
        self._notify()
        return True

    @_locked
    def with_leaf_bounds(self, until: datetime) -> dict[str, bytes] | None:
        """The files to store for every CA's leaf bound raised to at least `until`;
        None when every bound already is. Memory is not changed: the leader saves
        these files itself (off this lock, so Certify never waits on the write),
        then calls `raise_leaf_bounds`."""
        low = [ca for ca in self._cas if ca.leaf_bound is None or ca.leaf_bound < until]
        if not low:
            return None
        saved = [(ca, ca.leaf_bound) for ca in low]
        try:
            for ca in low:
                ca.leaf_bound = until
            return self._files()
        finally:
            for ca, bound in saved:
                ca.leaf_bound = bound

    @_locked
    def raise_leaf_bounds(self, until: datetime, *, stored: Callable[[], bool]) -> bool:
        """Raise in-memory leaf bounds to `until` if `stored()` (checked under the
        lock) says the files of `with_leaf_bounds(until)` are still what the store
        holds; True when raised. A leaf up to the bound then needs no save."""
        if not stored():
            return False
        for ca in self._cas:
            if ca.leaf_bound is None or ca.leaf_bound < until:
                ca.leaf_bound = until
        return True

    # ------------------------------------------------------------ change notification

    @_locked
    def add_listener(self, listener: Callable[[TrustBundleView], None]) -> None:
        """Call `listener(bundle)` after every bundle change (e.g. to rewrite ca.pem)."""
        self._listeners.append(listener)

    def deliver_changes_on(self, loop: asyncio.AbstractEventLoop) -> None:
        """Call listeners and wake watchers on `loop`, also for changes made in threads."""
        self._loop = loop

    async def wait_for_change(self, version: int) -> TrustBundleView:
        """Return the bundle once its version is above `version` (at once if it already
        is); the published one, so the event loop never waits for the lock."""
        while (bundle := self._published[0]).version <= version:
            if self._changed is None:
                self._changed = asyncio.Event()
            await self._changed.wait()
        return bundle

    def _notify(self) -> None:
        # Under the lock: published first, so whoever is woken reads this bundle.
        self._publish()
        bundle = self._published[0]
        loop = self._loop
        if loop is not None and not loop.is_closed() and not _running_on(loop):
            loop.call_soon_threadsafe(self._deliver, bundle)
        else:
            self._deliver(bundle)

    def _deliver(self, bundle: TrustBundleView) -> None:
        if bundle.version <= self._delivered_version:
            return  # a newer bundle was delivered first (made on the loop meanwhile)
        self._delivered_version = bundle.version
        for listener in self._listeners:
            try:
                listener(bundle)
            except Exception:
                log.exception("trust bundle listener failed")
        if self._changed is not None:
            self._changed.set()
            self._changed = None


# ---------------------------------------------------------------- CSR handling


@dataclasses.dataclass(frozen=True)
class _Names:
    general_names: tuple[x509.GeneralName, ...]
    dns: tuple[str, ...]
    uris: tuple[str, ...]
    ips: tuple[str, ...]


def _san_extension(csr: x509.CertificateSigningRequest) -> x509.SubjectAlternativeName | None:
    try:
        return csr.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return None
    except (ValueError, x509.DuplicateExtension) as exc:
        raise InvalidArgument(f"the CSR's extensions do not parse: {excerpt(str(exc))}") from None


def check_names(csr: x509.CertificateSigningRequest, max_sans: int = MAX_SANS) -> None:
    """The CSR asks for at most `max_sans` SANs, each within its length bound."""
    extension = _san_extension(csr)
    if extension is None:
        return
    count = len(extension)
    if count > max_sans:
        raise InvalidArgument(
            f"the CSR asks for {count} subject alternative names; at most {max_sans} "
            "are allowed per certificate (max_sans_per_csr)"
        )
    for name in extension:
        value = name.value
        if isinstance(name, x509.DNSName):
            kind, bound = "DNS name", MAX_DNS_NAME_LENGTH
        else:
            kind, bound = "name", MAX_URI_LENGTH
        text = value if isinstance(value, str) else str(value)
        if len(text) > bound:
            raise InvalidArgument(
                f"the CSR's {kind} {excerpt(text)} is longer than {bound} characters"
            )


def _csr_names(csr: x509.CertificateSigningRequest, max_sans: int = MAX_SANS) -> _Names:
    check_names(csr, max_sans)
    extension = _san_extension(csr)
    if extension is None:
        raise InvalidArgument("the CSR asks for no subject alternative names")
    general = tuple(extension)
    allowed_types = (x509.DNSName, x509.UniformResourceIdentifier, x509.IPAddress)
    for name in general:
        if not isinstance(name, allowed_types):
            raise InvalidArgument(f"the CSR asks for an unsupported name: {excerpt(str(name))}")
    if not general:
        raise InvalidArgument("the CSR asks for no subject alternative names")
    return _Names(
        general_names=general,
        dns=tuple(n.value for n in general if isinstance(n, x509.DNSName)),
        uris=tuple(n.value for n in general if isinstance(n, x509.UniformResourceIdentifier)),
        ips=tuple(str(n.value) for n in general if isinstance(n, x509.IPAddress)),
    )


def load_csr(der: bytes, *, max_sans: int | None = None) -> x509.CertificateSigningRequest:
    """Parse a DER CSR (PEM accepted too); InvalidArgument when it is not one.

    With `max_sans`, a DER CSR asking for more SANs than that is refused before
    it is parsed: a hostile 60,000-SAN CSR then costs a few header reads rather
    than building 60,000 objects (`check_names` still checks the parsed CSR).
    """
    if not der:
        raise InvalidArgument("certificate_signing_request is empty")
    if der.lstrip().startswith(b"-----BEGIN"):
        # Decoded here so a PEM CSR gets the same cheap SAN count as DER does.
        der = _pem_csr_body(der)
    if max_sans is not None and (der_san_count(der, max_sans) or 0) > max_sans:
        raise InvalidArgument(
            f"the CSR asks for more than {max_sans} subject alternative names; at most "
            f"{max_sans} are allowed per certificate (max_sans_per_csr)"
        )
    try:
        return x509.load_der_x509_csr(der)
    except ValueError as exc:
        raise InvalidArgument(
            f"certificate_signing_request is not a PKCS#10 CSR: {excerpt(str(exc))}"
        ) from None


_PEM_CSR = re.compile(
    rb"-----BEGIN (?:NEW )?CERTIFICATE REQUEST-----(?P<body>[A-Za-z0-9+/=\s]*?)"
    rb"-----END (?:NEW )?CERTIFICATE REQUEST-----"
)


def _pem_csr_body(pem: bytes) -> bytes:
    """The DER inside a PEM CSR; InvalidArgument when it is not a PEM CSR."""
    found = _PEM_CSR.search(pem)
    if found is None:
        raise InvalidArgument(
            "certificate_signing_request is not a PKCS#10 CSR: PEM without a "
            "CERTIFICATE REQUEST block"
        )
    try:
        return base64.b64decode(b"".join(found.group("body").split()), validate=True)
    except binascii.Error as exc:
        raise InvalidArgument(
            f"certificate_signing_request is not a PKCS#10 CSR: bad PEM base64 ({exc})"
        ) from None


# DER of the extensionRequest attribute type (PKCS#9, 1.2.840.113549.1.9.14) and of the
# subjectAltName extension (2.5.29.17), each as an OBJECT IDENTIFIER element.
_EXTENSION_REQUEST_OID = bytes.fromhex("06092a864886f70d01090e")
_SAN_OID = bytes.fromhex("0603551d11")


def _element(der: bytes, at: int, end: int) -> tuple[int, int, int] | None:
    """(tag, value start, value end) of the DER element at `at`, or None if malformed."""
    if at + 2 > end or der[at] & 0x1F == 0x1F:
        return None
    tag, first = der[at], der[at + 1]
    at += 2
    if first < 0x80:
        length = first
    else:
        size = first & 0x7F
        if not 1 <= size <= 4 or at + size > end:
            return None
        length = int.from_bytes(der[at : at + size], "big")
        at += size
    if at + length > end:
        return None
    return tag, at, at + length


def _children(der: bytes, start: int, end: int) -> Iterator[tuple[int, int, int]]:
    at = start
    while at < end:
        element = _element(der, at, end)
        if element is None:
            return
        yield element
        at = element[2]


def der_san_count(der: bytes, limit: int) -> int | None:
    """How many SANs a DER CSR asks for, counting no further than `limit + 1`; None
    when the CSR is not DER-shaped as expected (the full parse then decides).

    Reads only element headers: CertificationRequest > info > attributes [0] >
    extensionRequest > Extensions > subjectAltName > GeneralNames.
    """
    outer = _element(der, 0, len(der))
    if outer is None or outer[0] != 0x30:
        return None
    info = next(_children(der, outer[1], outer[2]), None)
    if info is None or info[0] != 0x30:
        return None
    counted: int | None = None
    for attributes in _children(der, info[1], info[2]):
        if attributes[0] != 0xA0:
            continue
        for attribute in _children(der, attributes[1], attributes[2]):
            parts = list(itertools.islice(_children(der, attribute[1], attribute[2]), 2))
            if len(parts) != 2 or der[parts[0][1] - 2 : parts[0][2]] != _EXTENSION_REQUEST_OID:
                continue
            extensions = next(_children(der, parts[1][1], parts[1][2]), None)
            if extensions is None:
                continue
            for extension in _children(der, extensions[1], extensions[2]):
                fields = list(_children(der, extension[1], extension[2]))
                if not fields or der[fields[0][1] - 2 : fields[0][2]] != _SAN_OID:
                    continue
                value = fields[-1]
                names = _element(der, value[1], value[2]) if value[0] == 0x04 else None
                if names is None:
                    continue
                count = sum(
                    1 for _ in itertools.islice(_children(der, names[1], names[2]), limit + 1)
                )
                counted = max(counted or 0, count)
    return counted


SUPPORTED_KEYS = f"ECDSA P-256/P-384, RSA {MIN_RSA_BITS}..{MAX_RSA_BITS} bits, Ed25519"


def check_csr(
    csr: x509.CertificateSigningRequest, *, max_sans: int = MAX_SANS
) -> CertificatePublicKey:
    """The CSR's key is one Waygate signs, its SANs are within bounds (`check_names`)
    and its self-signature verifies; returns the key."""
    key = csr_public_key(csr)
    verify_csr(csr, max_sans=max_sans)
    return key


def csr_public_key(csr: x509.CertificateSigningRequest) -> CertificatePublicKey:
    """The CSR's key, if it is one Waygate signs (the first half of `check_csr`)."""
    try:
        key = csr.public_key()
    except (ValueError, UnsupportedAlgorithm) as exc:
        raise InvalidArgument(
            f"the CSR's public key is not supported ({SUPPORTED_KEYS}): {excerpt(str(exc))}"
        ) from None
    if isinstance(key, rsa.RSAPublicKey):
        if not MIN_RSA_BITS <= key.key_size <= MAX_RSA_BITS:
            raise InvalidArgument(
                f"the CSR's RSA key has {key.key_size} bits; RSA keys must have "
                f"{MIN_RSA_BITS} to {MAX_RSA_BITS} bits"
            )
    elif isinstance(key, ec.EllipticCurvePublicKey):
        if not isinstance(key.curve, ec.SECP256R1 | ec.SECP384R1):
            raise InvalidArgument(
                f"the CSR's curve {key.curve.name} is not supported ({SUPPORTED_KEYS})"
            )
    elif not isinstance(key, ed25519.Ed25519PublicKey):
        raise InvalidArgument(
            f"the CSR's key type {type(key).__name__.lstrip('_')} is not supported "
            f"({SUPPORTED_KEYS})"
        )
    return key


def verify_csr(csr: x509.CertificateSigningRequest, *, max_sans: int = MAX_SANS) -> None:
    """The CSR's SANs are within bounds and its self-signature verifies (the second
    half of `check_csr`, after `csr_public_key`)."""
    check_names(csr, max_sans)
    try:
        valid = csr.is_signature_valid
    except (InvalidSignature, ValueError, UnsupportedAlgorithm):
        valid = False
    if not valid:
        raise InvalidArgument("the CSR's signature does not verify with its own public key")


#: The extended key usages a CSR may ask for; a leaf gets exactly those it asks for.
REQUESTABLE_USAGES = {
    ExtendedKeyUsageOID.SERVER_AUTH: "serverAuth",
    ExtendedKeyUsageOID.CLIENT_AUTH: "clientAuth",
}


def requested_usages(csr: x509.CertificateSigningRequest) -> tuple[x509.ObjectIdentifier, ...]:
    """The extended key usages the CSR asks for (its ExtendedKeyUsage extension request),
    in a fixed order; () when it asks for none (the leaf then gets both usages).

    This is how a caller asks for a narrower role: a tunnel agent asks for clientAuth
    only, and the tunnel server registers as an agent only a certificate that cannot
    serve TLS (see `waygate.tunnel.peers`). Anything but serverAuth and clientAuth
    is INVALID_ARGUMENT: Waygate issues no other usage.
    """
    try:
        extension = csr.extensions.get_extension_for_class(x509.ExtendedKeyUsage)
    except x509.ExtensionNotFound:
        return ()
    except (ValueError, x509.DuplicateExtension) as exc:
        raise InvalidArgument(f"the CSR's extensions do not parse: {excerpt(str(exc))}") from None
    asked = set(extension.value)
    unknown = asked - REQUESTABLE_USAGES.keys()
    if unknown or not asked:
        shown = ", ".join(sorted(getattr(o, "_name", o.dotted_string) for o in unknown))
        raise InvalidArgument(
            "the CSR asks for extended key usages Waygate does not issue "
            f"({shown or 'an empty list'}); ask for serverAuth and/or clientAuth, or none "
            "for both"
        )
    return tuple(oid for oid in REQUESTABLE_USAGES if oid in asked)


def quick_to_verify(key: CertificatePublicKey) -> bool:
    """Whether checking a CSR with this key costs little enough (P-256, Ed25519, RSA:
    0.1 to 0.3 ms here) to run on the event loop; P-384 costs about 1 ms."""
    return not isinstance(key, ec.EllipticCurvePublicKey) or isinstance(key.curve, ec.SECP256R1)


def _running_on(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False


def _random_serial() -> int:
    # 128 random bits, positive and non-zero (RFC 5280 4.1.2.2).
    while True:
        serial = secrets.randbits(128)
        if serial:
            return serial


def _human(delta: timedelta) -> str:
    seconds = int(delta.total_seconds())
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"
