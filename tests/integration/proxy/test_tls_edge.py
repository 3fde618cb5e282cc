"""The proxy's HTTPS listener over real sockets and real TLS: SNI selection among route
certificates (exact, wildcard, default), refused route certificates, the insecure
edge policies on the HTTP port, HSTS, and certificates swapped during a request loop."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import ssl
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from cryptography import x509

from tests.support.pki import LocalCA
from tests.support.proxyharness import (
    RecordingUpstream,
    endpoint,
    read_response,
    request,
    route,
    running_proxy,
    table,
)
from waygate.proxy.passthrough import TlsFront
from waygate.proxy.tls import ROUTE_CERT_REFUSED, DefaultCertificate, EdgeCertificates
from waygate.resolver.model import HSTS, InsecureEdgePolicy, RouteTLS, TLSTermination


def edge(
    certificate: tuple[bytes, bytes] | None = None,
    policy: InsecureEdgePolicy = InsecureEdgePolicy.NONE,
    hsts: HSTS | None = None,
) -> RouteTLS:
    cert, key = certificate if certificate else (b"", b"")
    return RouteTLS(
        termination=TLSTermination.EDGE,
        certificate=cert.decode(),
        key=key.decode(),
        insecure_edge_termination_policy=policy,
        hsts=hsts,
    )


@contextlib.asynccontextmanager
async def https_proxy(
    tmp_path: Path, routes: list, upstream: RecordingUpstream, ca: LocalCA
) -> AsyncIterator[tuple[object, int, int, EdgeCertificates, DefaultCertificate]]:
    files = ca.write_files(tmp_path / "default", dns=["proxy.waygate.local"], prefix="default-")
    default = DefaultCertificate.from_files(files.cert, files.key)
    certificates = EdgeCertificates(default)
    certificates.update(routes)
    endpoints = [endpoint("web", upstream.port)]
    async with running_proxy(table(routes, endpoints)) as (server, http_port):
        front = TlsFront(server, certificates, "127.0.0.1", 0)
        await front.start()
        try:
            yield server, http_port, front.bound_port, certificates, default
        finally:
            await front.drain(1.0)


def client_context(ca: LocalCA) -> ssl.SSLContext:
    context = ssl.create_default_context(cadata=ca.pem.decode())
    context.set_alpn_protocols(["http/1.1"])
    return context


async def presented(port: int, server_name: str | None, ca: LocalCA) -> x509.Certificate:
    context = client_context(ca)
    context.check_hostname = False
    _, writer = await asyncio.open_connection(
        "127.0.0.1", port, ssl=context, server_hostname=server_name
    )
    try:
        der = writer.get_extra_info("ssl_object").getpeercert(binary_form=True)
        assert writer.get_extra_info("ssl_object").selected_alpn_protocol() == "http/1.1"
        return x509.load_der_x509_certificate(der)
    finally:
        writer.close()
        with contextlib.suppress(Exception):
            await writer.wait_closed()


def names(certificate: x509.Certificate) -> list[str]:
    sans = certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return list(sans.get_values_for_type(x509.DNSName))


async def https_get(port: int, host: str, ca: LocalCA, path: str = "/") -> bytes:
    """GET over HTTPS; the name is verified only where the host has a route certificate."""
    context = client_context(ca)
    context.check_hostname = host.startswith(("a.", "b."))
    reader, writer = await asyncio.open_connection(
        "127.0.0.1", port, ssl=context, server_hostname=host
    )
    try:
        writer.write(f"GET {path} HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
        return await read_response(reader)
    finally:
        writer.close()
        with contextlib.suppress(Exception):
            await writer.wait_closed()


@pytest.fixture
async def upstream() -> AsyncIterator[RecordingUpstream]:
    up = await RecordingUpstream().start()
    yield up
    await up.stop()


async def test_sni_picks_exact_then_wildcard_then_default(
    tmp_path: Path, upstream: RecordingUpstream
) -> None:
    ca = LocalCA()
    routes = [
        route(
            "a.example.test", [("web", 100)], name="a", tls=edge(ca.issue(dns=["a.example.test"]))
        ),
        route(
            "b.example.test", [("web", 100)], name="b", tls=edge(ca.issue(dns=["b.example.test"]))
        ),
        route("*.wild.test", [("web", 100)], name="wild", tls=edge(ca.issue(dns=["*.wild.test"]))),
        # An exact host under the wildcard's domain wins over the wildcard.
        route("x.wild.test", [("web", 100)], name="x", tls=edge(ca.issue(dns=["x.wild.test"]))),
    ]
    async with https_proxy(tmp_path, routes, upstream, ca) as (_, _, port, _, _):
        assert names(await presented(port, "a.example.test", ca)) == ["a.example.test"]
        assert names(await presented(port, "B.Example.Test", ca)) == ["b.example.test"]
        assert names(await presented(port, "y.wild.test", ca)) == ["*.wild.test"]
        assert names(await presented(port, "x.wild.test", ca)) == ["x.wild.test"]
        # A wildcard covers one label only; unknown names and no SNI get the default.
        assert names(await presented(port, "a.b.wild.test", ca)) == ["proxy.waygate.local"]
        assert names(await presented(port, "unknown.test", ca)) == ["proxy.waygate.local"]
        assert names(await presented(port, None, ca)) == ["proxy.waygate.local"]
        # And the request is proxied, marked as HTTPS for the backend.
        response = await https_get(port, "a.example.test", ca)
        assert response.startswith(b"HTTP/1.1 200")
        assert b"X-Forwarded-Proto: https" in bytes(upstream.received)
        assert f"X-Forwarded-Port: {port}".encode() in bytes(upstream.received)


async def test_a_route_certificate_that_is_expired_or_for_another_host_is_refused(
    tmp_path: Path, upstream: RecordingUpstream
) -> None:
    ca = LocalCA()
    old = LocalCA(lambda: dt.datetime(2021, 10, 29, 13, 47, 51, tzinfo=dt.UTC))
    old_cert = old.issue(dns=["old.example.test"])
    refused_before = {
        kind: ROUTE_CERT_REFUSED.labels("demo/" + name, kind)._value.get()
        for name, kind in (("old", "expired"), ("other", "host_mismatch"))
    }
    routes = [
        route("old.example.test", [("web", 100)], name="old", tls=edge(old_cert)),
        route(
            "other.example.test",
            [("web", 100)],
            name="other",
            tls=edge(ca.issue(dns=["not-other.example.test"])),
        ),
    ]
    async with https_proxy(tmp_path, routes, upstream, ca) as (_, _, port, _, _):
        assert names(await presented(port, "old.example.test", ca)) == ["proxy.waygate.local"]
        assert names(await presented(port, "other.example.test", ca)) == ["proxy.waygate.local"]
    assert ROUTE_CERT_REFUSED.labels("demo/old", "expired")._value.get() == (
        refused_before["expired"] + 1
    )
    assert ROUTE_CERT_REFUSED.labels("demo/other", "host_mismatch")._value.get() == (
        refused_before["host_mismatch"] + 1
    )


async def test_insecure_edge_policies_on_the_http_port_and_hsts_on_https(
    tmp_path: Path, upstream: RecordingUpstream
) -> None:
    ca = LocalCA()
    routes = [
        route(
            "redirect.test",
            [("web", 100)],
            name="redirect",
            tls=edge(
                policy=InsecureEdgePolicy.REDIRECT,
                hsts=HSTS(max_age=31536000, include_subdomains=True),
            ),
        ),
        route(
            "allow.test", [("web", 100)], name="allow", tls=edge(policy=InsecureEdgePolicy.ALLOW)
        ),
        route("none.test", [("web", 100)], name="none", tls=edge()),
    ]
    async with https_proxy(tmp_path, routes, upstream, ca) as (_, http_port, https_port, _, _):
        response, _, writer = await request(
            http_port, b"GET /a?b=c HTTP/1.1\r\nHost: redirect.test\r\n\r\n"
        )
        writer.close()
        assert response.startswith(b"HTTP/1.1 302 Found\r\n")
        assert f"Location: https://redirect.test:{https_port}/a?b=c\r\n".encode() in response
        response, _, writer = await request(
            http_port, b"GET / HTTP/1.1\r\nHost: allow.test\r\n\r\n"
        )
        writer.close()
        assert response.startswith(b"HTTP/1.1 200")
        assert b"Strict-Transport-Security" not in response
        response, _, writer = await request(http_port, b"GET / HTTP/1.1\r\nHost: none.test\r\n\r\n")
        writer.close()
        assert response.startswith(b"HTTP/1.1 503")
        assert b"X-Waygate-Error: route demo/none is served on HTTPS only" in response
        assert upstream.received.count(b"GET ") == 1  # only the Allow request went upstream
        response = await https_get(https_port, "redirect.test", ca)
        assert response.startswith(b"HTTP/1.1 200")
        assert b"Strict-Transport-Security: max-age=31536000; includeSubDomains\r\n" in response


async def test_route_and_default_certificates_replaced_during_a_request_loop(
    tmp_path: Path, upstream: RecordingUpstream
) -> None:
    """Zero failed requests while route certificates and the default are swapped."""
    ca = LocalCA()
    routes = [
        route(
            "a.example.test", [("web", 100)], name="a", tls=edge(ca.issue(dns=["a.example.test"]))
        ),
        route("d.example.test", [("web", 100)], name="d", tls=edge()),  # the default's
    ]
    async with https_proxy(tmp_path, routes, upstream, ca) as (
        server,
        _,
        port,
        certificates,
        default,
    ):
        stop = asyncio.Event()
        results: list[bytes] = []
        seen_serials: set[int] = set()

        async def loop(host: str) -> None:
            while not stop.is_set():
                results.append((await https_get(port, host, ca))[:12])
                seen_serials.add((await presented(port, host, ca)).serial_number)

        loops = [asyncio.ensure_future(loop(h)) for h in ("a.example.test", "d.example.test")]
        try:
            for _ in range(4):
                await asyncio.sleep(0.2)
                routes[0] = route(
                    "a.example.test",
                    [("web", 100)],
                    name="a",
                    tls=edge(ca.issue(dns=["a.example.test"])),
                )
                certificates.update(routes)
                # The default certificate's files rewritten: picked up by the watcher's load.
                ca.write_files(tmp_path / "default", dns=["proxy.waygate.local"], prefix="default-")
                default.check_files()  # what the file watcher runs every FILE_POLL seconds
            await asyncio.sleep(0.2)
        finally:
            stop.set()
            await asyncio.wait_for(asyncio.gather(*loops), 20)
        assert results and all(r == b"HTTP/1.1 200" for r in results), set(results)
        # Both hosts saw several certificates: the swaps took effect.
        assert len(seen_serials) >= 6
        assert server.https_port == port


async def test_the_proxys_own_certificate_renewed_during_a_request_loop(
    upstream: RecordingUpstream,
) -> None:
    """The default certificate from the rotation client (certs' path): renewals
    are served from the next handshake on, with zero failed requests."""
    from waygate.core.rotation import CertificateRotator

    ca = LocalCA()
    rotator = CertificateRotator(
        ca, "spiffe://waygate.local/ns/local/sa/proxy", ("dns:proxy.waygate.local",)
    )
    await rotator.obtain()
    default = DefaultCertificate.from_rotator(rotator)
    certificates = EdgeCertificates(default)
    routes = [route("d.example.test", [("web", 100)], name="d", tls=edge())]
    certificates.update(routes)
    async with running_proxy(table(routes, [endpoint("web", upstream.port)])) as (server, _):
        front = TlsFront(server, certificates, "127.0.0.1", 0)
        await front.start()
        stop = asyncio.Event()
        results: list[bytes] = []
        serials: set[int] = set()

        async def loop() -> None:
            while not stop.is_set():
                results.append((await https_get(front.bound_port, "d.example.test", ca))[:12])
                serials.add((await presented(front.bound_port, "d.example.test", ca)).serial_number)

        running = asyncio.ensure_future(loop())
        try:
            for _ in range(3):
                await asyncio.sleep(0.2)
                await rotator.renew_once()
            await asyncio.sleep(0.2)
        finally:
            stop.set()
            await asyncio.wait_for(running, 20)
            await front.drain(1.0)
            default.close()
    assert results and all(r == b"HTTP/1.1 200" for r in results), set(results)
    assert len(serials) >= 3


async def test_a_route_key_goes_with_its_route(tmp_path: Path, upstream: RecordingUpstream) -> None:
    """Route keys live only in the SNI map's contexts: a removed route leaves none behind."""
    ca = LocalCA()
    routes = [
        route(
            "a.example.test", [("web", 100)], name="a", tls=edge(ca.issue(dns=["a.example.test"]))
        )
    ]
    async with https_proxy(tmp_path, routes, upstream, ca) as (_, _, port, certificates, _):
        assert names(await presented(port, "a.example.test", ca)) == ["a.example.test"]
        certificates.update([])
        assert not certificates.sni.cache and not certificates.sni.exact
        assert names(await presented(port, "a.example.test", ca)) == ["proxy.waygate.local"]


def test_route_certificate_expiry_is_exported_and_warned_under_a_fifth_of_its_life(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from waygate.proxy.tls import ROUTE_CERT_EXPIRY

    ca = LocalCA()  # leaves live 24 h from now
    files = ca.write_files(tmp_path, dns=["proxy.waygate.local"])
    cert = ca.issue(dns=["late.example.test"])
    leaf = x509.load_pem_x509_certificate(cert[0])
    late = leaf.not_valid_before_utc + (leaf.not_valid_after_utc - leaf.not_valid_before_utc) * 0.9
    certificates = EdgeCertificates(
        DefaultCertificate.from_files(files.cert, files.key), now=lambda: late
    )
    with caplog.at_level("WARNING", logger="waygate.proxy.tls"):
        certificates.update(
            [route("late.example.test", [("web", 100)], name="late", tls=edge(cert))]
        )
    warned = [r for r in caplog.records if "under 20%" in r.getMessage()]
    certificates.update([route("late.example.test", [("web", 100)], name="late", tls=edge(cert))])
    assert len([r for r in caplog.records if "under 20%" in r.getMessage()]) == len(warned) == 1
    gauge = ROUTE_CERT_EXPIRY.labels("demo/late", "late.example.test")._value.get()
    assert gauge == leaf.not_valid_after_utc.timestamp()
    assert any(
        r.getMessage() == "route certificate has under 20% of its life left" for r in caplog.records
    )
    certificates.update([])  # the route gone: its series too
    assert ("demo/late", "late.example.test") not in {
        tuple(s.labels.values()) for m in ROUTE_CERT_EXPIRY.collect() for s in m.samples
    }
