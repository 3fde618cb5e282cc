"""ingress-nginx's service-upstream: the Service's cluster IP at the Service port as the
backend's one endpoint.

ingress-nginx (kubernetes/ingress-nginx controller v1.15.1,
internal/ingress/controller/controller.go `createUpstreams` and
`getServiceClusterEndpoint`; internal/ingress/annotations/serviceupstream): with the
annotation (or the ConfigMap's `service-upstream`, its default) an Ingress's upstream
is `Spec.ClusterIP:port`, the port the Service port the Ingress names (by name: the
Service port's number; by number: that number), one endpoint, so kube-proxy balances.
A Service with no cluster IP (headless `None`, ExternalName) gets an error logged
and its endpoints used instead. The route backend asks for the cluster IP
(`use_cluster_ip`); the proxy's table gives it that one target, rebuilt with every
view, so a changed Service moves it.
"""

from __future__ import annotations

from typing import Any

from waygate.proxy.routing import Defaults, RouteTable, Target, build_table
from waygate.resolver import convert
from waygate.resolver.gateway.translate import Objects, translate
from waygate.resolver.ingress_nginx.annotations import judge
from waygate.resolver.ingress_nginx.catalogue import CATALOGUE, Verdict, proxy_lacks
from waygate.resolver.ingress_nginx.config import IngressNginx, config_from
from waygate.resolver.model import Endpoint, EndpointPort, Route, Service, ServicePort

P = "nginx.ingress.kubernetes.io/"
SETTINGS = IngressNginx(configmap=("ingress-nginx", "controller"))
CLUSTER_IP = "10.96.0.10"
# The Service port (80) is not the pods' port (8080): the cluster IP is dialled at 80.
WEB = Service(
    "shop",
    "web",
    cluster_ips=(CLUSTER_IP,),
    ports=(ServicePort("http", 80, "8080"), ServicePort("admin", 9000, "9090")),
)
PODS = tuple(
    Endpoint(
        "shop",
        "web",
        address,
        ports=(EndpointPort("http", 8080), EndpointPort("admin", 9090)),
        ready=True,
    )
    for address in ("10.1.0.1", "10.1.0.2")
)


def ingress(
    name: str, annotations: dict[str, str] | None = None, *, port: dict[str, Any] | None = None
) -> dict[str, Any]:
    backend = {"service": {"name": "web", "port": port or {"number": 80}}}
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "Ingress",
        "metadata": {"name": name, "namespace": "shop", "annotations": annotations or {}},
        "spec": {
            "ingressClassName": "nginx",
            "defaultBackend": backend,
            "rules": [
                {
                    "host": f"{name}.example.com",
                    "http": {"paths": [{"path": "/", "pathType": "Prefix", "backend": backend}]},
                }
            ],
        },
    }


def controller(data: dict[str, str]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "controller", "namespace": "ingress-nginx"},
        "data": data,
    }


def routes_of(*items: dict[str, Any], service: Service = WEB) -> list[Route]:
    found = Objects(services={service.key: service})
    for item in items:
        meta = item["metadata"]
        found.of(item["kind"])[(meta.get("namespace", ""), meta["name"])] = item
    return translate(found, ingress_nginx=SETTINGS).routes


def table(
    routes: list[Route],
    service: Service = WEB,
    endpoints: tuple[Endpoint, ...] = PODS,
    previous: RouteTable | None = None,
) -> RouteTable:
    return build_table(
        {r.key: r for r in routes},
        {service.key: endpoints},
        {service.key: service},
        defaults=Defaults(),
        cookie_key=b"k" * 32,
        previous=previous,
    )


def targets(built: RouteTable, route: str = "") -> set[tuple[str, int]]:
    """Every target of the table's routes (named `route` if given), as (address, port)."""
    return {
        (t.address, t.port)
        for entry in built.entries()
        if route in entry.route.name
        for backend in entry.backends
        for t in backend.picker.targets
    }


def finding(item: dict[str, Any], data: dict[str, str] | None = None) -> Any:
    plan, _ = judge(item, SETTINGS, {("ingress-nginx", "controller"): controller(data or {})})
    return next(f for f in plan.findings if f.annotation == "service-upstream"), plan


def test_the_annotation_makes_every_backend_of_the_ingress_ask_for_the_cluster_ip():
    routes = routes_of(ingress("up", {P + "service-upstream": "true"}))
    # The rule's path and spec.defaultBackend, on port 80.
    assert len(routes) == 2
    assert all(b.use_cluster_ip for r in routes for b in r.backends)
    assert not any(b.use_cluster_ip for r in routes_of(ingress("plain")) for b in r.backends)


def test_the_backend_is_the_cluster_ip_at_the_service_port_not_the_endpoints():
    built = table(routes_of(ingress("up", {P + "service-upstream": "true"})))
    assert targets(built) == {(CLUSTER_IP, 80)}
    entry = next(iter(built.entries()))
    [target] = entry.backends[0].picker.targets
    # An ordinary target: the picker, passive health and the route's timeouts take it.
    assert target == Target(CLUSTER_IP, 80, False, "", "shop", "web")
    assert target in built.targets
    # Without the annotation the same Service is balanced over its pods.
    assert targets(table(routes_of(ingress("plain")))) == {("10.1.0.1", 8080), ("10.1.0.2", 8080)}


def test_a_service_port_named_in_the_ingress_is_the_service_ports_number():
    # getServiceClusterEndpoint: a port by name is looked up in the Service's spec.
    item = ingress("named", {P + "service-upstream": "true"}, port={"name": "admin"})
    assert targets(table(routes_of(item))) == {(CLUSTER_IP, 9000)}


def test_a_service_without_the_port_gives_no_endpoint():
    # ingress-nginx errors for a port name the Service lacks; the proxy answers 503.
    item = ingress("nope", {P + "service-upstream": "true"}, port={"name": "metrics"})
    assert targets(table(routes_of(item))) == set()


def test_a_changed_service_moves_the_endpoint_with_the_next_view():
    routes = routes_of(ingress("up", {P + "service-upstream": "true"}))
    first = table(routes)
    # The Service recreated (a new cluster IP) and its port renumbered; new pods.
    moved = Service(
        "shop", "web", cluster_ips=("10.96.7.7",), ports=(ServicePort("http", 8081, "8080"),)
    )
    pods = (Endpoint("shop", "web", "10.1.0.9", ports=(EndpointPort("http", 8080),)),)
    second = table(routes, service=moved, endpoints=pods, previous=first)
    assert targets(second) == {("10.96.7.7", 8081)}
    assert Target(CLUSTER_IP, 80, False, "", "shop", "web") not in second.targets


def test_a_headless_service_keeps_its_endpoints_as_ingress_nginx_falls_back():
    # getServiceClusterEndpoint: `no ClusterIP found` is logged and serviceEndpoints used.
    headless = Service("shop", "web", headless=True, ports=WEB.ports)
    routes = routes_of(ingress("up", {P + "service-upstream": "true"}), service=headless)
    assert all(b.use_cluster_ip for r in routes for b in r.backends)
    built = table(routes, service=headless)
    assert targets(built) == {("10.1.0.1", 8080), ("10.1.0.2", 8080)}


def test_an_externalname_service_is_unaffected():
    external = Service("shop", "web", type="ExternalName", external_name="db.example.org")
    routes = routes_of(ingress("up", {P + "service-upstream": "true"}), service=external)
    assert targets(table(routes, service=external, endpoints=())) == set()


def test_the_configmap_key_is_the_default_and_the_annotation_overrides_it():
    on = controller({"service-upstream": "true"})
    assert all(b.use_cluster_ip for r in routes_of(on, ingress("a")) for b in r.backends)
    off = routes_of(on, ingress("b", {P + "service-upstream": "false"}))
    assert off and not any(b.use_cluster_ip for r in off for b in r.backends)
    # The key is honoured: no "not-honoured" note on the routes.
    assert all(r.ingress_verdicts == () for r in off)
    assert [v.verdict for v in config_from(on).verdicts()] == [Verdict.HONOURED]


def test_the_verdict_is_honoured_either_way():
    assert CATALOGUE["service-upstream"].verdict is Verdict.HONOURED
    assert "service-upstream" not in proxy_lacks()
    for value in ("true", "false"):
        found, plan = finding(ingress("v", {P + "service-upstream": value}))
        assert found.verdict is Verdict.HONOURED and not found.refuses
        assert plan.exact
    found, _ = finding(ingress("v", {P + "service-upstream": "yes"}))
    assert found.verdict is Verdict.NOT_HONOURED and "true or false" in found.note


def test_a_canary_keeps_its_own_choice_in_the_main_route():
    main = ingress("main")
    canary = ingress("canary", {P + "canary": "true", P + "canary-weight": "10"})
    canary["metadata"]["annotations"][P + "service-upstream"] = "true"
    canary["spec"]["rules"][0]["host"] = "main.example.com"
    [route] = [r for r in routes_of(main, canary) if r.host]
    assert [b.use_cluster_ip for b in route.backends] == [False, True]


def test_a_canary_on_the_main_ingress_service_keeps_its_side_in_the_proxy():
    # service-upstream on the canary only, one Service for both (the same unit test's
    # routes) through two routing tables: the main side keeps the pods and the canary
    # the cluster IP (a picker each), and a redispatch stays on its side.
    from waygate.proxy import canary as canary_rules

    main = ingress("main")
    canary = ingress("canary", {P + "canary": "true", P + "canary-weight": "10"})
    canary["metadata"]["annotations"][P + "service-upstream"] = "true"
    canary["spec"]["rules"][0]["host"] = "main.example.com"
    routes = routes_of(main, canary)
    first = table(routes)
    second = table(routes, previous=first)
    for built in (first, second):
        [entry] = [e for e in built.entries() if e.route.host]
        assert [sorted((t.address, t.port) for t in b.picker.targets) for b in entry.backends] == [
            [("10.1.0.1", 8080), ("10.1.0.2", 8080)],
            [(CLUSTER_IP, 80)],
        ]
        assert canary_rules.prepare(entry)
        split = entry.policies["canary"]
        assert split.side_of(split.main.backends[0]) is split.main
        assert split.side_of(split.canary.backends[0]) is split.canary


def test_with_upstream_hash_by_subset_every_key_gets_the_one_cluster_ip():
    # A subset of one (ingress-nginx's chashsubset over the one cluster endpoint): every
    # key hashes to it; a failed connect leaves nothing to walk to (502), never a pod.
    from waygate.proxy.routing import PassiveHealth

    annotations = {
        P + "service-upstream": "true",
        P + "upstream-hash-by": "$request_uri",
        P + "upstream-hash-by-subset": "true",
    }
    [entry] = [e for e in table(routes_of(ingress("sub", annotations))).entries() if e.route.host]
    assert entry.route.hash_subset_size == 3
    cluster = Target(CLUSTER_IP, 80, False, "", "shop", "web")
    health = PassiveHealth()
    assert {entry.pick(key, None, health, None)[0] for key in (b"/a", b"/b", b"/c")} == {cluster}
    assert entry.pick(b"/a", None, health, cluster)[0] is None


def test_the_choice_survives_the_proto():
    [route, *_] = routes_of(ingress("up", {P + "service-upstream": "true"}))
    again = convert.route_from_proto(convert.route_to_proto(route))
    assert again.backends == route.backends and again.backends[0].use_cluster_ip
