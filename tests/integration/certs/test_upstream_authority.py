"""certs as an intermediate under an organisation's root (upstream authority).

A test root and intermediates made here with `cryptography`; certs signs with
the intermediate, serves it with every leaf, publishes the root; its start
refuses an intermediate too short-lived to rotate; a leaf never outlives its
issuer; rotating to a new intermediate (same root, or a new root) follows the
same phases. The chains are linted with pkilint's
lint_pkix_signer_signee_cert_chain (root -> intermediate -> leaf).
"""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509 import verification
from cryptography.x509.oid import NameOID

from tests.integration.certs.test_pkilint_openssl import BIN, FAILING, run
from tests.unit.certs.helpers import RESOLVER_ID, Clock, make_csr, sign
from waygate.certs.authority import Authority, AuthorityConfig, Upstream
from waygate.certs.rotation import Phase
from waygate.certs.store import DirectoryCAStore
from waygate.core.errors import FailedPrecondition

HOUR = dt.timedelta(hours=1)
DAY = 24 * HOUR
CONFIG = AuthorityConfig(
    max_lifetime=DAY,
    default_lifetime=8 * HOUR,
    propagation_delay=HOUR,
    consumer_settle=dt.timedelta(0),
)
NEEDED = 2 * CONFIG.max_lifetime + CONFIG.propagation_delay


def _key_usage() -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=True, content_commitment=False, key_encipherment=False,
        data_encipherment=False, key_agreement=False, key_cert_sign=True, crl_sign=True,
        encipher_only=False, decipher_only=False,
    )  # fmt: skip


class OrgCA:
    """A CA certificate and key: the organisation's root or an intermediate under it."""

    def __init__(
        self, name: str, now: dt.datetime, lifetime: dt.timedelta, issuer: OrgCA | None = None
    ) -> None:
        self.key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name(
            [
                x509.NameAttribute(NameOID.ORGANIZATION_NAME, "Example Org"),
                x509.NameAttribute(NameOID.COMMON_NAME, name),
            ]
        )
        signer = issuer or self
        ski = x509.SubjectKeyIdentifier.from_public_key(self.key.public_key())
        issuer_ski = x509.SubjectKeyIdentifier.from_public_key(signer.key.public_key())
        self.cert = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(issuer.cert.subject if issuer else subject)
            .public_key(self.key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - HOUR)
            .not_valid_after(now + lifetime)
            .add_extension(
                x509.BasicConstraints(ca=True, path_length=None if issuer is None else 0),
                critical=True,
            )
            .add_extension(_key_usage(), critical=True)
            .add_extension(ski, critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(issuer_ski),
                critical=False,
            )
            .sign(signer.key, hashes.SHA256())
        )

    def upstream(self, root: OrgCA) -> Upstream:
        return Upstream(self.key, self.cert, root.cert, f"--ca-cert {self.cert.subject}")


def open_upstream(directory: Path, clock: Clock, upstream: Upstream) -> Authority:
    return Authority.open(DirectoryCAStore(directory), CONFIG, now=clock, upstream=upstream)


def issue(authority: Authority) -> tuple[x509.Certificate, tuple[x509.Certificate, ...]]:
    csr, _ = make_csr()
    issued = sign(authority, csr, identity=RESOLVER_ID, requested_by="test")
    return issued.leaf, issued.chain


def verifies(leaf: x509.Certificate, chain, roots, at: dt.datetime) -> bool:
    builder = verification.PolicyBuilder().store(verification.Store(list(roots))).time(at)
    try:
        builder.build_server_verifier(x509.DNSName("resolver.waygate.local")).verify(
            leaf, list(chain)
        )
    except verification.VerificationError:
        return False
    return True


async def lint_chain(tmp_path: Path, issuer: x509.Certificate, subject: x509.Certificate) -> list:
    paths = []
    for name, cert in (("issuer", issuer), ("subject", subject)):
        path = tmp_path / f"{name}.pem"
        path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        paths.append(str(path))
    _, out = await run(
        str(BIN / "lint_pkix_signer_signee_cert_chain"),
        "lint",
        "-s",
        "WARNING",
        "-f",
        "JSON",
        *paths,
    )
    return [
        (f["severity"], f["code"])
        for result in json.loads(out)["results"]
        for f in result["finding_descriptions"]
        if f["severity"] in FAILING
    ]


async def test_signs_with_the_intermediate_serves_it_and_publishes_the_root(
    tmp_path: Path,
) -> None:
    clock = Clock()
    root = OrgCA("Example Root", clock(), 3650 * DAY)
    intermediate = OrgCA("Example Waygate Intermediate", clock(), 90 * DAY, root)
    authority = open_upstream(tmp_path / "ca", clock, intermediate.upstream(root))
    assert authority.trust_bundle().certificates == (root.cert,)
    leaf, chain = issue(authority)
    assert chain == (intermediate.cert,)
    assert verifies(leaf, chain, [root.cert], clock())
    assert not verifies(leaf, (), [root.cert], clock())  # the chain is needed, and served
    assert await lint_chain(tmp_path, root.cert, intermediate.cert) == []
    assert await lint_chain(tmp_path, intermediate.cert, leaf) == []
    # A restart keeps it (the anchor is stored beside the intermediate).
    again = Authority.open(DirectoryCAStore(tmp_path / "ca"), CONFIG, now=clock)
    assert again.trust_bundle().certificates == (root.cert,)
    assert issue(again)[1] == (intermediate.cert,)


def test_an_intermediate_too_short_lived_to_rotate_is_refused_at_start(tmp_path: Path) -> None:
    clock = Clock()
    root = OrgCA("Example Root", clock(), 3650 * DAY)
    short = OrgCA("Short", clock(), NEEDED - HOUR, root)
    with pytest.raises(FailedPrecondition, match="two maximum leaf lifetimes"):
        open_upstream(tmp_path / "ca", clock, short.upstream(root))
    assert not (tmp_path / "ca").exists()  # refused before anything was written
    stranger = OrgCA("Not ours", clock(), 90 * DAY)
    other = OrgCA("Other", clock(), 90 * DAY, stranger)
    with pytest.raises(FailedPrecondition, match="not issued by the trust anchor"):
        open_upstream(tmp_path / "ca", clock, other.upstream(root))


def test_a_leaf_never_outlives_its_issuer(tmp_path: Path) -> None:
    clock = Clock()
    root = OrgCA("Example Root", clock(), 3650 * DAY)
    intermediate = OrgCA("Ending", clock(), NEEDED + HOUR, root)
    authority = open_upstream(tmp_path / "ca", clock, intermediate.upstream(root))
    clock.advance(NEEDED - HOUR)  # two hours of its life left; leaves last 8 h
    leaf, _ = issue(authority)
    assert leaf.not_valid_after_utc <= intermediate.cert.not_valid_after_utc
    with pytest.raises(FailedPrecondition, match="rotate"):
        authority.rotate()  # certs cannot make an organisation's intermediate


async def test_rotating_the_intermediate_follows_the_phases(tmp_path: Path) -> None:
    clock = Clock()
    root = OrgCA("Example Root", clock(), 3650 * DAY)
    first = OrgCA("Intermediate 1", clock(), 90 * DAY, root)
    authority = open_upstream(tmp_path / "ca", clock, first.upstream(root))
    authority.report_trust(
        identity=RESOLVER_ID, instance="pod-1", version=1,
        fingerprints=[a.fingerprint for a in authority.trust_bundle().authorities],
    )  # fmt: skip
    old_leaf, old_chain = issue(authority)

    # A new intermediate under the same root: certs restarts with it.
    second = OrgCA("Intermediate 2", clock(), 90 * DAY, root)
    authority = open_upstream(tmp_path / "ca", clock, second.upstream(root))
    assert authority.rotation_phase() is Phase.PREPARE
    assert authority.trust_bundle().certificates == (root.cert,)  # nothing new to trust
    assert issue(authority)[1] == (first.cert,)  # the old one signs until activation
    clock.advance(HOUR)
    authority.advance()
    assert authority.rotation_phase() is Phase.ACTIVATE
    new_leaf, new_chain = issue(authority)
    assert new_chain == (second.cert,)
    assert await lint_chain(tmp_path, second.cert, new_leaf) == []
    assert verifies(old_leaf, old_chain, authority.trust_bundle().certificates, clock())
    clock.advance(9 * HOUR)  # every leaf of the first has expired
    authority.advance()
    assert authority.rotation_phase() is Phase.IDLE  # the root stays: nothing to drop

    # A new root: both roots are published, and a consumer holding only the old one
    # holds the activation.
    new_root = OrgCA("Example Root 2", clock(), 3650 * DAY)
    third = OrgCA("Intermediate 3", clock(), 90 * DAY, new_root)
    authority = open_upstream(tmp_path / "ca", clock, third.upstream(new_root))
    authority.report_trust(
        identity=RESOLVER_ID, instance="pod-1", version=1,
        fingerprints=[authority.trust_bundle().authorities[0].fingerprint],
    )  # fmt: skip
    assert set(authority.trust_bundle().certificates) == {root.cert, new_root.cert}
    clock.advance(2 * HOUR)
    authority.advance()
    assert authority.rotation_phase() is Phase.PREPARE
    assert [c.name for c in authority.rotation_status().gate.waiting_for] == [
        f"{RESOLVER_ID} (pod-1)"
    ]
    authority.report_trust(
        identity=RESOLVER_ID, instance="pod-1", version=2,
        fingerprints=[a.fingerprint for a in authority.trust_bundle().authorities],
    )  # fmt: skip
    authority.advance()
    assert authority.rotation_phase() is Phase.ACTIVATE
    leaf, chain = issue(authority)
    assert verifies(leaf, chain, [new_root.cert], clock())
