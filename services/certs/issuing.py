"""Issuing: the leaf profile, signing one leaf, and the records ListIssued shows.

`leaf_request` checks a CSR and what is asked for it (`LeafRequest`, the
value `Authority.issue` takes); `Issuer` signs it with the CA the authority
gives it and keeps the records. No lock and no I/O: the authority
holds its lock, decides which CA signs and writes the store when the leaf
bound must move first (`leafbounds`).

Invariants:
- a leaf never outlives its issuer: not_after is capped at the issuer's
  not_after (`leaf_window`), and a leaf whose window would be empty is refused;
- the lifetime asked for is positive and at most the maximum, never silently
  shortened otherwise (INVALID_ARGUMENT names the bound);
- a leaf has an empty subject, its names in a critical SAN extension, exactly
  the extended key usages asked for (both serverAuth and clientAuth when none);
- what ListIssued shows is all that is kept of an issued leaf (no certificate,
  no CSR), in `IssuedRecords`, bounded by count and by bytes;
- a leaf is handed out only once the stored leaf bound covers it (`sign`).
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import itertools
from collections.abc import Callable, Sequence
from datetime import datetime, timedelta
from typing import TYPE_CHECKING

from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID

from waygate.certs import leafbounds
from waygate.certs.castate import CARecord, random_serial, signature_hash, whole_seconds
from waygate.certs.csr import (
    CertificatePublicKey,
    Names,
    check_csr,
    csr_names,
    requested_usages,
)
from waygate.certs.rotation import human
from waygate.core.errors import FailedPrecondition, InvalidArgument

if TYPE_CHECKING:
    # config reads this module's defaults: imported for the annotation only.
    from waygate.certs.config import AuthorityConfig

#: Records of issued leaves kept in memory for ListIssued (this process's life, not
#: persisted), by count and by estimated bytes; past either, expired ones go first.
ISSUED_RECORDS = 100_000
ISSUED_RECORDS_BYTES = 64 * 1024 * 1024
#: What `list_issued` returns without a limit (the newest matching records).
LIST_LIMIT = 10_000
#: What a record costs beyond its strings (objects, tuples, datetimes), for the byte bound.
_RECORD_OVERHEAD = 512
_STRING_OVERHEAD = 64


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
QUICK_SIGNING_KEYS = (ec.EllipticCurvePrivateKey, ed25519.Ed25519PrivateKey)


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
class LeafRequest:
    """A checked CSR and who asked: what the leaf signed for it will hold, and what
    its record will say."""

    public_key: CertificatePublicKey
    names: Names
    lifetime: timedelta
    extended_usages: Sequence[x509.ObjectIdentifier]
    identity: str
    requested_by: str


def leaf_request(
    csr: x509.CertificateSigningRequest,
    config: AuthorityConfig,
    *,
    identity: str,
    requested_by: str,
    lifetime: timedelta | None = None,
    public_key: CertificatePublicKey | None = None,
    extended_usages: Sequence[x509.ObjectIdentifier] = (),
) -> LeafRequest:
    """Check `csr` and the lifetime asked for, before anything is signed (needs no lock).

    `lifetime` None: the default lifetime. `public_key`: what `check_csr(csr)`
    returned, when the caller already ran it (parsing and verifying the key
    twice is a third of the signing cost). `extended_usages` empty: those the
    CSR asks for (`requested_usages`), serverAuth and clientAuth (what every
    Waygate process needs) when it asks for none.
    """
    if lifetime is None:
        lifetime = config.default_lifetime
    check_lifetime(lifetime, config.max_lifetime)
    if public_key is None:
        public_key = check_csr(csr, max_sans=config.max_sans)
    names = csr_names(csr, config.max_sans)
    usages = extended_usages or requested_usages(csr)
    return LeafRequest(public_key, names, lifetime, usages, identity, requested_by)


class Issuer:
    """Issues leaves for the authority: signs a request with the CA it is given, and
    keeps the ListIssued records. Not thread-safe: the authority's lock guards it;
    it writes nothing itself (the store write of a raised leaf bound is the
    authority's, through `store_bound`)."""

    def __init__(self, config: AuthorityConfig) -> None:
        self.config = config
        self.records = IssuedRecords(config.issued_records, config.issued_records_bytes)

    def sign(
        self,
        ca: CARecord,
        request: LeafRequest,
        now: datetime,
        *,
        at_once: bool,
        store_bound: Callable[[CARecord, datetime], None],
    ) -> Issued | None:
        """The leaf `ca` signs for `request` now, recorded. When the stored leaf bound
        does not cover it, `store_bound(ca, not_after)` raises and stores the bound
        before the leaf is handed out, or with `at_once` None is returned at once
        (nothing signed: the caller signs in a thread that may write)."""
        now = whole_seconds(now)
        not_before, not_after = leaf_window(ca, now, request.lifetime, self.config.backdate)
        covered = leafbounds.covers(ca, not_after)
        if not covered and at_once:
            return None
        leaf, serial = sign_leaf(
            ca,
            request.public_key,
            request.names,
            not_before=not_before,
            not_after=not_after,
            extended_usages=request.extended_usages,
        )
        if not covered:
            store_bound(ca, not_after)
        leafbounds.record_leaf(ca, not_after)
        serial_hex = format(serial, "x")
        self.records.add(
            serial=serial_hex,
            identity=request.identity,
            dns_names=request.names.dns,
            uris=request.names.uris,
            not_before=not_before,
            not_after=not_after,
            issuer_fingerprint=ca.fingerprint,
            requested_by=request.requested_by,
            now=now,
        )
        return Issued(leaf=leaf, chain=ca.chain, valid_until=not_after, serial=serial_hex)


def signs_quickly(ca: CARecord) -> bool:
    """Whether `ca`'s signature costs little enough for the event loop (`QUICK_SIGNING_KEYS`)."""
    return isinstance(ca.key, QUICK_SIGNING_KEYS)


def check_lifetime(lifetime: timedelta, max_lifetime: timedelta) -> None:
    if lifetime <= timedelta(0):
        raise InvalidArgument(f"lifetime must be positive, not {lifetime}")
    if lifetime > max_lifetime:
        raise InvalidArgument(
            f"lifetime {human(lifetime)} exceeds the maximum {human(max_lifetime)}"
        )


def leaf_window(
    issuer: CARecord, now: datetime, lifetime: timedelta, backdate: timedelta
) -> tuple[datetime, datetime]:
    """(not_before, not_after) of a leaf `issuer` signs now: never outside the issuer's
    (nor past its upstream anchor's expiry)."""
    now = whole_seconds(now)
    not_after = min(now + lifetime, issuer.signs_until)
    if not_after <= now:
        raise FailedPrecondition("the active CA has expired; rotate the CA")
    return max(now - backdate, issuer.not_before), not_after


def sign_leaf(
    issuer: CARecord,
    public_key: CertificatePublicKey,
    names: Names,
    *,
    not_before: datetime,
    not_after: datetime,
    extended_usages: Sequence[x509.ObjectIdentifier],
) -> tuple[x509.Certificate, int]:
    """The leaf and its serial, signed by `issuer`."""
    serial = random_serial()
    builder = (
        x509.CertificateBuilder()
        .subject_name(_EMPTY_NAME)
        .issuer_name(issuer.subject)
        .public_key(public_key)
        .serial_number(serial)
        .not_valid_before(not_before)
        .not_valid_after(not_after)
        .add_extension(_LEAF_BASIC_CONSTRAINTS, critical=True)
        .add_extension(
            _RSA_LEAF_KEY_USAGE if isinstance(public_key, rsa.RSAPublicKey) else _LEAF_KEY_USAGE,
            critical=True,
        )
        .add_extension(
            x509.ExtendedKeyUsage(list(extended_usages))
            if extended_usages
            else _LEAF_EXTENDED_KEY_USAGE,
            critical=False,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), critical=False)
        .add_extension(issuer.aki, critical=False)
        # The subject is empty (identities live in the SANs), so RFC 5280 makes the SAN critical.
        .add_extension(x509.SubjectAlternativeName(names.general_names), critical=True)
    )
    return builder.sign(issuer.key, signature_hash(issuer.key)), serial
