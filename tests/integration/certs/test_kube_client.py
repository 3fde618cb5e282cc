"""How certs reaches the Kubernetes API: a kubeconfig file, or the pod's ServiceAccount.

Against a STAND-IN Kubernetes API server (none can run here): real HTTP that
requires a bearer token, reached through a real kubeconfig file with the
official client's own loader, as `--kubeconfig FILE` reaches a cluster.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.support.kubeapi import KubeAPI as StandInAPI
from waygate.certs.authority import Authority, AuthorityConfig
from waygate.certs.kube_api import KubeAPI, KubeError, load_api_client
from waygate.certs.kube_store import SecretCAStore
from waygate.core.errors import FailedPrecondition

TOKEN = "stand-in-bearer-token"


@pytest.fixture
def standin() -> Iterator[StandInAPI]:
    with StandInAPI() as api:
        api.bearer_token = TOKEN
        yield api


def write_kubeconfig(path: Path, server: str, token: str) -> Path:
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "stand-in", "cluster": {"server": server}}],
                "users": [{"name": "certs", "user": {"token": token}}],
                "contexts": [
                    {"name": "certs", "context": {"cluster": "stand-in", "user": "certs"}}
                ],
                "current-context": "certs",
            }
        )
    )
    return path


def test_kubeconfig_reaches_the_api_with_its_token_and_the_ca_lands_in_the_secret(
    standin: StandInAPI, tmp_path: Path
) -> None:
    kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", standin.url, TOKEN)
    api = KubeAPI(load_api_client(kubeconfig))
    Authority.open(SecretCAStore(api, "waygate", "certs-ca"), AuthorityConfig())
    assert standin.get("v1", "Secret", "certs-ca", namespace="waygate")["data"]


def test_a_wrong_token_in_the_kubeconfig_is_refused_by_the_api(
    standin: StandInAPI, tmp_path: Path
) -> None:
    kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", standin.url, "wrong")
    api = KubeAPI(load_api_client(kubeconfig))
    with pytest.raises(KubeError) as caught:
        api.get("/api/v1/namespaces/waygate/secrets/certs-ca")
    assert caught.value.status == 401


def test_a_missing_kubeconfig_is_a_one_line_failed_precondition(tmp_path: Path) -> None:
    with pytest.raises(FailedPrecondition, match="cannot configure the Kubernetes client") as e:
        load_api_client(tmp_path / "absent")
    assert "\n" not in str(e.value)


@pytest.mark.skipif(
    "KUBERNETES_SERVICE_HOST" in os.environ, reason="inside a cluster the pod's account works"
)
def test_outside_a_cluster_without_kubeconfig_says_what_to_set() -> None:
    with pytest.raises(FailedPrecondition, match="set kubeconfig"):
        load_api_client(None)
