"""Auth-proxy routes (seed 001) over real TLS: a route with a client CA requires a
client certificate from it. A good one reaches the backend as X-Remote-User /
X-Remote-Group (the client's own copies stripped); a missing one is a 401 page;
one from a foreign CA is refused by TLS (an unknown-CA alert) before any request; one verified for another
host (a different TLS server name) is a 403."""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from pathlib import Path

import pytest

from tests.integration.proxy.test_tls_edge import https_proxy
from tests.support.pki import LocalCA
from tests.support.proxyharness import RecordingUpstream, read_response, route
from waygate.resolver.model import RouteTLS, TLSTermination


def client_ca_route(ca: LocalCA, client_ca: LocalCA, host: str, name: str):
    cert, key = ca.issue(dns=[host])
    return route(
        host,
        [("web", 100)],
        name=name,
        tls=RouteTLS(
            termination=TLSTermination.EDGE,
            certificate=cert.decode(),
            key=key.decode(),
            client_ca_certificate=client_ca.pem.decode(),
        ),
    )


async def get(
    port: int, ca: LocalCA, tmp_path: Path, server_name: str, host: str, client: LocalCA | None
) -> bytes:
    context = ssl.create_default_context(cadata=ca.pem.decode())
    context.check_hostname = False
    if client is not None:
        cert, key = client.issue(uris=["spiffe://waygate.local/ns/team/sa/alice"])
        path = tmp_path / "client.pem"
        path.write_bytes(cert + key)
        context.load_cert_chain(path)
    reader, writer = await asyncio.open_connection(
        "127.0.0.1", port, ssl=context, server_hostname=server_name
    )
    try:
        writer.write(
            f"GET / HTTP/1.1\r\nHost: {host}\r\nX-Remote-User: mallory\r\n"
            "X-Remote-Group: system:masters\r\n\r\n".encode()
        )
        return await read_response(reader)
    finally:
        writer.close()
        with contextlib.suppress(Exception):
            await writer.wait_closed()


@pytest.fixture
async def upstream():
    up = await RecordingUpstream().start()
    yield up
    await up.stop()


async def test_client_certificate_routes(tmp_path: Path, upstream: RecordingUpstream) -> None:
    ca, client_ca, foreign = LocalCA(), LocalCA(name="Front proxy clients"), LocalCA(name="X")
    routes = [
        client_ca_route(ca, client_ca, "auth.test", "auth"),
        client_ca_route(ca, LocalCA(name="Another"), "other-auth.test", "other"),
    ]
    async with https_proxy(tmp_path, routes, upstream, ca) as (_, _, port, _, _):
        good = await get(port, ca, tmp_path, "auth.test", "auth.test", client_ca)
        assert good.startswith(b"HTTP/1.1 200")
        seen = bytes(upstream.received)
        assert b"X-Remote-User: spiffe://waygate.local/ns/team/sa/alice\r\n" in seen
        assert b"mallory" not in seen and b"system:masters" not in seen

        missing = await get(port, ca, tmp_path, "auth.test", "auth.test", None)
        assert missing.startswith(b"HTTP/1.1 401 Unauthorized")
        assert b"X-Waygate-Error: route demo/auth requires a client certificate" in missing

        # TLS 1.3: the client's handshake ends before the server verifies its
        # certificate, so the refusal (an unknown-CA alert) shows as a close.
        with pytest.raises((ssl.SSLError, ConnectionError, asyncio.IncompleteReadError)):
            await get(port, ca, tmp_path, "auth.test", "auth.test", foreign)

        # Verified by other-auth.test's context, then asking for auth.test: 403.
        crossed = await get(port, ca, tmp_path, "auth.test", "other-auth.test", client_ca)
        assert crossed.startswith(b"HTTP/1.1 403 Forbidden"), crossed[:100]
    assert upstream.received.count(b"GET ") == 1


async def test_a_client_certificate_sent_to_an_ordinary_route_is_harmless(
    tmp_path: Path, upstream: RecordingUpstream
) -> None:
    # While an auth-proxy route exists every client is asked for a certificate;
    # one from that route's CA, sent to an ordinary route or to the default
    # certificate's names, must not fail the handshake there (nor give identity).
    ca, client_ca = LocalCA(), LocalCA(name="Front proxy clients")
    cert, key = ca.issue(dns=["plain.test"])
    plain = route(
        "plain.test",
        [("web", 100)],
        name="plain",
        tls=RouteTLS(termination=TLSTermination.EDGE, certificate=cert.decode(), key=key.decode()),
    )
    routes = [client_ca_route(ca, client_ca, "auth.test", "auth"), plain]
    async with https_proxy(tmp_path, routes, upstream, ca) as (_, _, port, _, _):
        ordinary = await get(port, ca, tmp_path, "plain.test", "plain.test", client_ca)
        assert ordinary.startswith(b"HTTP/1.1 200"), ordinary[:100]
        assert b"X-Remote-User" not in bytes(upstream.received)
        default = await get(port, ca, tmp_path, "nothing.test", "nothing.test", client_ca)
        assert default.startswith(b"HTTP/1.1 503"), default[:100]
