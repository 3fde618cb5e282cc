"""GRPCRoute through the proxy: a route from manifests (the one translation) matches
/SERVICE/METHOD and reaches a real grpcio backend over HTTP/2; another service is not
routed (the Gateway listener's miss, as a gRPC status)."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from tests.support.h2harness import GrpcBackend, running_h2_proxy, serve_h2_upstreams
from waygate.proxy.routing import Defaults, build_table
from waygate.resolver.manifests import parse_manifests

MANIFESTS = """apiVersion: gateway.networking.k8s.io/v1
kind: GatewayClass
metadata: {{name: waygate}}
spec: {{controllerName: waygate.io/gateway-controller}}
---
apiVersion: gateway.networking.k8s.io/v1
kind: Gateway
metadata: {{name: gw, namespace: apps}}
spec:
  gatewayClassName: waygate
  listeners: [{{name: http, port: 80, protocol: HTTP}}]
---
apiVersion: v1
kind: Service
metadata: {{name: echo, namespace: apps}}
spec: {{ports: [{{name: grpc, port: 50051, targetPort: {port}, appProtocol: kubernetes.io/h2c}}]}}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: echo-1
  namespace: apps
  labels: {{kubernetes.io/service-name: echo}}
addressType: IPv4
ports: [{{name: grpc, port: {port}}}]
endpoints: [{{addresses: [127.0.0.1]}}]
---
apiVersion: gateway.networking.k8s.io/v1
kind: GRPCRoute
metadata: {{name: echo, namespace: apps}}
spec:
  parentRefs: [{{name: gw}}]
  hostnames: [grpc.example.com]
  rules:
  - matches: [{{method: {{service: test.Echo, method: Unary}}}}]
    backendRefs: [{{name: echo, port: 50051}}]
"""


@pytest.fixture
async def backend():
    server = await GrpcBackend().start()
    yield server
    await server.stop()


async def test_grpc_route_reaches_its_method_and_nothing_else(backend: GrpcBackend) -> None:
    content = parse_manifests([(Path("m.yaml"), MANIFESTS.format(port=backend.port))])
    routes = {r.key: r for r in content.routes}
    endpoints: dict = {}
    for endpoint in content.endpoints:
        endpoints[endpoint.service_key] = (*endpoints.get(endpoint.service_key, ()), endpoint)
    services = {s.key: s for s in content.services}
    table = build_table(routes, endpoints, services, defaults=Defaults(), cookie_key=b"k" * 32)
    async with running_h2_proxy(table) as (server, port):
        serve_h2_upstreams(server, list(routes.values()))
        options = [("grpc.default_authority", "grpc.example.com")]
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=options) as channel:
            reply = await channel.unary_unary("/test.Echo/Unary")(b"hi", timeout=10)
            assert reply == b"hi|127.0.0.1"
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await channel.unary_unary("/test.Echo/Fail")(b"5", timeout=10)
            # Not this route's method: the listener's 404, as gRPC's table maps it.
            assert caught.value.code() == grpc.StatusCode.UNIMPLEMENTED
            assert "no route for host grpc.example.com" in (caught.value.details() or "")
    assert backend.calls == 1
