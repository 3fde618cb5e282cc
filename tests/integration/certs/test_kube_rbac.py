"""deploy/kustomize/base/rbac-certs.yaml grants every request certs makes, and no more.

Runs the CSR controller, the Secret CA store and the TokenReview
authenticator against a STAND-IN Kubernetes API server (none can run here),
records every request they send, and checks each against the rules of the
ClusterRole and Role, as the API server's RBAC authorizer would (apiGroup,
resource/subresource, verb, resourceName, namespace). Also checks the
approve/sign grants on the synthetic `signers` resource for each signer.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client

from tests.support.kubeapi import KubeAPI as StandInAPI
from tests.support.kubeapi_certs import (
    CSR_API_VERSION,
    CSR_KIND,
    conditions,
    csr_object,
    make_csr,
    node_user,
    service_account_user,
)
from waygate.certs.authority import Authority, AuthorityConfig
from waygate.certs.kube_api import KubeAPI
from waygate.certs.kube_auth import KubeServiceDirectory, TokenReviewAuthenticator
from waygate.certs.kube_bundle import BundlePublisher
from waygate.certs.kube_csr import SIGNERS, CSRController, SignerRules
from waygate.certs.kube_store import SecretCAStore
from waygate.certs.leader import certs_elector
from waygate.certs.policy import Policy
from waygate.certs.store import DirectoryCAStore

RBAC_FILE = Path(__file__).parents[3] / "deploy/kustomize/base/rbac-certs.yaml"
NAMESPACE, SECRET, ACCOUNT = "waygate", "waygate-certs-ca", "waygate-certs"


def load_roles() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(cluster-wide rules, rules in NAMESPACE) bound to the certs ServiceAccount."""
    documents = [d for d in yaml.safe_load_all(RBAC_FILE.read_text()) if d]
    roles = {(d["kind"], d["metadata"]["name"]): d for d in documents if "rules" in d}
    cluster_rules: list[dict[str, Any]] = []
    namespace_rules: list[dict[str, Any]] = []
    for binding in (d for d in documents if "roleRef" in d):
        subjects = binding["subjects"]
        assert {"kind": "ServiceAccount", "name": ACCOUNT, "namespace": NAMESPACE} in subjects
        role = roles[(binding["roleRef"]["kind"], binding["roleRef"]["name"])]
        if binding["kind"] == "ClusterRoleBinding":
            cluster_rules += role["rules"]
        else:
            assert binding["metadata"]["namespace"] == NAMESPACE
            assert role["metadata"]["namespace"] == NAMESPACE
            namespace_rules += role["rules"]
    return cluster_rules, namespace_rules


def attributes(
    method: str, path: str, watch: bool, query: dict[str, str] | None = None
) -> dict[str, Any]:
    """RBAC request attributes of one API request."""
    parts = [p for p in path.split("/") if p]
    group, rest = ("", parts[2:]) if parts[0] == "api" else (parts[1], parts[3:])
    namespace = None
    if rest[0] == "namespaces" and len(rest) >= 3:
        namespace, rest = rest[1], rest[2:]
    resource = rest[0] + (f"/{rest[2]}" if len(rest) > 2 else "")
    name = rest[1] if len(rest) > 1 else None
    verb = {
        "GET": ("watch" if watch else "list") if name is None else "get",
        "POST": "create",
        "PUT": "update",
        "PATCH": "patch",
        "DELETE": "delete",
    }[method]
    # The API server authorizes a list/watch narrowed to one name by that name.
    selector = (query or {}).get("fieldSelector", "")
    if name is None and selector.startswith("metadata.name=") and "," not in selector:
        name = selector.partition("=")[2]
    return {
        "group": group,
        "resource": resource,
        "verb": verb,
        "name": name,
        "namespace": namespace,
    }


def allowed(rules: list[dict[str, Any]], request: dict[str, Any]) -> bool:
    return any(
        request["group"] in rule["apiGroups"]
        and request["resource"] in rule["resources"]
        and request["verb"] in rule["verbs"]
        and (not rule.get("resourceNames") or request["name"] in rule["resourceNames"])
        for rule in rules
    )


@pytest.fixture
def standin() -> Iterator[StandInAPI]:
    with StandInAPI() as api:
        yield api


async def exercise(standin: StandInAPI, tmp_path: Path) -> None:
    """Everything certs does in a cluster, once."""
    api = KubeAPI(client.ApiClient(standin.configuration()), timeout=5.0)
    elector = certs_elector(api, NAMESPACE, "waygate-certs-leader", identity="certs-0")
    await asyncio.to_thread(elector._try_acquire_or_renew)  # lease get (absent), create
    await asyncio.to_thread(elector._try_acquire_or_renew)  # lease get, update
    assert elector.is_leader()
    store = SecretCAStore(api, NAMESPACE, SECRET, writer=elector)
    Authority.open(store, AuthorityConfig())  # get (absent), create
    authority = Authority.open(store, AuthorityConfig())  # get
    store.save(store.load() or {})  # update
    following = asyncio.create_task(store.follow(authority.adopt))  # list, watch by name
    await standin.wait_watchers(1, kind="Secret")
    following.cancel()
    await asyncio.gather(following, return_exceptions=True)

    standin.token_reviewer = lambda token, audiences: {"username": "u", "groups": []}
    await TokenReviewAuthenticator(api, audiences=("waygate-certs",)).authenticate("t")
    await KubeServiceDirectory(api).service("shop", "web")  # per-workload names: get

    publisher = BundlePublisher(api, NAMESPACE, "waygate-trust-bundle")
    publishing = asyncio.create_task(publisher.run())
    try:
        for pem in ("ONE\n", "ONE\nTWO\n"):  # create, then get + update
            publisher.publish(pem)
            async with asyncio.timeout(10):
                while publisher.published != pem:
                    await asyncio.sleep(0.02)
    finally:
        publishing.cancel()
        await asyncio.gather(publishing, return_exceptions=True)

    rules = SignerRules(policy=Policy("cluster.test"), max_lifetime=authority.config.max_lifetime)
    controller = CSRController(
        api, Authority.open(DirectoryCAStore(tmp_path / "ca"), AuthorityConfig()), rules
    )
    task = asyncio.create_task(controller.run())
    try:
        standin.create(
            csr_object(
                "signed",
                signer="waygate.io/tunnel-agent",
                request=make_csr("dns:edge-1"),
                user=node_user("edge-1"),
            )
        )
        standin.create(
            csr_object(
                "denied",
                signer="waygate.io/workload",
                request=make_csr("dns:x.other.svc"),
                user=service_account_user("shop", "web"),
            )
        )
        standin.create(
            csr_object(
                "failed",
                signer="waygate.io/workload",
                request=b"junk",
                user=service_account_user("shop", "web"),
            )
        )
        async with asyncio.timeout(10):
            for name, kind in (("signed", "Approved"), ("denied", "Denied"), ("failed", "Failed")):
                while kind not in conditions(standin.get(CSR_API_VERSION, CSR_KIND, name)):
                    await asyncio.sleep(0.02)
            while not standin.get(CSR_API_VERSION, CSR_KIND, "signed")["status"].get("certificate"):
                await asyncio.sleep(0.02)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_every_request_certs_makes_is_granted(standin: StandInAPI, tmp_path: Path) -> None:
    cluster_rules, namespace_rules = load_roles()
    await exercise(standin, tmp_path)
    seen = set()
    for request in standin.requests:
        attrs = attributes(request.method, request.path, request.watch, request.query)
        seen.add((attrs["resource"], attrs["verb"]))
        rules = cluster_rules + (namespace_rules if attrs["namespace"] == NAMESPACE else [])
        assert allowed(rules, attrs), f"RBAC does not grant {request.method} {request.path}"
    # The exercise covered each kind of request the code makes.
    assert {
        ("secrets", "get"),
        ("secrets", "create"),
        ("secrets", "update"),
        ("secrets", "list"),
        ("secrets", "watch"),
        ("leases", "get"),
        ("leases", "create"),
        ("leases", "update"),
        ("tokenreviews", "create"),
        ("services", "get"),
        ("configmaps", "get"),
        ("configmaps", "create"),
        ("configmaps", "update"),
        ("certificatesigningrequests", "list"),
        ("certificatesigningrequests", "watch"),
        ("certificatesigningrequests/approval", "update"),
        ("certificatesigningrequests/status", "update"),
    } <= seen


def test_signers_may_be_approved_and_signed_only_for_waygate_names() -> None:
    cluster_rules, _ = load_roles()
    for signer in SIGNERS:
        for verb in ("approve", "sign"):
            request = {
                "group": "certificates.k8s.io",
                "resource": "signers",
                "verb": verb,
                "name": signer,
            }
            assert allowed(cluster_rules, request), f"{verb} {signer} not granted"
    for other in ("kubernetes.io/kube-apiserver-client", "kubernetes.io/*", "example.com/x"):
        request = {
            "group": "certificates.k8s.io",
            "resource": "signers",
            "verb": "sign",
            "name": other,
        }
        assert not allowed(cluster_rules, request)


def test_the_secret_is_reachable_only_by_name_except_for_create() -> None:
    _, namespace_rules = load_roles()
    for verb in ("get", "update", "list", "watch"):
        base = {"group": "", "resource": "secrets", "verb": verb}
        assert allowed(namespace_rules, {**base, "name": SECRET})
        assert not allowed(namespace_rules, {**base, "name": "someone-elses"})
        assert not allowed(namespace_rules, {**base, "name": None})  # every Secret
    for verb in ("delete", "patch"):
        request = {"group": "", "resource": "secrets", "verb": verb, "name": SECRET}
        assert not allowed(namespace_rules, request)
