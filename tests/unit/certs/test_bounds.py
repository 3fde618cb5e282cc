"""Bounded CSRs and bounded ListIssued records (issue 8 item 4, certs side).

CSRs: at most `max_sans` SANs, each within its length bound; RSA keys of
2048..4096 bits; no other key type than ECDSA P-256/P-384 and Ed25519. Every
refusal is INVALID_ARGUMENT with a short message naming the bound, and
nothing is signed or recorded. Records: what ListIssued shows and nothing
more, bounded by count and bytes, expired ones dropped first, paged.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import threading
import time
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import dsa, ec, ed448, rsa
from hypothesis import given, settings
from hypothesis import strategies as st
from pyasn1.codec.der import decoder, encoder
from pyasn1_alt_modules import rfc2986

from tests.unit.certs.helpers import (
    RESOLVER_ID,
    RESOLVER_SANS,
    Clock,
    make_csr,
    open_authority,
    sign,
)
from waygate.certs.csr import (
    MAX_DNS_NAME_LENGTH,
    MAX_URI_LENGTH,
    check_csr,
    der_san_count,
    load_csr,
)
from waygate.certs.issuing import IssuedRecord, IssuedRecords
from waygate.core.errors import InvalidArgument

NOW = dt.datetime(2026, 3, 1, 12, 0, tzinfo=dt.UTC)
HOUR = dt.timedelta(hours=1)


def many_names(count: int) -> list[str]:
    return [f"dns:n{index}.hostile.test" for index in range(count)]


def test_sans_over_the_cap_are_refused_naming_it() -> None:
    csr, _ = make_csr(many_names(101))
    with pytest.raises(InvalidArgument) as refused:
        check_csr(csr)
    message = str(refused.value)
    assert "101 subject alternative names" in message
    assert "at most 100" in message and "max_sans_per_csr" in message
    check_csr(make_csr(many_names(100))[0])  # the cap itself is allowed


def test_the_authority_applies_its_configured_cap(tmp_path: Path) -> None:
    authority = open_authority(tmp_path / "ca", max_sans=3)
    names = [f"uri:{RESOLVER_ID}", "dns:a.test", "dns:b.test", "dns:c.test"]
    with pytest.raises(InvalidArgument, match="at most 3"):
        sign(authority, make_csr(names)[0], identity=RESOLVER_ID, requested_by="r")
    assert authority.list_issued(include_expired=True) == []
    sign(authority, make_csr(names[:3])[0], identity=RESOLVER_ID, requested_by="r")


@pytest.mark.parametrize(
    ("name", "bound"),
    [
        ("dns:" + "a" * 63 + "." + "b" * 63 + "." + "c" * 63 + "." + "d" * 63 + ".test", 253),
        ("uri:spiffe://waygate.local/" + "x" * MAX_URI_LENGTH, MAX_URI_LENGTH),
    ],
)
def test_a_san_over_its_length_is_refused_with_an_excerpt(name: str, bound: int) -> None:
    assert MAX_DNS_NAME_LENGTH == 253
    csr, _ = make_csr([name])
    with pytest.raises(InvalidArgument) as refused:
        check_csr(csr)
    message = str(refused.value)
    assert f"longer than {bound} characters" in message
    assert len(message) < 250  # an excerpt of the name, not the name


def csr_with_public_key(public_key: object) -> bytes:
    """A CSR carrying `public_key` whose signature (by another key) cannot verify.

    The key checks come before the signature check, so this is how a test asks
    about key sizes nobody wants to generate (RSA-8192 takes seconds); the
    system test generates a real one.
    """
    der = make_csr(RESOLVER_SANS)[0].public_bytes(serialization.Encoding.DER)
    request, _ = decoder.decode(der, asn1Spec=rfc2986.CertificationRequest())
    spki_der = public_key.public_bytes(  # type: ignore[attr-defined]
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    spki, _ = decoder.decode(spki_der, asn1Spec=rfc2986.SubjectPublicKeyInfo())
    request["certificationRequestInfo"]["subjectPKInfo"] = spki
    return bytes(encoder.encode(request))


def big_rsa_public_key(bits: int) -> rsa.RSAPublicKey:
    modulus = (1 << (bits - 1)) | 0xB5  # odd, exactly `bits` long: a modulus-shaped number
    return rsa.RSAPublicNumbers(65537, modulus).public_key()


def test_rsa_over_4096_bits_is_refused() -> None:
    csr = load_csr(csr_with_public_key(big_rsa_public_key(8192)))
    with pytest.raises(InvalidArgument, match="8192 bits; RSA keys must have 2048 to 4096 bits"):
        check_csr(csr)


def test_rsa_under_2048_bits_is_refused() -> None:
    key = rsa.generate_private_key(public_exponent=65537, key_size=1024)
    csr, _ = make_csr(RESOLVER_SANS, key=key)
    with pytest.raises(InvalidArgument, match="1024 bits; RSA keys must have 2048 to 4096"):
        check_csr(csr)


@pytest.mark.parametrize(
    ("key", "named"),
    [
        (ed448.Ed448PrivateKey.generate(), "Ed448PublicKey"),
        (ec.generate_private_key(ec.SECP521R1()), "secp521r1"),
        (ec.generate_private_key(ec.SECP256K1()), "secp256k1"),
    ],
)
def test_other_key_types_are_refused_naming_them(key: object, named: str) -> None:
    algorithm = None if isinstance(key, ed448.Ed448PrivateKey) else hashes.SHA256()
    csr = (
        x509.CertificateSigningRequestBuilder().subject_name(x509.Name([])).sign(key, algorithm)  # type: ignore[arg-type]
    )
    with pytest.raises(InvalidArgument) as refused:
        check_csr(csr)
    assert named in str(refused.value)
    assert "ECDSA P-256/P-384, RSA 2048..4096 bits, Ed25519" in str(refused.value)


def test_dsa_key_is_refused() -> None:
    key = dsa.generate_private_key(key_size=1024)
    csr = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(x509.Name([]))
        .sign(key, hashes.SHA256())
    )
    with pytest.raises(InvalidArgument, match="DSAPublicKey is not supported"):
        check_csr(csr)


# ---------------------------------------------------------------- records


def add(
    records: IssuedRecords, identity: str, not_after: dt.datetime, sans: int = 0
) -> IssuedRecord:
    return records.add(
        serial=f"{records_added(records):x}",
        identity=identity,
        dns_names=tuple(f"n{i}.test" for i in range(sans)),
        uris=(),
        not_before=not_after - HOUR,
        not_after=not_after,
        issuer_fingerprint="f" * 64,
        requested_by="tester",
        now=NOW,
    )


def records_added(records: IssuedRecords) -> int:
    return records._sequence + 1


def test_records_hold_only_what_list_issued_shows(tmp_path: Path) -> None:
    authority = open_authority(tmp_path / "ca")
    sign(authority, make_csr()[0], identity=RESOLVER_ID, requested_by="resolver")
    (record,) = authority.list_issued()
    fields = set(IssuedRecord.__slots__)
    assert fields == {
        "sequence",
        "serial",
        "identity",
        "dns_names",
        "uris",
        "not_before",
        "not_after",
        "issuer_fingerprint",
        "requested_by",
        "size",
    }
    assert not hasattr(record, "__dict__")  # no room for a certificate or a CSR


def test_past_the_count_expired_records_go_first() -> None:
    records = IssuedRecords(max_count=10, max_bytes=10**9)
    for _ in range(4):
        add(records, "expired", NOW - HOUR)
    fresh = [add(records, "fresh", NOW + HOUR) for _ in range(7)]  # 11 > 10: make room
    kept = records.newest(identity="", include_expired=True, limit=100, now=NOW)
    assert kept == fresh  # every expired record went, no fresh one


def test_past_the_count_without_expired_the_oldest_go_to_nine_tenths() -> None:
    records = IssuedRecords(max_count=10, max_bytes=10**9)
    added = [add(records, "fresh", NOW + HOUR) for _ in range(11)]
    kept = records.newest(identity="", include_expired=True, limit=100, now=NOW)
    assert kept == added[-9:]
    assert len(records) == 9


def test_the_byte_bound_holds() -> None:
    records = IssuedRecords(max_count=10**6, max_bytes=200_000)
    for _ in range(100):
        add(records, "big", NOW + HOUR, sans=100)
    assert records.bytes <= 200_000
    assert 0 < len(records) < 100


def test_pages_follow_the_sequence_and_filters() -> None:
    records = IssuedRecords(max_count=1000, max_bytes=10**9)
    for index in range(25):
        add(records, "a" if index % 2 else "b", NOW + (HOUR if index % 5 else -HOUR))
    seen: list[IssuedRecord] = []
    after = 0
    while True:
        page = records.page(
            identity="a", include_expired=False, after=after, size=4, max_bytes=10**9, now=NOW
        )
        assert len(page.records) <= 4
        seen += page.records
        if page.next_after is None:
            break
        after = page.next_after
    expected = [r for r in records.newest(identity="a", include_expired=False, limit=1000, now=NOW)]
    assert seen == expected and len(expected) == 10
    assert [r.sequence for r in seen] == sorted({r.sequence for r in seen})


def test_a_page_stays_within_its_bytes_yet_holds_at_least_one_record() -> None:
    records = IssuedRecords(max_count=1000, max_bytes=10**9)
    big = [add(records, "big", NOW + HOUR, sans=100) for _ in range(5)]
    page = records.page(
        identity="", include_expired=True, after=0, size=100, max_bytes=big[0].size * 2, now=NOW
    )
    assert page.records == tuple(big[:2]) and page.next_after == big[1].sequence
    tiny = records.page(identity="", include_expired=True, after=0, size=100, max_bytes=1, now=NOW)
    assert tiny.records == (big[0],)


def test_paging_survives_records_dropped_between_pages() -> None:
    records = IssuedRecords(max_count=10, max_bytes=10**9)
    first = [add(records, "x", NOW + HOUR) for _ in range(10)]
    page = records.page(
        identity="", include_expired=True, after=0, size=3, max_bytes=10**9, now=NOW
    )
    assert page.records == tuple(first[:3])
    later = [add(records, "x", NOW + HOUR) for _ in range(5)]  # drops the oldest
    assert page.next_after is not None
    rest = records.page(
        identity="", include_expired=True, after=page.next_after, size=100, max_bytes=10**9, now=NOW
    )
    survivors = [
        r
        for r in first[3:]
        if r in records.newest(identity="", include_expired=True, limit=100, now=NOW)
    ]
    assert list(rest.records) == survivors + later


def test_the_authority_keeps_its_configured_number_of_records(tmp_path: Path) -> None:
    clock = Clock()
    authority = open_authority(tmp_path / "ca", clock, issued_records=20)
    for _ in range(30):
        sign(authority, make_csr()[0], identity=RESOLVER_ID, requested_by="r")
    assert len(authority.list_issued(include_expired=True)) <= 20


# ---------------------------------------------------------------- counting SANs before parsing


@pytest.mark.parametrize("count", [0, 1, 100, 101, 5000])
def test_der_san_count_reads_only_up_to_the_cap(count: int) -> None:
    csr = make_csr(many_names(count))[0] if count else make_csr([])[0]
    der = csr.public_bytes(serialization.Encoding.DER)
    expected = None if count == 0 else min(count, 101)
    assert der_san_count(der, 100) == expected


def test_load_csr_refuses_past_the_cap_before_parsing() -> None:
    der = make_csr(many_names(5000))[0].public_bytes(serialization.Encoding.DER)
    with pytest.raises(
        InvalidArgument, match="more than 100 subject alternative names; at most 100"
    ):
        load_csr(der, max_sans=100)
    assert (
        len(load_csr(der).extensions.get_extension_for_class(x509.SubjectAlternativeName).value)
        == 5000
    )


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=600))
def test_der_san_count_never_fails_on_garbage(data: bytes) -> None:
    assert der_san_count(data, 100) in (None, *range(102))


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_der_san_count_never_fails_on_damaged_csrs(data: st.DataObject) -> None:
    der = bytearray(CSR_WITH_SANS)
    for _ in range(data.draw(st.integers(1, 6))):
        der[data.draw(st.integers(0, len(der) - 1))] = data.draw(st.integers(0, 255))
    assert der_san_count(bytes(der), 3) in (None, 0, 1, 2, 3, 4)


CSR_WITH_SANS = make_csr(many_names(3))[0].public_bytes(serialization.Encoding.DER)


# ---------------------------------------------------------------- bundle readers never wait


def test_the_bundle_is_read_without_waiting_for_a_signing_in_progress(tmp_path: Path) -> None:
    clock = Clock()
    authority = open_authority(tmp_path / "ca", clock)
    holding, release = threading.Event(), threading.Event()

    def slow_store_write() -> None:
        with authority._lock:  # what a signing thread holds while it saves the store
            holding.set()
            release.wait(10)

    writer = threading.Thread(target=slow_store_write)
    writer.start()
    try:
        assert holding.wait(5)
        started = time.monotonic()
        bundle = authority.trust_bundle()
        assert time.monotonic() - started < 1.0
        assert bundle.version == authority.version and len(bundle.authorities) == 1
    finally:
        release.set()
        writer.join(5)


def test_a_due_transition_still_shows_in_the_bundle(tmp_path: Path) -> None:
    clock = Clock()
    authority = open_authority(tmp_path / "ca", clock)
    rotation = authority.rotate(propagation_delay=HOUR)
    assert [a.state.value for a in authority.trust_bundle().authorities] == ["ACTIVE", "STAGED"]
    clock.advance(HOUR)
    states = [a.state.value for a in authority.trust_bundle().authorities]
    assert states == ["RETIRING", "ACTIVE"]
    assert authority.trust_bundle().version > rotation.bundle.version


async def test_the_event_loop_never_waits_for_the_lock_even_when_a_transition_is_due(
    tmp_path: Path,
) -> None:
    clock = Clock()
    authority = open_authority(tmp_path / "ca", clock)
    authority.deliver_changes_on(asyncio.get_running_loop())
    rotation = authority.rotate(propagation_delay=HOUR)
    clock.advance(HOUR)  # the switch is due: only the timer's thread applies it
    holding, release = threading.Event(), threading.Event()

    def slow_store_write() -> None:
        with authority._lock:  # what a signing thread holds across sign and fsync
            holding.set()
            release.wait(10)

    writer = threading.Thread(target=slow_store_write)
    writer.start()
    try:
        assert holding.wait(5)
        started = time.monotonic()
        bundle = authority.trust_bundle()
        due = authority.next_transition()
        older = await asyncio.wait_for(authority.wait_for_change(bundle.version - 1), 5)
        assert time.monotonic() - started < 1.0
        assert bundle.version == rotation.bundle.version == older.version
        assert due == rotation.signing_switch_at
    finally:
        release.set()
        writer.join(5)
    await asyncio.to_thread(authority.advance)  # the timer's step
    changed = await asyncio.wait_for(authority.wait_for_change(bundle.version), 5)
    assert [a.state.value for a in changed.authorities] == ["RETIRING", "ACTIVE"]
    assert authority.trust_bundle() == changed


async def test_listeners_never_hear_an_older_bundle_after_a_newer_one(tmp_path: Path) -> None:
    clock = Clock()
    authority = open_authority(tmp_path / "ca", clock)
    authority.deliver_changes_on(asyncio.get_running_loop())
    heard: list[int] = []
    authority.add_listener(lambda bundle: heard.append(bundle.version))
    # A change in a thread: its delivery is queued on the loop, which is busy here...
    worker = threading.Thread(target=authority.rotate, kwargs={"propagation_delay": HOUR})
    worker.start()
    worker.join(10)
    staged = authority.version
    # ...and a change on the loop is delivered at once, before the queued one.
    clock.advance(HOUR)
    assert authority.advance()
    for _ in range(5):
        await asyncio.sleep(0)
    assert heard == [staged + 1]
    assert authority.trust_bundle().version == staged + 1


def test_load_csr_counts_the_sans_of_a_pem_csr_before_parsing_too(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pem = make_csr(many_names(5000))[0].public_bytes(serialization.Encoding.PEM)

    def no_full_parse(data: bytes) -> x509.CertificateSigningRequest:
        raise AssertionError("a CSR past the cap was parsed in full")

    with monkeypatch.context() as patched:
        patched.setattr(x509, "load_der_x509_csr", no_full_parse)
        patched.setattr(x509, "load_pem_x509_csr", no_full_parse)
        with pytest.raises(InvalidArgument, match="more than 100 subject alternative names"):
            load_csr(pem, max_sans=100)
    assert load_csr(pem).public_bytes(serialization.Encoding.PEM) == pem


@pytest.mark.parametrize(
    "pem",
    [
        b"-----BEGIN CERTIFICATE REQUEST-----\n!!!!\n-----END CERTIFICATE REQUEST-----\n",
        b"-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n",
        b"-----BEGIN CERTIFICATE REQUEST-----\nAAAA",
    ],
)
def test_a_bad_pem_csr_is_a_clear_invalid_argument(pem: bytes) -> None:
    with pytest.raises(InvalidArgument, match="not a PKCS#10 CSR"):
        load_csr(pem, max_sans=100)
