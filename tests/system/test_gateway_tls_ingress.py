"""HTTPS listeners, TLSRoute passthrough and Ingress through real resolver and proxy processes.

The same harness as the conformance cases (tests/support/gatewayapi): HTTPS
listeners terminate with their Secret's certificate chosen by SNI and serve
only there; a TLS listener in Passthrough mode hands the TLS bytes to the
TLSRoute's backend untouched (the client sees the backend's own certificate);
Ingress objects of the `waygate` class route by host and path, fall back to
their defaultBackend, serve TLS hosts with their Secret, and report the
configured address in status.loadBalancer.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
from cryptography import x509

from tests.support.gatewayapi import INFRA, Conformance, tls_client_context, tls_secret
from tests.support.pki import self_signed
from tests.support.poll import until

pytestmark = [pytest.mark.system, pytest.mark.asyncio(loop_scope="module")]

V1, V2, V3 = (f"{INFRA}/infra-backend-v{n}" for n in (1, 2, 3))


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def suite(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Conformance]:
    conformance = await Conformance(tmp_path_factory.mktemp("manifests")).start()
    try:
        yield conformance
    finally:
        await conformance.stop()


async def peer_certificate(port: int, server_name: str) -> x509.Certificate:
    _reader, writer = await asyncio.open_connection(
        "127.0.0.1", port, ssl=tls_client_context(), server_hostname=server_name
    )
    try:
        der = writer.get_extra_info("ssl_object").getpeercert(binary_form=True)
        return x509.load_der_x509_certificate(der)
    finally:
        writer.close()


def common_name(certificate: x509.Certificate) -> str:
    (attribute,) = certificate.subject.get_attributes_for_oid(x509.NameOID.COMMON_NAME)
    return str(attribute.value)


async def test_https_listener_by_sni(suite: Conformance) -> None:
    await suite.apply("httproute-https-listener.yaml")
    response = await suite.request("/", host="example.org", tls=True)
    assert response.backend == V1
    assert (await suite.request("/", host="second-example.org", tls=True)).backend == V2
    assert (await suite.request("/", host="unknown-example.org", tls=True)).status == 404
    # Only the HTTPS listener has these routes: plain HTTP does not serve them.
    assert (await suite.request("/", host="example.org")).status == 404
    # Which certificate is served: the Secret's reaches a proxy that is a route
    # reader over mTLS (route keys never go out in plaintext); the translation's
    # test checks the routes carry it.


@contextlib.asynccontextmanager
async def tls_backend(host: str) -> AsyncIterator[int]:
    """A TLS server with its own certificate for `host`, answering one fixed response."""
    cert, key = self_signed(host)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    with tempfile.TemporaryDirectory() as temp:
        (Path(temp) / "c.pem").write_text(cert)
        (Path(temp) / "k.pem").write_text(key)
        context.load_cert_chain(Path(temp) / "c.pem", Path(temp) / "k.pem")

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError, asyncio.IncompleteReadError):
            await reader.readuntil(b"\r\n\r\n")
            writer.write(
                b"HTTP/1.1 200 OK\r\nContent-Length: 11\r\nConnection: close\r\n\r\npassthrough"
            )
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0, ssl=context)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()
        await server.wait_closed()


def passthrough_manifests(port: int, listener_port: int = 443) -> str:
    return f"""apiVersion: gateway.networking.k8s.io/v1
kind: Gateway
metadata: {{name: tls-passthrough, namespace: {INFRA}}}
spec:
  gatewayClassName: waygate
  listeners:
  - name: tls
    port: {listener_port}
    protocol: TLS
    hostname: "*.passthrough.test"
    tls: {{mode: Passthrough}}
    allowedRoutes: {{namespaces: {{from: Same}}}}
---
apiVersion: v1
kind: Service
metadata: {{name: passthrough-backend, namespace: {INFRA}}}
spec: {{ports: [{{name: https, port: 443, targetPort: {port}}}]}}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: passthrough-backend-local
  namespace: {INFRA}
  labels: {{kubernetes.io/service-name: passthrough-backend}}
addressType: IPv4
ports: [{{name: https, port: {port}}}]
endpoints: [{{addresses: [127.0.0.1]}}]
---
apiVersion: gateway.networking.k8s.io/v1
kind: TLSRoute
metadata: {{name: passthrough, namespace: {INFRA}}}
spec:
  parentRefs: [{{name: tls-passthrough}}]
  hostnames: [app.passthrough.test]
  rules: [{{backendRefs: [{{name: passthrough-backend, port: 443}}]}}]
"""


async def test_tls_route_passes_tls_through_by_sni(suite: Conformance) -> None:
    async with tls_backend("app.passthrough.test") as port:
        await suite.apply(extra=passthrough_manifests(port))
        served = await peer_certificate(suite.https_port, "app.passthrough.test")
        # The backend's own certificate: the proxy did not terminate.
        assert common_name(served) == "app.passthrough.test"
        response = await suite.request("/", host="app.passthrough.test", tls=True)
        assert (response.status, response.body) == (200, b"passthrough")
        (route,) = [
            r
            for r in await suite.gateways("--kind", "TLSRoute")
            if r["metadata"]["name"] == "passthrough"
        ]
        (parent,) = route["status"]["parents"]
        assert {c["type"]: c["status"] for c in parent["conditions"]} == {
            "Accepted": "True",
            "ResolvedRefs": "True",
        }


async def test_tls_route_on_a_listener_port_of_its_own_is_relayed_there_only(
    suite: Conformance,
) -> None:
    """A TLS listener whose port --listener-ports does not map is bound as is: its
    TLSRoutes are relayed there (the backend's own certificate), not on the HTTPS port."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        own = probe.getsockname()[1]
    async with tls_backend("app.passthrough.test") as port:
        await suite.apply(extra=passthrough_manifests(port, listener_port=own))

        async def relayed() -> bool:
            try:
                served = await peer_certificate(own, "app.passthrough.test")
            except OSError:
                return False
            return common_name(served) == "app.passthrough.test"

        await until(relayed, "the TLS listener's own port to relay", timeout=20)
        # The HTTPS port terminates that name itself (no route there): not relayed.
        served = await peer_certificate(suite.https_port, "app.passthrough.test")
        assert common_name(served) != "app.passthrough.test"


INGRESS = f"""apiVersion: networking.k8s.io/v1
kind: IngressClass
metadata: {{name: waygate}}
spec: {{controller: waygate.io/ingress-controller}}
---
apiVersion: networking.k8s.io/v1
kind: Ingress
metadata: {{name: shop, namespace: {INFRA}}}
spec:
  ingressClassName: waygate
  defaultBackend: {{service: {{name: infra-backend-v3, port: {{number: 8080}}}}}}
  tls: [{{hosts: [ingress.example.com], secretName: ingress-tls}}]
  rules:
  - host: ingress.example.com
    http:
      paths:
      - {{path: /app, pathType: Prefix, backend: {{service: {{name: infra-backend-v1, port: {{number: 8080}}}}}}}}
      - {{path: /exact, pathType: Exact, backend: {{service: {{name: infra-backend-v2, port: {{number: 8080}}}}}}}}
"""


async def test_ingress_routes_hosts_paths_tls_and_reports_its_address(suite: Conformance) -> None:
    secret = tls_secret(INFRA, "ingress-tls", "ingress.example.com")
    await suite.apply(extra=INGRESS + "---\n" + secret)
    host = "ingress.example.com"
    assert (await suite.request("/app/x", host=host)).backend == V1
    assert (await suite.request("/apple", host=host)).backend == V3
    assert (await suite.request("/exact", host=host)).backend == V2
    assert (await suite.request("/exact/more", host=host)).backend == V3
    assert (await suite.request("/", host="other.example.com")).backend == V3
    assert (await suite.request("/app", host=host, tls=True)).backend == V1
    (ingress,) = await suite.gateways("--kind", "Ingress")
    assert ingress["status"] == {"loadBalancer": {"ingress": [{"ip": "127.0.0.1"}]}}
