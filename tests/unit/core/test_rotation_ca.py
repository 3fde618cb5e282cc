"""A real certificate authority for rotation tests, and checks that it is one.

`LocalCA` (tests/support/pki.py) signs with `cryptography` (not a stub: every
leaf really chains to its CA and carries the CSR's SANs), under a clock the
test controls. It is the `Issuer` of the rotation unit tests and of the
in-process TLS tests, where certs itself is not the subject. `FakeClock` is a
clock whose `sleep` moves time instead of waiting.
"""

from __future__ import annotations

import asyncio
import datetime as dt

from cryptography import x509

from tests.support.pki import LocalCA
from waygate.core import errors
from waygate.core.rotation import CertificateRotator

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
