"""components/ingress-nginx: the class, the RBAC, the second LoadBalancer and the webhook.

The overlay dev-ingress-nginx also runs through every check of test_kustomize.py
(strict schema validation, real flags, hardened pods)."""

from __future__ import annotations

import yaml

from tests.deploy.test_kustomize import named, render


def test_the_component_wires_class_rbac_service_and_webhook():
    objects = [doc for doc in yaml.safe_load_all(render("dev-ingress-nginx")) if doc]
    klass = named(objects, "IngressClass", "nginx")
    assert klass["spec"]["controller"] == "k8s.io/ingress-nginx"
    assert "namespace" not in klass["metadata"]
    rules = named(objects, "ClusterRole", "waygate-resolver-ingress-nginx")["rules"]
    granted = {(g, r, v) for rule in rules for g in rule["apiGroups"] for r in rule["resources"]
               for v in rule["verbs"]}  # fmt: skip
    for wanted in (
        ("networking.k8s.io", "ingresses", "watch"),
        ("networking.k8s.io", "ingresses/status", "update"),
        ("", "configmaps", "watch"),
        ("", "secrets", "watch"),
        ("", "events", "create"),
    ):
        assert wanted in granted, wanted
    resolver = named(objects, "Deployment", "waygate-resolver")["spec"]["template"]["spec"]
    args = resolver["containers"][0]["args"]
    assert "--ingress-nginx" in args and "--admission-webhook-port=8443" in args
    assert "--tcp-services-configmap=ingress-nginx/tcp-services" in args
    assert {"name": "webhook", "containerPort": 8443} in resolver["containers"][0]["ports"]
    # The webhook reaches the resolver's Service on 443 -> its webhook port, over the
    # name its certificate carries (waygate-resolver.waygate.svc).
    service = named(objects, "Service", "waygate-resolver")
    assert {"name": "webhook", "port": 443, "targetPort": "webhook"} in service["spec"]["ports"]
    assert any("dns:waygate-resolver.waygate.svc" in a for a in args)
    webhook = named(objects, "ValidatingWebhookConfiguration", "waygate-ingress-nginx")
    [entry] = webhook["webhooks"]
    assert entry["clientConfig"]["service"] == {
        "namespace": "waygate",
        "name": "waygate-resolver",
        "path": "/validate",
        "port": 443,
    }
    assert entry["rules"][0]["resources"] == ["ingresses"]
    assert entry["sideEffects"] == "None"
    balancer = named(objects, "Service", "waygate-proxy-ingress-nginx")
    assert balancer["spec"]["type"] == "LoadBalancer"
    assert {p["port"] for p in balancer["spec"]["ports"]} == {80, 443}
