"""`waygate resolver serve --kubernetes` as a real process against a STAND-IN API server
(tests/support/kubeapi.py: real HTTP and watch semantics; no real Kubernetes API server
can run on these machines), reached through a kubeconfig file with a bearer token."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tests.support.kubeapi import KubeAPI
from tests.support.processes import http_get, run_cli, start_service

pytestmark = pytest.mark.system


def service(name: str) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": "shop"},
        "spec": {
            "clusterIP": "10.96.0.10",
            "ports": [{"name": "http", "port": 80, "targetPort": 8080}],
        },
    }


def endpoint_slice(name: str, service_name: str, addresses: list[tuple[str, bool]]) -> dict:
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": name,
            "namespace": "shop",
            "labels": {"kubernetes.io/service-name": service_name},
        },
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
        "endpoints": [
            {"addresses": [address], "conditions": {"ready": ready, "terminating": not ready}}
            for address, ready in addresses
        ],
    }


async def test_serves_what_the_cluster_holds_and_follows_removals(tmp_path: Path) -> None:
    with KubeAPI() as api:
        api.bearer_token = "resolver-token"
        api.register("waygate.io/v1", "Route", "routes", namespaced=True)
        api.create(service("web"))
        api.create(
            endpoint_slice(
                "web-1", "web", [("10.1.0.1", True), ("10.1.0.2", True), ("10.1.0.3", False)]
            )
        )
        kubeconfig = tmp_path / "kubeconfig"
        kubeconfig.write_text(
            f"""
apiVersion: v1
kind: Config
clusters: [{{name: stand-in, cluster: {{server: "{api.url}"}}}}]
users: [{{name: resolver, user: {{token: resolver-token}}}}]
contexts: [{{name: test, context: {{cluster: stand-in, user: resolver}}}}]
current-context: test
"""
        )
        resolver = await start_service(
            [
                "waygate",
                "resolver",
                "serve",
                "--grpc-port",
                "0",
                "--admin-port",
                "0",
                "--kubernetes",
                "--kubeconfig",
                str(kubeconfig),
            ]
        )
        try:
            async with asyncio.timeout(20):
                while (await http_get(resolver.admin_port, "/readyz"))[0] != 200:
                    await asyncio.sleep(0.1)
            addr = ("--addr", resolver.grpc_address, "--plaintext")
            code, out, err = await run_cli("resolve", "shop/web", *addr)
            assert code == 0, err
            assert "10.1.0.1" in out and "10.1.0.2" in out
            assert "10.1.0.3" not in out, "a terminating endpoint is never served"
            api.replace(endpoint_slice("web-1", "web", [("10.1.0.2", True)]))
            async with asyncio.timeout(20):
                while True:
                    code, out, _ = await run_cli("resolve", "shop/web", *addr)
                    if code == 0 and "10.1.0.1" not in out:
                        break
                    await asyncio.sleep(0.2)
            api.delete("discovery.k8s.io/v1", "EndpointSlice", "web-1", namespace="shop")
            async with asyncio.timeout(20):
                while (await run_cli("resolve", "shop/web", *addr))[0] != 3:
                    await asyncio.sleep(0.2)
            code, out, err = await run_cli("routes", *addr)
            # The Kubernetes source's own state first (issue 29), then the routes.
            first, rest = out.strip().split("\n", 1)
            assert code == 0 and first.startswith("kubernetes: valid (version "), out
            assert rest == "no routes", out
        finally:
            assert await resolver.stop() == 0


async def test_an_unreadable_kubeconfig_stops_start_up_with_one_line(tmp_path: Path) -> None:
    code, _, err = await run_cli(
        "resolver",
        "serve",
        "--grpc-port",
        "0",
        "--admin-port",
        "0",
        "--kubernetes",
        "--kubeconfig",
        str(tmp_path / "missing"),
    )
    assert code == 1
    assert "cannot load kubeconfig" in err and "Traceback" not in err
