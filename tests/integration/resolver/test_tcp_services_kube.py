"""--tcp-services-configmap in Kubernetes mode, through the STAND-IN API server
(tests/support/kubeapi; no real API server runs here): the ConfigMap is listed and
watched through the one list/watch layer, each entry a TCP route in the store with
its status (ServiceNotFound until the Service exists, then resolved), a bad entry
refused alone, an edit and a deletion applied live."""

from __future__ import annotations

import asyncio
import random
from typing import Any

from tests.support.kubeapi import KubeAPI as StandIn
from tests.support.poll import until
from waygate.resolver.gateway.kube import KINDS, GatewayObjects
from waygate.resolver.gateway.status import StatusBoard
from waygate.resolver.ingress_nginx.config import IngressNginx
from waygate.resolver.ingress_nginx.tcpservices import INVALID
from waygate.resolver.kube import KubernetesSource, Timeouts
from waygate.resolver.model import RESOLVED_REFS, TCP_LISTENER, Route
from waygate.resolver.store import Store


def tcp(store: Store) -> dict[int, Route]:
    return {r.listener_port: r for r in store.routes() if r.listener_protocol == TCP_LISTENER}


def reason(route: Route | None) -> str:
    if route is None or route.status is None:
        return "-"
    if not route.status.admitted:
        admitted = next(c for c in route.status.conditions if c.type == "Admitted")
        return admitted.reason
    refs = route.status.condition(RESOLVED_REFS)
    return refs.reason if refs is not None else "-"


def configmap(data: dict[str, str]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "tcp-services", "namespace": "ingress-nginx"},
        "data": data,
    }


async def test_the_configmap_is_watched_live() -> None:
    with StandIn(history=500, default_watch_timeout=60) as kubeapi:
        for kind, (prefix, plural, namespaced) in KINDS.items():
            if prefix.startswith("/apis/"):
                kubeapi.register(prefix[len("/apis/") :], kind, plural, namespaced=namespaced)
        kubeapi.register("waygate.io/v1", "Route", "routes", namespaced=True)
        kubeapi.create(configmap({"5432": "db/pg:5432:PROXY", "80x": "db/pg:5432"}))
        store = Store()
        settings = IngressNginx(tcp_services=("ingress-nginx", "tcp-services"))
        source = KubernetesSource(
            store,
            kubeapi.configuration(),
            gateway=GatewayObjects(store, StatusBoard(), ingress_nginx=settings),
            timeouts=Timeouts(watch=60, connect=2, request=5),
            backoff_initial=0.02,
            backoff_maximum=0.1,
            rng=random.Random(1),
        )
        task = asyncio.create_task(source.run())
        try:
            await until(lambda: reason(tcp(store).get(5432)) == "ServiceNotFound", timeout=10)
            assert tcp(store)[5432].proxy_protocol_from_client
            [refused] = [r for r in store.routes() if r.ingress_refusal]
            assert reason(refused) == INVALID
            # The Service and its endpoints appear: the entry resolves.
            kubeapi.create(
                {
                    "apiVersion": "v1",
                    "kind": "Service",
                    "metadata": {"name": "pg", "namespace": "db"},
                    "spec": {"ports": [{"name": "pg", "port": 5432, "targetPort": 5432}]},
                }
            )
            await until(lambda: reason(tcp(store).get(5432)) == "NoReadyEndpoints", timeout=10)
            # An edit: another port, the old one gone, in one step.
            kubeapi.replace(configmap({"6432": "db/pg:pg"}))
            await until(lambda: set(tcp(store)) == {6432}, timeout=10)
            kubeapi.delete("v1", "ConfigMap", "tcp-services", "ingress-nginx")
            await until(lambda: tcp(store) == {}, timeout=10)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
