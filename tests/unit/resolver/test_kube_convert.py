"""Kubernetes JSON -> resolver model: defaults, conditions, merging, Route CRs, errors."""

from __future__ import annotations

import pytest

from waygate.core.errors import InvalidArgument
from waygate.resolver.kube_convert import (
    endpoints_from_slice,
    merge_endpoints,
    route_from,
    service_from,
    slice_service,
)
from waygate.resolver.model import BalancePolicy, InsecureEdgePolicy, TLSTermination


def svc(spec: dict, name: str = "web") -> dict:
    return {"metadata": {"namespace": "default", "name": name}, "spec": spec}


def eps(endpoints: list, labels: dict | None = None, ports: list | None = None) -> dict:
    return {
        "metadata": {
            "namespace": "default",
            "name": "web-abc",
            "labels": {"kubernetes.io/service-name": "web", **(labels or {})},
        },
        "addressType": "IPv4",
        "ports": ports if ports is not None else [{"name": "http", "port": 8080}],
        "endpoints": endpoints,
    }


def test_service_defaults_and_types():
    plain = service_from(svc({"clusterIP": "10.0.0.1", "ports": [{"port": 80}]}))
    assert (plain.type, plain.cluster_ips, plain.ports[0].target_port, plain.ports[0].protocol) == (
        "ClusterIP",
        ("10.0.0.1",),
        "80",
        "TCP",
    )
    dual = service_from(svc({"clusterIP": "10.0.0.1", "clusterIPs": ["10.0.0.1", "fd00::1"]}))
    assert dual.cluster_ips == ("10.0.0.1", "fd00::1")
    headless = service_from(svc({"clusterIP": "None", "clusterIPs": ["None"]}))
    assert headless.headless and headless.cluster_ips == ()
    named = service_from(
        svc(
            {
                "type": "NodePort",
                "ports": [{"name": "h", "port": 80, "targetPort": "web", "nodePort": 30001}],
            }
        )
    )
    assert (named.ports[0].target_port, named.ports[0].node_port) == ("web", 30001)
    external = service_from(svc({"type": "ExternalName", "externalName": "db.example.com"}))
    assert (external.external_name, external.cluster_ips) == ("db.example.com", ())


def test_invalid_service_names_the_object_and_field():
    with pytest.raises(InvalidArgument, match="service default/web.*type"):
        service_from(svc({"type": "Magic"}))
    with pytest.raises(InvalidArgument, match="port"):
        service_from(svc({"ports": [{"port": "eighty"}]}))


def test_endpoint_conditions_default_to_ready_and_terminating_is_never_ready():
    endpoints = endpoints_from_slice(
        eps(
            [
                {"addresses": ["10.0.0.1"]},
                {"addresses": ["10.0.0.2"], "conditions": {"ready": True, "terminating": True}},
                {"addresses": ["10.0.0.3"], "conditions": {"ready": False}},
                {
                    "addresses": ["10.0.0.4", "10.0.0.44"],
                    "nodeName": "n1",
                    "zone": "z1",
                    "hostname": "pod-4",
                },
            ]
        )
    )
    by = {e.address: e for e in endpoints}
    assert set(by) == {"10.0.0.1", "10.0.0.2", "10.0.0.3", "10.0.0.4"}
    assert by["10.0.0.1"].ready and by["10.0.0.1"].serving and not by["10.0.0.1"].terminating
    assert not by["10.0.0.2"].ready and by["10.0.0.2"].terminating and not by["10.0.0.2"].usable
    assert not by["10.0.0.3"].ready and not by["10.0.0.3"].serving
    assert (by["10.0.0.4"].node_name, by["10.0.0.4"].zone, by["10.0.0.4"].hostname) == (
        "n1",
        "z1",
        "pod-4",
    )
    assert by["10.0.0.1"].ports[0].name == "http" and by["10.0.0.1"].ports[0].port == 8080


def test_slice_without_service_label_or_nil_port():
    unowned = eps([{"addresses": ["10.0.0.1"]}])
    del unowned["metadata"]["labels"]["kubernetes.io/service-name"]
    assert slice_service(unowned) is None and endpoints_from_slice(unowned) == []
    nil_port = endpoints_from_slice(
        eps([{"addresses": ["10.0.0.1"]}], ports=[{"name": "x", "port": None}])
    )
    assert nil_port[0].ports == ()


def test_invalid_endpoints_are_left_out_with_their_reason():
    problems: list[str] = []
    endpoints = endpoints_from_slice(
        eps([{"addresses": ["10.0.0.1"]}, {"addresses": []}, {"addresses": ["bad_address!"]}]),
        problems=problems,
    )
    assert [e.address for e in endpoints] == ["10.0.0.1"]
    assert len(problems) == 2 and "addresses" in problems[0]


def test_tunnel_by_label_or_edge_node_and_never_without_a_node():
    labelled = endpoints_from_slice(
        eps([{"addresses": ["10.0.0.1"], "nodeName": "e1"}], labels={"waygate.io/tunnel": "true"})
    )
    assert labelled[0].tunnel
    by_node = endpoints_from_slice(
        eps(
            [
                {"addresses": ["10.0.0.1"], "nodeName": "e1"},
                {"addresses": ["10.0.0.2"], "nodeName": "c1"},
            ]
        ),
        frozenset({"e1"}),
    )
    assert [e.tunnel for e in by_node] == [True, False]
    problems: list[str] = []
    nodeless = endpoints_from_slice(
        eps([{"addresses": ["10.0.0.1"]}], labels={"waygate.io/tunnel": "true"}), problems=problems
    )
    assert nodeless == [] and "node" in problems[0]


def test_merge_keeps_one_endpoint_per_address_ready_if_any_slice_says_so():
    a = endpoints_from_slice(eps([{"addresses": ["10.0.0.1"], "conditions": {"ready": False}}]))
    b = endpoints_from_slice(
        eps(
            [{"addresses": ["10.0.0.1"]}, {"addresses": ["10.0.0.2"]}],
            ports=[{"name": "metrics", "port": 9090}],
        )
    )
    merged = merge_endpoints([a, b])
    assert [e.address for e in merged] == ["10.0.0.1", "10.0.0.2"]
    assert merged[0].ready
    assert {p.name for p in merged[0].ports} == {"http", "metrics"}


def route_obj(spec: dict) -> dict:
    return {"metadata": {"namespace": "shop", "name": "front"}, "spec": spec}


def test_route_mapping_mirrors_the_proto_fields():
    route = route_from(
        route_obj(
            {
                "host": "Shop.Example.com",
                "path": "/cart",
                "backends": [{"service": "cart", "weight": 3}, {"service": "cart-v2"}],
                "targetPort": 8443,
                "tls": {"termination": "edge", "insecureEdgeTerminationPolicy": "Redirect"},
                "balance": "source",
                "sticky": {"disableCookies": True},
                "timeouts": {"connect": "1s", "server": 45, "httpRequest": "500ms"},
                "authProxyHeaders": True,
            }
        )
    )
    assert (route.namespace, route.name, route.host) == ("shop", "front", "shop.example.com")
    assert [(b.service, b.weight) for b in route.backends] == [("cart", 3), ("cart-v2", 100)]
    assert route.target_port == "8443" and route.balance is BalancePolicy.SOURCE
    assert route.tls.termination is TLSTermination.EDGE
    assert route.tls.insecure_edge_termination_policy is InsecureEdgePolicy.REDIRECT
    assert (route.timeouts.connect, route.timeouts.server, route.timeouts.http_request) == (
        1.0,
        45.0,
        0.5,
    )
    assert route.sticky.disable_cookies and route.auth_proxy_headers
    short = route_from(route_obj({"host": "a.example.com", "to": "web"}))
    assert [(b.service, b.weight) for b in short.backends] == [("web", 100)] and short.path == "/"


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"host": "bad host", "to": "web"}, "host"),
        ({"host": "a.example.com", "backends": [{"service": "web", "weight": 257}]}, "weight"),
        ({"host": "a.example.com", "to": "web", "backends": []}, "either 'to' or 'backends'"),
        ({"host": "a.example.com", "to": "web", "balance": "fastest"}, "balance"),
        ({"host": "a.example.com", "to": "web", "tls": {}}, "termination"),
        ({"host": "a.example.com", "to": "web", "timeouts": {"connect": "soon"}}, "connect"),
        (
            {
                "host": "a.example.com",
                "to": "web",
                "tls": {"termination": "edge", "certificate": "junk"},
            },
            "certificate",
        ),
    ],
)
def test_invalid_routes_say_which_object_and_field(spec, message):
    with pytest.raises(InvalidArgument, match=message) as exc:
        route_from(route_obj(spec))
    assert "shop/front" in str(exc.value)
