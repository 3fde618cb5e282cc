"""The CSR controller against a STAND-IN Kubernetes API server.

No Kubernetes API server can run on these machines; `tests.support.kubeapi`
stands in for one: real HTTP on 127.0.0.1, list/watch with resourceVersion
and 410, the /approval and /status subresources. The controller talks to it
through the official `kubernetes` client, and signs with a real Authority
(file-backed CA in a temporary directory). The stand-in has no admission, so
the tests put spec.username/groups into the CSRs as the API server would.
The certificate written to status is checked with `openssl verify` and
pkilint's chain linter, as a node would use it. Every wait on the watch is
bounded.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import sys
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from kubernetes import client

from tests.support.kubeapi import KubeAPI as StandInAPI
from tests.support.kubeapi_certs import (
    CSR_API_VERSION,
    CSR_KIND,
    certificate_chain,
    conditions,
    csr_object,
    make_csr,
    node_user,
    service_account_user,
)
from waygate.certs.authority import Authority, AuthorityConfig
from waygate.certs.kube_api import KubeAPI
from waygate.certs.kube_auth import KubeServiceDirectory
from waygate.certs.kube_csr import (
    CSR_COLLECTION,
    SIGNER_TUNNEL_AGENT,
    SIGNER_TUNNEL_SERVER,
    SIGNER_WORKLOAD,
    CSRController,
    SignerRules,
)
from waygate.certs.policy import Policy
from waygate.certs.service import SigningExecutor
from waygate.certs.store import DirectoryCAStore
from waygate.core.backoff import Backoff

WAIT = 10.0  # seconds any single wait on the controller may take
MAX_LIFETIME = timedelta(hours=48)


@pytest.fixture
def standin() -> Iterator[StandInAPI]:
    with StandInAPI() as api:
        yield api


@pytest.fixture
def authority(tmp_path: Path) -> Authority:
    config = AuthorityConfig(trust_domain="cluster.test", max_lifetime=MAX_LIFETIME)
    return Authority.open(DirectoryCAStore(tmp_path / "ca"), config)


def kube_api(configuration: client.Configuration) -> KubeAPI:
    return KubeAPI(client.ApiClient(configuration=configuration), timeout=5.0)


class Running:
    def __init__(self, controller: CSRController, task: asyncio.Task[None]) -> None:
        self.controller, self.task = controller, task

    async def stop(self) -> None:
        self.task.cancel()
        async with asyncio.timeout(WAIT):
            await asyncio.gather(self.task, return_exceptions=True)


@pytest.fixture
async def start(standin: StandInAPI, authority: Authority) -> AsyncIterator[Callable[..., Any]]:
    running: list[Running] = []

    async def start_controller(
        configuration: client.Configuration | None = None,
        signing: SigningExecutor | None = None,
    ) -> Running:
        rules = SignerRules(
            # Services for per-workload names come from the same stand-in API server.
            policy=Policy(
                "cluster.test",
                services=KubeServiceDirectory(
                    kube_api(configuration or standin.configuration()), cache_ttl=0
                ),
            ),
            max_lifetime=MAX_LIFETIME,
            tunnel_server_account=("waygate", "tunnel-server"),
            tunnel_server_names=("dns:tunnel.waygate.svc",),
        )
        controller = CSRController(
            kube_api(configuration or standin.configuration()),
            authority,
            rules,
            watch_timeout=30,
            list_backoff=lambda: Backoff(0.05, 0.2),
            retry_backoff=lambda: Backoff(0.05, 0.2),
            signing=signing,
        )
        task = asyncio.create_task(controller.run())
        handle = Running(controller, task)
        running.append(handle)
        async with asyncio.timeout(WAIT):
            await controller.synced.wait()
        await standin.wait_watchers(1, kind=CSR_KIND, timeout=WAIT)
        return handle

    yield start_controller
    for handle in running:
        await handle.stop()


async def settled(standin: StandInAPI, name: str) -> dict[str, Any]:
    """The CSR once the controller has finished with it (issued, denied or failed)."""
    async with asyncio.timeout(WAIT):
        while True:
            obj = standin.get(CSR_API_VERSION, CSR_KIND, name)
            found = conditions(obj)
            if (obj.get("status") or {}).get("certificate") or {"Denied", "Failed"} & set(found):
                return obj
            await asyncio.sleep(0.02)


async def run(*argv: str) -> tuple[int, str]:
    process = await asyncio.create_subprocess_exec(
        *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    async with asyncio.timeout(60):
        out, _ = await process.communicate()
    return process.returncode or 0, out.decode()


def ca_certificate(authority: Authority) -> x509.Certificate:
    return authority.trust_bundle().certificates[0]


async def test_agent_csr_is_approved_and_signed_for_its_node(
    standin: StandInAPI, authority: Authority, start: Callable[..., Any], tmp_path: Path
) -> None:
    await start()
    before = datetime.now(UTC)
    standin.create(
        csr_object(
            "agent-edge-1",
            signer=SIGNER_TUNNEL_AGENT,
            request=make_csr("dns:edge-1"),
            user=node_user("edge-1"),
            expiration_seconds=3600,
        )
    )
    obj = await settled(standin, "agent-edge-1")

    approved = conditions(obj)["Approved"]
    assert approved["status"] == "True"
    assert approved["reason"] == "WaygatePolicy"
    assert "dns:edge-1" in approved["message"]
    leaf, *chain = certificate_chain(obj)
    assert chain == []  # signed directly by the CA in the bundle
    leaf.verify_directly_issued_by(ca_certificate(authority))
    sans = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert list(sans) == [x509.DNSName("edge-1")]
    # expirationSeconds=3600 is honoured (not the CA's 24h default).
    lifetime = leaf.not_valid_after_utc - before
    assert timedelta(minutes=59) <= lifetime <= timedelta(minutes=61)
    issued = authority.list_issued(identity="edge-1")
    assert len(issued) == 1
    assert "system:node:edge-1" in issued[0].requested_by

    # What a node would do with status.certificate: check it with openssl and pkilint.
    ca_file, leaf_file = tmp_path / "ca.pem", tmp_path / "leaf.pem"
    ca_file.write_text(authority.trust_bundle().pem)
    leaf_file.write_bytes(base64.b64decode(obj["status"]["certificate"]))
    # An agent only dials out: its certificate is good for TLS clients, not servers.
    for purpose, verifies in (("sslclient", True), ("sslserver", False)):
        code, out = await run(
            "openssl", "verify", "-CAfile", str(ca_file), "-purpose", purpose,
            "-verify_hostname", "edge-1", str(leaf_file),
        )  # fmt: skip
        assert (code == 0) is verifies, out
    code, out = await run(
        str(Path(sys.executable).parent / "lint_pkix_signer_signee_cert_chain"),
        "lint", str(ca_file), str(leaf_file),
    )  # fmt: skip
    assert code == 0, out


async def test_signing_shares_certs_bounded_pool_and_waits_while_it_is_full(
    standin: StandInAPI, start: Callable[..., Any], authority: Authority
) -> None:
    signing = SigningExecutor(workers=1, queue=0)
    release = threading.Event()
    holder = asyncio.ensure_future(signing.run(release.wait, 30))  # Certify's, say
    try:
        await start(signing=signing)
        standin.create(
            csr_object(
                "agent-edge-1",
                signer=SIGNER_TUNNEL_AGENT,
                request=make_csr("dns:edge-1"),
                user=node_user("edge-1"),
            )
        )
        await asyncio.sleep(1.0)
        assert authority.list_issued(identity="edge-1") == []  # the pool is full: retried
        release.set()
        obj = await settled(standin, "agent-edge-1")
        assert certificate_chain(obj)
        assert len(authority.list_issued(identity="edge-1")) == 1
    finally:
        release.set()
        await holder
        signing.close()


async def test_expiration_seconds_beyond_the_maximum_is_clamped(
    standin: StandInAPI, start: Callable[..., Any]
) -> None:
    await start()
    before = datetime.now(UTC)
    standin.create(
        csr_object(
            "long",
            signer=SIGNER_TUNNEL_AGENT,
            request=make_csr("dns:edge-1"),
            user=node_user("edge-1"),
            expiration_seconds=30 * 86400,
        )
    )
    leaf = certificate_chain(await settled(standin, "long"))[0]
    lifetime = leaf.not_valid_after_utc - before
    assert MAX_LIFETIME - timedelta(minutes=1) <= lifetime <= MAX_LIFETIME + timedelta(minutes=1)


async def test_workload_csr_of_a_service_account_is_signed_with_its_spiffe_id(
    standin: StandInAPI, authority: Authority, start: Callable[..., Any]
) -> None:
    await start()
    spiffe = "spiffe://cluster.test/ns/shop/sa/web"
    # dns:web.shop.svc: Service "web" is named like the ServiceAccount (per-workload names).
    standin.create(
        {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "web", "namespace": "shop"}}
    )
    standin.create(
        csr_object(
            "web",
            signer=SIGNER_WORKLOAD,
            request=make_csr(f"uri:{spiffe}", "dns:web.shop.svc"),
            user=service_account_user("shop", "web"),
            usages=("digital signature", "key encipherment", "server auth", "client auth"),
        )
    )
    leaf = certificate_chain(await settled(standin, "web"))[0]
    sans = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.UniformResourceIdentifier) == [spiffe]
    assert [r.identity for r in authority.list_issued()] == [spiffe]


async def test_agent_csr_from_another_nodes_user_is_denied(
    standin: StandInAPI, authority: Authority, start: Callable[..., Any]
) -> None:
    await start()
    standin.create(
        csr_object(
            "agent-edge-2",
            signer=SIGNER_TUNNEL_AGENT,
            request=make_csr("dns:edge-2"),
            user=node_user("edge-1"),
        )
    )
    obj = await settled(standin, "agent-edge-2")
    denied = conditions(obj)["Denied"]
    assert denied["reason"] == "ForbiddenName"
    assert "dns:edge-2" in denied["message"]
    assert "Approved" not in conditions(obj)
    assert not (obj.get("status") or {}).get("certificate")
    assert authority.list_issued() == []


async def test_workload_csr_with_a_san_of_another_namespace_is_denied(
    standin: StandInAPI, authority: Authority, start: Callable[..., Any]
) -> None:
    await start()
    standin.create(
        csr_object(
            "web",
            signer=SIGNER_WORKLOAD,
            request=make_csr("uri:spiffe://cluster.test/ns/shop/sa/web", "dns:db.payments.svc"),
            user=service_account_user("shop", "web"),
        )
    )
    denied = conditions(await settled(standin, "web"))["Denied"]
    assert denied["reason"] == "ForbiddenName"
    assert "dns:db.payments.svc" in denied["message"]
    assert authority.list_issued() == []


async def test_forbidden_usage_is_denied(
    standin: StandInAPI, authority: Authority, start: Callable[..., Any]
) -> None:
    await start()
    standin.create(
        csr_object(
            "ca-wannabe",
            signer=SIGNER_TUNNEL_AGENT,
            request=make_csr("dns:edge-1"),
            user=node_user("edge-1"),
            usages=("digital signature", "cert sign"),
        )
    )
    denied = conditions(await settled(standin, "ca-wannabe"))["Denied"]
    assert denied["reason"] == "ForbiddenUsage"
    assert "'cert sign'" in denied["message"]
    assert authority.list_issued() == []


async def test_tunnel_server_csr_from_another_service_account_is_denied(
    standin: StandInAPI, start: Callable[..., Any]
) -> None:
    await start()
    standin.create(
        csr_object(
            "ts",
            signer=SIGNER_TUNNEL_SERVER,
            request=make_csr("dns:tunnel.waygate.svc"),
            user=service_account_user("waygate", "proxy"),
        )
    )
    denied = conditions(await settled(standin, "ts"))["Denied"]
    assert denied["reason"] == "RequesterNotTunnelServer"


async def test_unparsable_request_gets_a_failed_condition(
    standin: StandInAPI, start: Callable[..., Any]
) -> None:
    await start()
    standin.create(
        csr_object(
            "garbage",
            signer=SIGNER_WORKLOAD,
            request=b"-----BEGIN CERTIFICATE REQUEST-----\nAAAA\n-----END CERTIFICATE REQUEST-----\n",
            user=service_account_user("shop", "web"),
        )
    )
    obj = await settled(standin, "garbage")
    assert conditions(obj)["Failed"]["reason"] == "InvalidRequest"
    assert "Approved" not in conditions(obj) and "Denied" not in conditions(obj)


async def test_non_waygate_signer_is_left_untouched(
    standin: StandInAPI, start: Callable[..., Any]
) -> None:
    await start()
    foreign = standin.create(
        csr_object(
            "kubelet-client",
            signer="kubernetes.io/kube-apiserver-client-kubelet",
            request=make_csr("dns:edge-1"),
            user=node_user("edge-1"),
        )
    )
    # Created after the foreign one: once it is settled, the foreign one has
    # been seen (events arrive in order) and was not acted on.
    standin.create(
        csr_object(
            "agent",
            signer=SIGNER_TUNNEL_AGENT,
            request=make_csr("dns:edge-1"),
            user=node_user("edge-1"),
        )
    )
    await settled(standin, "agent")
    assert standin.get(CSR_API_VERSION, CSR_KIND, "kubelet-client") == foreign
    touched = [r for r in standin.requests if r.method != "GET" and "kubelet-client" in r.path]
    assert touched == []


async def test_finished_csrs_are_left_alone_and_approved_ones_signed_after_a_restart(
    standin: StandInAPI, authority: Authority, start: Callable[..., Any]
) -> None:
    """What a restart finds: finished CSRs, and one approved before the crash but unsigned."""
    denied = standin.create(
        csr_object(
            "old-denied",
            signer=SIGNER_TUNNEL_AGENT,
            request=make_csr("dns:edge-1"),
            user=node_user("edge-1"),
            conditions=[{"type": "Denied", "status": "True", "reason": "ByHand"}],
        )
    )
    standin.create(
        csr_object(
            "half-done",
            signer=SIGNER_TUNNEL_AGENT,
            request=make_csr("dns:edge-1"),
            user=node_user("edge-1"),
            conditions=[{"type": "Approved", "status": "True", "reason": "WaygatePolicy"}],
        )
    )
    await start()
    obj = await settled(standin, "half-done")
    leaf = certificate_chain(obj)[0]
    leaf.verify_directly_issued_by(ca_certificate(authority))
    # Signed, not approved a second time.
    assert [c["type"] for c in obj["status"]["conditions"]] == ["Approved"]
    assert standin.get(CSR_API_VERSION, CSR_KIND, "old-denied") == denied
    assert len(authority.list_issued()) == 1


async def test_a_second_controller_run_issues_nothing_new(
    standin: StandInAPI, authority: Authority, start: Callable[..., Any]
) -> None:
    first = await start()
    for node in ("edge-1", "edge-2"):
        standin.create(
            csr_object(
                f"agent-{node}",
                signer=SIGNER_TUNNEL_AGENT,
                request=make_csr(f"dns:{node}"),
                user=node_user(node),
            )
        )
    settled_objects = [await settled(standin, f"agent-{n}") for n in ("edge-1", "edge-2")]
    await first.stop()
    # Every event of our own writes has been seen; one certificate per CSR.
    assert len(authority.list_issued()) == 2

    await start()
    # A marker CSR created after the restart, handled after the relisted ones.
    standin.create(
        csr_object(
            "marker",
            signer=SIGNER_TUNNEL_AGENT,
            request=make_csr("dns:edge-3"),
            user=node_user("edge-3"),
        )
    )
    await settled(standin, "marker")
    assert len(authority.list_issued()) == 3
    for before in settled_objects:
        name = before["metadata"]["name"]
        assert standin.get(CSR_API_VERSION, CSR_KIND, name) == before


async def test_watch_resumes_from_its_version_after_a_dropped_connection(
    standin: StandInAPI, start: Callable[..., Any]
) -> None:
    await start()
    lists_before = _list_requests(standin)
    standin.drop_watches()
    standin.create(
        csr_object(
            "during-outage",
            signer=SIGNER_TUNNEL_AGENT,
            request=make_csr("dns:edge-1"),
            user=node_user("edge-1"),
        )
    )
    obj = await settled(standin, "during-outage")
    assert "certificate" in obj["status"]
    # Resumed with resourceVersion, no new list.
    assert _list_requests(standin) == lists_before
    resumed = [r for r in standin.requests if r.watch and r.query.get("resourceVersion")]
    assert resumed


async def test_watch_lists_again_when_its_version_expired(
    standin: StandInAPI, start: Callable[..., Any]
) -> None:
    await start()
    lists_before = _list_requests(standin)
    # A write the CSR watch does not see moves the oldest resumable version
    # past the controller's, so its resume gets 410.
    standin.create(
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "x", "namespace": "y"}}
    )
    standin.expire_history()
    standin.drop_watches()
    standin.create(
        csr_object(
            "after-expiry",
            signer=SIGNER_TUNNEL_AGENT,
            request=make_csr("dns:edge-1"),
            user=node_user("edge-1"),
        )
    )
    # The CSR created after the expiry reaches the controller through the new list.
    obj = await settled(standin, "after-expiry")
    assert "certificate" in obj["status"]
    assert _list_requests(standin) == lists_before + 1


async def test_api_errors_are_retried_until_the_api_answers(
    standin: StandInAPI, start: Callable[..., Any]
) -> None:
    standin.create(
        csr_object(
            "early",
            signer=SIGNER_TUNNEL_AGENT,
            request=make_csr("dns:edge-1"),
            user=node_user("edge-1"),
        )
    )
    without_token = standin.configuration()
    standin.bearer_token = "the-right-token"  # the controller has none: 401 for now
    controller_task = asyncio.create_task(start(without_token))
    async with asyncio.timeout(WAIT):
        while _list_requests(standin) < 3:  # failed, backed off, tried again
            await asyncio.sleep(0.02)
    assert not controller_task.done()
    standin.bearer_token = None
    async with asyncio.timeout(WAIT):
        await controller_task
    assert "certificate" in (await settled(standin, "early"))["status"]


async def test_stopping_the_controller_closes_its_watch(
    standin: StandInAPI, start: Callable[..., Any]
) -> None:
    running = await start()
    assert standin.watchers(CSR_KIND) == 1
    await running.stop()
    # The stand-in notices a closed connection only when it writes to it: make
    # it write until its watch is gone (an open, read connection would stay).
    async with asyncio.timeout(WAIT):
        for index in itertools.count():
            if not standin.watchers(CSR_KIND):
                break
            standin.create(
                csr_object(
                    f"poke-{index}",
                    signer="example.com/other",
                    request=make_csr("dns:x"),
                    user=node_user("x"),
                )
            )
            await asyncio.sleep(0.05)


def _list_requests(standin: StandInAPI) -> int:
    return sum(
        1
        for r in standin.requests
        if r.method == "GET" and not r.watch and r.path == CSR_COLLECTION
    )
