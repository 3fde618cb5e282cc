"""TLS session resumption on the HTTPS listener, and what a resumed session may do.

A session verified for one auth-proxy route must not carry its client certificate
to another route's host (SNI B) on resumption: the contexts share the listener's
session cache, so the identity is re-verified against the route's own CA."""

from __future__ import annotations

import asyncio
import socket
import ssl
from pathlib import Path

import pytest

from tests.integration.proxy.test_tls_client_cert import client_ca_route
from tests.integration.proxy.test_tls_edge import https_proxy
from tests.support.pki import LocalCA
from tests.support.proxyharness import RecordingUpstream
from waygate.proxy import tls as waygate_tls


def _client(
    ca: LocalCA, tmp_path: Path, client: LocalCA, version: ssl.TLSVersion
) -> ssl.SSLContext:
    context = ssl.create_default_context(cadata=ca.pem.decode())
    context.check_hostname = False
    context.maximum_version = version
    cert, key = client.issue(uris=["spiffe://waygate.local/ns/team/sa/alice"])
    path = tmp_path / "client.pem"
    path.write_bytes(cert + key)
    context.load_cert_chain(path)
    return context


def _get(
    port: int, context: ssl.SSLContext, server_name: str, host: str, session: ssl.SSLSession | None
) -> tuple[bytes, ssl.SSLSession | None, bool]:
    with (
        socket.create_connection(("127.0.0.1", port), timeout=5) as raw,
        context.wrap_socket(raw, server_hostname=server_name, session=session) as tls,
    ):
        tls.sendall(f"GET / HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
        data = b""
        while chunk := tls.recv(65536):
            data += chunk
        return data, tls.session, tls.session_reused


@pytest.fixture
async def upstream():
    up = await RecordingUpstream().start()
    yield up
    await up.stop()


@pytest.mark.parametrize("version", [ssl.TLSVersion.TLSv1_2, ssl.TLSVersion.TLSv1_3])
async def test_resumed_session_does_not_carry_a_client_certificate_to_another_route(
    tmp_path: Path, upstream: RecordingUpstream, version: ssl.TLSVersion
) -> None:
    ca, client_ca = LocalCA(), LocalCA(name="Front proxy clients")
    routes = [
        client_ca_route(ca, client_ca, "auth.test", "auth"),
        client_ca_route(ca, LocalCA(name="Another"), "other-auth.test", "other"),
    ]
    context = _client(ca, tmp_path, client_ca, version)
    async with https_proxy(tmp_path, routes, upstream, ca) as (_, _, port, _, _):
        first, session, _ = await asyncio.to_thread(
            _get, port, context, "auth.test", "auth.test", None
        )
        assert first.startswith(b"HTTP/1.1 200"), first[:100]
        again, _, reused = await asyncio.to_thread(
            _get, port, context, "auth.test", "auth.test", session
        )
        assert again.startswith(b"HTTP/1.1 200"), again[:100]
        assert reused, "the listener resumes sessions (stateful: session id / TLS 1.3 ticket)"
        crossed, _, reused = await asyncio.to_thread(
            _get, port, context, "other-auth.test", "other-auth.test", session
        )
        assert crossed.startswith(b"HTTP/1.1 403 Forbidden"), crossed[:200]
        assert b"X-Waygate-Error: route demo/other requires a client certificate" in crossed


async def test_the_listener_session_cache_is_bounded(
    tmp_path: Path, upstream: RecordingUpstream, monkeypatch: pytest.MonkeyPatch
) -> None:
    """OpenSSL's default cache (20,480 sessions kept two hours, two per TLS 1.3
    handshake) grew the soak's proxy by tens of MiB: the listener's is bounded."""
    monkeypatch.setattr(waygate_tls, "SESSION_CACHE", 8)
    ca = LocalCA()
    context = ssl.create_default_context(cadata=ca.pem.decode())
    context.check_hostname = False
    routes = [client_ca_route(ca, LocalCA(name="Unused"), "auth.test", "auth")]
    async with https_proxy(tmp_path, routes, upstream, ca) as (_, _, port, certificates, _):
        for _ in range(20):  # full handshakes: no session offered
            await asyncio.to_thread(_get, port, context, "plain.test", "plain.test", None)
        listener = certificates.context
        assert listener.num_tickets == 1
        assert 0 < listener.session_stats()["number"] <= 8
