"""Route objects' status subresource, written by the resolver's leader from its route
conditions, against the STAND-IN API server (tests/support/kubeapi.py; no real API
server runs here) through the official client. Every wait has a timeout."""

from __future__ import annotations

import asyncio

import kubernetes.client as k8s
import pytest

from tests.integration.resolver.test_kube_source import Running, endpoint, endpoint_slice, route
from tests.integration.resolver.test_kube_source import service as kube_service
from tests.support.kubeapi import KubeAPI
from tests.support.poll import until
from waygate.core.kube import KubeAPI as Client
from waygate.resolver.kube import SOURCE
from waygate.resolver.kube_status import RouteStatusWriter


@pytest.fixture
def kubeapi():
    with KubeAPI(history=200, default_watch_timeout=60) as api:
        api.register("waygate.io/v1", "Route", "routes", namespaced=True)
        yield api


def conditions(kubeapi: KubeAPI, name: str, namespace: str = "mine") -> dict[str, dict]:
    obj = kubeapi.get("waygate.io/v1", "Route", name, namespace)
    return {c["type"]: c for c in (obj.get("status") or {}).get("conditions") or []}


async def test_the_leader_writes_conditions_and_follows_their_changes(kubeapi: KubeAPI) -> None:
    kubeapi.create(route("ghost", "ghost.example.com", namespace="mine", backends=[
        {"service": "doesnotexist", "weight": 1}
    ]))  # fmt: skip
    async with Running(kubeapi) as running:
        client = Client(k8s.ApiClient(kubeapi.configuration()), timeout=5)
        leading = True
        writer = RouteStatusWriter(
            running.store, client, source=SOURCE, is_leader=lambda: leading, interval=0.05
        )
        task = asyncio.create_task(writer.run())
        try:
            await until(lambda: "ResolvedRefs" in conditions(kubeapi, "ghost"), timeout=10)
            refs = conditions(kubeapi, "ghost")["ResolvedRefs"]
            assert (refs["status"], refs["reason"], refs["message"]) == (
                "False",
                "ServiceNotFound",
                "service mine/doesnotexist not found",
            )
            assert refs["observedGeneration"] == 1 and refs["lastTransitionTime"]
            assert conditions(kubeapi, "ghost")["Admitted"]["status"] == "True"
            spec_before = kubeapi.get("waygate.io/v1", "Route", "ghost", "mine")["spec"]
            # The service appears with a ready endpoint: the status follows.
            kubeapi.create(kube_service("doesnotexist", namespace="mine"))
            kubeapi.create(
                endpoint_slice("doesnotexist-1", "doesnotexist", [endpoint("10.1.0.1")], "mine")
            )
            await until(
                lambda: conditions(kubeapi, "ghost")["ResolvedRefs"]["status"] == "True",
                timeout=10,
            )
            after = kubeapi.get("waygate.io/v1", "Route", "ghost", "mine")
            assert after["spec"] == spec_before, "only the status subresource is written"
            # A follower writes nothing, even when the status would change.
            leading = False
            await asyncio.sleep(0.2)
            writes = sum(1 for r in kubeapi.requests if r.method == "PUT")
            kubeapi.delete("v1", "Service", "doesnotexist", "mine")
            await until(
                lambda: (
                    (running.store.get_route("mine", "ghost").status.problem() or "")
                    == "service mine/doesnotexist not found"
                ),
                timeout=10,
            )
            await asyncio.sleep(0.3)
            assert sum(1 for r in kubeapi.requests if r.method == "PUT") == writes
            assert conditions(kubeapi, "ghost")["ResolvedRefs"]["status"] == "True"
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            client.close()


async def test_a_route_object_that_cannot_be_served_says_why(kubeapi: KubeAPI) -> None:
    kubeapi.create(route("bad", "Not_A_Host", namespace="mine"))
    async with Running(kubeapi) as running:
        client = Client(k8s.ApiClient(kubeapi.configuration()), timeout=5)
        writer = RouteStatusWriter(
            running.store,
            client,
            source=SOURCE,
            is_leader=lambda: True,
            interval=0.05,
            invalid=running.source.invalid_routes,
        )
        task = asyncio.create_task(writer.run())
        try:
            await until(lambda: "Admitted" in conditions(kubeapi, "bad"), timeout=10)
            admitted = conditions(kubeapi, "bad")["Admitted"]
            assert (admitted["status"], admitted["reason"]) == ("False", "InvalidSpec")
            assert "host" in admitted["message"]
            assert running.store.get_route("mine", "bad") is None, "never served"
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            client.close()
