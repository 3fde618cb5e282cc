"""Kubernetes Events on ingress-nginx Ingresses, posted by the resolver's leader, against
the STAND-IN API server (tests/support/kubeapi.py; no real API server runs here)."""

from __future__ import annotations

import kubernetes.client as k8s
import pytest

from tests.support.kubeapi import KubeAPI
from waygate.core.kube import KubeAPI as Client
from waygate.resolver.gateway.translate import Objects, translate
from waygate.resolver.ingress_nginx.config import IngressNginx
from waygate.resolver.ingress_nginx.events import IngressEventWriter
from waygate.resolver.model import Service, ServicePort
from waygate.resolver.store import Store

P = "nginx.ingress.kubernetes.io/"


def ingress(name: str, annotations: dict[str, str]) -> dict:
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


def load(store: Store, *items: dict) -> None:
    web = Service("shop", "web", ports=(ServicePort("http", 80, "8080"),))
    objects = Objects(services={web.key: web})
    for item in items:
        objects.of("Ingress")[("shop", item["metadata"]["name"])] = item
    store.replace_source(
        "kubernetes-gateway", routes=translate(objects, ingress_nginx=IngressNginx()).routes
    )


@pytest.fixture
def kubeapi():
    with KubeAPI(history=200) as api:
        yield api


def events(kubeapi: KubeAPI) -> dict[str, dict]:
    return {e["involvedObject"]["name"]: e for e in kubeapi.list("v1", "Event", "shop")}


async def test_events_say_why_an_ingress_is_not_served_and_follow_changes(kubeapi: KubeAPI) -> None:
    store = Store()
    load(
        store,
        ingress("guarded", {P + "enable-modsecurity": "true"}),
        ingress("errors", {P + "fastcgi-index": "index.php"}),
        ingress("plain", {P + "load-balance": "ewma"}),
    )
    client = Client(k8s.ApiClient(kubeapi.configuration()), timeout=5)
    leading = True
    writer = IngressEventWriter(store, client, is_leader=lambda: leading)
    assert await writer.write_pass() == 3
    found = events(kubeapi)
    guarded = found["guarded"]
    assert (guarded["type"], guarded["reason"]) == ("Warning", "UnsupportedAnnotation")
    assert "enable-modsecurity" in guarded["message"]
    assert guarded["involvedObject"]["kind"] == "Ingress"
    assert (found["errors"]["type"], found["errors"]["reason"]) == (
        "Warning",
        "AnnotationNotHonoured",
    )
    assert found["plain"]["reason"] == "AnnotationsHonoured"
    # Nothing changed: nothing posted again.
    assert await writer.write_pass() == 0
    # The Ingress changes: one new Event, for it alone.
    load(
        store,
        ingress("guarded", {}),
        ingress("errors", {P + "fastcgi-index": "index.php"}),
        ingress("plain", {P + "load-balance": "ewma"}),
    )
    assert await writer.write_pass() == 0  # "guarded" has no verdict left to report
    load(
        store,
        ingress("guarded", {P + "auth-url": "http://example.com/#;\ninjection_point"}),
        ingress("errors", {P + "fastcgi-index": "index.php"}),
        ingress("plain", {P + "load-balance": "ewma"}),
    )
    assert await writer.write_pass() == 1
    reasons = sorted(e["reason"] for e in kubeapi.list("v1", "Event", "shop"))
    assert reasons.count("InvalidAnnotation") == 1
    client.close()
