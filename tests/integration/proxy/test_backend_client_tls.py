"""ingress-nginx's proxy-ssl-secret and backend-protocol AUTO_HTTP over real TLS.

proxy-ssl-secret (resolver: tests/unit/resolver/test_ingress_nginx_proxyssl.py): the
route's RouteTLS carries the Secret's tls.crt/tls.key (`backend_client_certificate`,
`backend_client_key`) and ca.crt (`destination_ca_certificate`). Here a backend that
REQUIRES a client certificate from a test CA gets the route's; a backend whose
certificate chains to ca.crt verifies; another CA is a 502 that says why. One client
context per (CA, certificate, key), reused by every connection and dropped with the
last route that asks for it.

AUTO_HTTP (`upstream_scheme_from_client`, nginx's `proxy_pass $scheme://`): one backend
port that answers TLS and plain connections alike (it peeks at the first byte) and
reports which scheme arrived: a client over HTTPS (HTTP/1.1 or HTTP/2) reaches it over
TLS, a plain client (HTTP/1.1 or h2c) in plain HTTP, and the pool never hands one kind
of connection to the other.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import ssl
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from tests.support.dualscheme import DualBackend
from tests.support.h2client import H2Client
from tests.support.h2harness import running_h2_proxy
from tests.support.pki import LocalCA
from tests.support.proxyharness import endpoint, read_response, route, running_proxy, table
from waygate.core.tls import server_context
from waygate.proxy.passthrough import TlsFront
from waygate.proxy.tls import DefaultCertificate, EdgeCertificates
from waygate.proxy.upstream_tls import UpstreamTLS
from waygate.resolver.model import InsecureEdgePolicy, RouteTLS, TLSTermination


class Pki:
    def __init__(self) -> None:
        self.backends = LocalCA(name="Backend CA")  # proxy-ssl-secret's ca.crt
        self.foreign = LocalCA(name="Some other CA")
        self.clients = LocalCA(name="Backend's client CA")  # the backend trusts these
        self.client = self.clients.issue(common_name="ingress-client", client_only=True)
        self.other_client = self.clients.issue(common_name="other-client", client_only=True)
        self.edge = LocalCA(name="Edge CA")


@pytest.fixture(scope="module")
def pki() -> Pki:
    return Pki()


@contextlib.contextmanager
def backend(
    pki: Pki, *, ca: LocalCA | None = None, require_client: bool = True
) -> Iterator[DualBackend]:
    """A backend serving a certificate of `ca` (the Backend CA) for web.demo.svc that
    requires a client certificate of the clients' CA."""
    cert, key = (ca or pki.backends).issue(dns=["web.demo.svc"])
    context = server_context(
        chain_pem=cert,
        key_pem=key,
        client_ca_pem=pki.clients.pem if require_client else None,
        client_auth="required" if require_client else "none",
    )
    with DualBackend(context) as started:
        yield started


def reencrypt(pki: Pki, client: tuple[bytes, bytes] | None, **kw: object) -> RouteTLS:
    return RouteTLS(
        termination=TLSTermination.REENCRYPT,
        destination_ca_certificate=pki.backends.pem.decode(),
        insecure_edge_termination_policy=InsecureEdgePolicy.ALLOW,
        backend_client_certificate=client[0].decode() if client else "",
        backend_client_key=client[1].decode() if client else "",
        **kw,  # type: ignore[arg-type]
    )


@contextlib.asynccontextmanager
async def plain_proxy(port: int, tls: RouteTLS) -> AsyncIterator[tuple[int, UpstreamTLS]]:
    routes = [route("secure.test", [("web", 100)], name="secure", tls=tls)]
    async with running_proxy(table(routes, [endpoint("web", port)])) as (server, proxy_port):
        upstream_tls = UpstreamTLS(lambda: None, lambda: None, server.dialer.connect)
        server.upstream_tls = upstream_tls
        yield proxy_port, upstream_tls


async def get(port: int, host: str = "secure.test") -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(f"GET / HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
        return await read_response(reader, timeout=10)
    finally:
        writer.close()


def answer(response: bytes) -> dict[str, str]:
    assert response.startswith(b"HTTP/1.1 200"), response
    return json.loads(response.split(b"\r\n\r\n", 1)[1])  # type: ignore[no-any-return]


# ---------------------------------------------------------------- proxy-ssl-secret


async def test_a_backend_requiring_a_client_certificate_gets_the_routes_own(pki: Pki) -> None:
    with backend(pki) as up:
        async with plain_proxy(up.port, reencrypt(pki, pki.client)) as (port, _):
            assert answer(await get(port)) == {"scheme": "https", "client": "ingress-client"}
        # Without the route's certificate the same backend refuses the handshake: the
        # certificate above is what let it through.
        async with plain_proxy(up.port, reencrypt(pki, None)) as (port, _):
            response = await get(port)
        assert response.startswith(b"HTTP/1.1 502"), response
        assert b"x-waygate-error: upstream" in response.lower()


async def test_a_withheld_key_is_a_502_that_says_so_never_a_handshake_without_it(
    pki: Pki,
) -> None:
    # A proxy that is not a route reader gets the certificate without its key
    # (convert's with_key): it must not try the backend without the certificate.
    with backend(pki, require_client=False) as up:
        tls = dataclasses.replace(reencrypt(pki, pki.client), backend_client_key="")
        async with plain_proxy(up.port, tls) as (port, _):
            response = await get(port)
    assert response.startswith(b"HTTP/1.1 502"), response
    assert b"backend client key is withheld from this proxy" in response
    assert up.connections == []


async def test_the_backend_is_verified_against_ca_crt_and_another_ca_is_a_502(pki: Pki) -> None:
    # Chains to ca.crt (the route's destination CA): verified, 200.
    with backend(pki) as up:
        async with plain_proxy(up.port, reencrypt(pki, pki.client)) as (port, _):
            assert answer(await get(port))["scheme"] == "https"
    # A backend certificate from a CA that is not ca.crt: 502 naming the issuer.
    with backend(pki, ca=pki.foreign) as up:
        async with plain_proxy(up.port, reencrypt(pki, pki.client)) as (port, _):
            response = await get(port)
    assert response.startswith(b"HTTP/1.1 502"), response
    assert b"upstream certificate signed by an unknown authority" in response
    assert b"Some other CA" in response
    assert up.connections == []  # nothing of the request was sent to it


async def test_one_context_per_certificate_key_and_ca_reused_then_dropped(pki: Pki) -> None:
    with backend(pki) as up:
        tls = reencrypt(pki, pki.client)
        async with plain_proxy(up.port, tls) as (port, upstream_tls):
            for _ in range(3):  # three client connections, three upstream connections
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.write(b"GET / HTTP/1.1\r\nHost: secure.test\r\nConnection: close\r\n\r\n")
                assert answer(await read_response(reader, timeout=10))["client"]
                writer.close()
            assert len(upstream_tls._contexts) == 1
            # Another client certificate (a rotated Secret): its own context; the view
            # without the old one lets the old context (and its key) go.
            rotated = reencrypt(pki, pki.other_client)
            other = route("secure.test", [("web", 100)], name="secure", tls=rotated)
            context = upstream_tls.context(other)
            assert context is not upstream_tls.context(route("x", [], name="x", tls=tls))
            upstream_tls.keep_only([other])
            assert list(upstream_tls._contexts.values()) == [context]


# ---------------------------------------------------------------- AUTO_HTTP


@contextlib.asynccontextmanager
async def auto_front(
    pki: Pki, tmp_path: Path, backend_port: int, **route_fields: object
) -> AsyncIterator[tuple[int, int]]:
    """The proxy's plain port and an HTTPS listener, one AUTO_HTTP route to the
    backend (its certificate for auto.test served at the edge; `route_fields` more)."""
    edge_cert, edge_key = pki.edge.issue(dns=["auto.test"])
    tls = dataclasses.replace(
        reencrypt(pki, pki.client), certificate=edge_cert.decode(), key=edge_key.decode()
    )
    routes = [
        route(
            "auto.test",
            [("web", 100)],
            name="auto",
            tls=tls,
            upstream_scheme_from_client=True,
            **route_fields,  # type: ignore[arg-type]
        )
    ]
    files = pki.edge.write_files(tmp_path / "default", dns=["default.test"], prefix="d-")
    certificates = EdgeCertificates(DefaultCertificate.from_files(files.cert, files.key))
    certificates.update(routes)
    async with running_h2_proxy(table(routes, [endpoint("web", backend_port)])) as (
        server,
        plain_port,
    ):
        server.upstream_tls = UpstreamTLS(lambda: None, lambda: None, server.dialer.connect)
        front = TlsFront(server, certificates, "127.0.0.1", 0)
        await front.start()
        try:
            yield plain_port, front.bound_port
        finally:
            await front.drain(1.0)


def client_tls(pki: Pki, alpn: str) -> ssl.SSLContext:
    context = ssl.create_default_context(cadata=pki.edge.pem.decode())
    context.set_alpn_protocols([alpn])
    return context


async def https_get(port: int, context: ssl.SSLContext) -> bytes:
    reader, writer = await asyncio.open_connection(
        "127.0.0.1", port, ssl=context, server_hostname="auto.test"
    )
    try:
        writer.write(b"GET / HTTP/1.1\r\nHost: auto.test\r\n\r\n")
        return await read_response(reader, timeout=10)
    finally:
        writer.close()


async def test_auto_http_follows_the_clients_scheme_and_never_mixes_connections(
    pki: Pki, tmp_path: Path
) -> None:
    with backend(pki) as up:
        async with auto_front(pki, tmp_path, up.port) as (plain, secure):
            tls_answer = answer(await https_get(secure, client_tls(pki, "http/1.1")))
            assert tls_answer == {"scheme": "https", "client": "ingress-client"}
            plain_answer = answer(await get(plain, "auto.test"))
            assert plain_answer == {"scheme": "http", "client": ""}
            # Pooled apart: the next of each kind reuses its own connection.
            assert answer(await https_get(secure, client_tls(pki, "http/1.1")))["scheme"] == "https"
            assert answer(await get(plain, "auto.test"))["scheme"] == "http"
            assert sorted(up.connections) == ["http", "https"]


async def test_auto_http_for_http2_clients(pki: Pki, tmp_path: Path) -> None:
    with backend(pki) as up:
        async with auto_front(pki, tmp_path, up.port) as (plain, secure):
            h2 = await H2Client.connect(
                secure, tls=client_tls(pki, "h2"), server_hostname="auto.test"
            )
            try:
                response = await h2.request("GET", "/", "auto.test")
            finally:
                await h2.close()
            assert response.status == 200
            assert json.loads(response.body)["scheme"] == "https"
            h2c = await H2Client.connect(plain)
            try:
                response = await h2c.request("GET", "/", "auto.test")
            finally:
                await h2c.close()
            assert response.status == 200
            assert json.loads(response.body) == {"scheme": "http", "client": ""}


async def test_auto_http_with_proxy_http_version_1_0_for_every_client(
    pki: Pki, tmp_path: Path
) -> None:
    # AUTO_HTTP and proxy-http-version 1.0 on one route: the scheme still follows the
    # client's (the route's client certificate only over TLS), the request is
    # HTTP/1.0 with Connection: close, and no connection carries a second request
    # (the backend would keep each open).
    with backend(pki) as up:
        async with auto_front(pki, tmp_path, up.port, upstream_http10=True) as (plain, secure):
            schemes = []
            for _ in range(2):
                schemes.append(answer(await https_get(secure, client_tls(pki, "http/1.1"))))
                schemes.append(answer(await get(plain, "auto.test")))
                for port, tls in ((secure, client_tls(pki, "h2")), (plain, None)):
                    h2 = await H2Client.connect(port, tls=tls, server_hostname="auto.test")
                    try:
                        response = await h2.request("GET", "/", "auto.test")
                    finally:
                        await h2.close()
                    assert response.status == 200
                    schemes.append(json.loads(response.body))
            tls_answer = {"scheme": "https", "client": "ingress-client"}
            plain_answer = {"scheme": "http", "client": ""}
            assert schemes == [tls_answer, plain_answer] * 4
            assert up.connections == ["https", "http"] * 4  # one per request
            for head in up.heads:
                line, *fields = head.split(b"\r\n")
                assert line == b"GET / HTTP/1.0", line
                assert b"Connection: close" in fields, fields
