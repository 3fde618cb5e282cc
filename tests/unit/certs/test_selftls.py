"""certs' own serving certificate: its CA answers the shared rotation client in-process."""

from __future__ import annotations

import datetime as dt
import random
from pathlib import Path

import pytest
from cryptography import x509

from tests.unit.certs.helpers import Clock, open_authority
from waygate.certs.selftls import AuthorityIssuer, serving_certificate

IDENTITY = "spiffe://waygate.local/ns/local/sa/certs"
SANS = ("dns:certs.waygate.local", "ip:127.0.0.1")


class Stop(Exception):
    pass


async def test_certs_signs_its_own_certificate_and_records_it(tmp_path: Path) -> None:
    authority = open_authority(tmp_path / "ca", Clock())
    rotator, credentials = await serving_certificate(authority, IDENTITY, SANS)
    assert credentials is not None
    leaf = rotator.current.leaf
    sans = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.UniformResourceIdentifier) == [IDENTITY]
    assert sans.get_values_for_type(x509.DNSName) == ["certs.waygate.local"]
    assert leaf.issuer == authority.active_authority().certificate.subject
    (record,) = authority.list_issued()
    assert (record.identity, record.requested_by) == (IDENTITY, "certs")


async def test_renews_through_the_authority_at_about_seventy_percent(tmp_path: Path) -> None:
    clock = Clock()
    authority = open_authority(tmp_path / "ca", clock)
    waits: list[float] = []

    async def sleep(seconds: float) -> None:
        waits.append(seconds)
        if len(authority.list_issued()) >= 2:  # one renewal is enough
            raise Stop
        clock.advance(dt.timedelta(seconds=seconds))

    rotator, _ = await serving_certificate(
        authority, IDENTITY, SANS, now=clock, sleep=sleep, rng=random.Random(3)
    )
    first = rotator.current
    with pytest.raises(Stop):
        await rotator.run()
    second = rotator.current
    assert second.serial != first.serial and second.key is not first.key
    elapsed = (clock() - first.not_before) / first.lifetime
    assert 0.65 <= elapsed <= 0.75


async def test_the_issuer_refuses_what_the_authority_refuses(tmp_path: Path) -> None:
    from waygate.core.errors import InvalidArgument

    issuer = AuthorityIssuer(open_authority(tmp_path / "ca", Clock()))
    with pytest.raises(InvalidArgument, match="not a PKCS#10 CSR"):
        await issuer.certify(b"not a csr", IDENTITY)


async def test_a_renewal_behind_a_held_lock_waits_in_a_thread_not_on_the_loop(
    tmp_path: Path,
) -> None:
    """A rotation or a store write holds the authority's lock: the renewal waits for it
    off the event loop, which keeps running meanwhile."""
    import asyncio
    import threading

    from tests.unit.certs.helpers import csr_der

    authority = open_authority(tmp_path / "ca", Clock())
    issuer = AuthorityIssuer(authority)
    der = csr_der((f"uri:{IDENTITY}", *SANS))
    await issuer.certify(der, IDENTITY)
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with authority._lock:
            held.set()
            release.wait(10)

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert held.wait(5)
        renewal = asyncio.ensure_future(issuer.certify(der, IDENTITY))
        for _ in range(10):
            await asyncio.sleep(0.01)
        assert not renewal.done()
    finally:
        release.set()
        holder.join(5)
    issued = await asyncio.wait_for(renewal, 5)
    assert issued.leaf_der
    assert len(authority.list_issued()) == 2
