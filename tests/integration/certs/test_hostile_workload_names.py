"""Per-workload names against a real certs process and a STAND-IN Kubernetes API server.

A ServiceAccount must not get another workload's Service name (issue 12 item
5). certs runs as a real process in cluster mode: Certify callers are
authenticated by TokenReview (the stand-in's reviewer plays the API
server's token authenticator), Services are read from the stand-in, and the
CSR controller judges `waygate.io/workload` CSRs by the same rule. No
Kubernetes API server can run here; the stand-in serves real HTTP.

ServiceAccount shop/web may get: api.shop.svc (Service api names it in
`waygate.io/serving-service-account`) and web.shop.svc (Service web has no
annotation and its name). It may not get db.shop.svc (annotated for
ServiceAccount postgres) nor ghost.shop.svc (no such Service).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from tests.support.kubeapi import KubeAPI as StandInAPI
from tests.support.kubeapi_certs import (
    CSR_API_VERSION,
    CSR_KIND,
    conditions,
    csr_object,
    make_csr,
    service_account_user,
)
from tests.support.processes import RunningService, start_service
from waygate.certs.v1 import certs_pb2, certs_pb2_grpc

pytestmark = pytest.mark.system

PROJECTED = "projected-token-of-shop-web"
AUDIENCE = "waygate-certs"
SPIFFE = "spiffe://cluster.test/ns/shop/sa/web"
ANNOTATION = "waygate.io/serving-service-account"
WORKLOAD_USAGES = ("digital signature", "key encipherment", "server auth", "client auth")


def service(name: str, serving_account: str | None = None) -> dict[str, Any]:
    metadata: dict[str, Any] = {"name": name, "namespace": "shop"}
    if serving_account is not None:
        metadata["annotations"] = {ANNOTATION: serving_account}
    return {"apiVersion": "v1", "kind": "Service", "metadata": metadata, "spec": {}}


@pytest.fixture
def standin() -> Iterator[StandInAPI]:
    with StandInAPI() as api:

        def reviewer(token: str, audiences: list[str]) -> dict[str, Any] | None:
            if token == PROJECTED and AUDIENCE in audiences:
                return {"username": "system:serviceaccount:shop:web", "groups": []}
            return None

        api.token_reviewer = reviewer
        for obj in (service("api", "web"), service("web"), service("db", "postgres")):
            api.create(obj)
        yield api


@pytest.fixture
async def certs(standin: StandInAPI, tmp_path: Path) -> AsyncIterator[RunningService]:
    kubeconfig = standin.kubeconfig(tmp_path / "kubeconfig", "certs-bearer")
    process = await start_service(
        [
            "waygate",
            "certs",
            "serve",
            "--grpc-port",
            "0",
            "--admin-port",
            "0",
            "--trust-domain",
            "cluster.test",
            "--ca-dir",
            str(tmp_path / "ca"),
            "--kubeconfig",
            str(kubeconfig),
            "--token-audience",
            AUDIENCE,
            "--csr-controller",
        ]
    )
    try:
        yield process
    finally:
        await process.stop()


async def certify(certs: RunningService, *names: str) -> certs_pb2.CertifyResponse:
    pem = make_csr(*names)  # certs takes PEM as well as DER
    async with grpc.aio.insecure_channel(certs.grpc_address) as channel:
        return await certs_pb2_grpc.CertsStub(channel).Certify(
            certs_pb2.CertifyRequest(
                identity=SPIFFE, token=PROJECTED, certificate_signing_request=pem
            ),
            timeout=20,
        )


async def test_certify_gives_a_service_account_only_its_own_services(
    certs: RunningService,
) -> None:
    issued = await certify(certs, f"uri:{SPIFFE}", "dns:api.shop.svc", "dns:web.shop.svc")
    assert issued.serial
    issued = await certify(certs, f"uri:{SPIFFE}", "dns:api.shop.svc.cluster.local")
    assert issued.serial

    for name, why in (
        ("dns:db.shop.svc", "names ServiceAccount 'postgres'"),
        ("dns:ghost.shop.svc", "Service shop/ghost does not exist"),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await certify(certs, f"uri:{SPIFFE}", name)
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
        details = refused.value.details() or ""
        assert f"'{name}'" in details and why in details
        assert "only for a Service NAME in its own namespace" in details


async def settled(standin: StandInAPI, name: str) -> dict[str, Any]:
    async with asyncio.timeout(20):
        while True:
            obj = standin.get(CSR_API_VERSION, CSR_KIND, name)
            found = conditions(obj)
            if "Denied" in found or (obj.get("status") or {}).get("certificate"):
                return obj
            await asyncio.sleep(0.05)


async def test_the_csr_controller_applies_the_same_rule(
    certs: RunningService, standin: StandInAPI
) -> None:
    for name, sans in (
        ("own", (f"uri:{SPIFFE}", "dns:api.shop.svc")),
        ("theirs", (f"uri:{SPIFFE}", "dns:db.shop.svc")),
    ):
        standin.create(
            csr_object(
                name,
                signer="waygate.io/workload",
                request=make_csr(*sans),
                user=service_account_user("shop", "web"),
                usages=WORKLOAD_USAGES,
            )
        )
    own = await settled(standin, "own")
    assert own["status"].get("certificate")
    denied = conditions(await settled(standin, "theirs"))["Denied"]
    assert denied["reason"] == "ForbiddenName"
    assert "names ServiceAccount 'postgres'" in denied["message"]
    assert ANNOTATION in denied["message"]
