"""Which protocol the proxy speaks to a backend: a route's upstreamProtocol, else the
service port's appProtocol (Kubernetes' field), in every source and over the wire."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from waygate.core.errors import InvalidArgument
from waygate.resolver import convert
from waygate.resolver.filesource import FileError, parse_routes_file
from waygate.resolver.kube_convert import service_from
from waygate.resolver.model import Route, RouteBackend, ServicePort, speaks_http2
from waygate.resolver.validation import validate_route

FILE = textwrap.dedent(
    """\
    services:
      - namespace: demo
        name: grpc
        ports:
          - {name: grpc, port: 7001, targetPort: "7001", appProtocol: kubernetes.io/h2c}
    routes:
      - namespace: demo
        name: forced
        host: forced.test
        to: grpc
        upstreamProtocol: http
      - namespace: demo
        name: by-port
        host: port.test
        to: grpc
    """
)


def test_routes_file_reads_both_and_round_trips_over_the_wire(tmp_path: Path):
    content = parse_routes_file(tmp_path / "routes.yaml", FILE)
    service = content.services[0]
    assert service.ports[0].app_protocol == "kubernetes.io/h2c"
    routes = {r.name: r for r in content.routes}
    assert routes["forced"].upstream_protocol == "http"
    assert not speaks_http2(routes["forced"], service.ports[0])
    assert speaks_http2(routes["by-port"], service.ports[0])
    assert convert.service_from_proto(convert.service_to_proto(service)) == service
    assert convert.route_from_proto(convert.route_to_proto(routes["forced"])) == routes["forced"]


def test_unknown_route_protocol_is_refused_with_the_field(tmp_path: Path):
    with pytest.raises(FileError, match="upstreamProtocol: 'spdy' is not one of"):
        parse_routes_file(
            tmp_path / "r.yaml", FILE.replace("upstreamProtocol: http", "upstreamProtocol: spdy")
        )
    with pytest.raises(InvalidArgument, match="upstream_protocol"):
        validate_route(
            Route("demo", "r", "a.test", backends=(RouteBackend("s"),), upstream_protocol="h3")
        )


@pytest.mark.parametrize(
    ("value", "http2"),
    [
        ("kubernetes.io/h2c", True),
        ("grpc", True),
        ("h2", True),
        ("h2c", True),
        ("http", False),
        ("", False),
        ("kubernetes.io/ws", False),
    ],
)
def test_app_protocol_values(value, http2):
    route = Route("demo", "r", "a.test", backends=(RouteBackend("s"),))
    assert speaks_http2(route, ServicePort("p", 80, "80", app_protocol=value)) is http2


def test_kubernetes_service_port_app_protocol():
    service = service_from(
        {
            "metadata": {"namespace": "demo", "name": "grpc"},
            "spec": {"ports": [{"name": "grpc", "port": 7001, "appProtocol": "grpc"}]},
        }
    )
    assert service.ports[0].app_protocol == "grpc"
