"""--proxy-protocol over real sockets: every connection to the HTTP and HTTPS ports
starts with a PROXY header (v1 or v2), and its source address is the client's
everywhere the peer's was (X-Forwarded-For and Forwarded to the backend, access
checks), for HTTP/1.1, h2c, TLS (the header before the ClientHello) and
passthrough alike. A connection without a header in time, or with a malformed
one, is closed, counted, and holds nothing afterwards.

ingress-nginx's behaviour (test/e2e/settings/proxy_protocol.go): X-Forwarded-Port
is the header's destination port and X-Forwarded-Proto is https when that port is
443 (a load balancer that terminated TLS)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import ssl
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration.proxy.test_reencrypt import TlsBackend
from tests.support.h2client import H2Client
from tests.support.pki import LocalCA
from tests.support.proxyharness import (
    RecordingUpstream,
    endpoint,
    read_response,
    route,
    running_proxy,
    table,
)
from waygate.proxy import proxyproto
from waygate.proxy.accept import HEADER_OUTCOMES
from waygate.proxy.passthrough import TlsFront
from waygate.proxy.routing import Defaults
from waygate.proxy.tls import DefaultCertificate, EdgeCertificates
from waygate.proxy.view import HTTPS_FRONT, passthrough_table
from waygate.resolver.model import RouteAccess, RouteTLS, TLSTermination

HOST = "pp.test"
V1 = b"PROXY TCP4 192.168.0.1 192.168.0.11 56324 1234\r\n"
V2_6 = proxyproto.v2(proxyproto.Addresses("2001:db8::7", 40000, "2001:db8::1", 8443))
#: A v2 LOCAL header (a load balancer's health check): the peer's address stands.
V2_LOCAL = proxyproto.V2_SIGNATURE + bytes((0x20, 0x00, 0, 0))
GET = f"GET / HTTP/1.1\r\nHost: {HOST}\r\n\r\n".encode()


def outcome(listener: str, what: str) -> float:
    return HEADER_OUTCOMES[listener, what]._value.get()  # type: ignore[no-any-return]


@contextlib.asynccontextmanager
async def proxied(
    tmp_path: Path, *, timeout: float = 5.0, access: RouteAccess | None = None
) -> AsyncIterator[tuple[Any, int, TlsFront, RecordingUpstream, LocalCA]]:
    """A proxy with --proxy-protocol (HTTP and HTTPS ports), one route to a recording
    upstream and one passthrough route (pass.test, set by `passthrough_to`)."""
    upstream = await RecordingUpstream().start()
    ca = LocalCA()
    files = ca.write_files(tmp_path, dns=[HOST], prefix="default-")
    routes = table(
        [route(HOST, [("web", 100)], name="pp", access=access)], [endpoint("web", upstream.port)]
    )
    try:
        async with running_proxy(routes, proxy_protocol_timeout=timeout) as (server, port):
            front = TlsFront(
                server,
                EdgeCertificates(DefaultCertificate.from_files(files.cert, files.key)),
                "127.0.0.1",
                0,
            )
            await front.start()
            try:
                yield server, port, front, upstream, ca
            finally:
                await front.drain(1.0)
    finally:
        await upstream.stop()


async def get_with(port: int, header: bytes, request: bytes = GET) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(header + request)
        return await read_response(reader, timeout=10)
    finally:
        writer.close()


def seen_headers(upstream: RecordingUpstream) -> dict[str, str]:
    return {k.lower(): v for k, v in upstream.requests[-1]["headers"]}  # type: ignore[attr-defined]


async def tls_after(
    port: int, header: bytes, ca: LocalCA, *, name: str = HOST, alpn: list[str] | None = None
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A TLS connection whose first bytes, before the ClientHello, are `header`."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(header)
    sock.setblocking(False)
    context = ssl.create_default_context(cadata=ca.pem.decode())
    if alpn:
        context.set_alpn_protocols(alpn)
    return await asyncio.wait_for(
        asyncio.open_connection(sock=sock, ssl=context, server_hostname=name), 10
    )


async def test_http1_v1_header_names_the_client_to_the_backend(tmp_path: Path) -> None:
    # proxy_protocol.go "should respect port passed by the PROXY Protocol".
    before = outcome("http", "read")
    async with proxied(tmp_path) as (_, port, _, upstream, _):
        response = await get_with(port, V1)
        assert response.startswith(b"HTTP/1.1 200")
        headers = seen_headers(upstream)
        assert headers["x-forwarded-for"] == "192.168.0.1"
        assert headers["x-forwarded-port"] == "1234"
        assert headers["x-forwarded-proto"] == "http"
        assert headers["forwarded"].startswith("for=192.168.0.1;")
        # The header itself never reaches the backend.
        assert b"PROXY" not in upstream.received
    assert outcome("http", "read") == before + 1


async def test_destination_port_443_means_https_to_the_backend(tmp_path: Path) -> None:
    # proxy_protocol.go "should respect proto passed by the PROXY Protocol server port".
    async with proxied(tmp_path) as (_, port, _, upstream, _):
        header = b"PROXY TCP4 192.168.0.1 192.168.0.11 56324 443\r\n"
        assert (await get_with(port, header)).startswith(b"HTTP/1.1 200")
        headers = seen_headers(upstream)
        assert headers["x-forwarded-port"] == "443"
        assert headers["x-forwarded-proto"] == "https"
        assert headers["x-forwarded-for"] == "192.168.0.1"


async def test_v2_header_and_the_request_in_one_write_and_keep_alive(tmp_path: Path) -> None:
    async with proxied(tmp_path) as (_, port, _, upstream, _):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(V2_6 + GET)  # the header and the request in one segment
            assert (await read_response(reader, timeout=10)).startswith(b"HTTP/1.1 200")
            writer.write(GET)  # the next request on the connection: the same client
            assert (await read_response(reader, timeout=10)).startswith(b"HTTP/1.1 200")
        finally:
            writer.close()
        assert [
            {k.lower(): v for k, v in r["headers"]}["x-forwarded-for"]  # type: ignore[attr-defined]
            for r in upstream.requests
        ] == ["2001:db8::7", "2001:db8::7"]
        assert seen_headers(upstream)["forwarded"].startswith('for="[2001:db8::7]";')


async def test_header_trickled_byte_by_byte(tmp_path: Path) -> None:
    async with proxied(tmp_path) as (_, port, _, upstream, _):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            for i in range(len(V1)):
                writer.write(V1[i : i + 1])
                await writer.drain()
            writer.write(GET)
            assert (await read_response(reader, timeout=10)).startswith(b"HTTP/1.1 200")
        finally:
            writer.close()
        assert seen_headers(upstream)["x-forwarded-for"] == "192.168.0.1"


async def test_local_header_keeps_the_peer_address(tmp_path: Path) -> None:
    async with proxied(tmp_path) as (_, port, _, upstream, _):
        assert (await get_with(port, V2_LOCAL)).startswith(b"HTTP/1.1 200")
        assert seen_headers(upstream)["x-forwarded-for"] == "127.0.0.1"


async def test_h2c_after_a_v2_header(tmp_path: Path) -> None:
    async with proxied(tmp_path) as (_, port, _, upstream, _):
        client = await H2Client.connect(port, preface=False)
        try:
            client.send_raw(proxyproto.v2(proxyproto.Addresses("203.0.113.9", 1, "10.0.0.1", 80)))
            client.h2.initiate_connection()
            client.flush()
            answer = await client.request("GET", "/", HOST)
        finally:
            await client.close()
        assert answer.status == 200
        headers = seen_headers(upstream)
        assert headers["x-forwarded-for"] == "203.0.113.9"
        assert headers["x-forwarded-port"] == "80"


async def test_tls_after_a_v1_header_http1_and_h2(tmp_path: Path) -> None:
    # proxy_protocol.go "should enable PROXY Protocol for HTTPS".
    before = outcome("https", "read")
    async with proxied(tmp_path) as (_, _, front, upstream, ca):
        reader, writer = await tls_after(front.bound_port, V1, ca)
        try:
            writer.write(GET)
            assert (await read_response(reader, timeout=10)).startswith(b"HTTP/1.1 200")
        finally:
            writer.close()
        headers = seen_headers(upstream)
        assert headers["x-forwarded-for"] == "192.168.0.1"
        assert headers["x-forwarded-port"] == "1234"
        assert headers["x-forwarded-proto"] == "https"

        reader, writer = await tls_after(front.bound_port, V2_6, ca, alpn=["h2"])
        client = H2Client(reader, writer)
        client._task = asyncio.get_running_loop().create_task(client._read_forever())
        try:
            client.h2.initiate_connection()
            client.flush()
            answer = await client.request("GET", "/", HOST)
        finally:
            await client.close()
        assert answer.status == 200
        assert seen_headers(upstream)["x-forwarded-for"] == "2001:db8::7"
    assert outcome("https", "read") == before + 2


async def test_passthrough_after_a_header_relays_the_client_hello_only(tmp_path: Path) -> None:
    backend_ca = LocalCA(name="Backend CA")
    backend = await TlsBackend(backend_ca.issue(dns=["pass.test"])).start()
    try:
        async with proxied(tmp_path) as (server, _, front, _, _):
            passthrough = route(
                "pass.test",
                [("tls", 100)],
                name="pass",
                tls=RouteTLS(termination=TLSTermination.PASSTHROUGH),
            )
            relayed = passthrough_table(
                {passthrough.key: passthrough},
                {("demo", "tls"): (endpoint("tls", backend.port),)},
                {},
                defaults=Defaults(),
                cookie_key=b"k" * 32,
                previous=None,
            )
            server.set_view(server.view.replace(passthrough={HTTPS_FRONT: relayed}))
            reader, writer = await tls_after(front.bound_port, V1, backend_ca, name="pass.test")
            try:
                writer.write(b"GET / HTTP/1.1\r\nHost: pass.test\r\n\r\n")
                async with asyncio.timeout(10):
                    head = await reader.readuntil(b"\r\n\r\n")
            finally:
                writer.close()
            # The backend's own TLS completed: the PROXY header was not relayed to it.
            assert head.startswith(b"HTTP/1.1 200")
            assert backend.requests == [b"GET / HTTP/1.1\r\nHost: pass.test\r\n\r\n"]
    finally:
        await backend.stop()


async def test_allow_list_judges_the_headers_address(tmp_path: Path) -> None:
    # The peer is 127.0.0.1 every time; only the header's address differs.
    rules = RouteAccess(allow=("192.168.0.0/24",))
    async with proxied(tmp_path, access=rules) as (_, port, front, upstream, ca):
        assert (await get_with(port, V1)).startswith(b"HTTP/1.1 200")
        outside = b"PROXY TCP4 10.1.1.1 192.168.0.11 56324 80\r\n"
        assert (await get_with(port, outside)).startswith(b"HTTP/1.1 403")
        assert (await get_with(port, V2_LOCAL)).startswith(b"HTTP/1.1 403")
        reader, writer = await tls_after(front.bound_port, outside, ca)
        try:
            writer.write(GET)
            assert (await read_response(reader, timeout=10)).startswith(b"HTTP/1.1 403")
        finally:
            writer.close()
        assert len(upstream.requests) == 1


async def _closed_by_proxy(port: int, data: bytes) -> bytes:
    """What the proxy sends before closing a connection that starts with `data` (a reset,
    the kernel's answer to a close with the client's bytes unread: nothing)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        if data:
            writer.write(data)
        async with asyncio.timeout(10):
            try:
                return await reader.read()
            except ConnectionResetError:
                return b""
    finally:
        writer.close()


@pytest.mark.parametrize(
    "data",
    [
        GET,  # no header at all: a client that went around the load balancer
        b"PROXY TCP4 999.1.1.1 1.1.1.1 1 2\r\n" + GET,
        b"PROXY TCP4 " + b"1" * 120,  # a v1 line past its bound
        proxyproto.V2_SIGNATURE + bytes((0x21, 0x11, 0xFF, 0xFF)),  # a v2 over MAX_V2
    ],
)
async def test_malformed_headers_close_the_connection(tmp_path: Path, data: bytes) -> None:
    async with proxied(tmp_path) as (server, port, front, upstream, _):
        before = (outcome("http", "invalid"), outcome("https", "invalid"))
        assert await _closed_by_proxy(port, data) == b""
        assert await _closed_by_proxy(front.bound_port, data) == b""
        assert (outcome("http", "invalid"), outcome("https", "invalid")) == (
            before[0] + 1,
            before[1] + 1,
        )
        assert not upstream.requests and not server.awaiting_header


async def test_no_header_in_time_is_closed_and_releases_everything(tmp_path: Path) -> None:
    async with proxied(tmp_path, timeout=0.3) as (server, port, front, upstream, _):
        fds = len(os.listdir("/proc/self/fd"))
        tasks = len(asyncio.all_tasks())
        before = (outcome("http", "timeout"), outcome("https", "timeout"))
        silent = [await asyncio.open_connection("127.0.0.1", p) for p in (port, front.bound_port)]
        partial = await asyncio.open_connection("127.0.0.1", port)
        partial[1].write(V1[:10])  # a header begun and never finished
        try:
            async with asyncio.timeout(10):
                for reader, _ in (*silent, partial):
                    assert await reader.read() == b""
        finally:
            for _, writer in (*silent, partial):
                writer.close()
        assert (outcome("http", "timeout"), outcome("https", "timeout")) == (
            before[0] + 2,
            before[1] + 1,
        )
        async with asyncio.timeout(10):
            while (
                server.awaiting_header
                or server.connections
                or front.pending
                or len(os.listdir("/proc/self/fd")) > fds
                or len(asyncio.all_tasks()) > tasks
            ):
                await asyncio.sleep(0.02)
        assert not upstream.requests


async def test_drain_closes_connections_still_waiting_for_a_header(tmp_path: Path) -> None:
    async with proxied(tmp_path) as (server, port, _, _, _):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        async with asyncio.timeout(10):
            while not server.awaiting_header:
                await asyncio.sleep(0.01)
        server.stop_accepting()
        async with asyncio.timeout(10):
            assert await reader.read() == b""
        writer.close()
        assert not server.awaiting_header


async def test_a_route_expecting_the_header_on_a_proxy_without_the_setting_is_reported() -> None:
    """use-proxy-protocol on a route (Route.client_proxy_protocol) and a proxy without
    --proxy-protocol: the status page names the mismatch (`waygate check` reads it);
    with the setting, or without such a route, nothing is said."""
    from waygate.proxy.status import PROXY_PROTOCOL_SECTION, proxy_protocol_sections

    upstream = await RecordingUpstream().start()
    expecting = table(
        [route(HOST, [("web", 100)], name="pp", client_proxy_protocol=True)],
        [endpoint("web", upstream.port)],
    )
    plain = table([route(HOST, [("web", 100)], name="pp")], [endpoint("web", upstream.port)])
    try:
        async with running_proxy(expecting) as (server, _):
            [section] = proxy_protocol_sections(server)
            assert section.title == PROXY_PROTOCOL_SECTION and section.state == "bad"
            assert [row[0] for row in section.rows] == ["demo/pp"]
            server.set_table(plain)
            assert proxy_protocol_sections(server) == []
        async with running_proxy(expecting, proxy_protocol_timeout=5.0) as (server, _):
            assert proxy_protocol_sections(server) == []
    finally:
        await upstream.stop()


async def test_a_client_gone_during_its_header_is_counted_closed(tmp_path: Path) -> None:
    async with proxied(tmp_path) as (server, port, front, _, _):
        before = (outcome("http", "closed"), outcome("https", "closed"))
        for target in (port, front.bound_port):
            _, writer = await asyncio.open_connection("127.0.0.1", target)
            writer.write(V1[:10])  # a header begun, then the client leaves
            await writer.drain()
            writer.close()
        async with asyncio.timeout(10):
            while (outcome("http", "closed"), outcome("https", "closed")) != (
                before[0] + 1,
                before[1] + 1,
            ):
                await asyncio.sleep(0.02)
            while server.awaiting_header or front.pending:
                await asyncio.sleep(0.02)
