"""BackendTLSPolicy through real resolver and proxy processes, with the suite's manifests.

The conformance suite's BackendTLSPolicy files (v1.6.1, unchanged) run against a
real TLS backend whose certificate a LocalCA signed for abc.example.com (and
the URI SAN spiffe://abc.example.com/test-identity), as the suite's own
tls-backend is: the CA goes in the ConfigMap `tls-checks-ca-certificate`, an
unrelated CA in `mismatch-ca-certificate`. What the suite asserts is asserted
here: the request reaches the backend with the policy's hostname as SNI; a
wrong hostname, a wrong CA or SANs the certificate lacks fail (502, with the
explained reason, never a bare error); a policy whose ConfigMap is missing or
malformed, or of an unsupported kind, says so in its status and its backend
answers 5xx; the HTTPS listener re-encrypts too.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio

from tests.support.gatewayapi import (
    INFRA,
    Conformance,
    TlsRecordingUpstream,
    tls_backend_objects,
)
from tests.support.pki import LocalCA
from tests.support.poll import until

pytestmark = [pytest.mark.system, pytest.mark.asyncio(loop_scope="module")]

FILES = (
    "backendtlspolicy.yaml",
    "backendtlspolicy-san.yaml",
    "backendtlspolicy-invalid-ca-certificate-ref.yaml",
    "backendtlspolicy-invalid-kind.yaml",
)
HOST = "abc.example.com"


class Suite:
    def __init__(self, conformance: Conformance, backend: TlsRecordingUpstream, ca: LocalCA):
        self.conformance = conformance
        self.backend = backend
        self.ca = ca


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def suite(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Suite]:
    ca = LocalCA()
    backend = await TlsRecordingUpstream(
        "tls-backend", ca.issue(dns=[HOST], uris=["spiffe://abc.example.com/test-identity"])
    ).start()
    conformance = await Conformance(tmp_path_factory.mktemp("manifests")).start()
    try:
        extra = tls_backend_objects(
            FILES,
            backend.port,
            {
                "tls-checks-ca-certificate": ca.pem.decode(),
                "mismatch-ca-certificate": LocalCA(name="unrelated CA").pem.decode(),
            },
        )
        await conformance.apply(*FILES, extra=extra)
        yield Suite(conformance, backend, ca)
    finally:
        await conformance.stop()
        await backend.stop()


def policy_conditions(items: list[dict[str, Any]], name: str) -> dict[str, tuple[str, str, str]]:
    (policy,) = [
        i for i in items if i["kind"] == "BackendTLSPolicy" and i["metadata"]["name"] == name
    ]
    (ancestor,) = [
        a for a in policy["status"]["ancestors"] if a["ancestorRef"]["name"] == "same-namespace"
    ]
    assert ancestor["controllerName"] == "waygate.io/gateway-controller"
    return {c["type"]: (c["status"], c["reason"], c["message"]) for c in ancestor["conditions"]}


async def test_valid_policy_reaches_the_backend_with_its_hostname_as_sni(suite: Suite) -> None:
    before = len(suite.backend.requests)
    response = await suite.conformance.request("/backendtlspolicy", host=HOST)
    assert response.status == 200, response
    assert response.backend == "tls-backend"
    assert suite.backend.requests[before:][0]["target"] == "/backendtlspolicy"
    assert suite.backend.server_names[-1] == HOST
    items = await suite.conformance.gateways()
    (policy,) = [i for i in items if i["metadata"]["name"] == "normative-test"]
    # Used through both Gateways (HTTP and the HTTPS listener): both are its ancestors.
    assert sorted(a["ancestorRef"]["name"] for a in policy["status"]["ancestors"]) == [
        "same-namespace",
        "same-namespace-with-https-listener",
    ]
    conditions = policy_conditions(items, "normative-test")
    assert conditions["Accepted"][:2] == ("True", "Accepted")
    assert conditions["ResolvedRefs"][:2] == ("True", "ResolvedRefs")


async def test_https_listener_reencrypts_with_the_policy(suite: Suite) -> None:
    response = await suite.conformance.request(
        "/backendtlspolicy", host="https-listener.org", tls=True
    )
    assert response.status == 200, response
    assert response.backend == "tls-backend"
    assert suite.backend.server_names[-1] == HOST


async def test_wrong_hostname_is_refused_with_the_explained_reason(suite: Suite) -> None:
    response = await suite.conformance.request("/backendtlspolicy-host-mismatch", host=HOST)
    assert response.status == 502
    assert b"upstream certificate is for abc.example.com" in response.body
    assert b"not mismatch.example.com" in response.body
    # The policy itself is fine: the backend's certificate is what does not fit.
    conditions = policy_conditions(await suite.conformance.gateways(), "host-mismatch")
    assert conditions["Accepted"][0] == "True"


async def test_wrong_ca_is_refused_as_an_unknown_authority(suite: Suite) -> None:
    response = await suite.conformance.request("/backendtlspolicy-cert-mismatch", host=HOST)
    assert response.status == 502
    assert b"upstream certificate signed by an unknown authority" in response.body


@pytest.mark.parametrize(
    ("path", "status"),
    [
        ("/backendtlspolicy-san-dns", 200),
        ("/backendtlspolicy-san-dns-mismatch", 502),
        ("/backendtlspolicy-san-uri", 200),
        ("/backendtlspolicy-san-uri-mismatch", 502),
        ("/backendtlspolicy-multiple-sans", 200),
        ("/backendtlspolicy-multiple-mismatch-sans", 502),
    ],
)
async def test_subject_alt_names(suite: Suite, path: str, status: int) -> None:
    response = await suite.conformance.request(path, host=HOST)
    assert response.status == status, response
    if status == 502:
        assert b"none is a subjectAltName the route accepts" in response.body
        assert b"spiffe://abc.example.com/test-identity" in response.body
    else:
        assert response.backend == "tls-backend"


@pytest.mark.parametrize(
    ("policy", "reason", "message"),
    [
        (
            "nonexistent-ca-certificate-ref",
            "InvalidCACertificateRef",
            f"ConfigMap {INFRA}/nonexistent-ca-certificate does not exist",
        ),
        (
            "malformed-ca-certificate-ref",
            "InvalidCACertificateRef",
            f"ConfigMap {INFRA}/malformed-ca-certificate has no ca.crt",
        ),
        ("invalid-kind", "InvalidKind", "only a ConfigMap is supported"),
    ],
)
async def test_unusable_ca_reference_is_reported_and_answers_5xx(
    suite: Suite, policy: str, reason: str, message: str
) -> None:
    conditions = policy_conditions(await suite.conformance.gateways(), policy)
    assert conditions["Accepted"][:2] == ("False", "NoValidCACertificate")
    assert conditions["ResolvedRefs"][:2] == ("False", reason)
    assert message in conditions["ResolvedRefs"][2]
    response = await suite.conformance.request("/backendtlspolicy-" + policy, host=HOST)
    assert response.status == 500
    assert message.encode() in response.body
    # The route is accepted all the same (the suite's GatewayAndRoutesMustBeAccepted).
    route_name = (
        "backendtlspolicy-invalid-kind-test"
        if policy == "invalid-kind"
        else "backendtlspolicy-invalid-ca-certificate-ref"
    )
    (route,) = [
        i
        for i in await suite.conformance.gateways("--kind", "HTTPRoute")
        if i["metadata"]["name"] == route_name
    ]
    (parent,) = route["status"]["parents"]
    assert {c["type"]: c["status"] for c in parent["conditions"]}["Accepted"] == "True"


async def test_a_config_map_that_appears_is_picked_up(suite: Suite) -> None:
    """The suite's reconcile case: the missing ConfigMap is created, the policy turns
    Accepted and the backend is reached (then the manifests go back as they were)."""
    conformance = suite.conformance
    ca = suite.ca.pem.decode()
    extra = tls_backend_objects(
        FILES,
        suite.backend.port,
        {
            "tls-checks-ca-certificate": ca,
            "mismatch-ca-certificate": LocalCA(name="unrelated CA").pem.decode(),
            "nonexistent-ca-certificate": ca,
        },
    )
    await conformance.apply(*FILES, extra=extra)
    try:

        async def accepted() -> bool:
            conditions = policy_conditions(
                await conformance.gateways(), "nonexistent-ca-certificate-ref"
            )
            return conditions["Accepted"][0] == "True"

        await until(accepted, "the policy to be accepted once its ConfigMap exists", timeout=20)
        response = await conformance.request(
            "/backendtlspolicy-nonexistent-ca-certificate-ref", host=HOST
        )
        assert response.status == 200 and response.backend == "tls-backend"
    finally:
        await conformance.apply(
            *FILES,
            extra=tls_backend_objects(
                FILES,
                suite.backend.port,
                {
                    "tls-checks-ca-certificate": ca,
                    "mismatch-ca-certificate": LocalCA(name="unrelated CA").pem.decode(),
                },
            ),
        )
