"""The rotation client under a controllable clock: when it renews, how it retries,
when it warns, what it exports. No sockets and no real waiting: `FakeClock.sleep`
moves time, and the issuer is a real CA (`LocalCA`) that signs every CSR."""

from __future__ import annotations

import datetime as dt
import itertools
import logging
import random
import stat

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.serialization import Encoding
from prometheus_client import REGISTRY

from tests.support.pki import LocalCA
from waygate.core import errors
from waygate.core.backoff import Backoff
from waygate.core.rotation import (
    CertificateRotator,
    HeldCertificate,
    Issued,
    TrustBundle,
    TrustStore,
    save_certificate,
)
from waygate.core.sans import parse_san

from .test_rotation_ca import START, FakeClock, TimeUp

DAY = dt.timedelta(hours=24)
IDENTITY = "spiffe://waygate.local/ns/local/sa/resolver"
SANS = ("dns:resolver.waygate.local", "ip:127.0.0.1")


def make(
    clock: FakeClock, ca: LocalCA, *, seed: int = 7, identity: str = IDENTITY
) -> CertificateRotator:
    rng = random.Random(seed)
    return CertificateRotator(
        ca,
        identity,
        SANS,
        now=clock.now,
        sleep=clock.sleep,
        rng=rng,
        backoff=Backoff(initial=1.0, maximum=60.0, rng=rng),
    )


class Recorder(logging.Handler):
    """Log records with the fake time at which they were emitted."""

    def __init__(self, clock: FakeClock) -> None:
        super().__init__(logging.DEBUG)
        self.clock = clock
        self.records: list[tuple[dt.datetime, logging.LogRecord]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append((self.clock.now(), record))


@pytest.fixture
def recorder():
    def attach(clock: FakeClock) -> Recorder:
        handler = Recorder(clock)
        logger = logging.getLogger("waygate.core.rotation")
        logger.addHandler(handler)
        logger.setLevel(logging.DEBUG)
        handlers.append(handler)
        return handler

    handlers: list[Recorder] = []
    yield attach
    for handler in handlers:
        logging.getLogger("waygate.core.rotation").removeHandler(handler)


async def test_first_certificate_is_for_a_key_made_here_and_names_the_identity() -> None:
    clock = FakeClock()
    ca = LocalCA(clock.now)
    rotator = make(clock, ca)
    held = await rotator.obtain()

    csr, identity, _ = ca.requests[0]
    assert identity == IDENTITY
    assert isinstance(held.key, ec.EllipticCurvePrivateKey)
    assert held.key.curve.name == "secp256r1"
    # What crossed to the CA is a CSR for our public key, nothing more.
    assert csr.public_key() == held.key.public_key()
    names = csr.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert names.get_values_for_type(x509.UniformResourceIdentifier) == [IDENTITY]
    assert names.get_values_for_type(x509.DNSName) == ["resolver.waygate.local"]
    held.leaf.verify_directly_issued_by(ca.certificate)
    assert held.version == 1 and held.not_after == START + DAY


async def test_renews_at_seventy_percent_of_the_lifetime_with_jitter() -> None:
    clock = FakeClock(until=START + 10 * DAY)
    ca = LocalCA(clock.now, backdate=dt.timedelta(minutes=5))
    rotator = make(clock, ca)
    installed: list[tuple[dt.datetime, HeldCertificate]] = []
    rotator.subscribe(lambda held: installed.append((clock.now(), held)))
    await rotator.obtain()
    with pytest.raises(TimeUp):
        await rotator.run()

    fractions = []
    for (_, previous), (at, _) in itertools.pairwise(installed):
        fractions.append((at - previous.not_before) / previous.lifetime)
    # 10 days of 24h certificates renewed at ~70%: about 14 renewals.
    assert 12 <= len(fractions) <= 16
    assert all(0.65 <= f <= 0.75 for f in fractions), fractions
    # Jitter: the renewal points differ from one certificate to the next.
    assert len({round(f, 4) for f in fractions}) > len(fractions) // 2
    # Every renewal is a new key and a new serial; versions count up.
    assert len({h.key.public_key().public_numbers() for _, h in installed}) == len(installed)
    assert [h.version for _, h in installed] == list(range(1, len(installed) + 1))
    assert rotator.current is installed[-1][1]


async def test_retries_with_backoff_while_the_issuer_is_down_and_keeps_the_certificate() -> None:
    clock = FakeClock()
    ca = LocalCA(clock.now)
    rotator = make(clock, ca)
    first = await rotator.obtain()

    clock.until = first.not_before + first.lifetime * 0.78
    ca.fail_with = errors.Unavailable("certs at 127.0.0.1:7002: connection refused")
    with pytest.raises(TimeUp):
        await rotator.run()
    # Still serving the old certificate: a failure never takes it away.
    assert rotator.current is first
    attempts = [at for _, _, at in ca.requests[1:]]
    assert attempts[0] >= rotator.renew_at
    gaps = [(b - a).total_seconds() for a, b in itertools.pairwise(attempts)]
    # Exponential backoff from ~1s, capped (60s, and at most 1/50 of the lifetime).
    assert gaps[0] <= 1.0 + 1e-6
    assert gaps[5] > gaps[0] * 4
    assert max(gaps) <= 60.0 + 1e-6
    assert len(attempts) > 20

    # certs comes back: the next attempt succeeds and the backoff starts over.
    ca.fail_with = None
    clock.until = clock.now() + dt.timedelta(minutes=5)
    with pytest.raises(TimeUp):
        await rotator.run()
    assert rotator.current.version == 2
    assert rotator.current.not_after > first.not_after


async def test_warns_when_under_twenty_percent_of_life_is_left(recorder) -> None:
    clock = FakeClock()
    ca = LocalCA(clock.now)
    rotator = make(clock, ca)
    held = await rotator.obtain()
    log = recorder(clock)
    ca.fail_with = errors.Unavailable("down")
    clock.until = held.not_before + held.lifetime * 0.9
    with pytest.raises(TimeUp):
        await rotator.run()

    warnings = [(at, r) for at, r in log.records if r.levelno == logging.WARNING]
    infos = [(at, r) for at, r in log.records if r.levelno == logging.INFO]
    assert warnings, "no warning although the certificate is under 20% of its life"
    first_warning = warnings[0][0]
    assert held.remaining_fraction(first_warning) < 0.2
    # Before that point the failures were logged, but not as warnings.
    assert infos and all(
        held.remaining_fraction(at) >= 0.2 for at, _ in infos if at < first_warning
    )
    assert "life left" in warnings[0][1].getMessage()
    assert warnings[0][1].serial == held.serial


async def test_expiry_gauge_follows_the_certificate_held() -> None:
    clock = FakeClock()
    ca = LocalCA(clock.now)
    identity = "spiffe://waygate.local/ns/local/sa/gauge"
    rotator = make(clock, ca, identity=identity)

    def gauge() -> float | None:
        return REGISTRY.get_sample_value(
            "waygate_certificate_expiry_timestamp_seconds", {"identity": identity}
        )

    first = await rotator.obtain()
    assert gauge() == first.not_after.timestamp()
    clock.advance(3600)
    second = await rotator.renew_once()
    assert gauge() == second.not_after.timestamp() == first.not_after.timestamp() + 3600


async def test_a_permanent_refusal_stops_obtain_at_once() -> None:
    clock = FakeClock()
    ca = LocalCA(clock.now)
    ca.fail_with = errors.PermissionDenied("dns:evil.example is not allowed for resolver")
    rotator = make(clock, ca)
    with pytest.raises(errors.PermissionDenied, match="evil"):
        await rotator.obtain()
    assert ca.failures == 1 and clock.sleeps == []


async def test_obtain_gives_up_after_its_timeout_with_the_last_error() -> None:
    clock = FakeClock()
    ca = LocalCA(clock.now)
    ca.fail_with = errors.Unavailable("connection refused")
    rotator = make(clock, ca)
    with pytest.raises(errors.Unavailable, match=r"after 30s: connection refused"):
        await rotator.obtain(timeout=30)
    assert ca.failures > 3
    assert not rotator.has_certificate


async def test_a_certificate_for_another_key_is_refused() -> None:
    clock = FakeClock()
    ca = LocalCA(clock.now)
    rotator = make(clock, ca)
    other = x509.CertificateSigningRequestBuilder().subject_name(x509.Name([]))
    other_key = ec.generate_private_key(ec.SECP256R1())

    async def wrong(csr_der: bytes, identity: str) -> Issued:
        csr = other.add_extension(
            x509.SubjectAlternativeName([x509.UniformResourceIdentifier(identity)]), critical=True
        ).sign(other_key, hashes.SHA256())
        leaf = ca.sign(csr)
        return Issued(leaf.public_bytes(Encoding.DER), (), leaf.not_valid_after_utc)

    ca.certify = wrong  # type: ignore[method-assign]
    with pytest.raises(errors.InvalidArgument, match="different key"):
        await rotator.renew_once()
    assert not rotator.has_certificate


async def test_subscribers_see_each_certificate_once_even_if_one_breaks() -> None:
    clock = FakeClock()
    ca = LocalCA(clock.now)
    rotator = make(clock, ca)
    seen: list[int] = []

    def broken(_held: HeldCertificate) -> None:
        raise RuntimeError("subscriber bug")

    rotator.subscribe(broken)
    unsubscribe = rotator.subscribe(lambda held: seen.append(held.version))
    await rotator.obtain()
    await rotator.renew_once()
    unsubscribe()
    await rotator.renew_once()
    assert seen == [1, 2]
    assert rotator.current.version == 3


def test_trust_store_takes_each_different_bundle_once() -> None:
    first, second = LocalCA(), LocalCA(name="second")
    store = TrustStore(first.bundle(version=3))
    changes: list[int] = []
    store.subscribe(lambda bundle: changes.append(bundle.version))
    both = TrustBundle(version=4, certificates=(first.certificate, second.certificate))
    assert store.update(both)
    assert not store.update(both)  # same certificates: no change
    assert changes == [4]
    # certs restarted with its counter from 1: what it says now is current.
    assert store.update(second.bundle(version=1))
    assert changes == [4, 1]
    assert store.current.certificates == (second.certificate,)
    assert TrustBundle.from_pem(both.pem).certificates == both.certificates
    with pytest.raises(errors.InvalidArgument):
        TrustBundle.from_pem(b"not a certificate")


async def test_saved_key_is_private_and_matches_the_certificate(tmp_path) -> None:
    ca = LocalCA()
    held = await CertificateRotator(ca, IDENTITY).obtain()
    save_certificate(held, tmp_path / "client" / "key.pem", tmp_path / "client" / "cert.pem")
    key_mode = stat.S_IMODE((tmp_path / "client" / "key.pem").stat().st_mode)
    assert key_mode == 0o600
    assert (tmp_path / "client" / "cert.pem").read_bytes() == held.chain_pem()
    assert [p.name for p in (tmp_path / "client").iterdir() if p.name.startswith(".")] == []


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("resolver", "must be dns:NAME"),
        ("ip:300.1.1.1", "not an IP"),
        ("email:a@b", "kind must be"),
    ],
)
def test_bad_sans_are_named(text: str, problem: str) -> None:
    with pytest.raises(errors.InvalidArgument, match=problem):
        parse_san(text)


def test_renew_fraction_outside_the_lifetime_is_refused() -> None:
    with pytest.raises(ValueError, match="renew_fraction"):
        CertificateRotator(LocalCA(), IDENTITY, renew_fraction=0.98)


async def test_a_certificate_due_on_arrival_does_not_renew_in_a_tight_loop() -> None:
    """certs may cap a leaf at an expiring CA, so it arrives already past its
    renewal point: the rotator must space its attempts out, not hammer certs."""
    clock = FakeClock(until=START + dt.timedelta(minutes=10))
    ca = LocalCA(clock.now, lifetime=dt.timedelta(minutes=10), backdate=dt.timedelta(hours=1))
    calls: list[dt.datetime] = []
    certify = ca.certify

    async def counting(csr_der: bytes, identity: str) -> Issued:
        calls.append(clock.now())
        if calls.count(clock.now()) > 3:
            raise AssertionError("renewing again and again at the same instant")
        return await certify(csr_der, identity)

    ca.certify = counting  # type: ignore[method-assign]
    rotator = make(clock, ca)
    with pytest.raises(TimeUp):
        await rotator.run()
    assert 3 <= len(calls) <= 20
    gaps = [(b - a).total_seconds() for a, b in itertools.pairwise(calls[1:])]
    assert all(gap > 0 for gap in gaps)
