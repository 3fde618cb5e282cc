"""--ingress-nginx in Kubernetes mode, through the STAND-IN API server (tests/support/kubeapi;
no real API server runs here): Ingresses of the nginx class (no IngressClass object)
are listed and watched into routes, the controller ConfigMap applies live, the leader
writes each Ingress's status.loadBalancer and posts Events on the one it refuses."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest
from kubernetes import client as k8s

from tests.support.kubeapi import KubeAPI as StandIn
from tests.support.poll import until
from waygate.core.kube import KubeAPI
from waygate.resolver.gateway.kube import KINDS, GatewayObjects, StatusWriter
from waygate.resolver.gateway.status import StatusBoard
from waygate.resolver.ingress_nginx.config import IngressNginx
from waygate.resolver.ingress_nginx.events import IngressEventWriter
from waygate.resolver.kube import KubernetesSource, Timeouts
from waygate.resolver.store import Store

P = "nginx.ingress.kubernetes.io/"


@pytest.fixture
def kubeapi() -> Any:
    with StandIn(history=500, default_watch_timeout=60) as api:
        api.register("waygate.io/v1", "Route", "routes", namespaced=True)
        for kind, (prefix, plural, namespaced) in KINDS.items():
            if prefix.startswith("/apis/"):
                api.register(prefix[len("/apis/") :], kind, plural, namespaced=namespaced)
        yield api


def ingress(name: str, annotations: dict[str, str]) -> dict[str, Any]:
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "Ingress",
        "metadata": {"name": name, "namespace": "shop", "annotations": annotations},
        "spec": {
            "ingressClassName": "nginx",
            "rules": [
                {
                    "host": f"{name}.example.com",
                    "http": {
                        "paths": [
                            {
                                "path": "/",
                                "pathType": "Prefix",
                                "backend": {"service": {"name": "web", "port": {"number": 80}}},
                            }
                        ]
                    },
                }
            ],
        },
    }


def watching(kubeapi: StandIn, store: Store, gateway: GatewayObjects) -> KubernetesSource:
    """The resolver's Kubernetes source on the stand-in, with short back-offs."""
    return KubernetesSource(
        store,
        kubeapi.configuration(),
        gateway=gateway,
        timeouts=Timeouts(watch=60, connect=2, request=5),
        backoff_initial=0.02,
        backoff_maximum=0.1,
        rng=random.Random(1),
    )


def refused(store: Store, name: str) -> bool | None:
    """None: no route of the Ingress yet; else whether its routes are refused."""
    mine = [r for r in store.routes() if r.origin == f"Ingress shop/{name}"]
    if not mine:
        return None
    return all(r.ingress_refusal is not None for r in mine)


async def test_kubernetes_mode_serves_refuses_and_follows_the_configmap(kubeapi: StandIn) -> None:
    kubeapi.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "shop"}})
    kubeapi.create(
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": "web", "namespace": "shop"},
            "spec": {"ports": [{"name": "http", "port": 80, "targetPort": 8080}]},
        }
    )
    kubeapi.create(ingress("shop", {P + "rewrite-target": "/"}))
    kubeapi.create(ingress("admin", {P + "enable-modsecurity": "true"}))
    store, board = Store(), StatusBoard()
    settings = IngressNginx(configmap=("ingress-nginx", "controller"))
    gateway = GatewayObjects(store, board, addresses=("192.0.2.7",), ingress_nginx=settings)
    source = watching(kubeapi, store, gateway)
    client = KubeAPI(k8s.ApiClient(kubeapi.configuration()), timeout=5)
    status = StatusWriter(client, board, is_leader=lambda: True, interval=0.05)
    events = IngressEventWriter(store, client, is_leader=lambda: True, interval=0.05)
    tasks = [asyncio.create_task(t.run()) for t in (source, status, events)]
    try:
        await until(lambda: refused(store, "shop") is False, timeout=10)
        assert refused(store, "admin") is True

        def address(name: str) -> list[Any]:
            obj = kubeapi.get("networking.k8s.io/v1", "Ingress", name, "shop")
            return ((obj.get("status") or {}).get("loadBalancer") or {}).get("ingress") or []

        await until(lambda: address("shop") == [{"ip": "192.0.2.7"}], timeout=10)
        assert address("admin") == []

        def reasons() -> dict[str, set[str]]:
            # Every Event's reason per Ingress: an Ingress gets one Event per verdict
            # change, and the list comes in the order of the Events' generated names.
            found: dict[str, set[str]] = {}
            for e in kubeapi.list("v1", "Event", "shop"):
                found.setdefault(e["involvedObject"]["name"], set()).add(e["reason"])
            return found

        await until(lambda: "UnsupportedAnnotation" in reasons().get("admin", ()), timeout=10)
        # The controller ConfigMap changes live: a key bearing on access Waygate cannot
        # honour (a WAF) refuses every Ingress of the class; removing it serves them again.
        kubeapi.create(
            {
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "metadata": {"name": "controller", "namespace": "ingress-nginx"},
                "data": {"enable-modsecurity": "true"},
            }
        )
        await until(lambda: refused(store, "shop") is True, timeout=10)
        await until(lambda: "UnsupportedConfiguration" in reasons().get("shop", ()), timeout=10)
        kubeapi.delete("v1", "ConfigMap", "controller", "ingress-nginx")
        await until(lambda: refused(store, "shop") is False, timeout=10)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        client.close()


async def test_an_auth_secret_is_read_through_the_watch_and_follows_changes(
    kubeapi: StandIn,
) -> None:
    """auth-secret in Kubernetes mode: the Opaque Secret arrives through the same
    list/watch as TLS Secrets (kept with --ingress-nginx); until it exists the
    Ingress is not served, then its credentials are on the route, and an edit of
    the Secret reaches the route."""
    import base64

    def auth_secret(line: str) -> dict[str, Any]:
        return {
            "apiVersion": "v1",
            "kind": "Secret",
            "type": "Opaque",
            "metadata": {"name": "htpasswd", "namespace": "shop"},
            "data": {"auth": base64.b64encode(line.encode()).decode()},
        }

    kubeapi.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "shop"}})
    kubeapi.create(ingress("staff", {P + "auth-type": "basic", P + "auth-secret": "htpasswd"}))
    store = Store()
    gateway = GatewayObjects(store, StatusBoard(), ingress_nginx=IngressNginx())
    source = watching(kubeapi, store, gateway)
    task = asyncio.create_task(source.run())

    def credentials() -> tuple[str, ...] | None:
        mine = [r for r in store.routes() if r.origin == "Ingress shop/staff"]
        if not mine or mine[0].access is None:
            return None
        return mine[0].access.credentials

    try:
        await until(lambda: refused(store, "staff") is True, timeout=10)
        kubeapi.create(auth_secret("ann:{PLAIN}one\n"))
        await until(lambda: credentials() == ("ann:{PLAIN}one",), timeout=10)
        assert refused(store, "staff") is False
        kubeapi.replace(auth_secret("ann:{PLAIN}two\n"))
        await until(lambda: credentials() == ("ann:{PLAIN}two",), timeout=10)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_service_upstream_follows_the_service_through_the_watch(kubeapi: StandIn) -> None:
    """service-upstream in Kubernetes mode: the route's backend asks for the cluster IP,
    and the proxy's table, built from what the resolver holds, dials the Service's
    clusterIP at its port; a renumbered port and a Service recreated with another
    clusterIP move it (ingress-nginx's createUpstreams runs on every sync)."""
    from waygate.proxy.routing import Defaults, build_table

    def service(cluster_ip: str, port: int) -> dict[str, Any]:
        return {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": "web", "namespace": "shop"},
            "spec": {
                "clusterIP": cluster_ip,
                "ports": [{"name": "http", "port": port, "targetPort": 8080}],
            },
        }

    kubeapi.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "shop"}})
    kubeapi.create(service("10.96.0.10", 80))
    item = ingress("up", {P + "service-upstream": "true"})
    item["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"]["port"] = {"name": "http"}
    kubeapi.create(item)
    store = Store()
    gateway = GatewayObjects(store, StatusBoard(), ingress_nginx=IngressNginx())
    source = watching(kubeapi, store, gateway)
    task = asyncio.create_task(source.run())

    def dialled() -> set[tuple[str, int]]:
        routes = {r.key: r for r in store.routes() if r.origin == "Ingress shop/up"}
        found = store.get_service("shop", "web")
        table = build_table(
            routes,
            {("shop", "web"): store.endpoints_of("shop", "web")},
            {("shop", "web"): found} if found is not None else {},
            defaults=Defaults(),
            cookie_key=b"k" * 32,
        )
        return {(t.address, t.port) for t in table.targets}

    try:
        await until(lambda: dialled() == {("10.96.0.10", 80)}, timeout=10)
        assert all(b.use_cluster_ip for r in store.routes() for b in r.backends)
        kubeapi.replace(service("10.96.0.10", 8081))
        await until(lambda: dialled() == {("10.96.0.10", 8081)}, timeout=10)
        # A clusterIP is immutable in Kubernetes: a new one comes with a new Service.
        kubeapi.delete("v1", "Service", "web", "shop")
        await until(lambda: dialled() == set(), timeout=10)
        kubeapi.create(service("10.96.0.99", 8081))
        await until(lambda: dialled() == {("10.96.0.99", 8081)}, timeout=10)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_add_headers_configmap_is_read_through_the_watch_and_applies_live(
    kubeapi: StandIn,
) -> None:
    """The controller ConfigMap's add-headers names another ConfigMap: until it exists
    no header is set (ingress-nginx logs a warning and sets none), then its entries are
    on every route's response headers, and an edit of it reaches the routes."""

    def header_configmap(value: str) -> dict[str, Any]:
        return {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": "response-headers", "namespace": "ingress-nginx"},
            "data": {"X-Frame-Options": value},
        }

    kubeapi.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "shop"}})
    kubeapi.create(
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": "controller", "namespace": "ingress-nginx"},
            "data": {"add-headers": "ingress-nginx/response-headers"},
        }
    )
    kubeapi.create(ingress("shop", {}))
    store = Store()
    settings = IngressNginx(configmap=("ingress-nginx", "controller"))
    gateway = GatewayObjects(store, StatusBoard(), ingress_nginx=settings)
    source = watching(kubeapi, store, gateway)
    task = asyncio.create_task(source.run())

    def headers() -> tuple[tuple[str, str], ...] | None:
        mine = [r for r in store.routes() if r.origin == "Ingress shop/shop"]
        if not mine:
            return None
        found = mine[0].filters.response_headers if mine[0].filters else None
        return found.set if found is not None else ()

    try:
        await until(lambda: headers() == (), timeout=10)
        assert refused(store, "shop") is False
        kubeapi.create(header_configmap("DENY"))
        await until(lambda: headers() == (("X-Frame-Options", "DENY"),), timeout=10)
        kubeapi.replace(header_configmap("SAMEORIGIN"))
        await until(lambda: headers() == (("X-Frame-Options", "SAMEORIGIN"),), timeout=10)
        kubeapi.delete("v1", "ConfigMap", "response-headers", "ingress-nginx")
        await until(lambda: headers() == (), timeout=10)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
