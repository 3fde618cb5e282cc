"""Kubernetes-mode wiring of certs, against a STAND-IN Kubernetes API server.

No API server can run here; `tests.support.kubeapi` serves real HTTP and is
reached through a real kubeconfig file (server URL and bearer token), as
`waygate certs serve --kubeconfig FILE` would reach a cluster.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import yaml

from tests.support.kubeapi import KubeAPI as StandInAPI
from tests.support.kubeapi_certs import (
    CSR_API_VERSION,
    CSR_KIND,
    certificate_chain,
    conditions,
    csr_object,
    make_csr,
    service_account_user,
)
from waygate.certs.auth import Caller, StaticTokenAuthenticator
from waygate.certs.authority import Authority, AuthorityConfig
from waygate.certs.kube_csr import SIGNER_TUNNEL_SERVER
from waygate.certs.kube_setup import (
    ca_store,
    csr_controller,
    open_kube_api,
    san_patterns_problem,
    secret_reference_problem,
    service_account_problem,
    with_token_review,
)
from waygate.certs.kube_store import SecretCAStore
from waygate.certs.store import DirectoryCAStore
from waygate.core.errors import FailedPrecondition

TOKEN = "stand-in-bearer-token"


@pytest.fixture
def standin() -> Iterator[StandInAPI]:
    with StandInAPI() as api:
        api.bearer_token = TOKEN
        yield api


@pytest.fixture
def kubeconfig(standin: StandInAPI, tmp_path: Path) -> Path:
    path = tmp_path / "kubeconfig"
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "stand-in", "cluster": {"server": standin.url}}],
                "users": [{"name": "certs", "user": {"token": TOKEN}}],
                "contexts": [
                    {"name": "certs", "context": {"cluster": "stand-in", "user": "certs"}}
                ],
                "current-context": "certs",
            }
        )
    )
    return path


def test_kubeconfig_reaches_the_api_and_the_ca_lands_in_the_secret(
    standin: StandInAPI, kubeconfig: Path, tmp_path: Path
) -> None:
    api = open_kube_api(kubeconfig)
    store = ca_store(api, "waygate/certs-ca", tmp_path / "unused")
    assert isinstance(store, SecretCAStore)
    Authority.open(store, AuthorityConfig())
    assert standin.get("v1", "Secret", "certs-ca", namespace="waygate")["data"]
    assert not (tmp_path / "unused").exists()


def test_without_a_secret_the_directory_store_is_used(tmp_path: Path) -> None:
    store = ca_store(None, None, tmp_path / "ca")
    assert isinstance(store, DirectoryCAStore)


def test_a_missing_kubeconfig_is_a_one_line_failed_precondition(tmp_path: Path) -> None:
    with pytest.raises(FailedPrecondition, match="cannot configure the Kubernetes client"):
        open_kube_api(tmp_path / "absent")


@pytest.mark.skipif(
    "KUBERNETES_SERVICE_HOST" in os.environ, reason="inside a cluster the pod's account works"
)
def test_outside_a_cluster_without_kubeconfig_says_what_to_set() -> None:
    with pytest.raises(FailedPrecondition, match="set kubeconfig"):
        open_kube_api(None)


async def test_static_tokens_first_then_token_review(
    standin: StandInAPI, kubeconfig: Path, tmp_path: Path
) -> None:
    reviewed: list[str] = []

    def reviewer(token: str, audiences: list[str]) -> dict | None:
        reviewed.append(token)
        if token == "projected" and audiences == ["waygate-certs"]:
            return {"username": "system:serviceaccount:shop:web", "groups": []}
        return None

    standin.token_reviewer = reviewer
    static_token = "s" * 40
    static = StaticTokenAuthenticator([(static_token, Caller(name="resolver"))])
    authenticator = with_token_review(static, open_kube_api(kubeconfig), "waygate-certs")

    assert await authenticator.authenticate(static_token) == Caller(name="resolver")
    assert reviewed == []
    caller = await authenticator.authenticate("projected")
    assert caller is not None and caller.service_account == "web"
    assert await authenticator.authenticate("neither") is None
    assert reviewed == ["projected", "neither"]


async def test_csr_controller_from_settings_values_signs_for_the_tunnel_server(
    standin: StandInAPI, kubeconfig: Path, tmp_path: Path
) -> None:
    authority = Authority.open(DirectoryCAStore(tmp_path / "ca"), AuthorityConfig())
    controller = csr_controller(
        open_kube_api(kubeconfig),
        authority,
        trust_domain="cluster.test",
        max_lifetime=timedelta(days=7),
        tunnel_server_service_account="waygate/tunnel-server",
        tunnel_server_names=("tunnel.waygate.svc", "ip:10.0.0.9"),
    )
    task = asyncio.create_task(controller.run())
    try:
        standin.create(
            csr_object(
                "ts",
                signer=SIGNER_TUNNEL_SERVER,
                request=make_csr("dns:tunnel.waygate.svc", "ip:10.0.0.9"),
                user=service_account_user("waygate", "tunnel-server"),
                usages=("digital signature", "server auth"),
            )
        )
        async with asyncio.timeout(10):
            while not (standin.get(CSR_API_VERSION, CSR_KIND, "ts").get("status") or {}).get(
                "certificate"
            ):
                await asyncio.sleep(0.02)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    obj = standin.get(CSR_API_VERSION, CSR_KIND, "ts")
    assert "Approved" in conditions(obj)
    certificate_chain(obj)[0].verify_directly_issued_by(authority.trust_bundle().certificates[0])


@pytest.mark.parametrize(
    ("check", "good", "bad"),
    [
        (secret_reference_problem, "waygate/certs-ca", "certs-ca"),
        (service_account_problem, "waygate/tunnel-server", "system:serviceaccount:a:b"),
        (san_patterns_problem, ("tunnel.waygate.svc", "ip:10.0.0.9"), ("ip:not-an-ip",)),
    ],
)
def test_setting_checks(check, good, bad) -> None:  # type: ignore[no-untyped-def]
    assert check(good) is None
    assert check(bad)
