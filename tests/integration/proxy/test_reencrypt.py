"""Reencrypt routes over real TLS to real backends, and failures that explain themselves.

Seed 000 reproduced: a backend whose serving certificate expired answers the
client with 502 and the expiry time, and the log line, the span and the
`waygate_proxy_upstream_tls_failures_total` counter say the same. A wrong name
and an unknown CA likewise."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
import ssl
from collections.abc import AsyncIterator

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from tests.support.pki import LocalCA
from tests.support.proxyharness import endpoint, read_response, route, running_proxy, table
from waygate.core.tls import server_context
from waygate.proxy import records as proxy_records
from waygate.proxy.upstream_tls import UPSTREAM_TLS_FAILURES, UpstreamTLS
from waygate.resolver.model import InsecureEdgePolicy, RouteTLS, TLSTermination

SEED_000_EXPIRY = "2021-10-30T13:47:51Z"
TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


class TlsBackend:
    """A real HTTPS backend: answers every request with 200 and what it saw."""

    def __init__(self, certificate: tuple[bytes, bytes]) -> None:
        self.context = server_context(chain_pem=certificate[0], key_pem=certificate[1])
        self.requests: list[bytes] = []
        self.resumed: list[bool] = []  # per connection: was its TLS session resumed?
        self.port = 0
        self._server: asyncio.AbstractServer | None = None

    async def start(self) -> TlsBackend:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0, ssl=self.context)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.resumed.append(writer.get_extra_info("ssl_object").session_reused)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                self.requests.append(head)
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 8\r\n\r\nsecured\n")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, ssl.SSLError):
            pass
        finally:
            writer.close()

    async def stop(self) -> None:
        assert self._server is not None
        self._server.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._server.wait_closed(), 2)


def reencrypt(destination_ca: bytes, server_name: str = "") -> RouteTLS:
    return RouteTLS(
        termination=TLSTermination.REENCRYPT,
        destination_ca_certificate=destination_ca.decode(),
        destination_server_name=server_name,
        # The tests speak plain HTTP to the proxy; the TLS under test is the upstream hop.
        insecure_edge_termination_policy=InsecureEdgePolicy.ALLOW,
    )


@contextlib.asynccontextmanager
async def proxy_to(backend: TlsBackend, tls: RouteTLS, **kw: object) -> AsyncIterator[int]:
    routes = [route("secure.test", [("web", 100)], name="secure", tls=tls)]
    endpoints = [endpoint("web", backend.port)]
    async with running_proxy(table(routes, endpoints), **kw) as (server, port):
        server.upstream_tls = UpstreamTLS(lambda: None, lambda: None, server.dialer.connect)
        yield port


async def get(port: int, *, traced: bool = False) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        extra = f"traceparent: {TRACEPARENT}\r\n" if traced else ""
        writer.write(f"GET / HTTP/1.1\r\nHost: secure.test\r\n{extra}\r\n".encode())
        return await read_response(reader)
    finally:
        writer.close()


@pytest.fixture
def spans(monkeypatch: pytest.MonkeyPatch) -> InMemorySpanExporter:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(proxy_records, "tracer", lambda: provider.get_tracer("test"))
    return exporter


def failures(reason: str) -> float:
    return UPSTREAM_TLS_FAILURES.labels("demo/secure", reason)._value.get()


async def test_reencrypt_verifies_the_backend_as_service_namespace_svc_and_pools() -> None:
    ca = LocalCA()
    backend = await TlsBackend(ca.issue(dns=["web.demo.svc"])).start()
    try:
        async with proxy_to(backend, reencrypt(ca.pem)) as port:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            for _ in range(3):
                writer.write(b"GET / HTTP/1.1\r\nHost: secure.test\r\n\r\n")
                response = await read_response(reader)
                assert response.startswith(b"HTTP/1.1 200") and response.endswith(b"secured\n")
            writer.close()
        assert len(backend.requests) == 3
        assert b"X-Forwarded-Proto: http" in backend.requests[0]
    finally:
        await backend.stop()


async def test_seed_000_an_expired_backend_certificate_is_a_502_that_says_when(
    spans: InMemorySpanExporter, caplog: pytest.LogCaptureFixture
) -> None:
    old = LocalCA(lambda: dt.datetime(2021, 10, 29, 13, 47, 51, tzinfo=dt.UTC))
    backend = await TlsBackend(old.issue(dns=["web.demo.svc"])).start()
    before = failures("expired")
    reason = f"upstream certificate expired at {SEED_000_EXPIRY}"
    try:
        async with proxy_to(backend, reencrypt(old.pem)) as port:
            with caplog.at_level(logging.WARNING, logger="waygate.proxy.upstream_tls"):
                response = await get(port, traced=True)
    finally:
        await backend.stop()
    assert response.startswith(b"HTTP/1.1 502 ")
    assert f"X-Waygate-Error: {reason}\r\n".encode() in response
    assert response.endswith(reason.encode() + b"\n")
    assert failures("expired") == before + 1
    assert any(getattr(r, "reason", None) == reason for r in caplog.records)
    (span,) = spans.get_finished_spans()
    assert span.status.status_code == StatusCode.ERROR
    assert span.attributes["waygate.upstream_tls.error"] == reason
    assert span.attributes["waygate.upstream_tls.reason"] == "expired"
    assert span.attributes["http.response.status_code"] == 502
    assert not backend.requests


async def test_a_backend_certificate_for_another_name_is_a_502_naming_both() -> None:
    ca = LocalCA()
    backend = await TlsBackend(ca.issue(dns=["a.demo.svc"])).start()
    before = failures("name_mismatch")
    try:
        async with proxy_to(backend, reencrypt(ca.pem, server_name="b.demo.svc")) as port:
            response = await get(port)
    finally:
        await backend.stop()
    reason = b"upstream certificate is for a.demo.svc, not b.demo.svc"
    assert response.startswith(b"HTTP/1.1 502 ")
    assert b"X-Waygate-Error: " + reason + b"\r\n" in response
    assert failures("name_mismatch") == before + 1


async def test_a_backend_certificate_from_an_unknown_ca_is_a_502_naming_its_issuer() -> None:
    foreign = LocalCA(name="Someone Else's CA")
    backend = await TlsBackend(foreign.issue(dns=["web.demo.svc"])).start()
    before = failures("unknown_authority")
    try:
        async with proxy_to(backend, reencrypt(LocalCA().pem)) as port:
            response = await get(port)
    finally:
        await backend.stop()
    reason = b"upstream certificate signed by an unknown authority (issuer CN=Someone Else's CA)"
    assert b"X-Waygate-Error: " + reason + b"\r\n" in response
    assert failures("unknown_authority") == before + 1


async def test_a_backend_that_does_not_speak_tls_is_a_502_with_the_reason() -> None:
    async def plain(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(100)
        writer.write(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
        writer.close()

    server = await asyncio.start_server(plain, "127.0.0.1", 0)
    port_of_backend = server.sockets[0].getsockname()[1]
    routes = [route("secure.test", [("web", 100)], name="secure", tls=reencrypt(LocalCA().pem))]
    try:
        async with running_proxy(table(routes, [endpoint("web", port_of_backend)])) as (px, port):
            px.upstream_tls = UpstreamTLS(lambda: None, lambda: None, px.dialer.connect)
            response = await get(port)
    finally:
        server.close()
    assert response.startswith(b"HTTP/1.1 502 ")
    assert b"X-Waygate-Error: upstream TLS handshake failed" in response


async def test_failed_upstream_handshakes_leave_no_fd_or_task_behind() -> None:
    import os

    old = LocalCA(lambda: dt.datetime(2021, 10, 29, 13, 47, 51, tzinfo=dt.UTC))
    backend = await TlsBackend(old.issue(dns=["web.demo.svc"])).start()
    try:
        async with proxy_to(backend, reencrypt(old.pem)) as port:
            await get(port)
            await asyncio.sleep(0.2)
            fds, tasks = len(os.listdir("/proc/self/fd")), len(asyncio.all_tasks())
            for _ in range(20):
                assert (await get(port)).startswith(b"HTTP/1.1 502 ")
            async with asyncio.timeout(10):
                while len(os.listdir("/proc/self/fd")) > fds or len(asyncio.all_tasks()) > tasks:
                    await asyncio.sleep(0.05)
    finally:
        await backend.stop()


async def test_upstream_tls_sessions_are_resumed() -> None:
    """Each new upstream connection (no pooling here) resumes the last session."""
    ca = LocalCA()
    backend = await TlsBackend(ca.issue(dns=["web.demo.svc"])).start()
    try:
        async with proxy_to(backend, reencrypt(ca.pem), max_idle_per_endpoint=0) as port:
            for _ in range(3):
                assert (await get(port)).startswith(b"HTTP/1.1 200")
        assert backend.resumed == [False, True, True]
    finally:
        await backend.stop()


async def test_pooled_tls_connections_serve_only_routes_that_ask_for_the_same_tls() -> None:
    """Idle upstream connections are pooled per endpoint and per the TLS a route asks
    for: a plain route to the same endpoint never takes a TLS connection, and a
    reencrypt route naming another server name never takes one verified for the first
    name (before, both reused the first route's connection: the plain route's request
    went out encrypted, the second route's unverified for its name)."""
    ca = LocalCA()
    backend = await TlsBackend(ca.issue(dns=["web.demo.svc", "alias.test"])).start()
    routes = [
        route("secure.test", [("web", 100)], name="secure", tls=reencrypt(ca.pem)),
        route("alias.test", [("web", 100)], name="alias", tls=reencrypt(ca.pem, "alias.test")),
        route("plain.test", [("web", 100)], name="plain"),
    ]
    try:
        async with running_proxy(table(routes, [endpoint("web", backend.port)])) as (
            server,
            port,
        ):
            server.upstream_tls = UpstreamTLS(lambda: None, lambda: None, server.dialer.connect)

            async def get_host(host: str) -> bytes:
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                try:
                    writer.write(f"GET / HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
                    return await read_response(reader)
                finally:
                    writer.close()

            assert (await get_host("secure.test")).startswith(b"HTTP/1.1 200 ")
            assert (await get_host("secure.test")).startswith(b"HTTP/1.1 200 ")
            assert len(backend.resumed) == 1  # the second request reused the first connection
            assert (await get_host("alias.test")).startswith(b"HTTP/1.1 200 ")
            assert len(backend.resumed) == 2  # its own connection, verified for alias.test
            # Plain HTTP to a TLS port: a connection of its own, which the backend
            # cannot read; never the pooled TLS connection.
            plain = await get_host("plain.test")
            assert not plain.startswith(b"HTTP/1.1 200 "), plain
            assert len(backend.requests) == 3
    finally:
        await backend.stop()
