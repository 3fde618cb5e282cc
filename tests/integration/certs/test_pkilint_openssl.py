"""Issued leaves and the CA, checked by independent tools: pkilint and openssl.

- `lint_pkix_cert lint -s WARNING -f JSON` on the CA of every key type and on
  leaves of every key type: no ERROR (or worse) finding, with one known
  exception: pkilint checks URIs with the `validators` package, which knows
  only web schemes and reports every `spiffe://` URI as
  `pkix.invalid_uri_syntax`. That finding is allowed only for spiffe URIs,
  which are then checked against the SPIFFE ID grammar here instead; a leaf
  with DNS and IP SANs only must have no ERROR at all.
- `lint_pkix_signer_signee_cert_chain lint ca.pem leaf.pem`: no finding.
- `openssl verify -CAfile ca.pem -purpose sslserver|sslclient` with the
  hostname (and IP) checked.
"""

from __future__ import annotations

import asyncio
import json
import re
import sys
from pathlib import Path

import pytest

from tests.unit.certs.helpers import RESOLVER_ID, RESOLVER_SANS, make_csr, open_authority, pem, sign
from waygate.certs.castate import KEY_ALGORITHMS

BIN = Path(sys.executable).parent
SPIFFE_ID = re.compile(r"^spiffe://[a-z0-9._-]+(/[A-Za-z0-9._-]+)+$")
FAILING = {"FATAL", "ERROR"}
SPIFFE_URI_FINDING = "pkix.invalid_uri_syntax"


async def run(*argv: str) -> tuple[int, str]:
    process = await asyncio.create_subprocess_exec(
        *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    out, _ = await asyncio.wait_for(process.communicate(), 60)
    return process.returncode or 0, out.decode()


async def lint_cert(path: Path) -> list[tuple[str, str, str]]:
    """(severity, code, message) of every finding at WARNING or above."""
    _, out = await run(
        str(BIN / "lint_pkix_cert"), "lint", "-s", "WARNING", "-f", "JSON", str(path)
    )
    findings = []
    for result in json.loads(out)["results"]:
        for finding in result["finding_descriptions"]:
            findings.append((finding["severity"], finding["code"], finding.get("message") or ""))
    return findings


def errors_of(findings: list[tuple[str, str, str]]) -> list[tuple[str, str, str]]:
    failing = []
    for severity, code, message in findings:
        if severity not in FAILING:
            continue
        spiffe = re.search(r'"(spiffe://[^"]*)"', message)
        if code == SPIFFE_URI_FINDING and spiffe and SPIFFE_ID.match(spiffe.group(1)):
            continue  # pkilint's validator knows no spiffe scheme (see the module docstring)
        failing.append((severity, code, message))
    return failing


def issue_leaf(
    directory: Path, ca_algorithm: str, leaf_algorithm: str, sans: tuple[str, ...]
) -> tuple[Path, Path]:
    authority = open_authority(directory / "ca", key_algorithm=ca_algorithm)
    identity = RESOLVER_ID if f"uri:{RESOLVER_ID}" in sans else sans[0].partition(":")[2]
    csr, _ = make_csr(sans, leaf_algorithm)
    leaf = sign(authority, csr, identity=identity, requested_by="test").leaf
    ca_file, leaf_file = directory / "ca.pem", directory / "leaf.pem"
    ca_file.write_text(authority.trust_bundle().pem)
    leaf_file.write_bytes(pem(leaf))
    return ca_file, leaf_file


CASES = [(ca, "ecdsa-p256") for ca in KEY_ALGORITHMS] + [
    ("ecdsa-p256", leaf) for leaf in KEY_ALGORITHMS if leaf != "ecdsa-p256"
]


@pytest.mark.parametrize(("ca_algorithm", "leaf_algorithm"), CASES)
async def test_leaf_and_ca_pass_pkilint_and_openssl(
    tmp_path: Path, ca_algorithm: str, leaf_algorithm: str
) -> None:
    ca_file, leaf_file = issue_leaf(tmp_path, ca_algorithm, leaf_algorithm, RESOLVER_SANS)
    ca_findings, leaf_findings, chain, server, client, by_ip = await asyncio.gather(
        lint_cert(ca_file),
        lint_cert(leaf_file),
        run(str(BIN / "lint_pkix_signer_signee_cert_chain"), "lint", str(ca_file), str(leaf_file)),
        run(
            "openssl",
            "verify",
            "-CAfile",
            str(ca_file),
            "-purpose",
            "sslserver",
            "-verify_hostname",
            "resolver.waygate.local",
            str(leaf_file),
        ),
        run("openssl", "verify", "-CAfile", str(ca_file), "-purpose", "sslclient", str(leaf_file)),
        run(
            "openssl",
            "verify",
            "-CAfile",
            str(ca_file),
            "-purpose",
            "sslserver",
            "-verify_ip",
            "127.0.0.1",
            str(leaf_file),
        ),
    )
    assert errors_of(ca_findings) == [] and ca_findings == []
    assert errors_of(leaf_findings) == []
    # The one tolerated finding really is the spiffe URI, nothing else.
    assert {code for severity, code, _ in leaf_findings if severity in FAILING} <= {
        SPIFFE_URI_FINDING
    }
    assert chain[0] == 0, chain[1]
    for code, out in (server, client, by_ip):
        assert code == 0 and out.strip().endswith("OK"), out


async def test_dns_and_ip_leaf_has_no_error_at_all(tmp_path: Path) -> None:
    _, leaf_file = issue_leaf(
        tmp_path, "ecdsa-p256", "ecdsa-p256", ("dns:resolver.waygate.local", "ip:127.0.0.1")
    )
    findings = await lint_cert(leaf_file)
    assert [f for f in findings if f[0] in FAILING] == []


async def test_an_agent_role_leaf_passes_and_serves_no_tls(tmp_path: Path) -> None:
    """The tunnel agent's leaf (its CSR asks for clientAuth only): no pkilint ERROR, a
    valid TLS client for openssl, and no TLS server (what keeps it from passing as a
    serving certificate, and a serving certificate from passing as an agent's)."""
    from cryptography import x509

    from waygate.core.rotation import build_csr, generate_key

    # A node named by its FQDN: pkilint reports a one-label DNS name (edge-1) as an ERROR.
    NODE = "edge-1.nodes.example.net"
    authority = open_authority(tmp_path / "ca")
    csr = x509.load_der_x509_csr(build_csr(generate_key(), NODE, (), client_only=True))
    leaf = sign(authority, csr, identity=NODE, requested_by="test").leaf
    ca_file, leaf_file = tmp_path / "ca.pem", tmp_path / "leaf.pem"
    ca_file.write_text(authority.trust_bundle().pem)
    leaf_file.write_bytes(pem(leaf))
    findings, chain, client, server = await asyncio.gather(
        lint_cert(leaf_file),
        run(str(BIN / "lint_pkix_signer_signee_cert_chain"), "lint", str(ca_file), str(leaf_file)),
        run("openssl", "verify", "-CAfile", str(ca_file), "-purpose", "sslclient", str(leaf_file)),
        run("openssl", "verify", "-CAfile", str(ca_file), "-purpose", "sslserver", str(leaf_file)),
    )
    assert [f for f in findings if f[0] in FAILING] == []
    assert chain[0] == 0, chain[1]
    assert client[0] == 0 and client[1].strip().endswith("OK"), client[1]
    assert server[0] != 0 and "unsuitable certificate purpose" in server[1], server[1]


async def test_openssl_rejects_the_wrong_hostname(tmp_path: Path) -> None:
    """The checks above could fail: a name the leaf does not carry is refused."""
    ca_file, leaf_file = issue_leaf(tmp_path, "ecdsa-p256", "ecdsa-p256", RESOLVER_SANS)
    code, out = await run(
        "openssl",
        "verify",
        "-CAfile",
        str(ca_file),
        "-purpose",
        "sslserver",
        "-verify_hostname",
        "proxy.waygate.local",
        str(leaf_file),
    )
    assert code != 0 and "hostname mismatch" in out


async def test_pkilint_would_report_a_broken_ca(tmp_path: Path) -> None:
    """A CA without keyUsage is an ERROR for pkilint: the lint really runs."""
    import datetime as dt

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "broken")])
    now = dt.datetime.now(dt.UTC)
    broken = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now)
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    path = tmp_path / "broken.pem"
    path.write_bytes(pem(broken))
    assert errors_of(await lint_cert(path)) != []
