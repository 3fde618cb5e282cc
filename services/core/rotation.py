"""Keep this process's certificate fresh: a key made here, a certificate from certs.

`CertificateRotator` holds the process's current key and certificate. It
generates an ECDSA P-256 key locally for every certificate it asks for, sends
only a CSR to an `Issuer` (the certs service's `Certify`, or anything that
signs), and renews at `renew_fraction` (70%) of the certificate's lifetime,
plus or minus `jitter_fraction` (5%) of it, so a fleet that started together
does not renew together. While the issuer fails it keeps the current
certificate and retries with exponential backoff; once less than
`warn_fraction` (20%) of the life remains every failed attempt logs a warning,
and `waygate_certificate_expiry_timestamp_seconds{identity}` always shows when
the certificate held right now expires, so an expiry is visible long before it
happens.

`TrustStore` holds the CA bundle peers are verified against; the trust-bundle
watcher (`waygate.certs.client`) feeds it from `WatchTrustBundle`.

Invariants:
- The private key never leaves the process: it is held in memory, never put
  in a request, and written to disk only by `save_certificate` (0600, atomic).
- A certificate is installed only if it is for our key and names our identity;
  subscribers see each installed certificate exactly once, in order.
- Clock and sleep are injected: tests drive a day of rotation without waiting.

No grpc here: the RPC lives behind the `Issuer` protocol.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
from collections.abc import Awaitable, Callable, Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Generic, NamedTuple, Protocol, TypeVar

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID
from prometheus_client import Counter, Gauge

from waygate.core.backoff import Backoff
from waygate.core.errors import (
    FailedPrecondition,
    InvalidArgument,
    PermissionDenied,
    Unauthenticated,
    Unavailable,
    WaygateError,
)
from waygate.core.files import write_file_atomically
from waygate.core.sans import identity_san, parse_san

log = logging.getLogger(__name__)

EXPIRY = Gauge(
    "waygate_certificate_expiry_timestamp_seconds",
    "When the certificate this process holds right now expires (Unix time).",
    ["identity"],
)
TRUST_EXPIRY = Gauge(
    "waygate_trust_expiry_timestamp_seconds",
    "When this process's TLS trust breaks unless something is renewed or rotated (Unix "
    "time): the earliest expiry among its own certificate and the CA that issued it; "
    "without a certificate of its own, the last CA of its trust bundle to expire.",
)
TRUST_BUNDLE_VERSION = Gauge(
    "waygate_trust_bundle_version",
    "Version of the trust bundle this process applied (0: the file it started from).",
)
RENEWALS = Counter(
    "waygate_certificate_renewals_total",
    "Attempts to get a certificate from certs, by outcome (ok, failed).",
    ["identity", "result"],
)

#: Longest single sleep of the renewal loop, so wall-clock jumps are noticed.
MAX_SLEEP = 300.0

# The issuer said no for a reason retrying cannot fix (at start we stop with
# the message; once running we keep retrying, since an operator may fix it).
PERMANENT_ERRORS: tuple[type[WaygateError], ...] = (
    InvalidArgument,
    PermissionDenied,
    Unauthenticated,
)

Clock = Callable[[], datetime]
Sleep = Callable[[float], Awaitable[None]]
PrivateKey = ec.EllipticCurvePrivateKey
T = TypeVar("T")


def utc_now() -> datetime:
    return datetime.now(UTC)


class Issued(NamedTuple):
    """What an issuer returns: the leaf, intermediates (DER) and the leaf's not_after."""

    leaf_der: bytes
    chain_der: Sequence[bytes]
    valid_until: datetime


class Issuer(Protocol):
    async def certify(self, csr_der: bytes, identity: str) -> Issued:
        """Sign the CSR for `identity`; raise a `waygate.core.errors` error when it cannot."""
        ...


# ---------------------------------------------------------------- names and CSRs


def sans_for(identity: str, sans: Sequence[str]) -> tuple[x509.GeneralName, ...]:
    """The CSR's SANs: the identity's own SAN first, then the others, no duplicates."""
    names: list[x509.GeneralName] = []
    for text in (identity_san(identity), *sans):
        name = parse_san(text)
        if name not in names:
            names.append(name)
    return tuple(names)


def generate_key() -> PrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


#: What a client-only certificate asks for: it authenticates a TLS client and never
#: serves (the tunnel agent's role: the tunnel server registers no certificate that
#: could also serve TLS as an agent).
CLIENT_ONLY = x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH])


def build_csr(
    key: PrivateKey, identity: str, sans: Sequence[str], *, client_only: bool = False
) -> bytes:
    """A DER PKCS#10 request with an empty subject: the SANs carry every name (RFC 6125).

    `client_only`: the request asks for the clientAuth extended key usage only
    (certs then issues exactly that); otherwise it asks for no usage and gets
    serverAuth and clientAuth."""
    builder = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(x509.Name([]))
        .add_extension(x509.SubjectAlternativeName(list(sans_for(identity, sans))), critical=True)
    )
    if client_only:
        builder = builder.add_extension(CLIENT_ONLY, critical=False)
    return builder.sign(key, hashes.SHA256()).public_bytes(serialization.Encoding.DER)


def _pem(certificates: Sequence[x509.Certificate]) -> bytes:
    return b"".join(c.public_bytes(serialization.Encoding.PEM) for c in certificates)


# ---------------------------------------------------------------- the certificate held


@dataclasses.dataclass(frozen=True)
class HeldCertificate:
    """A key and the certificate issued for it; `version` counts installs from 1."""

    identity: str
    key: PrivateKey
    leaf: x509.Certificate
    chain: tuple[x509.Certificate, ...]
    version: int

    @property
    def not_before(self) -> datetime:
        return self.leaf.not_valid_before_utc

    @property
    def not_after(self) -> datetime:
        return self.leaf.not_valid_after_utc

    @property
    def lifetime(self) -> timedelta:
        return self.not_after - self.not_before

    @property
    def serial(self) -> str:
        return format(self.leaf.serial_number, "x")

    def remaining_fraction(self, now: datetime) -> float:
        seconds = self.lifetime.total_seconds()
        return (self.not_after - now).total_seconds() / seconds if seconds > 0 else 0.0

    def key_pem(self) -> bytes:
        """PKCS#8 PEM, unencrypted: for TLS libraries that take bytes. Never log or send it."""
        return self.key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )

    def chain_pem(self) -> bytes:
        """The leaf, then its intermediates: what a TLS peer presents."""
        return _pem((self.leaf, *self.chain))


def _check_issued(
    issued: Issued, key: PrivateKey, identity: str, *, client_only: bool = False
) -> HeldCertificate:
    """Parse what the issuer returned and make sure it is ours (and, `client_only`, that
    it is no more than a client's) before using it."""
    try:
        leaf = x509.load_der_x509_certificate(issued.leaf_der)
        chain = tuple(x509.load_der_x509_certificate(der) for der in issued.chain_der)
    except ValueError as exc:
        raise InvalidArgument(
            f"the issuer returned a certificate that does not parse: {exc}"
        ) from None
    ours = key.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    theirs = leaf.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    if ours != theirs:
        raise InvalidArgument("the issuer returned a certificate for a different key")
    try:
        names = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        names = x509.SubjectAlternativeName([])
    if parse_san(identity_san(identity)) not in names:
        raise InvalidArgument(f"the issuer returned a certificate that does not name {identity}")
    if client_only:
        try:
            usages = leaf.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
        except x509.ExtensionNotFound:
            usages = None
        if usages is None or list(usages) != [ExtendedKeyUsageOID.CLIENT_AUTH]:
            raise InvalidArgument(
                f"the issuer ignored the request for a client-only certificate for {identity} "
                "(extended key usage clientAuth only); is certs older than this process?"
            )
    return HeldCertificate(identity=identity, key=key, leaf=leaf, chain=chain, version=0)


# ---------------------------------------------------------------- subscribers


class _Subscribers(Generic[T]):
    def __init__(self) -> None:
        self._callbacks: list[Callable[[T], None]] = []

    def add(self, callback: Callable[[T], None]) -> Callable[[], None]:
        self._callbacks.append(callback)
        return lambda: self._callbacks.remove(callback) if callback in self._callbacks else None

    def notify(self, value: T) -> None:
        for callback in list(self._callbacks):
            try:
                callback(value)
            except Exception:
                # One broken subscriber must not keep the others on an old certificate.
                log.exception("certificate subscriber %r failed", callback)


# ---------------------------------------------------------------- the rotator


class CertificateRotator:
    """Obtain, hold and renew one identity's certificate."""

    def __init__(
        self,
        issuer: Issuer,
        identity: str,
        sans: Sequence[str] = (),
        *,
        renew_fraction: float = 0.7,
        jitter_fraction: float = 0.05,
        warn_fraction: float = 0.2,
        backoff: Backoff | None = None,
        now: Clock = utc_now,
        sleep: Sleep = asyncio.sleep,
        rng: random.Random | None = None,
        key_factory: Callable[[], PrivateKey] = generate_key,
        client_only: bool = False,
    ) -> None:
        if (
            jitter_fraction < 0
            or not 0 < renew_fraction - jitter_fraction <= renew_fraction + jitter_fraction < 1
        ):
            raise ValueError("renew_fraction +- jitter_fraction must stay within (0, 1)")
        if not 0 < warn_fraction < 1:
            raise ValueError("warn_fraction must be within (0, 1)")
        self.identity = identity
        self.sans = tuple(sans)
        sans_for(identity, self.sans)  # bad SANs fail here, at start, not at the first renewal
        self._issuer = issuer
        self._renew_fraction = renew_fraction
        self._jitter_fraction = jitter_fraction
        self._warn_fraction = warn_fraction
        self._backoff = backoff or Backoff(initial=1.0, maximum=60.0, rng=rng)
        self._now = now
        self._sleep = sleep
        self._rng = rng or random.Random()
        self._key_factory = key_factory
        # Ask for (and insist on) a client-only certificate (`build_csr`).
        self.client_only = client_only
        self._current: HeldCertificate | None = None
        self._renew_at: datetime | None = None
        self._subscribers: _Subscribers[HeldCertificate] = _Subscribers()

    # -------------------------------------------------------- reading

    @property
    def current(self) -> HeldCertificate:
        if self._current is None:
            raise FailedPrecondition(f"no certificate for {self.identity} yet")
        return self._current

    @property
    def has_certificate(self) -> bool:
        return self._current is not None

    @property
    def renew_at(self) -> datetime:
        """When the next renewal is due (drawn once per certificate, with jitter)."""
        if self._renew_at is None:
            raise FailedPrecondition(f"no certificate for {self.identity} yet")
        return self._renew_at

    def subscribe(self, callback: Callable[[HeldCertificate], None]) -> Callable[[], None]:
        """Call `callback(certificate)` on every new certificate; returns an unsubscribe."""
        return self._subscribers.add(callback)

    # -------------------------------------------------------- obtaining

    async def renew_once(self) -> HeldCertificate:
        """One attempt: a fresh key, a CSR, the issuer; installs and returns the result."""
        key = self._key_factory()
        csr = build_csr(key, self.identity, self.sans, client_only=self.client_only)
        try:
            issued = await self._issuer.certify(csr, self.identity)
            held = _check_issued(issued, key, self.identity, client_only=self.client_only)
        except Exception:
            RENEWALS.labels(self.identity, "failed").inc()
            raise
        RENEWALS.labels(self.identity, "ok").inc()
        return self._install(held)

    async def obtain(self, timeout: float = 30.0) -> HeldCertificate:
        """The first certificate, retrying transient failures for up to `timeout` seconds.

        A permanent refusal (bad token, forbidden name) raises at once: start-up
        stops with the issuer's message instead of retrying a mistake.
        """
        started = self._now()
        backoff = self._backoff
        while True:
            try:
                held = await self.renew_once()
            except PERMANENT_ERRORS:
                raise
            except WaygateError as exc:
                waited = (self._now() - started).total_seconds()
                if waited >= timeout:
                    raise Unavailable(
                        f"no certificate for {self.identity} after {waited:.0f}s: {exc}"
                    ) from None
                delay = min(backoff.next_delay(), max(timeout - waited, 0.01))
                log.info(
                    "cannot get a certificate yet; retrying",
                    extra={
                        "identity": self.identity,
                        "error": str(exc),
                        "retry_in": round(delay, 2),
                    },
                )
                await self._sleep(delay)
            else:
                backoff.reset()
                return held

    async def run(self) -> None:
        """Renew for ever: at the due time, and with backoff while the issuer fails.

        Never raises for an issuer failure (the current certificate stays in
        use); only cancellation ends it.
        """
        if self._current is None:
            await self.obtain(timeout=float("inf"))
        while True:
            wait = (self.renew_at - self._now()).total_seconds()
            if wait > 0:
                # In slices: the wall clock may jump (suspend, NTP step) while
                # asyncio's monotonic sleep would not notice.
                await self._sleep(min(wait, MAX_SLEEP))
                continue
            try:
                await self.renew_once()
            except Exception as exc:
                # Whatever went wrong, the current certificate is still the best
                # we have: keep it and try again (a crash would drop the process).
                if not isinstance(exc, WaygateError):
                    log.exception("unexpected error while renewing the certificate")
                await self._sleep(self._failure_delay(exc))
            else:
                if self.renew_at > self._now():
                    self._backoff.reset()
                else:
                    # Due again on arrival (certs capped it at an expiring CA, say):
                    # renewing at once, again and again, would hammer certs. Space
                    # the attempts out as after a failure.
                    held = self.current
                    await self._sleep(
                        min(
                            self._backoff.next_delay(), max(held.lifetime.total_seconds() / 50, 1.0)
                        )
                    )

    def _failure_delay(self, exc: Exception) -> float:
        held = self.current
        now = self._now()
        left = held.remaining_fraction(now)
        fields = {
            "identity": self.identity,
            "error": str(exc),
            "serial": held.serial,
            "not_after": held.not_after.isoformat(),
        }
        if left <= 0:
            log.error("certificate has EXPIRED and cannot be renewed", extra=fields)
        elif left < self._warn_fraction:
            log.warning(
                "certificate expires in %.0fs (%.0f%% of its life left) and cannot be renewed",
                (held.not_after - now).total_seconds(),
                left * 100,
                extra=fields,
            )
        else:
            log.info("certificate renewal failed; retrying", extra=fields)
        # Retry at least a few times per remaining lifetime, however short it is.
        ceiling = max(held.lifetime.total_seconds() / 50, 0.05)
        return min(self._backoff.next_delay(), ceiling)

    def _install(self, held: HeldCertificate) -> HeldCertificate:
        version = self._current.version + 1 if self._current is not None else 1
        held = dataclasses.replace(held, version=version)
        self._current = held
        draw = self._rng.uniform(-self._jitter_fraction, self._jitter_fraction)
        self._renew_at = held.not_before + held.lifetime * (self._renew_fraction + draw)
        EXPIRY.labels(self.identity).set(held.not_after.timestamp())
        HORIZON.certificate(held)
        log.info(
            "new certificate",
            extra={
                "identity": self.identity,
                "serial": held.serial,
                "not_after": held.not_after.isoformat(),
                "renew_at": self._renew_at.isoformat(),
            },
        )
        self._subscribers.notify(held)
        return held


# ---------------------------------------------------------------- trust bundle


@dataclasses.dataclass(frozen=True)
class TrustBundle:
    """The CA certificates peers are verified against, and the bundle's version."""

    version: int
    certificates: tuple[x509.Certificate, ...]

    @property
    def pem(self) -> bytes:
        return _pem(self.certificates)

    @classmethod
    def from_pem(cls, pem: bytes, version: int = 0) -> TrustBundle:
        try:
            certificates = tuple(x509.load_pem_x509_certificates(pem))
        except ValueError:
            raise InvalidArgument("the trust bundle holds no PEM certificate") from None
        return cls(version=version, certificates=certificates)


class TrustHorizon:
    """When this process's trust breaks: `TRUST_EXPIRY` and `TRUST_BUNDLE_VERSION`,
    from the latest certificate installed and bundle applied (one per process)."""

    def __init__(self) -> None:
        self._held: HeldCertificate | None = None
        self._bundle: TrustBundle | None = None

    def certificate(self, held: HeldCertificate) -> None:
        self._held = held
        self._publish()

    def bundle(self, bundle: TrustBundle) -> None:
        self._bundle = bundle
        TRUST_BUNDLE_VERSION.set(bundle.version)
        self._publish()

    def expiry(self) -> datetime | None:
        cas = self._bundle.certificates if self._bundle is not None else ()
        if self._held is None:
            return max((ca.not_valid_after_utc for ca in cas), default=None)
        # Its own certificate, every intermediate it serves, and the anchor above them.
        moments = [self._held.not_after, *(c.not_valid_after_utc for c in self._held.chain)]
        top_issuer = (self._held.chain[-1] if self._held.chain else self._held.leaf).issuer
        anchors = [ca.not_valid_after_utc for ca in cas if ca.subject == top_issuer]
        if anchors:
            moments.append(max(anchors))
        return min(moments)

    def _publish(self) -> None:
        moment = self.expiry()
        if moment is not None:
            TRUST_EXPIRY.set(moment.timestamp())


HORIZON = TrustHorizon()


class TrustStore:
    """The current trust bundle; subscribers hear of every change."""

    def __init__(self, bundle: TrustBundle) -> None:
        self._bundle = bundle
        self._subscribers: _Subscribers[TrustBundle] = _Subscribers()
        HORIZON.bundle(bundle)

    @property
    def current(self) -> TrustBundle:
        return self._bundle

    def subscribe(self, callback: Callable[[TrustBundle], None]) -> Callable[[], None]:
        return self._subscribers.add(callback)

    def update(self, bundle: TrustBundle) -> bool:
        """Take `bundle` unless it holds the same CAs; True when it changed.

        No version comparison: certs is the source of truth, and what its stream
        says now is current even if its counter restarted.
        """
        if bundle.certificates == self._bundle.certificates:
            if bundle.version != self._bundle.version:
                # The same CAs under certs' numbering: what the process reports applying.
                self._bundle = bundle
                HORIZON.bundle(bundle)
            return False
        self._bundle = bundle
        HORIZON.bundle(bundle)
        log.info(
            "trust bundle changed",
            extra={"version": bundle.version, "authorities": len(bundle.certificates)},
        )
        self._subscribers.notify(bundle)
        return True


# ---------------------------------------------------------------- files


def save_certificate(held: HeldCertificate, key_path: Path, cert_path: Path) -> None:
    """key.pem (0600) first, then cert.pem (0644), so cert.pem never names a missing key."""
    write_file_atomically(key_path, held.key_pem(), 0o600)
    write_file_atomically(cert_path, held.chain_pem(), 0o644)
