"""The Authority: leaf profile per key type, bad input refused with nothing written, restarts."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa
from cryptography.x509 import verification
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from tests.unit.certs.helpers import (
    RESOLVER_ID,
    RESOLVER_SANS,
    Clock,
    csr_der,
    make_csr,
    open_authority,
    sign,
    snapshot,
    tampered_csr_der,
)
from waygate.certs.castate import KEY_ALGORITHMS, CAState
from waygate.certs.csr import check_csr, load_csr
from waygate.core.errors import FailedPrecondition, InvalidArgument

HOUR = dt.timedelta(hours=1)


def verify(leaf: x509.Certificate, roots: tuple[x509.Certificate, ...], at: dt.datetime) -> None:
    """Chain `leaf` to `roots` as a TLS client would (server name) and a server would (client).

    cryptography's verifier follows the Web PKI, which forbids Ed25519 keys;
    with one in the chain the signature and validity are checked directly
    (openssl verifies those chains fully in test_pkilint_openssl.py).
    """
    if any(isinstance(c.public_key(), ed25519.Ed25519PublicKey) for c in (leaf, *roots)):
        issuer = next(r for r in roots if r.subject == leaf.issuer)
        leaf.verify_directly_issued_by(issuer)
        assert leaf.not_valid_before_utc <= at <= leaf.not_valid_after_utc
        return
    builder = verification.PolicyBuilder().store(verification.Store(list(roots))).time(at)
    builder.build_server_verifier(x509.DNSName("resolver.waygate.local")).verify(leaf, [])
    builder.build_client_verifier().verify(leaf, [])


def test_ca_certificate_profile(tmp_path: Path) -> None:
    clock = Clock()
    authority = open_authority(tmp_path / "ca", clock)
    (ca,) = authority.trust_bundle().authorities
    cert = ca.certificate
    assert ca.state is CAState.ACTIVE
    basic = cert.extensions.get_extension_for_class(x509.BasicConstraints)
    assert basic.critical and basic.value.ca
    usage = cert.extensions.get_extension_for_class(x509.KeyUsage)
    assert usage.critical and usage.value.key_cert_sign and usage.value.crl_sign
    assert cert.subject.get_attributes_for_oid(NameOID.ORGANIZATION_NAME)[0].value == "Waygate"
    assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    assert cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier)
    assert cert.not_valid_after_utc - clock() == dt.timedelta(days=365)
    assert isinstance(cert.public_key(), ec.EllipticCurvePublicKey)


@pytest.mark.parametrize("ca_algorithm", KEY_ALGORITHMS)
@pytest.mark.parametrize("leaf_algorithm", KEY_ALGORITHMS)
def test_every_key_type_signs_and_is_signed(
    tmp_path: Path, ca_algorithm: str, leaf_algorithm: str
) -> None:
    clock = Clock()
    authority = open_authority(tmp_path / "ca", clock, key_algorithm=ca_algorithm)
    csr, _ = make_csr(RESOLVER_SANS, leaf_algorithm)
    issued = sign(authority, csr, identity=RESOLVER_ID, requested_by="resolver")
    leaf = issued.leaf
    verify(leaf, authority.trust_bundle().certificates, clock())
    assert issued.valid_until == leaf.not_valid_after_utc == clock() + 24 * HOUR
    assert leaf.not_valid_before_utc == clock() - dt.timedelta(minutes=5)  # backdated
    basic = leaf.extensions.get_extension_for_class(x509.BasicConstraints)
    assert basic.critical and not basic.value.ca
    usage = leaf.extensions.get_extension_for_class(x509.KeyUsage).value
    assert usage.digital_signature and not usage.key_cert_sign
    assert usage.key_encipherment == isinstance(leaf.public_key(), rsa.RSAPublicKey)
    eku = leaf.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(eku) == [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
    ca_ski = (
        authority.trust_bundle()
        .certificates[0]
        .extensions.get_extension_for_class(x509.SubjectKeyIdentifier)
    )
    aki = leaf.extensions.get_extension_for_class(x509.AuthorityKeyIdentifier).value
    assert aki.key_identifier == ca_ski.value.digest
    assert leaf.extensions.get_extension_for_class(x509.SubjectKeyIdentifier)
    sans = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.UniformResourceIdentifier) == [RESOLVER_ID]
    assert sans.get_values_for_type(x509.DNSName) == ["resolver.waygate.local"]
    assert format(leaf.serial_number, "x") == issued.serial and 0 < leaf.serial_number < 2**128
    assert issued.chain == ()


def test_serials_are_random(tmp_path: Path) -> None:
    authority = open_authority(tmp_path / "ca")
    serials = {
        sign(authority, make_csr()[0], identity=RESOLVER_ID, requested_by="r").serial
        for _ in range(50)
    }
    assert len(serials) == 50


def test_lifetime_is_honoured_and_capped_by_the_maximum(tmp_path: Path) -> None:
    clock = Clock()
    authority = open_authority(tmp_path / "ca", clock, max_lifetime=48 * HOUR)
    issued = sign(
        authority, make_csr()[0], identity=RESOLVER_ID, requested_by="r", lifetime=2 * HOUR
    )
    assert issued.valid_until == clock() + 2 * HOUR
    before = snapshot(tmp_path / "ca")
    with pytest.raises(InvalidArgument, match="lifetime 49h exceeds the maximum 2d"):
        sign(authority, make_csr()[0], identity=RESOLVER_ID, requested_by="r", lifetime=49 * HOUR)
    with pytest.raises(InvalidArgument, match="must be positive"):
        sign(
            authority,
            make_csr()[0],
            identity=RESOLVER_ID,
            requested_by="r",
            lifetime=dt.timedelta(0),
        )
    assert snapshot(tmp_path / "ca") == before
    assert len(authority.list_issued()) == 1


def test_leaf_never_outlives_its_ca(tmp_path: Path) -> None:
    clock = Clock()
    authority = open_authority(
        tmp_path / "ca", clock, ca_lifetime=10 * 24 * HOUR, max_lifetime=7 * 24 * HOUR
    )
    clock.advance(9 * 24 * HOUR)
    issued = sign(authority, make_csr()[0], identity=RESOLVER_ID, requested_by="r")
    assert issued.valid_until == authority.trust_bundle().authorities[0].not_after


def test_malformed_and_unsigned_csrs(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match="empty"):
        load_csr(b"")
    with pytest.raises(InvalidArgument, match="not a PKCS#10 CSR"):
        load_csr(b"\x30\x03garbage")
    with pytest.raises(InvalidArgument, match="signature does not verify"):
        check_csr(load_csr(tampered_csr_der()))
    check_csr(load_csr(csr_der()))


def test_weak_rsa_csr_is_refused() -> None:
    weak = rsa.generate_private_key(public_exponent=65537, key_size=1024)
    csr, _ = make_csr(RESOLVER_SANS, key=weak)
    with pytest.raises(InvalidArgument, match="1024 bits"):
        check_csr(csr)


def test_ed25519_csr_is_accepted() -> None:
    csr, _ = make_csr(RESOLVER_SANS, key=ed25519.Ed25519PrivateKey.generate())
    check_csr(csr)


def test_list_issued_filters(tmp_path: Path) -> None:
    clock = Clock()
    authority = open_authority(tmp_path / "ca", clock)
    sign(authority, make_csr()[0], identity=RESOLVER_ID, requested_by="resolver", lifetime=HOUR)
    other_id = "spiffe://waygate.local/ns/local/sa/proxy"
    sign(authority, make_csr((f"uri:{other_id}",))[0], identity=other_id, requested_by="proxy")
    assert {r.identity for r in authority.list_issued()} == {RESOLVER_ID, other_id}
    (record,) = authority.list_issued(identity=other_id)
    assert record.requested_by == "proxy" and record.uris == (other_id,)
    clock.advance(2 * HOUR)
    assert [r.identity for r in authority.list_issued()] == [other_id]
    assert len(authority.list_issued(include_expired=True)) == 2


def test_restart_keeps_the_ca(tmp_path: Path) -> None:
    first = open_authority(tmp_path / "ca")
    fingerprint = first.active_authority().fingerprint
    version = first.version
    again = open_authority(tmp_path / "ca")
    assert again.active_authority().fingerprint == fingerprint
    assert again.version == version
    leaf = sign(again, make_csr()[0], identity=RESOLVER_ID, requested_by="r").leaf
    verify(leaf, first.trust_bundle().certificates, dt.datetime.now(dt.UTC))


def test_restart_refuses_a_key_others_can_read(tmp_path: Path) -> None:
    open_authority(tmp_path / "ca")
    (key,) = (tmp_path / "ca").glob("*.key.pem")
    key.chmod(0o644)
    before = snapshot(tmp_path / "ca")
    with pytest.raises(FailedPrecondition, match=r"key\.pem has mode 0644"):
        open_authority(tmp_path / "ca")
    assert snapshot(tmp_path / "ca") == before


def test_restart_refuses_a_key_that_does_not_parse(tmp_path: Path) -> None:
    open_authority(tmp_path / "ca")
    (key,) = (tmp_path / "ca").glob("*.key.pem")
    key.write_bytes(b"-----BEGIN PRIVATE KEY-----\nnot a key\n-----END PRIVATE KEY-----\n")
    with pytest.raises(FailedPrecondition, match="unreadable"):
        open_authority(tmp_path / "ca")


def test_files_without_state_are_not_overwritten(tmp_path: Path) -> None:
    (tmp_path / "ca").mkdir(mode=0o700)
    (tmp_path / "ca" / "ca-1.cert.pem").write_bytes(b"x")
    with pytest.raises(FailedPrecondition, match="refusing to create a new CA over it"):
        open_authority(tmp_path / "ca")


def test_leaf_bound_is_saved_rarely(tmp_path: Path) -> None:
    clock = Clock()
    authority = open_authority(tmp_path / "ca", clock)
    sign(authority, make_csr()[0], identity=RESOLVER_ID, requested_by="r")
    before = snapshot(tmp_path / "ca")
    for _ in range(5):
        clock.advance(dt.timedelta(minutes=10))
        sign(authority, make_csr()[0], identity=RESOLVER_ID, requested_by="r")
    assert snapshot(tmp_path / "ca") == before  # within the bound step: no write
    clock.advance(HOUR)
    sign(authority, make_csr()[0], identity=RESOLVER_ID, requested_by="r")
    assert snapshot(tmp_path / "ca") != before


def test_list_issued_returns_the_newest_within_the_limit(tmp_path: Path) -> None:
    authority = open_authority(tmp_path / "ca")
    serials = [
        sign(authority, make_csr()[0], identity=RESOLVER_ID, requested_by="r").serial
        for _ in range(5)
    ]
    assert [r.serial for r in authority.list_issued(limit=3)] == serials[2:]
    assert [r.serial for r in authority.list_issued()] == serials


@pytest.mark.parametrize(
    "damage",
    [
        lambda state: state.update(format=99),
        lambda state: state["authorities"][0].update(state="SLEEPING"),
        lambda state: state["authorities"][0].pop("name"),
        lambda state: state["authorities"][0].update(activate_at="yesterday"),
        lambda state: state["authorities"][0].update(state="RETIRING"),
    ],
)
def test_a_damaged_state_file_refuses_to_start(tmp_path: Path, damage) -> None:  # type: ignore[no-untyped-def]
    open_authority(tmp_path / "ca")
    path = tmp_path / "ca" / "state.json"
    state = json.loads(path.read_text())
    damage(state)
    path.write_text(json.dumps(state))
    with pytest.raises(FailedPrecondition, match="state"):
        open_authority(tmp_path / "ca")
