"""SAN policy: static patterns, ServiceAccount and node callers, identity must be a SAN."""

from __future__ import annotations

import pytest

from tests.unit.certs.helpers import RESOLVER, RESOLVER_ID, RESOLVER_SANS, make_csr
from waygate.certs.auth import Caller
from waygate.certs.policy import Policy, check_pattern, pattern_matches
from waygate.core.errors import InvalidArgument, PermissionDenied
from waygate.core.sans import identity_san

POLICY = Policy("waygate.local")


@pytest.mark.parametrize(
    ("pattern", "name", "expected"),
    [
        ("dns:*.waygate.local", "dns:a.waygate.local", True),
        ("dns:*.waygate.local", "dns:A.Waygate.Local", True),
        ("dns:*.waygate.local", "dns:a.b.waygate.local", False),  # exactly one label
        ("dns:*.waygate.local", "dns:waygate.local", False),
        ("dns:*.waygate.local", "dns:*.waygate.local", False),  # no wildcard certificates
        ("dns:resolver.waygate.local", "dns:resolver.waygate.local.", True),
        ("dns:resolver.waygate.local", "uri:resolver.waygate.local", False),
        ("uri:spiffe://waygate.local/ns/a/*", "uri:spiffe://waygate.local/ns/a/sa/x", True),
        ("uri:spiffe://waygate.local/ns/a/*", "uri:spiffe://waygate.local/ns/b/sa/x", False),
        ("uri:spiffe://waygate.local/ns/a/sa/x", "uri:spiffe://waygate.local/ns/a/sa/xy", False),
        ("ip:127.0.0.1", "ip:127.0.0.1", True),
        ("ip:::1", "ip:0:0:0:0:0:0:0:1", True),
        ("ip:127.0.0.1", "ip:127.0.0.2", False),
    ],
)
def test_pattern_matches(pattern: str, name: str, expected: bool) -> None:
    assert pattern_matches(pattern, name) is expected


@pytest.mark.parametrize(
    "pattern", ["resolver", "dns:", "email:a@b", "dns:a.*.b", "uri:spiffe://*/x", "ip:not-an-ip"]
)
def test_malformed_patterns_are_named(pattern: str) -> None:
    problem = check_pattern(pattern)
    assert problem is not None and repr(pattern) in problem


def test_identity_name_by_shape() -> None:
    assert identity_san(RESOLVER_ID) == f"uri:{RESOLVER_ID}"
    assert identity_san("node-1") == "dns:node-1"
    assert identity_san("127.0.0.1") == "ip:127.0.0.1"


def test_static_caller_gets_exactly_its_patterns() -> None:
    csr, _ = make_csr(RESOLVER_SANS)
    assert POLICY.authorize_csr(RESOLVER, RESOLVER_ID, csr) == list(RESOLVER_SANS)


def test_first_forbidden_san_is_named() -> None:
    csr, _ = make_csr((f"uri:{RESOLVER_ID}", "dns:proxy.waygate.local", "dns:evil.example"))
    with pytest.raises(PermissionDenied, match=r"resolver may not .* 'dns:proxy\.waygate\.local'"):
        POLICY.authorize_csr(RESOLVER, RESOLVER_ID, csr)


def test_unsupported_san_kind_is_forbidden() -> None:
    csr, _ = make_csr((f"uri:{RESOLVER_ID}", "email:root@waygate.local"))
    with pytest.raises(PermissionDenied, match="RFC822Name"):
        POLICY.authorize_csr(RESOLVER, RESOLVER_ID, csr)


def test_identity_must_be_one_of_the_sans() -> None:
    csr, _ = make_csr(("dns:resolver.waygate.local",))
    with pytest.raises(InvalidArgument, match="not among the CSR's subject alternative names"):
        POLICY.authorize_csr(RESOLVER, RESOLVER_ID, csr)


def test_csr_without_sans_is_invalid() -> None:
    csr, _ = make_csr(())
    with pytest.raises(InvalidArgument, match="no subject alternative names"):
        POLICY.authorize_csr(RESOLVER, RESOLVER_ID, csr)


def test_service_account_caller() -> None:
    caller = Caller(name="system:serviceaccount:shop:web", namespace="shop", service_account="web")
    own = "spiffe://waygate.local/ns/shop/sa/web"
    ok, _ = make_csr((f"uri:{own}", "dns:web.shop.svc", "dns:api.shop.svc.cluster.local"))
    POLICY.authorize_csr(caller, own, ok)
    for forbidden in (
        "uri:spiffe://waygate.local/ns/shop/sa/db",  # another ServiceAccount
        "uri:spiffe://other.domain/ns/shop/sa/web",  # another trust domain
        "dns:web.bank.svc",  # another namespace
        "dns:a.web.shop.svc",  # more than one label
    ):
        csr, _ = make_csr((f"uri:{own}", forbidden))
        with pytest.raises(PermissionDenied, match=forbidden.replace(".", r"\.")):
            POLICY.authorize_csr(caller, own, csr)


def test_node_caller_gets_its_node_name_only() -> None:
    caller = Caller(name="system:node:edge-1", node="edge-1")
    csr, _ = make_csr(("dns:edge-1",))
    POLICY.authorize_csr(caller, "edge-1", csr)
    other, _ = make_csr(("dns:edge-2",))
    with pytest.raises(PermissionDenied, match="edge-2"):
        POLICY.authorize_csr(caller, "edge-2", other)
