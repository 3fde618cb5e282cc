"""GRPCRoute end to end: the conformance suite's GRPCRoute manifests (v1.6.1, unchanged)
through real resolver and proxy processes to real grpcio backends over h2c.

The suite's grpc-infra-backend-v1/v2 Services point at two grpcio servers that
answer `gateway_api_conformance.echo_basic.grpcecho.GrpcEcho` with their own
name, so a test can tell which backend served a call, as the suite's echo does.
Asserted as the suite asserts: the method (and header) matches pick the
backend; a call no rule takes is UNIMPLEMENTED (the listener's 404).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
import pytest_asyncio

from tests.support.gatewayapi import INFRA, Conformance, endpoint_slices

pytestmark = [pytest.mark.system, pytest.mark.asyncio(loop_scope="module")]

SERVICE = "gateway_api_conformance.echo_basic.grpcecho.GrpcEcho"
V1, V2 = "grpc-infra-backend-v1", "grpc-infra-backend-v2"


class EchoServer:
    """A grpcio server answering GrpcEcho's Echo, EchoTwo and EchoThree with its name."""

    def __init__(self, name: str, certificate: tuple[bytes, bytes] | None = None) -> None:
        self.name = name
        self.certificate = certificate  # (PEM chain, key): serve TLS (ALPN h2)
        self.server: Any = None
        self.port = 0

    async def start(self) -> EchoServer:
        async def answer(request: bytes, context: Any) -> bytes:
            return self.name.encode()

        handler = grpc.unary_unary_rpc_method_handler(answer)
        self.server = grpc.aio.server()
        self.server.add_generic_rpc_handlers(
            (
                grpc.method_handlers_generic_handler(
                    SERVICE, {"Echo": handler, "EchoTwo": handler, "EchoThree": handler}
                ),
            )
        )
        if self.certificate is None:
            self.port = self.server.add_insecure_port("127.0.0.1:0")
        else:
            chain, key = self.certificate
            credentials = grpc.ssl_server_credentials([(key, chain)])
            self.port = self.server.add_secure_port("127.0.0.1:0", credentials)
        await self.server.start()
        return self

    async def stop(self) -> None:
        await self.server.stop(None)


class Suite:
    def __init__(self, conformance: Conformance) -> None:
        self.conformance = conformance

    async def call(
        self, method: str, metadata: dict[str, str] | None = None, authority: str = ""
    ) -> str:
        """The name of the backend that answered, or the status code's name (with its
        details when `authority` is given)."""
        address = f"127.0.0.1:{self.conformance.port}"
        options = [("grpc.default_authority", authority)] if authority else []
        async with grpc.aio.insecure_channel(address, options=options) as channel:
            try:
                reply = await channel.unary_unary(f"/{SERVICE}/{method}")(
                    b"", metadata=tuple((metadata or {}).items()), timeout=10
                )
            except grpc.aio.AioRpcError as exc:
                if authority:
                    return f"{exc.code().name}: {exc.details()}"
                return str(exc.code().name)
        return bytes(reply).decode()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def suite(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Suite]:
    servers = [await EchoServer(V1).start(), await EchoServer(V2).start()]
    conformance = await Conformance(tmp_path_factory.mktemp("manifests")).start()
    try:
        # The grpc-infra-backend Services' endpoints: the grpcio servers.
        ports = {key: up.port for key, up in conformance.backends.items()}
        for server in servers:
            ports[(INFRA, server.name)] = server.port
        (conformance.directory / "02-backends.yaml").write_text(endpoint_slices(ports))
        yield Suite(conformance)
    finally:
        await conformance.stop()
        for server in servers:
            await server.stop()


async def test_exact_method_matching(suite: Suite) -> None:
    await suite.conformance.apply("grpcroute-exact-method-matching.yaml")
    assert await suite.call("Echo") == V1
    assert await suite.call("EchoTwo") == V2
    assert await suite.call("EchoThree") == "UNIMPLEMENTED"
    (route,) = [
        i
        for i in await suite.conformance.gateways("--kind", "GRPCRoute")
        if i["metadata"]["name"] == "exact-matching"
    ]
    (parent,) = route["status"]["parents"]
    assert {c["type"]: c["status"] for c in parent["conditions"]} == {
        "Accepted": "True",
        "ResolvedRefs": "True",
    }


@pytest.mark.parametrize(
    ("metadata", "expected"),
    [
        ({"version": "one"}, V1),
        ({"version": "two"}, V2),
        ({"version": "two", "color": "orange"}, V1),
        ({"version": "two", "color": "blue"}, V2),
        ({"color": "orange"}, "UNIMPLEMENTED"),
        ({"some-other-header": "one"}, "UNIMPLEMENTED"),
        ({"color": "blue"}, V1),
        ({"color": "green"}, V1),
        ({"color": "red"}, V2),
        ({"color": "yellow"}, V2),
    ],
)
async def test_header_matching(suite: Suite, metadata: dict[str, str], expected: str) -> None:
    if suite.conformance.applied < 2:
        await suite.conformance.apply("grpcroute-header-matching.yaml")
    assert await suite.call("Echo", metadata) == expected


TLS_ROUTE = f"""apiVersion: v1
kind: Service
metadata: {{name: grpc-tls, namespace: {INFRA}}}
spec: {{ports: [{{name: grpcs, port: 443, targetPort: 8443, appProtocol: kubernetes.io/h2c}}]}}
---
apiVersion: gateway.networking.k8s.io/v1
kind: GRPCRoute
metadata: {{name: grpc-tls, namespace: {INFRA}}}
spec:
  parentRefs: [{{name: same-namespace}}]
  hostnames: [grpc-tls.example.com]
  rules: [{{backendRefs: [{{name: grpc-tls, port: 443}}]}}]
---
apiVersion: gateway.networking.k8s.io/v1
kind: BackendTLSPolicy
metadata: {{name: grpc-tls, namespace: {INFRA}}}
spec:
  targetRefs: [{{group: "", kind: Service, name: grpc-tls, sectionName: grpcs}}]
  validation:
    caCertificateRefs: [{{group: "", kind: ConfigMap, name: grpc-ca}}]
    hostname: {{hostname}}
"""


async def test_backend_tls_policy_reencrypts_grpc_over_h2(suite: Suite) -> None:
    """A GRPCRoute whose Service has a BackendTLSPolicy: h2c in, TLS with ALPN h2 out,
    verified against the ConfigMap's CA for the policy's hostname."""
    import yaml

    from tests.support.pki import LocalCA

    ca = LocalCA()
    server = await EchoServer("grpc-tls", ca.issue(dns=["abc.example.com"])).start()
    try:
        extras = [
            TLS_ROUTE.replace("{hostname}", "abc.example.com"),
            yaml.safe_dump(
                {
                    "apiVersion": "v1",
                    "kind": "ConfigMap",
                    "metadata": {"name": "grpc-ca", "namespace": INFRA},
                    "data": {"ca.crt": ca.pem.decode()},
                }
            ),
            yaml.safe_dump(
                {
                    "apiVersion": "discovery.k8s.io/v1",
                    "kind": "EndpointSlice",
                    "metadata": {
                        "name": "grpc-tls-local",
                        "namespace": INFRA,
                        "labels": {"kubernetes.io/service-name": "grpc-tls"},
                    },
                    "addressType": "IPv4",
                    "ports": [{"name": "grpcs", "port": server.port, "protocol": "TCP"}],
                    "endpoints": [{"addresses": ["127.0.0.1"]}],
                }
            ),
        ]
        await suite.conformance.apply(extra="\n---\n".join(extras))
        assert await suite.call("Echo", authority="grpc-tls.example.com") == "grpc-tls"
        # The same backend named for another host: refused, and the reason says why.
        extras[0] = TLS_ROUTE.replace("{hostname}", "other.example.com")
        await suite.conformance.apply(extra="\n---\n".join(extras))
        answer = await suite.call("Echo", authority="grpc-tls.example.com")
        assert answer.startswith("UNAVAILABLE") and "not other.example.com" in answer, answer
    finally:
        await server.stop()
