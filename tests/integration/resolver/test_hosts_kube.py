"""Host ownership across kinds in Kubernetes mode (issue 31, finding 7), through the
STAND-IN API server (tests/support/kubeapi): demo's Route object owns its host, and an
Ingress and a Gateway (with that hostname and an HTTPRoute) of namespace evil created
later are not served; the statuses written through /status say so."""

from __future__ import annotations

from typing import Any

from tests.integration.resolver.test_gateway_kube import (
    GROUP,
    Replica,
    kubeapi,
    our_parent,
    replicas,
)
from tests.support.kubeapi import KubeAPI as StandIn
from tests.support.poll import until

__all__ = ["kubeapi", "replicas"]  # the fixtures, used by name

HOST = "echo.localtest.me"


def evil_objects() -> list[dict[str, Any]]:
    backend = {"service": {"name": "web", "port": {"number": 80}}}
    return [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "evil"}},
        {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "IngressClass",
            "metadata": {"name": "waygate"},
            "spec": {"controller": "waygate.io/ingress-controller"},
        },
        {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "Ingress",
            "metadata": {"name": "takeover", "namespace": "evil"},
            "spec": {
                "ingressClassName": "waygate",
                "rules": [
                    {
                        "host": HOST,
                        "http": {
                            "paths": [{"path": "/", "pathType": "Prefix", "backend": backend}]
                        },
                    }
                ],
            },
        },
        {
            "apiVersion": f"{GROUP}/v1",
            "kind": "Gateway",
            "metadata": {"name": "gw", "namespace": "evil"},
            "spec": {
                "gatewayClassName": "waygate",
                "listeners": [{"name": "http", "port": 80, "protocol": "HTTP", "hostname": HOST}],
            },
        },
        {
            "apiVersion": f"{GROUP}/v1",
            "kind": "HTTPRoute",
            "metadata": {"name": "api", "namespace": "evil"},
            "spec": {
                "parentRefs": [{"name": "gw"}],
                "rules": [
                    {
                        "matches": [{"path": {"type": "PathPrefix", "value": "/api"}}],
                        "backendRefs": [{"name": "web", "port": 80}],
                    }
                ],
            },
        },
    ]


async def test_objects_of_a_younger_namespace_lose_the_host_and_say_so(
    kubeapi: StandIn, replicas: list[Replica]
) -> None:
    kubeapi.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "demo"}})
    kubeapi.create(
        {
            "apiVersion": f"{GROUP}/v1",
            "kind": "GatewayClass",
            "metadata": {"name": "waygate"},
            "spec": {"controllerName": "waygate.io/gateway-controller"},
        }
    )
    kubeapi.create(
        {
            "apiVersion": "waygate.io/v1",
            "kind": "Route",
            "metadata": {"name": "echo", "namespace": "demo"},
            "spec": {"host": HOST, "to": "echo"},
        }
    )
    replica = await Replica(kubeapi, "solo").start()
    replicas.append(replica)
    await until(lambda: replica.store.get_route("demo", "echo") is not None, "demo's route")
    for obj in evil_objects():
        kubeapi.create(obj)

    def evil_routes() -> list[Any]:
        return [r for r in replica.store.routes("evil") if r.host == HOST]

    await until(lambda: len(evil_routes()) == 2, "evil's Ingress and HTTPRoute translated")
    demo = replica.store.get_route("demo", "echo")
    assert demo is not None and demo.status is not None and demo.status.admitted
    for route in evil_routes():
        assert route.status is not None and not route.status.admitted
        admitted = route.status.condition("Admitted")
        assert admitted is not None and admitted.reason == "HostAlreadyClaimed"
        assert f"host {HOST} belongs to namespace demo" in admitted.message

    def written(kind: str, name: str) -> dict[str, Any]:
        api_version = f"{GROUP}/v1" if kind != "Ingress" else "networking.k8s.io/v1"
        return kubeapi.get(api_version, kind, name, "evil")

    await until(lambda: our_parent(written("HTTPRoute", "api")) is not None, "the route status")

    def route_conditions() -> dict[str, tuple[str, str]]:
        parent = our_parent(written("HTTPRoute", "api")) or {}
        return {c["type"]: (c["status"], c["reason"]) for c in parent.get("conditions", [])}

    await until(lambda: "Conflicted" in route_conditions(), "Conflicted in the route status")
    assert route_conditions()["Accepted"] == ("False", "HostAlreadyClaimed")
    assert route_conditions()["Conflicted"] == ("True", "HostAlreadyClaimed")
    (listener,) = written("Gateway", "gw")["status"]["listeners"]
    conflicted = next(c for c in listener["conditions"] if c["type"] == "Conflicted")
    assert (conflicted["status"], conflicted["reason"]) == ("True", "HostAlreadyClaimed")
    # IngressStatus has no conditions: none are written (the API would refuse or drop them).
    await until(lambda: "status" in written("Ingress", "takeover"), "the Ingress status")
    assert "conditions" not in written("Ingress", "takeover")["status"]
