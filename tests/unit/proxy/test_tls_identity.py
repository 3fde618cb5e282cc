"""Identity headers of auth-proxy routes, from real certificates."""

from __future__ import annotations

import datetime as dt

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from waygate.core.settings import SettingsError
from waygate.proxy.app import Settings
from waygate.proxy.tls import identity_headers


def certificate(subject: list[x509.NameAttribute], sans: list[x509.GeneralName]):
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name(subject))
        .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "ca")]))
        .public_key(key.public_key())
        .serial_number(0xABC)
        .not_valid_before(now)
        .not_valid_after(now + dt.timedelta(hours=1))
    )
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    return builder.sign(key, hashes.SHA256())


def test_cn_and_organisations_without_a_spiffe_id() -> None:
    cert = certificate(
        [
            x509.NameAttribute(NameOID.COMMON_NAME, "alice"),
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "admins"),
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "devs"),
            x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, "platform"),
        ],
        [x509.RFC822Name("alice@example.com")],
    )
    assert identity_headers(cert) == (
        b"X-Remote-User: alice\r\nX-Remote-Group: admins\r\nX-Remote-Group: devs\r\n"
    )
    assert identity_headers(cert, ("ou", "email", "serial")) == (
        b"X-Remote-User: alice\r\nX-Remote-Group: admins\r\nX-Remote-Group: devs\r\n"
        b"X-Remote-Extra-Ou: platform\r\nX-Remote-Extra-Email: alice@example.com\r\n"
        b"X-Remote-Extra-Serial: abc\r\n"
    )


def test_the_spiffe_id_wins_and_no_field_can_inject_a_header_line() -> None:
    cert = certificate(
        [x509.NameAttribute(NameOID.ORGANIZATION_NAME, "ops\r\nX-Remote-User: root")],
        [x509.UniformResourceIdentifier("spiffe://waygate.local/ns/a/sa/b")],
    )
    assert identity_headers(cert) == (
        b"X-Remote-User: spiffe://waygate.local/ns/a/sa/b\r\n"
        b"X-Remote-Group: ops??X-Remote-User: root\r\n"
    )


def test_unknown_extra_fields_are_refused_at_start() -> None:
    with pytest.raises(SettingsError, match="remote_extra_fields: phone"):
        Settings(remote_extra_fields="ou, phone")
    assert Settings(remote_extra_fields="OU, email").extra_fields() == ("ou", "email")
