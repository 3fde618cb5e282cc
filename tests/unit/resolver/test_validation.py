"""Route, service and endpoint validation: every rule rejects with the field named."""

from __future__ import annotations

import dataclasses

import pytest

from tests.support.pki import self_signed
from waygate.core.errors import InvalidArgument
from waygate.resolver.model import (
    Endpoint,
    EndpointPort,
    InsecureEdgePolicy,
    Route,
    RouteBackend,
    RouteTimeouts,
    RouteTLS,
    Service,
    ServicePort,
    StickySessions,
    TLSTermination,
)
from waygate.resolver.validation import validate_endpoint, validate_route, validate_service

CERT, KEY = self_signed()
OTHER_CERT, OTHER_KEY = self_signed("other.example.com")


def route(**changes: object) -> Route:
    base = Route("default", "web", "web.example.com", "/", (RouteBackend("web", 100),))
    return dataclasses.replace(base, **changes)  # type: ignore[arg-type]


def rejects(r: Route, field: str) -> str:
    with pytest.raises(InvalidArgument) as info:
        validate_route(r)
    message = str(info.value)
    assert message.startswith(f"route {r.namespace or '?'}/{r.name or '?'}: {field}:"), message
    return message


def test_valid_route_is_normalised() -> None:
    got = validate_route(route(host="Web.Example.COM.", path=""))
    assert got.host == "web.example.com"
    assert got.path == "/"


def test_wildcard_host_is_allowed_only_as_leading_label() -> None:
    assert validate_route(route(host="*.Apps.example.com")).host == "*.apps.example.com"
    rejects(route(host="web.*.example.com"), "host")
    rejects(route(host="*.com"), "host")


@pytest.mark.parametrize(
    "host",
    ["", "-web.example.com", "web-.example.com", "we_b.example.com", "a" * 64 + ".com", "1.2.3.4"],
)
def test_bad_hosts_are_rejected(host: str) -> None:
    rejects(route(host=host), "host")


def test_path_must_start_with_slash() -> None:
    assert "must start with '/'" in rejects(route(path="api"), "path")
    rejects(route(path="/a b"), "path")


def test_weights_are_0_to_256_and_all_zero_is_allowed() -> None:
    validate_route(route(backends=(RouteBackend("web", 0), RouteBackend("canary", 0))))
    validate_route(route(backends=(RouteBackend("web", 256),)))
    message = rejects(
        route(backends=(RouteBackend("web", 1), RouteBackend("canary", 257))), "backends[1].weight"
    )
    assert "0..256" in message


def test_backends_rules() -> None:
    rejects(route(backends=()), "backends")
    rejects(route(backends=tuple(RouteBackend(f"s{i}", 1) for i in range(5))), "backends")
    rejects(route(backends=(RouteBackend("web", 1), RouteBackend("web", 2))), "backends[1].service")
    rejects(route(backends=(RouteBackend("Web_1", 1),)), "backends[0].service")


def test_names_and_target_port() -> None:
    rejects(route(namespace=""), "namespace")
    rejects(route(name="Not Valid"), "name")
    validate_route(route(target_port="https"))
    validate_route(route(target_port="8443"))
    rejects(route(target_port="70000"), "target_port")
    rejects(route(target_port="a_port"), "target_port")


def test_edge_tls_with_matching_key_passes() -> None:
    tls = RouteTLS(TLSTermination.EDGE, CERT, KEY, ca_certificate=OTHER_CERT)
    assert validate_route(route(tls=tls)).tls == tls


def test_key_that_does_not_match_the_certificate_is_rejected() -> None:
    message = rejects(route(tls=RouteTLS(TLSTermination.EDGE, CERT, OTHER_KEY)), "tls.key")
    assert "does not match" in message


def test_pem_that_does_not_parse_is_rejected() -> None:
    rejects(route(tls=RouteTLS(TLSTermination.EDGE, "garbage", KEY)), "tls.certificate")
    rejects(route(tls=RouteTLS(TLSTermination.EDGE, CERT, "garbage")), "tls.key")
    rejects(
        route(tls=RouteTLS(TLSTermination.REENCRYPT, destination_ca_certificate="nope")),
        "tls.destination_ca_certificate",
    )


def test_certificate_without_key_is_rejected() -> None:
    rejects(route(tls=RouteTLS(TLSTermination.EDGE, CERT, "")), "tls.key")
    rejects(route(tls=RouteTLS(TLSTermination.EDGE, "", KEY)), "tls.certificate")


def test_a_backend_client_certificate_is_a_reencrypt_routes_with_its_key() -> None:
    """ingress-nginx proxy-ssl-secret's tls.crt/tls.key: checked as tls.certificate/key."""
    reencrypt = RouteTLS(TLSTermination.REENCRYPT)
    with_pair = dataclasses.replace(
        reencrypt, backend_client_certificate=CERT, backend_client_key=KEY
    )
    assert validate_route(route(tls=with_pair)).tls == with_pair
    rejects(
        route(tls=dataclasses.replace(with_pair, backend_client_key=OTHER_KEY)),
        "tls.backend_client_key",
    )
    rejects(
        route(tls=dataclasses.replace(with_pair, backend_client_key="")), "tls.backend_client_key"
    )
    rejects(
        route(tls=dataclasses.replace(with_pair, backend_client_certificate="garbage")),
        "tls.backend_client_certificate",
    )
    edge = RouteTLS(
        TLSTermination.EDGE, CERT, KEY, backend_client_certificate=CERT, backend_client_key=KEY
    )
    rejects(route(tls=edge), "tls.backend_client_certificate")


def test_termination_specific_rules() -> None:
    rejects(
        route(tls=RouteTLS(TLSTermination.PASSTHROUGH, CERT, KEY)),
        "tls.certificate",
    )
    rejects(
        route(
            tls=RouteTLS(
                TLSTermination.PASSTHROUGH,
                insecure_edge_termination_policy=InsecureEdgePolicy.ALLOW,
            )
        ),
        "tls.insecure_edge_termination_policy",
    )
    rejects(route(path="/api", tls=RouteTLS(TLSTermination.PASSTHROUGH)), "path")
    rejects(
        route(tls=RouteTLS(TLSTermination.EDGE, destination_ca_certificate=CERT)),
        "tls.destination_ca_certificate",
    )
    rejects(
        route(tls=RouteTLS(TLSTermination.PASSTHROUGH), sticky=StickySessions(cookie_name="x")),
        "sticky.cookie_name",
    )
    validate_route(route(tls=RouteTLS(TLSTermination.REENCRYPT, destination_ca_certificate=CERT)))


def test_timeouts_must_be_positive() -> None:
    rejects(route(timeouts=RouteTimeouts(connect=0)), "timeouts.connect")
    rejects(route(timeouts=RouteTimeouts(tunnel=-1)), "timeouts.tunnel")
    validate_route(route(timeouts=RouteTimeouts(connect=5, tunnel=3600)))


def test_service_rules() -> None:
    good = Service(
        "default",
        "web",
        "NodePort",
        ("10.0.0.1",),
        ports=(ServicePort("http", 80, "8080", node_port=30080),),
    )
    assert validate_service(good) == good
    cases = [
        (dataclasses.replace(good, type="Weird"), "type"),
        (dataclasses.replace(good, cluster_ips=("nope",)), "cluster_ips[0]"),
        (dataclasses.replace(good, type="ClusterIP"), "ports[0].node_port"),
        (dataclasses.replace(good, ports=(ServicePort("http", 0, "8080"),)), "ports[0].port"),
        (dataclasses.replace(good, ports=(ServicePort("http", 80, ""),)), "ports[0].target_port"),
        (
            dataclasses.replace(good, ports=(ServicePort("", 80, "1"), ServicePort("", 81, "2"))),
            "ports[1].name",
        ),
        (dataclasses.replace(good, type="ExternalName", ports=()), "external_name"),
        (dataclasses.replace(good, headless=True), "cluster_ips"),
    ]
    for service, field in cases:
        with pytest.raises(InvalidArgument, match=rf"^service default/web: {re_escape(field)}:"):
            validate_service(service)


def test_endpoint_rules() -> None:
    good = Endpoint(
        "default", "web", "10.1.0.1", (EndpointPort("http", 8080),), node_name="edge-1", tunnel=True
    )
    assert validate_endpoint(good) == good
    with pytest.raises(InvalidArgument, match="node_name"):
        validate_endpoint(dataclasses.replace(good, node_name=""))
    with pytest.raises(InvalidArgument, match=r"ports\[0\].port"):
        validate_endpoint(dataclasses.replace(good, ports=(EndpointPort("http", 70000),)))
    with pytest.raises(InvalidArgument, match="address"):
        validate_endpoint(dataclasses.replace(good, address="not an address"))


def re_escape(text: str) -> str:
    import re

    return re.escape(text)
