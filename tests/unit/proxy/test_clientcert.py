"""The subject and issuer DNs the backend gets (ssl-client-subject-dn, -issuer-dn) and
auth-tls-match-cn searches: nginx's $ssl_client_s_dn is OpenSSL's RFC 2253 form, so
each is checked against `openssl x509 -nameopt RFC2253` (the external checker)."""

from __future__ import annotations

import datetime as dt
import shutil
import subprocess
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from tests.support.pki import LocalCA, certificate_pem
from waygate.proxy.clientcert import Rules, decide, distinguished_name
from waygate.resolver.model import ClientCertificate

NAMES = {
    "plain": [
        (NameOID.COMMON_NAME, "authtls.foo.com-client"),
        (NameOID.ORGANIZATION_NAME, "Acme Co"),
    ],
    "escaped": [
        (NameOID.COUNTRY_NAME, "DE"),
        (NameOID.ORGANIZATION_NAME, "Acme, Inc"),
        (NameOID.ORGANIZATIONAL_UNIT_NAME, "a+b"),
        (NameOID.COMMON_NAME, "Jürgen X"),
        (NameOID.EMAIL_ADDRESS, "a@b.c"),
        (NameOID.SERIAL_NUMBER, "42"),
    ],
    "control": [(NameOID.COMMON_NAME, "evil\r\nssl-client-verify: SUCCESS")],
}


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI")
@pytest.mark.parametrize("kind", sorted(NAMES))
def test_the_dn_is_openssls_rfc2253_form(kind: str, tmp_path: Path) -> None:
    ca = LocalCA()
    name = x509.Name([x509.NameAttribute(oid, value) for oid, value in NAMES[kind]])
    key = ec.generate_private_key(ec.SECP256R1())
    certificate = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(ca.name)
        .public_key(key.public_key())
        .serial_number(1)
        .not_valid_before(dt.datetime(2024, 1, 1))
        .not_valid_after(dt.datetime(2030, 1, 1))
        .sign(ca.key, hashes.SHA256())
    )
    (tmp_path / "leaf.pem").write_bytes(certificate_pem(certificate))
    out = subprocess.run(
        ["openssl", "x509", "-in", str(tmp_path / "leaf.pem"), "-noout", "-subject",
         "-nameopt", "RFC2253"],
        capture_output=True, text=True, check=True, timeout=30,
    ).stdout.strip()  # fmt: skip
    ours = distinguished_name(certificate.subject)
    assert "subject=" + ours == out
    assert "\r" not in ours and "\n" not in ours  # a safe header value


def test_plain_http_only_has_match_cn() -> None:
    # No certificate on plain HTTP: nginx's `$ssl_client_s_dn !~ ...` refuses (403);
    # without match-cn nothing is added (nginx drops an empty proxy_set_header).
    ca = "-----BEGIN CERTIFICATE-----\n"
    assert decide(Rules(ClientCertificate(ca, match_subject="CN=a")), None, None) == (
        403,
        "client certificate unauthorized",
    )
    assert decide(Rules(ClientCertificate(ca)), None, None) == b""
    # verify off: nothing asked, nothing checked, NONE to the backend.
    assert decide(Rules(ClientCertificate(ca, verify="off")), object(), b"x") == (
        b"ssl-client-verify: NONE\r\n"
    )


def test_a_refused_hosts_rules_answer_403_everywhere() -> None:
    rules = Rules(ClientCertificate("", refusal="host h: refused"))
    assert decide(rules, None, None) == (403, "host h: refused")
    assert decide(rules, object(), None) == (403, "host h: refused")
