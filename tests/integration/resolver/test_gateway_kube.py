"""Gateway API objects in Kubernetes mode, through the STAND-IN API server (tests/support/kubeapi):
the kinds are listed and watched into the store, and the status is written through the
/status subresource by the replica holding the Lease only, with observedGeneration, other
controllers' route parents kept, and a resourceVersion conflict retried."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator
from typing import Any

import pytest
from kubernetes import client as k8s

from tests.support.kubeapi import KubeAPI as StandIn
from tests.support.poll import until
from waygate.core.kube import KubeAPI
from waygate.core.leader import LeaderElector, LeaseTiming
from waygate.resolver.gateway.kube import KINDS, GatewayObjects, StatusWriter
from waygate.resolver.gateway.status import StatusBoard
from waygate.resolver.kube import KubernetesSource, Timeouts
from waygate.resolver.kube_status import LEADER, LEADER_TRANSITIONS
from waygate.resolver.store import Store

GROUP = "gateway.networking.k8s.io"
FAST = LeaseTiming(lease_duration=3.0, renew_deadline=2.0, retry_period=0.2)


@pytest.fixture
def kubeapi() -> Any:
    with StandIn(history=500, default_watch_timeout=60) as api:
        api.register("waygate.io/v1", "Route", "routes", namespaced=True)
        for kind, (prefix, plural, namespaced) in KINDS.items():
            if prefix.startswith("/apis/"):
                api.register(prefix[len("/apis/") :], kind, plural, namespaced=namespaced)
        yield api


class Replica:
    """One resolver's Kubernetes side: source, board, elector and status writer."""

    def __init__(self, api: StandIn, name: str) -> None:
        self.store = Store()
        self.board = StatusBoard()
        self.gateway = GatewayObjects(self.store, self.board, addresses=("192.0.2.1",))
        self.source = KubernetesSource(
            self.store,
            api.configuration(),
            gateway=self.gateway,
            timeouts=Timeouts(watch=60, connect=2, request=5),
            backoff_initial=0.02,
            backoff_maximum=0.1,
            rng=random.Random(1),
        )
        self.kube = KubeAPI(k8s.ApiClient(api.configuration()), timeout=5)
        self.elector = LeaderElector(
            self.kube,
            "waygate",
            "resolver-status",
            identity=name,
            timing=FAST,
            component="resolver",
            leader_gauge=LEADER,
            transitions=LEADER_TRANSITIONS,
        )
        self.writer = StatusWriter(
            self.kube,
            self.board,
            is_leader=self.elector.is_leader,
            interval=0.05,
            synced=self.source.synced.is_set,
        )
        self.tasks: list[asyncio.Task[None]] = []

    async def start(self, *, elect: bool = True) -> Replica:
        self.tasks.append(asyncio.create_task(self.source.run()))
        if elect:
            self.tasks.append(asyncio.create_task(self.elector.run()))
            self.tasks.append(asyncio.create_task(self.writer.run()))
        async with asyncio.timeout(10):
            await self.source.wait_synced()
        return self

    async def stop(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        self.kube.close()


@pytest.fixture
async def replicas(kubeapi: StandIn) -> AsyncIterator[list[Replica]]:
    running: list[Replica] = []
    yield running
    for replica in running:
        await replica.stop()


def seed(api: StandIn) -> None:
    api.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "shop"}})
    api.create(
        {
            "apiVersion": f"{GROUP}/v1",
            "kind": "GatewayClass",
            "metadata": {"name": "waygate"},
            "spec": {"controllerName": "waygate.io/gateway-controller"},
        }
    )
    api.create(
        {
            "apiVersion": f"{GROUP}/v1",
            "kind": "Gateway",
            "metadata": {"name": "web", "namespace": "shop"},
            "spec": {
                "gatewayClassName": "waygate",
                "listeners": [{"name": "http", "port": 80, "protocol": "HTTP"}],
            },
        }
    )
    api.create(
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": "app", "namespace": "shop"},
            "spec": {"ports": [{"name": "http", "port": 80, "targetPort": 8080}]},
        }
    )
    api.create(http_route("app"))


def http_route(backend: str, path: str = "/") -> dict[str, Any]:
    return {
        "apiVersion": f"{GROUP}/v1",
        "kind": "HTTPRoute",
        "metadata": {"name": "app", "namespace": "shop"},
        "spec": {
            "parentRefs": [{"name": "web"}],
            "hostnames": ["app.example.com"],
            "rules": [
                {
                    "matches": [{"path": {"type": "PathPrefix", "value": path}}],
                    "backendRefs": [{"name": backend, "port": 80}],
                }
            ],
        },
    }


def conditions(status: dict[str, Any]) -> dict[str, tuple[str, str, int]]:
    return {
        c["type"]: (c["status"], c["reason"], c["observedGeneration"])
        for c in status.get("conditions", [])
    }


def our_parent(route: dict[str, Any]) -> dict[str, Any] | None:
    for parent in (route.get("status") or {}).get("parents", []):
        if parent["controllerName"] == "waygate.io/gateway-controller":
            return parent
    return None


async def test_objects_are_watched_and_only_the_leader_writes_status(
    kubeapi: StandIn, replicas: list[Replica]
) -> None:
    seed(kubeapi)
    leader = await Replica(kubeapi, "a").start()
    replicas.append(leader)
    await until(lambda: leader.elector.leading, "replica a to lead", timeout=10)
    follower = await Replica(kubeapi, "b").start()
    replicas.append(follower)
    for replica in (leader, follower):
        await until(
            lambda r=replica: any(x.origin == "HTTPRoute shop/app" for x in r.store.routes()),
            "the HTTPRoute's route in the store",
        )

    def gateway() -> dict[str, Any]:
        return kubeapi.get(f"{GROUP}/v1", "Gateway", "web", "shop")

    await until(lambda: "listeners" in (gateway().get("status") or {}), "the Gateway's status")
    status = gateway()["status"]
    assert conditions(status)["Programmed"] == ("True", "Programmed", 1)
    assert status["listeners"][0]["attachedRoutes"] == 1
    assert status["addresses"] == [{"type": "IPAddress", "value": "192.0.2.1"}]
    await until(
        lambda: our_parent(kubeapi.get(f"{GROUP}/v1", "HTTPRoute", "app", "shop")) is not None,
        "the HTTPRoute's status",
    )
    assert leader.writer.writes > 0 and follower.writer.writes == 0

    # A spec change (generation 2) with a missing backend: the reason, at generation 2.
    kubeapi.replace(http_route("ghost", "/v2"))

    def route_conditions() -> dict[str, tuple[str, str, int]]:
        parent = our_parent(kubeapi.get(f"{GROUP}/v1", "HTTPRoute", "app", "shop"))
        return conditions(parent or {})

    await until(
        lambda: route_conditions().get("ResolvedRefs", ("", "", 0))[2] == 2,
        "the status of generation 2",
    )
    assert route_conditions()["ResolvedRefs"] == ("False", "BackendNotFound", 2)
    assert route_conditions()["Accepted"] == ("True", "Accepted", 2)
    assert follower.writer.writes == 0


async def test_other_controllers_parents_are_kept_and_conflicts_retried(
    kubeapi: StandIn, replicas: list[Replica]
) -> None:
    seed(kubeapi)
    theirs = {
        "parentRef": {"group": GROUP, "kind": "Gateway", "name": "elsewhere"},
        "controllerName": "example.com/other",
        "conditions": [],
    }
    route = kubeapi.get(f"{GROUP}/v1", "HTTPRoute", "app", "shop")
    route["status"] = {"parents": [theirs]}
    kubeapi.replace(route)
    replica = Replica(kubeapi, "solo")
    replicas.append(replica)
    calls: list[str] = []
    real_call = replica.writer._call

    async def racing(function: Any, path: str, *args: Any) -> Any:
        # The first status write meets a concurrent change: the stand-in answers 409.
        if path.endswith("/httproutes/app/status") and "raced" not in calls:
            calls.append("raced")
            current = kubeapi.get(f"{GROUP}/v1", "HTTPRoute", "app", "shop")
            current["metadata"].setdefault("labels", {})["touched"] = "yes"
            kubeapi.replace(current)
        return await real_call(function, path, *args)

    replica.writer._call = racing
    await replica.start()
    await until(
        lambda: our_parent(kubeapi.get(f"{GROUP}/v1", "HTTPRoute", "app", "shop")) is not None,
        "the HTTPRoute's status after the conflict",
    )
    parents = kubeapi.get(f"{GROUP}/v1", "HTTPRoute", "app", "shop")["status"]["parents"]
    assert [p["controllerName"] for p in parents] == [
        "example.com/other",
        "waygate.io/gateway-controller",
    ]
    assert replica.writer.conflicts == 1


async def test_a_bad_object_gets_its_reason_in_status_while_the_rest_is_served(
    kubeapi: StandIn, replicas: list[Replica]
) -> None:
    seed(kubeapi)
    bad = http_route("app")
    bad["metadata"]["name"] = "bad"
    bad["spec"]["rules"][0]["matches"] = [
        {"path": {"type": "RegularExpression", "value": "/(unclosed"}}
    ]
    kubeapi.create(bad)
    replica = await Replica(kubeapi, "solo").start()
    replicas.append(replica)
    await until(
        lambda: our_parent(kubeapi.get(f"{GROUP}/v1", "HTTPRoute", "bad", "shop")) is not None,
        "the bad HTTPRoute's status",
    )
    parent = our_parent(kubeapi.get(f"{GROUP}/v1", "HTTPRoute", "bad", "shop"))
    assert parent is not None
    (accepted,) = [c for c in parent["conditions"] if c["type"] == "Accepted"]
    assert (accepted["status"], accepted["reason"]) == ("False", "UnsupportedValue")
    assert "invalid regular expression" in accepted["message"]
    origins = {route.origin for route in replica.store.routes()}
    assert "HTTPRoute shop/app" in origins and "HTTPRoute shop/bad" not in origins


async def test_backend_tls_policy_and_listener_reports_reach_kubernetes_status(
    kubeapi: StandIn, replicas: list[Replica]
) -> None:
    """BackendTLSPolicy and ConfigMaps are watched like the other kinds: a missing
    ConfigMap is written as the policy's reason, and creating it clears it; a proxy's
    listener report becomes the Gateway listener's Programmed=False in Kubernetes."""
    from tests.support.pki import LocalCA
    from waygate.resolver.model import ListenerState

    seed(kubeapi)
    kubeapi.create(
        {
            "apiVersion": f"{GROUP}/v1",
            "kind": "BackendTLSPolicy",
            "metadata": {"name": "app-tls", "namespace": "shop"},
            "spec": {
                "targetRefs": [{"group": "", "kind": "Service", "name": "app"}],
                "validation": {
                    "caCertificateRefs": [{"group": "", "kind": "ConfigMap", "name": "app-ca"}],
                    "hostname": "app.shop.example",
                },
            },
        }
    )
    replica = await Replica(kubeapi, "solo").start()
    replicas.append(replica)

    def policy() -> dict[str, tuple[str, str, int]]:
        status = kubeapi.get(f"{GROUP}/v1", "BackendTLSPolicy", "app-tls", "shop").get("status")
        ancestors = (status or {}).get("ancestors") or [{}]
        assert len(ancestors) == 1
        return conditions(ancestors[0])

    await until(lambda: "Accepted" in policy(), "the policy's status")
    assert policy()["Accepted"] == ("False", "NoValidCACertificate", 1)
    assert policy()["ResolvedRefs"] == ("False", "InvalidCACertificateRef", 1)
    kubeapi.create(
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": "app-ca", "namespace": "shop"},
            "data": {"ca.crt": LocalCA().pem.decode()},
        }
    )
    await until(lambda: policy()["Accepted"][0] == "True", "the policy accepted")
    (route,) = [r for r in replica.store.routes() if r.origin == "HTTPRoute shop/app"]
    assert route.tls is not None and route.tls.destination_server_name == "app.shop.example"

    stream = object()
    replica.board.report_listeners(
        stream,
        "edge/7",
        [ListenerState("shop/web", 80, "HTTP", 0, "PortUnavailable", "port 80 is in use")],
    )

    def listener() -> dict[str, tuple[str, str, int]]:
        gateway = kubeapi.get(f"{GROUP}/v1", "Gateway", "web", "shop")
        return conditions(gateway["status"]["listeners"][0])

    await until(lambda: listener()["Programmed"][0] == "False", "the report in Kubernetes")
    assert listener()["Programmed"] == ("False", "PortUnavailable", 1)
    replica.board.forget_listeners(stream)
    await until(lambda: listener()["Programmed"][0] == "True", "the report dropped")
