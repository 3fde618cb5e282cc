"""`waygate certs serve` in Kubernetes mode, as a real process, against a STAND-IN API server.

No Kubernetes API server can run here: `tests.support.kubeapi` serves real
HTTP on 127.0.0.1 and is reached through a kubeconfig file with a bearer
token, exactly as a cluster would be. The process keeps its CA in a Secret,
authenticates Certify callers by TokenReview (the stand-in's reviewer plays
the API server's token authenticator) and runs the CSR controller; the
`waygate cert issue` client is a real process too.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

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
    node_user,
)
from tests.support.processes import run_cli, start_service

pytestmark = pytest.mark.system

BEARER = "stand-in-bearer-token"
PROJECTED = "projected-token-of-shop-web"
AUDIENCE = "waygate-certs"


@pytest.fixture
def standin() -> Iterator[StandInAPI]:
    with StandInAPI() as api:
        api.bearer_token = BEARER

        def reviewer(token: str, audiences: list[str]) -> dict[str, Any] | None:
            if token == PROJECTED and AUDIENCE in audiences:
                return {"username": "system:serviceaccount:shop:web", "groups": []}
            return None

        api.token_reviewer = reviewer
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
                "users": [{"name": "certs", "user": {"token": BEARER}}],
                "contexts": [
                    {"name": "certs", "context": {"cluster": "stand-in", "user": "certs"}}
                ],
                "current-context": "certs",
            }
        )
    )
    return path


def serve_argv(kubeconfig: Path) -> list[str]:
    return [
        "waygate",
        "certs",
        "serve",
        "--grpc-port",
        "0",
        "--admin-port",
        "0",
        "--trust-domain",
        "cluster.test",
        "--kubeconfig",
        str(kubeconfig),
        "--ca-secret",
        "waygate/waygate-certs-ca",
        "--token-audience",
        AUDIENCE,
        "--csr-controller",
    ]


async def signed(standin: StandInAPI, name: str) -> dict[str, Any]:
    # A bound, not a speed claim: the process's start, its leader election and the CSR
    # watch take longer while another pytest worker starts processes beside it.
    async with asyncio.timeout(60):
        while True:
            obj = standin.get(CSR_API_VERSION, CSR_KIND, name)
            if (obj.get("status") or {}).get("certificate"):
                return obj
            await asyncio.sleep(0.05)


async def test_cluster_mode_end_to_end(
    standin: StandInAPI, kubeconfig: Path, tmp_path: Path
) -> None:
    certs = await start_service(serve_argv(kubeconfig))
    try:
        standin.create(
            csr_object(
                "agent-edge-1",
                signer="waygate.io/tunnel-agent",
                request=make_csr("dns:edge-1"),
                user=node_user("edge-1"),
            )
        )
        first = await signed(standin, "agent-edge-1")
        assert "Approved" in conditions(first)
        secret = standin.get("v1", "Secret", "waygate-certs-ca", namespace="waygate")
        assert secret["type"] == "Opaque" and secret["data"]

        code, _, err = await run_cli(
            "cert", "issue", "--addr", certs.grpc_address,
            "--identity", "spiffe://cluster.test/ns/shop/sa/web",
            "--out", str(tmp_path / "web"),
            env={"WAYGATE_CERTS_TOKEN": PROJECTED},
        )  # fmt: skip
        assert code == 0, err
        assert (tmp_path / "web" / "cert.pem").is_file()

        code, _, err = await run_cli(
            "cert", "issue", "--addr", certs.grpc_address,
            "--identity", "spiffe://cluster.test/ns/shop/sa/web",
            "--out", str(tmp_path / "nope"),
            env={"WAYGATE_CERTS_TOKEN": "not-a-projected-token"},
        )  # fmt: skip
        assert code == 1
        assert "UNAUTHENTICATED" in err and "Traceback" not in err
    finally:
        assert await certs.stop() == 0

    # A restart finds its CA in the Secret and leaves the finished CSR alone.
    again = await start_service(serve_argv(kubeconfig))
    try:
        standin.create(
            csr_object(
                "agent-edge-2",
                signer="waygate.io/tunnel-agent",
                request=make_csr("dns:edge-2"),
                user=node_user("edge-2"),
            )
        )
        second = await signed(standin, "agent-edge-2")
    finally:
        assert await again.stop() == 0
    first_leaf, second_leaf = certificate_chain(first)[0], certificate_chain(second)[0]
    assert first_leaf.issuer == second_leaf.issuer
    assert standin.get(CSR_API_VERSION, CSR_KIND, "agent-edge-1") == first


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--ca-secret", "no-namespace"], "NAMESPACE/NAME"),
        (["--csr-controller", "--kubeconfig", "/nonexistent/kubeconfig"], "kubeconfig"),
    ],
)
async def test_bad_kubernetes_settings_stop_start_with_one_line(
    flags: list[str], words: str, tmp_path: Path
) -> None:
    code, _, err = await run_cli(
        "certs", "serve", "--grpc-port", "0", "--admin-port", "0",
        "--ca-dir", str(tmp_path / "ca"), *flags,
    )  # fmt: skip
    assert code != 0
    assert "Traceback" not in err
    # Besides the process's JSON log lines, one line for the user says what is wrong.
    messages = [line for line in err.splitlines() if line.startswith("waygate:")]
    assert len(messages) == 1, err
    assert words in messages[0]
