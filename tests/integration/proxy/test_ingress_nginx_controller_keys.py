"""The controller ConfigMap's server-tokens, ssl-protocols, ssl-ciphers and
forwarded-for-header on the wire: real TLS handshakes against the proxy's HTTPS
listener (its SNI contexts), real HTTP/1.1 and HTTP/2 clients against the request
core, real backends (HTTP/1.1 `RecordingUpstream`, h2c `H2Backend`).

What ingress-nginx renders (rootfs/etc/nginx/template/nginx.tmpl): `server_tokens
off; more_clear_headers Server;`, `ssl_protocols`, `ssl_ciphers`, `real_ip_header
{{ $cfg.ForwardedForHeader }}` with `real_ip_recursive on`, and upstream
`X-Forwarded-For $remote_addr`, `X-Original-Forwarded-For $http_<header>`. The
resolver's side: tests/unit/resolver/test_ingress_nginx_controller_keys.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import socket
import ssl
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration.proxy.test_ingress_responses import _echo, _h2_answering, _route, _table
from tests.integration.proxy.test_request_core import PAIRS, ask
from tests.support.h2harness import running_h2_proxy
from tests.support.pki import LocalCA
from tests.support.proxyharness import RecordingUpstream, endpoint, route, running_proxy, table
from waygate.proxy.passthrough import TlsFront
from waygate.proxy.tls import DefaultCertificate, EdgeCertificates
from waygate.resolver.model import (
    ForwardedHeadersMode,
    HeaderModifier,
    RouteAccess,
    RouteFilters,
    RouteTLS,
    TLSTermination,
)

ONLY_AES256 = "ECDHE-ECDSA-AES256-GCM-SHA384"
AES128 = "ECDHE-ECDSA-AES128-GCM-SHA256"


@pytest.fixture
async def upstream() -> AsyncIterator[RecordingUpstream]:
    up = await RecordingUpstream().start()
    yield up
    await up.stop()


# ---------------------------------------------------------------- ssl-protocols, ssl-ciphers


def _tls_route(ca: LocalCA, host: str, name: str, **tls: Any) -> Any:
    cert, key = ca.issue(dns=[host])
    return route(
        host,
        [("web", 100)],
        name=name,
        tls=RouteTLS(
            termination=TLSTermination.EDGE, certificate=cert.decode(), key=key.decode(), **tls
        ),
    )


def _withheld(item: Any) -> Any:
    return dataclasses.replace(item, tls=dataclasses.replace(item.tls, key=""))


@contextlib.asynccontextmanager
async def https_front(
    ca: LocalCA, tmp_path: Path, upstream: RecordingUpstream
) -> AsyncIterator[int]:
    routes = [
        _tls_route(ca, "v13.test", "v13", protocols=("TLSv1.3",)),
        _tls_route(ca, "ciphers.test", "ciphers", ciphers=ONLY_AES256),
        _tls_route(ca, "plain.test", "plain"),
        # Keys the resolver withholds (no mTLS): the default certificate serves these
        # hosts, and their policy still holds (fail closed).
        _withheld(_tls_route(ca, "v13-nokey.test", "v13-nokey", protocols=("TLSv1.3",))),
        _withheld(_tls_route(ca, "ciphers-nokey.test", "ciphers-nokey", ciphers=ONLY_AES256)),
    ]
    files = ca.write_files(tmp_path / "default", dns=["default.test"], prefix="d-")
    certificates = EdgeCertificates(DefaultCertificate.from_files(files.cert, files.key))
    certificates.update(routes)
    assert {label for label, _, _ in certificates.refusals} == {
        "demo/v13-nokey",
        "demo/ciphers-nokey",
    }
    async with running_h2_proxy(table(routes, [endpoint("web", upstream.port)])) as (server, _):
        front = TlsFront(server, certificates, "127.0.0.1", 0)
        await front.start()
        try:
            yield front.bound_port
        finally:
            await front.drain(1.0)


def _client(
    ca: LocalCA, maximum: ssl.TLSVersion = ssl.TLSVersion.TLSv1_3, ciphers: str = ""
) -> ssl.SSLContext:
    context = ssl.create_default_context(cadata=ca.pem.decode())
    context.maximum_version = maximum
    if ciphers:
        context.set_ciphers(ciphers)
    context.set_alpn_protocols(["http/1.1"])
    return context


def _handshake(port: int, context: ssl.SSLContext, name: str) -> tuple[str, str, bytes]:
    """(version, cipher, the answer's status line) of one request on a new connection."""
    with (
        socket.create_connection(("127.0.0.1", port), timeout=10) as raw,
        context.wrap_socket(raw, server_hostname=name) as tls,
    ):
        tls.sendall(f"GET / HTTP/1.1\r\nHost: {name}\r\nConnection: close\r\n\r\n".encode())
        data = b""
        while chunk := tls.recv(65536):
            data += chunk
        cipher = tls.cipher()
        return str(tls.version()), cipher[0] if cipher else "", data.split(b"\r\n", 1)[0]


async def test_a_tls_1_3_only_host_refuses_a_tls_1_2_client(
    tmp_path: Path, upstream: RecordingUpstream
) -> None:
    ca = LocalCA()
    async with https_front(ca, tmp_path, upstream) as port:
        tls12 = _client(ca, ssl.TLSVersion.TLSv1_2)
        for host in ("v13.test", "v13-nokey.test"):
            # (asyncio's TLS closes on the protocol_version alert: the client may see EOF)
            with pytest.raises(ssl.SSLError, match="PROTOCOL_VERSION|EOF"):
                await asyncio.to_thread(_handshake, port, tls12, host)
        version, _, status = await asyncio.to_thread(_handshake, port, _client(ca), "v13.test")
        assert (version, status) == ("TLSv1.3", b"HTTP/1.1 200 OK")
        # Another host of the same listener keeps TLS 1.2.
        version, _, status = await asyncio.to_thread(_handshake, port, tls12, "plain.test")
        assert (version, status) == ("TLSv1.2", b"HTTP/1.1 200 OK")
    assert upstream.received.count(b"GET ") == 2
    # (the default certificate's host name is not v13-nokey.test: a TLS 1.3 client
    # that checks it stops there; the handshake itself is what is tested above)


async def test_a_cipher_outside_the_hosts_list_is_refused(
    tmp_path: Path, upstream: RecordingUpstream
) -> None:
    # ingress-nginx test/e2e/settings/tls.go "setting cipher suite": the TLS 1.2
    # client gets the listed suite (an ECDSA one here: the test CA's keys are P-256).
    ca = LocalCA()
    async with https_front(ca, tmp_path, upstream) as port:
        only128 = _client(ca, ssl.TLSVersion.TLSv1_2, AES128)
        for host in ("ciphers.test", "ciphers-nokey.test"):
            with pytest.raises(ssl.SSLError, match="HANDSHAKE_FAILURE|EOF"):
                await asyncio.to_thread(_handshake, port, only128, host)
        both = _client(ca, ssl.TLSVersion.TLSv1_2, f"{AES128}:{ONLY_AES256}")
        version, cipher, status = await asyncio.to_thread(_handshake, port, both, "ciphers.test")
        assert (version, cipher, status) == ("TLSv1.2", ONLY_AES256, b"HTTP/1.1 200 OK")
        # The listener's own list (Mozilla intermediate, AES128 first) on other hosts.
        _, cipher, _ = await asyncio.to_thread(_handshake, port, only128, "plain.test")
        assert cipher == AES128
        # TLS 1.3 suites are OpenSSL's (nginx's ssl_ciphers does not touch them).
        version, _, status = await asyncio.to_thread(_handshake, port, _client(ca), "ciphers.test")
        assert (version, status) == ("TLSv1.3", b"HTTP/1.1 200 OK")


async def test_sslyze_sees_only_the_hosts_tls_1_2_suite(
    tmp_path: Path, upstream: RecordingUpstream
) -> None:
    """An external checker: sslyze's TLS 1.0-1.3 scans of the narrowed hosts."""
    ca = LocalCA()
    async with https_front(ca, tmp_path, upstream) as port:
        scan = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "sslyze",
            "--tlsv1",
            "--tlsv1_1",
            "--tlsv1_2",
            "--tlsv1_3",
            "--json_out=-",
            f"ciphers.test:{port}{{127.0.0.1}}",
            f"v13.test:{port}{{127.0.0.1}}",
            f"ciphers-nokey.test:{port}{{127.0.0.1}}",
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        output, errors = await asyncio.wait_for(scan.communicate(), 240)
    assert scan.returncode == 0, errors.decode(errors="replace")[-2000:]
    results = {
        result["server_location"]["hostname"]: result["scan_result"]
        for result in json.loads(output)["server_scan_results"]
    }

    def accepted(host: str, command: str) -> list[str]:
        found = results[host][command]["result"]["accepted_cipher_suites"]
        return [suite["cipher_suite"]["openssl_name"] for suite in found]

    assert accepted("ciphers.test", "tls_1_2_cipher_suites") == [ONLY_AES256]
    assert accepted("ciphers-nokey.test", "tls_1_2_cipher_suites") == [ONLY_AES256]
    assert accepted("ciphers.test", "tls_1_3_cipher_suites")  # OpenSSL's own
    assert accepted("v13.test", "tls_1_2_cipher_suites") == []
    assert accepted("v13.test", "tls_1_3_cipher_suites")
    for host in results:
        assert accepted(host, "tls_1_0_cipher_suites") == []
        assert accepted(host, "tls_1_1_cipher_suites") == []


# ---------------------------------------------------------------- server-tokens


@pytest.mark.parametrize(("client", "backend"), PAIRS)
async def test_server_tokens_off_clears_the_backends_server_header(client, backend):
    # ingress-nginx test/e2e/settings/server_tokens.go "should not exists Server
    # header in the response" (there: `more_clear_headers Server;` in the config).
    main = await RecordingUpstream().start()
    cleared = RouteFilters(response_headers=HeaderModifier(remove=("Server",)))
    fields = [(b":status", b"200"), (b"server", b"backend/1.2.3")]
    try:
        async with (
            _h2_answering(fields) as h2,
            running_proxy(_table(_route(backend, filters=cleared), main.port, h2.port)) as (
                _,
                port,
            ),
        ):
            answer = await ask(client, port, "/", [_echo([("Server", "backend/1.2.3")])])
            # The proxy's own answer (no such host) advertises nothing either.
            unknown = await ask(client, port, "/", [("Host", "nowhere.test")])
    finally:
        await main.stop()
    assert answer.status == 200
    assert "server" not in answer.headers
    assert "server" not in {name.lower() for name in unknown.headers}


# ---------------------------------------------------------------- forwarded-for-header


def _forwarded_route(**kw: Any) -> Any:
    return _route(
        access=RouteAccess(trusted_proxies=("127.0.0.0/8",), deny=("192.0.2.0/24",)),
        client_address_header="x-client-ip",
        forwarded_headers=ForwardedHeadersMode.IF_NONE,
        **kw,
    )


def _sent(answer: Any) -> dict[str, str]:
    return {k.lower(): v for k, v in json.loads(answer.body)["headers"]}


@pytest.mark.parametrize("client", ["http/1.1", "h2c"])
async def test_forwarded_for_header_names_the_client_for_access_and_the_backend(
    upstream: RecordingUpstream, client: str
) -> None:
    async with running_proxy(_table(_forwarded_route(), upstream.port)) as (_, port):
        # nginx real_ip_header X-Client-IP, recursive, from a trusted peer (127.0.0.1).
        denied = await ask(client, port, "/", [("X-Client-IP", "192.0.2.7")])
        # X-Forwarded-For is not read any more: it cannot get a client past the deny.
        allowed = await ask(
            client,
            port,
            "/",
            [
                ("X-Client-IP", "192.0.2.7, 198.51.100.1"),
                ("X-Forwarded-For", "203.0.113.5"),
                ("X-Original-Forwarded-For", "forged"),
            ],
        )
        spoofed = await ask(client, port, "/", [("X-Forwarded-For", "192.0.2.7")])
    assert denied.status == 403
    assert allowed.status == 200
    seen = _sent(allowed)
    # The backend gets X-Forwarded-For $remote_addr and X-Original-Forwarded-For
    # $http_x_client_ip (the client's own copy dropped).
    assert seen["x-forwarded-for"] == "198.51.100.1"
    assert seen["x-original-forwarded-for"] == "192.0.2.7, 198.51.100.1"
    assert spoofed.status == 200
    assert _sent(spoofed)["x-forwarded-for"] == "192.0.2.7"  # passed on, as IF_NONE


async def test_an_untrusted_peer_names_no_client(upstream: RecordingUpstream) -> None:
    route = _route(
        access=RouteAccess(trusted_proxies=("10.0.0.0/8",), allow=("198.51.100.0/24",)),
        client_address_header="x-client-ip",
        forwarded_headers=ForwardedHeadersMode.IF_NONE,
    )
    async with running_proxy(_table(route, upstream.port)) as (_, port):
        answer = await ask("http/1.1", port, "/", [("X-Client-IP", "198.51.100.1")])
    assert answer.status == 403  # the peer (127.0.0.1) is the client: not allowed
