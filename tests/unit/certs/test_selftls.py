"""certs' own serving certificate: issued by its CA, renewed at 70% of its life."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import pytest
from cryptography import x509

from tests.unit.certs.helpers import Clock, open_authority
from waygate.certs.selftls import SelfServingCertificate

IDENTITY = "spiffe://waygate.local/ns/local/sa/certs"
NAMES = (f"uri:{IDENTITY}", "dns:certs.waygate.local", "ip:127.0.0.1")


class Stop(Exception):
    pass


async def test_renews_at_seventy_percent_and_serves_the_new_one(tmp_path: Path) -> None:
    clock = Clock()
    authority = open_authority(tmp_path / "ca", clock)
    waits: list[float] = []

    async def sleep(seconds: float) -> None:
        waits.append(seconds)
        if len(waits) > 1:  # the second wait: one renewal is enough
            raise Stop
        clock.advance(dt.timedelta(seconds=seconds))

    serving = SelfServingCertificate(authority, IDENTITY, NAMES, now=clock, sleep=sleep)
    serving.credentials()
    first = serving.certificate
    assert first is not None
    sans = first.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.DNSName) == ["certs.waygate.local"]
    lifetime = first.not_valid_after_utc - first.not_valid_before_utc
    assert serving.renew_at() == first.not_valid_before_utc + lifetime * 0.7
    # Nothing new to hand to gRPC until a renewal happened.
    assert serving._fetch() is None

    started, renew_at = clock(), serving.renew_at()
    with pytest.raises(Stop):
        await serving.run()
    # It slept exactly until 70% of the first certificate's life, then renewed.
    assert waits[0] == (renew_at - started).total_seconds()
    second = serving.certificate
    assert second is not None and second.serial_number != first.serial_number
    assert second.not_valid_before_utc == renew_at - dt.timedelta(minutes=5)  # backdated
    # gRPC's next handshake gets the new certificate, once.
    assert serving._fetch() is not None and serving._fetch() is None
