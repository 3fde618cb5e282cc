"""The CSR approver's judgement (`kube_csr.review`): pure, no API server, no sockets."""

from __future__ import annotations

import base64
import dataclasses
from datetime import UTC, datetime, timedelta

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.x509.oid import ExtendedKeyUsageOID

from tests.support.kubeapi_certs import (
    csr_object,
    make_csr,
    node_user,
    service_account_user,
)
from tests.unit.certs.helpers import duplicate_san_csr_der
from waygate.certs.kube_csr import (
    SIGNER_TUNNEL_AGENT,
    SIGNER_TUNNEL_SERVER,
    SIGNER_WORKLOAD,
    Action,
    SignerRules,
    review,
    with_certificate,
    with_condition,
)
from waygate.certs.policy import Policy

RULES = SignerRules(
    policy=Policy("cluster.test"),
    max_lifetime=timedelta(hours=48),
    tunnel_server_account=("waygate", "tunnel-server"),
    tunnel_server_names=("dns:tunnel.waygate.svc", "dns:tunnel.example.com", "ip:10.0.0.9"),
)


def agent_csr(node: str = "edge-1", **kwargs: object) -> dict:
    return csr_object(
        "agent",
        signer=SIGNER_TUNNEL_AGENT,
        request=make_csr(f"dns:{node}"),
        user=node_user(node),
        **kwargs,  # type: ignore[arg-type]
    )


def test_agent_csr_from_its_own_node_is_approved_for_the_node_name() -> None:
    verdict = review(agent_csr(), RULES)
    assert verdict.action is Action.APPROVE
    assert verdict.identity == "edge-1"
    assert verdict.csr is not None
    assert "system:node:edge-1" in verdict.message and "dns:edge-1" in verdict.message
    assert verdict.lifetime is None  # no expirationSeconds: the CA's default


def test_agent_csr_for_another_node_is_denied_naming_the_name() -> None:
    obj = csr_object(
        "agent",
        signer=SIGNER_TUNNEL_AGENT,
        request=make_csr("dns:edge-2"),
        user=node_user("edge-1"),
    )
    verdict = review(obj, RULES)
    assert verdict.action is Action.DENY
    assert verdict.reason == "ForbiddenName"
    assert "dns:edge-2" in verdict.message and "system:node:edge-1" in verdict.message


def test_agent_csr_with_an_extra_san_is_denied() -> None:
    obj = csr_object(
        "agent",
        signer=SIGNER_TUNNEL_AGENT,
        request=make_csr("dns:edge-1", "ip:10.1.2.3"),
        user=node_user("edge-1"),
    )
    verdict = review(obj, RULES)
    assert verdict.action is Action.DENY
    assert "ip:10.1.2.3" in verdict.message


@pytest.mark.parametrize(
    "user",
    [
        service_account_user("kube-system", "edge-1"),
        # The node prefix without the system:nodes group is not a node.
        {"username": "system:node:edge-1", "groups": ["system:authenticated"]},
        {"username": "alice", "groups": ["system:nodes"]},
    ],
)
def test_agent_signer_signs_only_for_node_users(user: dict) -> None:
    obj = csr_object("agent", signer=SIGNER_TUNNEL_AGENT, request=make_csr("dns:edge-1"), user=user)
    verdict = review(obj, RULES)
    assert verdict.action is Action.DENY
    assert verdict.reason == "RequesterNotANode"
    assert user["username"] in verdict.message


def test_subject_organisation_does_not_make_a_node() -> None:
    """yurttunnel trusts O=system:nodes in the subject; the requesting user decides here."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    pem = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(
            x509.Name(
                [
                    x509.NameAttribute(NameOID.ORGANIZATION_NAME, "system:nodes"),
                    x509.NameAttribute(NameOID.COMMON_NAME, "system:node:edge-1"),
                ]
            )
        )
        .add_extension(x509.SubjectAlternativeName([x509.DNSName("edge-1")]), critical=False)
        .sign(key, hashes.SHA256())
        .public_bytes(serialization.Encoding.PEM)
    )
    obj = csr_object(
        "agent",
        signer=SIGNER_TUNNEL_AGENT,
        request=pem,
        user=service_account_user("default", "intruder"),
    )
    assert review(obj, RULES).action is Action.DENY


def test_workload_csr_for_its_own_namespace_is_approved_with_the_spiffe_identity() -> None:
    obj = csr_object(
        "web",
        signer=SIGNER_WORKLOAD,
        request=make_csr(
            "dns:web.shop.svc", "uri:spiffe://cluster.test/ns/shop/sa/web", "dns:api.shop.svc"
        ),
        user=service_account_user("shop", "web"),
        usages=("digital signature", "key encipherment", "server auth", "client auth"),
    )
    verdict = review(obj, RULES)
    assert verdict.action is Action.APPROVE
    assert verdict.identity == "spiffe://cluster.test/ns/shop/sa/web"


def test_workload_csr_with_a_san_of_another_namespace_is_denied() -> None:
    obj = csr_object(
        "web",
        signer=SIGNER_WORKLOAD,
        request=make_csr("uri:spiffe://cluster.test/ns/shop/sa/web", "dns:db.payments.svc"),
        user=service_account_user("shop", "web"),
    )
    verdict = review(obj, RULES)
    assert verdict.action is Action.DENY
    assert verdict.reason == "ForbiddenName"
    assert "dns:db.payments.svc" in verdict.message


def test_workload_csr_for_another_service_account_identity_is_denied() -> None:
    obj = csr_object(
        "web",
        signer=SIGNER_WORKLOAD,
        request=make_csr("uri:spiffe://cluster.test/ns/shop/sa/admin"),
        user=service_account_user("shop", "web"),
    )
    verdict = review(obj, RULES)
    assert verdict.action is Action.DENY
    assert "spiffe://cluster.test/ns/shop/sa/admin" in verdict.message


def test_workload_signer_refuses_node_users() -> None:
    obj = csr_object(
        "web", signer=SIGNER_WORKLOAD, request=make_csr("dns:edge-1"), user=node_user("edge-1")
    )
    verdict = review(obj, RULES)
    assert verdict.action is Action.DENY
    assert verdict.reason == "RequesterNotServiceAccount"


def test_tunnel_server_gets_only_its_configured_names() -> None:
    user = service_account_user("waygate", "tunnel-server")
    allowed = csr_object(
        "ts",
        signer=SIGNER_TUNNEL_SERVER,
        request=make_csr("dns:tunnel.waygate.svc", "ip:10.0.0.9"),
        user=user,
        usages=("digital signature", "server auth"),
    )
    verdict = review(allowed, RULES)
    assert verdict.action is Action.APPROVE
    assert verdict.identity == "tunnel.waygate.svc"

    # A ServiceAccount's usual names are not the tunnel server's configured ones.
    extra = csr_object(
        "ts",
        signer=SIGNER_TUNNEL_SERVER,
        request=make_csr("dns:tunnel.waygate.svc", "dns:other.waygate.svc"),
        user=user,
    )
    denied = review(extra, RULES)
    assert denied.action is Action.DENY
    assert "dns:other.waygate.svc" in denied.message


def test_tunnel_server_signer_refuses_other_service_accounts() -> None:
    obj = csr_object(
        "ts",
        signer=SIGNER_TUNNEL_SERVER,
        request=make_csr("dns:tunnel.waygate.svc"),
        user=service_account_user("waygate", "proxy"),
    )
    verdict = review(obj, RULES)
    assert verdict.action is Action.DENY
    assert verdict.reason == "RequesterNotTunnelServer"
    assert "system:serviceaccount:waygate:tunnel-server" in verdict.message
    unconfigured = SignerRules(policy=RULES.policy, max_lifetime=RULES.max_lifetime)
    assert review(obj, unconfigured).action is Action.DENY


@pytest.mark.parametrize("usage", ["cert sign", "crl sign", "any", "code signing", "server auth"])
def test_forbidden_usage_is_denied_naming_it(usage: str) -> None:
    """An agent only dials out: even "server auth" is refused to it."""
    verdict = review(agent_csr(usages=("digital signature", usage)), RULES)
    assert verdict.action is Action.DENY
    assert verdict.reason == "ForbiddenUsage"
    assert repr(usage) in verdict.message


def test_other_signers_and_finished_csrs_are_skipped() -> None:
    foreign = agent_csr()
    foreign["spec"]["signerName"] = "kubernetes.io/kube-apiserver-client"
    assert review(foreign, RULES).action is Action.SKIP
    for kind in ("Denied", "Failed"):
        finished = agent_csr(conditions=[{"type": kind, "status": "True"}])
        assert review(finished, RULES).action is Action.SKIP
    issued = with_certificate(agent_csr(), b"-----BEGIN CERTIFICATE-----\n")
    assert review(issued, RULES).action is Action.SKIP


def test_approved_but_unsigned_csr_is_signed_and_not_approved_again() -> None:
    approved = agent_csr(conditions=[{"type": "Approved", "status": "True"}])
    assert review(approved, RULES).action is Action.SIGN


def test_approved_csr_the_policy_forbids_fails_instead_of_being_signed() -> None:
    obj = csr_object(
        "agent",
        signer=SIGNER_TUNNEL_AGENT,
        request=make_csr("dns:edge-2"),
        user=node_user("edge-1"),
        conditions=[{"type": "Approved", "status": "True", "reason": "ManualApproval"}],
    )
    verdict = review(obj, RULES)
    assert verdict.action is Action.FAIL
    assert verdict.reason == "SignerPolicy"
    assert "dns:edge-2" in verdict.message


@pytest.mark.parametrize(
    ("request_bytes", "words"),
    [
        (b"", "empty"),
        (b"not a csr at all", "CERTIFICATE REQUEST"),
        (
            b"-----BEGIN CERTIFICATE REQUEST-----\nAAAA\n-----END CERTIFICATE REQUEST-----\n",
            "not a PKCS#10",
        ),
    ],
)
def test_unparsable_request_fails(request_bytes: bytes, words: str) -> None:
    obj = agent_csr()
    obj["spec"]["request"] = base64.b64encode(request_bytes).decode()
    verdict = review(obj, RULES)
    assert verdict.action is Action.FAIL
    assert verdict.reason == "InvalidRequest"
    assert words in verdict.message


def test_request_whose_signature_does_not_verify_fails() -> None:
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    good = x509.load_pem_x509_csr(make_csr("dns:edge-1"))
    der = bytearray(good.public_bytes(serialization.Encoding.DER))
    der[-1] ^= 0x01  # flip a bit of the signature
    pem = (
        b"-----BEGIN CERTIFICATE REQUEST-----\n"
        + base64.encodebytes(bytes(der))
        + b"-----END CERTIFICATE REQUEST-----\n"
    )
    obj = agent_csr()
    obj["spec"]["request"] = base64.b64encode(pem).decode()
    verdict = review(obj, RULES)
    assert verdict.action is Action.FAIL
    assert "signature" in verdict.message


@pytest.mark.parametrize(
    ("asked", "expected"),
    [
        (3600, timedelta(hours=1)),
        (60, timedelta(seconds=600)),  # Kubernetes' minimum
        (10 * 86400, timedelta(hours=48)),  # the CA's maximum
    ],
)
def test_expiration_seconds_is_honoured_within_bounds(asked: int, expected: timedelta) -> None:
    assert review(agent_csr(expiration_seconds=asked), RULES).lifetime == expected


def test_condition_and_certificate_edits_keep_the_rest_of_the_object() -> None:
    obj = agent_csr(conditions=[{"type": "Approved", "status": "True"}])
    moment = datetime(2030, 1, 2, 3, 4, 5, tzinfo=UTC)
    failed = with_condition(obj, "Failed", "SigningFailed", "no", moment)
    assert [c["type"] for c in failed["status"]["conditions"]] == ["Approved", "Failed"]
    assert failed["status"]["conditions"][1]["lastUpdateTime"] == "2030-01-02T03:04:05Z"
    assert obj["status"]["conditions"] == [{"type": "Approved", "status": "True"}]
    signed = with_certificate(obj, b"PEM")
    assert base64.b64decode(signed["status"]["certificate"]) == b"PEM"
    assert signed["status"]["conditions"] == obj["status"]["conditions"]
    assert signed["spec"] is obj["spec"]


def test_edits_of_a_listed_object_carry_its_kind() -> None:
    """List items come without apiVersion/kind; what is sent back names them."""
    listed = agent_csr()
    del listed["apiVersion"], listed["kind"]
    moment = datetime(2030, 1, 2, tzinfo=UTC)
    for edited in (
        with_condition(listed, "Denied", "R", "m", moment),
        with_certificate(listed, b"x"),
    ):
        assert edited["apiVersion"] == "certificates.k8s.io/v1"
        assert edited["kind"] == "CertificateSigningRequest"


def test_a_csr_with_a_duplicate_extension_fails_instead_of_being_retried() -> None:
    der = duplicate_san_csr_der(x509.DNSName("edge-1"))
    pem = x509.load_der_x509_csr(der).public_bytes(serialization.Encoding.PEM)
    obj = csr_object("dup", signer=SIGNER_TUNNEL_AGENT, request=pem, user=node_user("edge-1"))
    verdict = review(obj, RULES)
    assert verdict.action is Action.FAIL
    assert "extensions do not parse" in verdict.message


def test_the_leaf_carries_exactly_the_requested_auth_usages() -> None:
    agent = review(agent_csr(usages=("digital signature", "client auth")), RULES)
    assert agent.action is Action.APPROVE
    assert agent.extended_usages == (ExtendedKeyUsageOID.CLIENT_AUTH,)
    workload = csr_object(
        "web",
        signer=SIGNER_WORKLOAD,
        request=make_csr("uri:spiffe://cluster.test/ns/shop/sa/web", "dns:web.shop.svc"),
        user=service_account_user("shop", "web"),
        usages=("digital signature", "server auth"),
    )
    verdict = review(workload, RULES)
    assert verdict.action is Action.APPROVE
    assert verdict.extended_usages == (ExtendedKeyUsageOID.SERVER_AUTH,)


def test_a_csr_without_server_or_client_auth_is_denied() -> None:
    verdict = review(agent_csr(usages=("digital signature",)), RULES)
    assert verdict.action is Action.DENY
    assert "neither 'server auth' nor 'client auth'" in verdict.message


def test_a_request_past_the_san_cap_fails_before_it_is_parsed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    names = [f"dns:n{index}.edge.test" for index in range(5000)]
    obj = csr_object(
        "wide", signer=SIGNER_TUNNEL_AGENT, request=make_csr(*names), user=node_user("n0")
    )

    def no_full_parse(data: bytes) -> x509.CertificateSigningRequest:
        raise AssertionError("a CSR past the cap was parsed in full")

    monkeypatch.setattr(x509, "load_der_x509_csr", no_full_parse)
    monkeypatch.setattr(x509, "load_pem_x509_csr", no_full_parse)
    verdict = review(obj, RULES)
    assert verdict.action is Action.FAIL
    assert verdict.reason == "InvalidRequest"
    assert "more than 100 subject alternative names" in verdict.message


def test_the_san_cap_is_the_configured_one_not_the_default() -> None:
    # The controller applies the same max_sans_per_csr as Certify: a CSR within the
    # default cap (100) but over a configured 3 fails as an invalid request.
    names = [f"dns:edge-1.n{i}.example" for i in range(4)]
    obj = csr_object(
        "agent", signer=SIGNER_TUNNEL_AGENT, request=make_csr(*names), user=node_user("edge-1")
    )
    strict = dataclasses.replace(RULES, max_sans=3)
    verdict = review(obj, strict)
    assert verdict.action is Action.FAIL
    assert verdict.reason == "InvalidRequest" and "at most 3" in verdict.message
    assert review(obj, RULES).action is not Action.FAIL  # within the default cap
