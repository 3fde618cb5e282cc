"""When a process's trust breaks: its own certificate and the CA above it, exported.

`TrustHorizon` feeds waygate_trust_expiry_timestamp_seconds and
waygate_trust_bundle_version from the rotator's installs and the trust store's
bundles; real certificates from `LocalCA` (tests/support/pki.py).
"""

from __future__ import annotations

import datetime as dt

from prometheus_client import REGISTRY

from tests.support.pki import LocalCA
from waygate.core.rotation import CertificateRotator, TrustBundle, TrustHorizon, TrustStore


def exported(name: str) -> float | None:
    return REGISTRY.get_sample_value(name)


async def test_the_earliest_of_the_leaf_and_its_issuing_ca() -> None:
    horizon = TrustHorizon()
    ca = LocalCA(lifetime=dt.timedelta(hours=24))
    held = await CertificateRotator(ca, "spiffe://w/ns/t/sa/a", ["ip:127.0.0.1"]).obtain()
    other = LocalCA()  # another CA in the bundle, not the issuer: not what we depend on
    horizon.bundle(TrustBundle(3, (ca.certificate, other.certificate)))
    horizon.certificate(held)
    assert horizon.expiry() == min(held.not_after, ca.certificate.not_valid_after_utc)
    assert horizon.expiry() == held.not_after  # a CA outlives its 24 h leaves


async def test_without_a_certificate_the_last_ca_to_expire() -> None:
    horizon = TrustHorizon()
    first, second = LocalCA(), LocalCA()
    horizon.bundle(TrustBundle(1, (first.certificate, second.certificate)))
    assert horizon.expiry() == max(
        first.certificate.not_valid_after_utc, second.certificate.not_valid_after_utc
    )


async def test_the_process_wide_gauges_follow_the_store_and_the_rotator() -> None:
    ca = LocalCA()
    store = TrustStore(ca.bundle(version=0))
    # The same CAs under certs' numbering: the version is taken, subscribers hear nothing.
    heard: list[TrustBundle] = []
    store.subscribe(heard.append)
    assert store.update(ca.bundle(version=7)) is False
    assert store.current.version == 7 and heard == []
    assert exported("waygate_trust_bundle_version") == 7
    held = await CertificateRotator(ca, "spiffe://w/ns/t/sa/b", ["ip:127.0.0.1"]).obtain()
    assert exported("waygate_trust_expiry_timestamp_seconds") == held.not_after.timestamp()
