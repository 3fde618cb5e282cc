"""The Route CRD (deploy/kustomize/base/crd-route.yaml) mirrors the proto Route and accepts
exactly what the Kubernetes source can read: checked field by field against the proto
descriptor, and with sample objects through the CRD's schema and the source's converter."""

from __future__ import annotations

from pathlib import Path

import jsonschema
import pytest
import yaml

from waygate.resolver.kube_convert import route_from
from waygate.resolver.v1 import resolver_pb2

CRD = Path(__file__).resolve().parents[3] / "deploy" / "kustomize" / "base" / "crd-route.yaml"


@pytest.fixture(scope="module")
def crd() -> dict:
    return yaml.safe_load(CRD.read_text())


@pytest.fixture(scope="module")
def schema(crd) -> dict:
    (version,) = crd["spec"]["versions"]
    return version["schema"]["openAPIV3Schema"]


def test_identity(crd):
    assert crd["apiVersion"] == "apiextensions.k8s.io/v1"
    assert crd["spec"]["group"] == "waygate.io" and crd["spec"]["scope"] == "Namespaced"
    assert crd["spec"]["names"]["kind"] == "Route" and crd["spec"]["names"]["plural"] == "routes"
    assert [v["name"] for v in crd["spec"]["versions"]] == ["v1"]


def camel(descriptor) -> set[str]:
    # Field numbers 50-79, 90-109, 120-139 and 180-199 are made only from Gateway API
    # and Ingress objects (waygate.resolver.gateway: listener_protocol, BackendTLSPolicy's
    # RouteTLS fields; ingress-nginx's annotations and its TCP services ConfigMap),
    # never written in a Route object.
    return {
        field.json_name
        for field in descriptor.fields
        # (120-169 and 171-179: ingress-nginx's route fields, derived from annotations;
        # 180-199: its TCP services ConfigMap)
        if not (50 <= field.number <= 79 or 90 <= field.number <= 109)
        and not 120 <= field.number <= 169
        and not 171 <= field.number <= 179
        and not 180 <= field.number <= 199
    }


def test_every_proto_route_field_is_in_the_schema(schema):
    spec = schema["properties"]["spec"]["properties"]
    # namespace, name and creationTimestamp live in metadata, status in the status
    # subresource; "to" is the file format's shorthand.
    metadata = {"namespace", "name", "creationTimestamp", "status"}
    assert camel(resolver_pb2.Route.DESCRIPTOR) - metadata == set(spec) - {"to"}
    assert camel(resolver_pb2.RouteBackend.DESCRIPTOR) == set(
        spec["backends"]["items"]["properties"]
    )
    tls = camel(resolver_pb2.RouteTLS.DESCRIPTOR)
    # The proto spells them *CaCertificate in JSON; the CRD keeps OpenShift's spelling.
    assert tls - {"destinationCaCertificate", "clientCaCertificate"} | {
        "destinationCACertificate",
        "clientCACertificate",
    } == set(spec["tls"]["properties"])
    assert camel(resolver_pb2.HSTS.DESCRIPTOR) == set(
        spec["tls"]["properties"]["hsts"]["properties"]
    )
    assert camel(resolver_pb2.StickySessions.DESCRIPTOR) == set(spec["sticky"]["properties"])
    assert camel(resolver_pb2.RouteTimeouts.DESCRIPTOR) == set(spec["timeouts"]["properties"])


GOOD = [
    {"host": "web.example.com", "to": "web"},
    {
        "host": "*.apps.example.com",
        "path": "/api",
        "backends": [{"service": "api", "weight": 256}, {"service": "api-canary", "weight": 0}],
        "targetPort": "https",
        "tls": {"termination": "edge", "insecureEdgeTerminationPolicy": "Redirect"},
        "balance": "roundrobin",
        "sticky": {"cookieName": "route-a"},
        "timeouts": {"connect": "5s", "tunnel": "1h", "httpRequest": "250ms"},
        "authProxyHeaders": True,
        "forwardedHeaders": "if-none",
    },
    {
        "host": "console.example.com",
        "to": "console",
        "tls": {
            "termination": "reencrypt",
            "destinationServerName": "console.openshift-console.svc",
            "presentClientCertificate": True,
            "hsts": {"maxAge": "365d", "includeSubdomains": True, "preload": True},
        },
        "sticky": {"sameSite": "Strict"},
        "timeouts": {"keepAlive": "300s"},
    },
    {
        "host": "db.example.com",
        "to": "db",
        "targetPort": 5432,
        "tls": {"termination": "passthrough"},
    },
]

BAD = [
    {"to": "web"},  # no host
    {"host": "a.example.com", "backends": [{"service": "web", "weight": 257}]},
    {"host": "a.example.com", "to": "web", "tls": {"termination": "mirror"}},
    {"host": "a.example.com", "to": "web", "balance": "fastest"},
    {"host": "a.example.com", "to": "web", "path": "no-slash"},
    {"host": "a.example.com", "to": "web", "timeouts": {"connect": "soon"}},
    {"host": "a.example.com", "to": "web", "colour": "blue"},
    {"host": "a.example.com", "to": "web", "path": "/a b"},
    {"host": "a.example.com", "to": "web", "path": "/" + "a" * 1024},
    {"host": "a.example.com", "to": "web", "forwardedHeaders": "sometimes"},
    {"host": "a.example.com", "to": "web", "sticky": {"sameSite": "Lenient"}},
    {"host": "a.example.com", "to": "web", "tls": {"termination": "edge", "hsts": {}}},
    {"host": "a.example.com", "to": "web", "tls": {"termination": "edge", "key": "k" * 70000}},
]


CONVERTER_REFUSES = [
    ({"host": "a.example.com", "to": "web", "path": "/%2e%2e/admin"}, "dot-segments"),
    ({"host": "a.example.com", "to": "web", "path": "/a/../etc"}, "dot-segments"),
    (
        {
            "host": "a.example.com",
            "to": "web",
            "tls": {"termination": "edge", "destinationServerName": "b.example.com"},
        },
        "only reencrypt",
    ),
    (
        {
            "host": "a.example.com",
            "to": "web",
            "tls": {"termination": "edge", "hsts": {"maxAge": "1h", "preload": True}},
        },
        "preload needs",
    ),
]


def obj(spec: dict) -> dict:
    return {
        "apiVersion": "waygate.io/v1",
        "kind": "Route",
        "metadata": {"namespace": "default", "name": "r"},
        "spec": spec,
    }


def strict(schema: dict) -> dict:
    """The schema with unknown fields refused, as the API server prunes/rejects them."""
    if isinstance(schema, dict):
        out = {k: strict(v) for k, v in schema.items()}
        if schema.get("type") == "object" and "properties" in schema:
            out.setdefault("additionalProperties", False)
        return out
    if isinstance(schema, list):
        return [strict(v) for v in schema]
    return schema


@pytest.mark.parametrize("spec", GOOD)
def test_good_routes_pass_the_schema_and_the_converter(schema, spec):
    jsonschema.validate(obj(spec), strict(schema))
    assert route_from(obj(spec)).host == spec["host"]


def test_new_fields_reach_the_model(schema):
    route = route_from(obj(GOOD[2]))
    assert route.tls is not None and route.tls.hsts is not None
    assert route.tls.hsts.max_age == 365 * 86400 and route.tls.hsts.preload
    assert route.tls.destination_server_name == "console.openshift-console.svc"
    assert route.tls.present_client_certificate
    assert route.sticky.same_site.value == "Strict" and route.timeouts.keep_alive == 300
    assert route_from(obj(GOOD[1])).forwarded_headers.value == "if-none"


@pytest.mark.parametrize(("spec", "reason"), CONVERTER_REFUSES)
def test_the_converter_refuses_what_the_schema_cannot_see(spec, reason):
    from waygate.core.errors import InvalidArgument

    with pytest.raises(InvalidArgument, match=reason):
        route_from(obj(spec))


@pytest.mark.parametrize("spec", BAD)
def test_bad_routes_fail_the_schema(schema, spec):
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(obj(spec), strict(schema))
