"""ingress-nginx's client certificates (auth-tls-*) over real TLS sockets, HTTP/1.1
and HTTP/2: one proxy, one HTTPS listener, hosts with different client-CA needs.

What nginx does with ssl_verify_client / ssl_verify_depth / ssl_crl /
error_page 495 496 and ingress-nginx's `$ssl_client_s_dn !~ "CN=..."` check
(rootfs/etc/nginx/template/nginx.tmpl; nginx's ngx_http_process_request and
ngx_http_ssl_servername), asserted on the wire: the handshake never fails on a
certificate, the request is answered 400 (or redirected), 403 or 421, or
forwarded with ingress-nginx's ssl-client-* headers (a client's own dropped).
The system tests (tests/system/test_ingress_nginx_authtls.py) port ingress-nginx's
own e2e assertions through a real resolver.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import shutil
import ssl
from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path
from urllib.parse import unquote

import pytest

from tests.integration.proxy.test_tls_resumption import _get
from tests.support.h2client import H2Client
from tests.support.h2harness import running_h2_proxy
from tests.support.pki import LocalCA
from tests.support.proxyharness import RecordingUpstream, endpoint, read_response, route, table
from waygate.proxy.passthrough import TlsFront
from waygate.proxy.tls import DefaultCertificate, EdgeCertificates
from waygate.resolver.model import (
    ClientCertificate,
    ExternalAuth,
    RouteAccess,
    RouteTLS,
    TLSTermination,
)

ERROR_PAGE = "http://errors.test/error"


class Pki:
    def __init__(self) -> None:
        self.server = LocalCA(name="Server CA")
        self.clients = LocalCA(name="Client root")
        self.inner = self.clients.intermediate("Client intermediate")
        self.deeper = self.inner.intermediate("Client intermediate 2")
        self.foreign = LocalCA(name="Foreign")
        self.revoked = self.clients.issue(common_name="revoked", client_only=True)
        self.crl = self.clients.revocation_list([self.revoked[0]])


def edge_route(pki: Pki, host: str, rules: ClientCertificate | None, name: str):
    cert, key = pki.server.issue(dns=[host])
    return route(
        host,
        [("web", 100)],
        name=name,
        tls=RouteTLS(termination=TLSTermination.EDGE, certificate=cert.decode(), key=key.decode()),
        access=RouteAccess(client_certificate=rules) if rules is not None else None,
    )


def rules(pki: Pki, **kw: object) -> ClientCertificate:
    return ClientCertificate(ca_certificates=pki.clients.pem.decode(), **kw)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def pki() -> Pki:
    return Pki()


@contextlib.asynccontextmanager
async def front(
    pki: Pki, tmp_path: Path, auth_port: int = 0
) -> AsyncIterator[tuple[int, RecordingUpstream]]:
    chain = (pki.inner.pem + pki.clients.pem).decode()
    routes = [
        edge_route(pki, "auth.test", rules(pki, pass_certificate=True), "auth"),
        edge_route(pki, "optional.test", rules(pki, verify="optional"), "optional"),
        edge_route(pki, "noca.test", rules(pki, verify="optional_no_ca"), "noca"),
        edge_route(pki, "off.test", rules(pki, verify="off"), "off"),
        edge_route(pki, "cn.test", rules(pki, match_subject="CN=(nomatch|authtls)"), "cn"),
        edge_route(pki, "nocn.test", rules(pki, match_subject="CN=notgonnamatch"), "nocn"),
        edge_route(pki, "errors.test", rules(pki, error_page=ERROR_PAGE), "errors"),
        edge_route(pki, "crl.test", rules(pki, revocation_lists=pki.crl.decode()), "crl"),
        edge_route(
            pki,
            "depth1.test",
            ClientCertificate(ca_certificates=chain, depth=1),
            "depth1",
        ),
        edge_route(
            pki,
            "depth3.test",
            ClientCertificate(ca_certificates=chain, depth=3),
            "depth3",
        ),
        edge_route(pki, "plain.test", None, "plain"),
        edge_route(pki, "*.wild.test", rules(pki), "wild"),
        edge_route(pki, "broken.test", ClientCertificate("", refusal="host refused"), "broken"),
    ]
    if auth_port:
        guarded = edge_route(pki, "extauth.test", rules(pki), "extauth")
        auth = ExternalAuth(url=f"http://127.0.0.1:{auth_port}/auth")
        routes.append(dataclasses.replace(guarded, external_auth=auth))
    upstream = await RecordingUpstream().start()
    files = pki.server.write_files(tmp_path / "default", dns=["default.test"], prefix="d-")
    certificates = EdgeCertificates(DefaultCertificate.from_files(files.cert, files.key))
    certificates.update(routes)
    try:
        async with running_h2_proxy(table(routes, [endpoint("web", upstream.port)])) as (
            server,
            _,
        ):
            tls_front = TlsFront(server, certificates, "127.0.0.1", 0)
            await tls_front.start()
            try:
                yield tls_front.bound_port, upstream
            finally:
                await tls_front.drain(1.0)
    finally:
        await upstream.stop()


def client_context(
    pki: Pki, tmp_path: Path, holder: LocalCA | None, *, cn: str = "authtls", chain: bytes = b""
) -> ssl.SSLContext:
    context = ssl.create_default_context(cadata=pki.server.pem.decode())
    context.set_alpn_protocols(["http/1.1"])
    if holder is not None:
        cert, key = holder.issue(common_name=cn, client_only=True)
        path = tmp_path / f"client-{id(holder)}-{cn}.pem"
        path.write_bytes(cert + chain + key)
        context.load_cert_chain(path)
    return context


async def get(
    port: int, context: ssl.SSLContext, server_name: str, host: str | None = None
) -> bytes:
    reader, writer = await asyncio.open_connection(
        "127.0.0.1", port, ssl=context, server_hostname=server_name
    )
    try:
        writer.write(
            f"GET / HTTP/1.1\r\nHost: {host or server_name}\r\n"
            "ssl-client-verify: SUCCESS\r\nssl-client-subject-dn: CN=admin\r\n"
            "SSL-Client-Cert: forged\r\n\r\n".encode()
        )
        return await read_response(reader, timeout=10)
    finally:
        writer.close()
        with contextlib.suppress(Exception):
            await writer.wait_closed()


def forwarded(response: bytes) -> dict[str, str]:
    """The headers the backend saw (RecordingUpstream echoes them as JSON)."""
    record = json.loads(response.split(b"\r\n\r\n", 1)[1])
    return {name.lower(): value for name, value in record["headers"]}


async def test_verify_on_optional_and_off(pki: Pki, tmp_path: Path) -> None:
    good = client_context(pki, tmp_path, pki.clients)
    foreign = client_context(pki, tmp_path, pki.foreign)
    none = client_context(pki, tmp_path, None)
    async with front(pki, tmp_path) as (port, upstream):
        # on: a certificate from the CA is forwarded with ingress-nginx's headers.
        ok = await get(port, good, "auth.test")
        assert ok.startswith(b"HTTP/1.1 200"), ok[:200]
        seen = forwarded(ok)
        assert seen["ssl-client-verify"] == "SUCCESS"
        assert seen["ssl-client-subject-dn"] == "CN=authtls"
        assert seen["ssl-client-issuer-dn"] == "CN=Client root"
        assert seen["ssl-client-cert"].startswith("-----BEGIN%20CERTIFICATE-----%0A")
        assert unquote(seen["ssl-client-cert"]).endswith("-----END CERTIFICATE-----\n")
        assert "forged" not in json.dumps(seen) and "CN=admin" not in json.dumps(seen)
        # on: none, or one from another CA: 400 (the handshake itself succeeds).
        missing = await get(port, none, "auth.test")
        assert missing.startswith(b"HTTP/1.1 400 Bad Request"), missing[:200]
        assert b"No required SSL certificate was sent" in missing
        failed = await get(port, foreign, "auth.test")
        assert failed.startswith(b"HTTP/1.1 400 Bad Request"), failed[:200]
        assert b"The SSL certificate error" in failed
        # optional: none passes (NONE), a failed one does not.
        assert forwarded(await get(port, none, "optional.test"))["ssl-client-verify"] == "NONE"
        assert (await get(port, foreign, "optional.test")).startswith(b"HTTP/1.1 400")
        # optional_no_ca: an untrusted issuer passes, marked FAILED.
        noca = forwarded(await get(port, foreign, "noca.test"))
        assert noca["ssl-client-verify"].startswith("FAILED:"), noca
        assert noca["ssl-client-subject-dn"] == "CN=authtls"
        # optional_no_ca lets only an untrusted issuer through: an expired certificate
        # from the CA is still a 400 (nginx's ngx_ssl_verify_error_optional).
        expired = ssl.create_default_context(cadata=pki.server.pem.decode())
        cert, key = pki.clients.issue(common_name="late", lifetime=timedelta(hours=-1))
        (tmp_path / "expired.pem").write_bytes(cert + key)
        expired.load_cert_chain(tmp_path / "expired.pem")
        assert (await get(port, expired, "noca.test")).startswith(b"HTTP/1.1 400")
        assert (await get(port, expired, "auth.test")).startswith(b"HTTP/1.1 400")
        # off: nothing asked, nothing checked.
        off = forwarded(await get(port, none, "off.test"))
        assert off["ssl-client-verify"] == "NONE" and "ssl-client-subject-dn" not in off
        assert upstream.received.count(b"GET ") == 4


async def test_match_cn_error_page_crl_and_depth(pki: Pki, tmp_path: Path) -> None:
    good = client_context(pki, tmp_path, pki.clients)
    other_cn = client_context(pki, tmp_path, pki.clients, cn="someone-else")
    none = client_context(pki, tmp_path, None)
    async with front(pki, tmp_path) as (port, _):
        assert (await get(port, good, "cn.test")).startswith(b"HTTP/1.1 200")
        refused = await get(port, other_cn, "cn.test")
        assert refused.startswith(b"HTTP/1.1 403"), refused[:200]
        assert b"client certificate unauthorized" in refused
        assert (await get(port, good, "nocn.test")).startswith(b"HTTP/1.1 403")

        # Another Ingress's rules on the host refused (AuthTLSError): 403 for every
        # request, on the host's own certificate.
        for client in (none, good):
            broken = await get(port, client, "broken.test")
            assert broken.startswith(b"HTTP/1.1 403"), broken[:200]
            assert b"X-Waygate-Error: host refused\r\n" in broken

        redirect = await get(port, none, "errors.test")
        assert redirect.startswith(b"HTTP/1.1 302"), redirect[:200]
        assert f"\r\nLocation: {ERROR_PAGE}\r\n".encode() in redirect
        assert (await get(port, good, "errors.test")).startswith(b"HTTP/1.1 200")

        # ssl_crl: a revoked certificate fails (400); another from the same CA passes.
        revoked = ssl.create_default_context(cadata=pki.server.pem.decode())
        path = tmp_path / "revoked.pem"
        path.write_bytes(pki.revoked[0] + pki.revoked[1])
        revoked.load_cert_chain(path)
        assert (await get(port, revoked, "crl.test")).startswith(b"HTTP/1.1 400")
        assert (await get(port, good, "crl.test")).startswith(b"HTTP/1.1 200")

        # ssl_verify_depth (OpenSSL's count): one intermediate passes at depth 1;
        # a leaf under two intermediates needs more.
        one = client_context(pki, tmp_path, pki.inner)
        assert (await get(port, one, "depth1.test")).startswith(b"HTTP/1.1 200")
        two = client_context(pki, tmp_path, pki.deeper, chain=pki.deeper.pem)
        assert (await get(port, two, "depth1.test")).startswith(b"HTTP/1.1 400")
        assert (await get(port, two, "depth3.test")).startswith(b"HTTP/1.1 200")


async def test_another_hosts_connection_is_misdirected(pki: Pki, tmp_path: Path) -> None:
    # A connection made for plain.test (no certificate asked) carrying a request for
    # auth.test: nginx's 421, HTTP/1.1 and HTTP/2 alike; and a connection made for
    # optional.test (another CA context's rules) too.
    good = client_context(pki, tmp_path, pki.clients)
    async with front(pki, tmp_path) as (port, upstream):
        crossed = await get(port, good, "plain.test", host="auth.test")
        assert crossed.startswith(b"HTTP/1.1 421 Misdirected Request"), crossed[:200]
        other_rules = await get(port, good, "optional.test", host="auth.test")
        assert other_rules.startswith(b"HTTP/1.1 421"), other_rules[:200]
        # A wildcard host: another name under it is taken (the named difference).
        wild = await get(port, good, "a.wild.test", host="b.wild.test")
        assert wild.startswith(b"HTTP/1.1 200"), wild[:200]
        assert (await get(port, good, "a.wild.test", host="auth.test")).startswith(b"HTTP/1.1 421")

        h2 = client_context(pki, tmp_path, pki.clients)
        h2.set_alpn_protocols(["h2"])
        client = await H2Client.connect(port, tls=h2, server_hostname="plain.test")
        try:
            assert (await client.request("GET", "/", "plain.test")).status == 200
            assert (await client.request("GET", "/", "auth.test")).status == 421
        finally:
            await client.close()
        client = await H2Client.connect(port, tls=h2, server_hostname="auth.test")
        try:
            response = await client.request("GET", "/", "auth.test")
            assert response.status == 200
            assert json.loads(response.body)["headers"]
            # Another host with verification, even by the same CA and mode: 421, as
            # nginx (its server name is not the one negotiated).
            assert (await client.request("GET", "/", "cn.test")).status == 421
            assert (await client.request("GET", "/", "optional.test")).status == 421
            # A host without client-certificate rules takes the connection (as nginx).
            assert (await client.request("GET", "/", "plain.test")).status == 200
        finally:
            await client.close()
        assert upstream.received.count(b"GET ") == 4


async def test_a_resumed_session_keeps_its_hosts_rules(pki: Pki, tmp_path: Path) -> None:
    # A session made for plain.test, resumed under auth.test's name, never stands for
    # a certificate auth.test's CA verified (TLS 1.2 and 1.3: 421 or a full handshake).
    for version in (ssl.TLSVersion.TLSv1_2, ssl.TLSVersion.TLSv1_3):
        context = client_context(pki, tmp_path, pki.clients)
        context.maximum_version = version
        context.check_hostname = False
        async with front(pki, tmp_path) as (port, _):
            first = await asyncio.to_thread(_get, port, context, "plain.test", "plain.test", None)
            assert first[0].startswith(b"HTTP/1.1 200")
            again = await asyncio.to_thread(_get, port, context, "auth.test", "auth.test", first[1])
            status = again[0].split(b"\r\n", 1)[0]
            if again[2]:  # resumed: its certificate was never auth.test's to verify
                assert status.startswith(b"HTTP/1.1 421"), (version, status)
            else:
                assert status.startswith(b"HTTP/1.1 200"), (version, status)
            # auth.test's own session: a full handshake or a resumption, never a refusal.
            own = await asyncio.to_thread(_get, port, context, "auth.test", "auth.test", None)
            assert own[0].startswith(b"HTTP/1.1 200")
            back = await asyncio.to_thread(_get, port, context, "auth.test", "auth.test", own[1])
            assert back[0].startswith(b"HTTP/1.1 200"), (version, back[0][:100])


async def test_the_auth_url_service_gets_the_certificate_headers(pki: Pki, tmp_path: Path) -> None:
    # ingress-nginx's auth location sets ssl-client-verify/-subject-dn/-issuer-dn too
    # (nginx.tmpl, "Pass the extracted client certificate to the auth provider").
    auth = await RecordingUpstream().start()
    try:
        async with front(pki, tmp_path, auth.port) as (port, upstream):
            response = await get(port, client_context(pki, tmp_path, pki.clients), "extauth.test")
            assert response.startswith(b"HTTP/1.1 200"), response[:200]
            asked = bytes(auth.received)
            assert b"GET /auth HTTP/1.1\r\n" in asked
            assert b"\r\nssl-client-verify: SUCCESS\r\n" in asked
            assert b"\r\nssl-client-subject-dn: CN=authtls\r\n" in asked
            assert b"forged" not in asked and b"CN=admin" not in asked
            assert b"ssl-client-verify: SUCCESS" in bytes(upstream.received)
    finally:
        await auth.stop()


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI")
async def test_the_certificate_request_names_the_hosts_cas(pki: Pki, tmp_path: Path) -> None:
    # nginx's ssl_client_certificate names its CAs in the CertificateRequest (browsers
    # offer only certificates they issued); a host without rules asks for none.
    async with front(pki, tmp_path) as (port, _):
        for name, expected in (("auth.test", "CN = Client root"), ("plain.test", None)):
            process = await asyncio.create_subprocess_exec(
                "openssl", "s_client", "-connect", f"127.0.0.1:{port}", "-servername", name,
                "-tls1_2",
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
            )  # fmt: skip
            out, _ = await asyncio.wait_for(process.communicate(), 30)
            text = out.decode(errors="replace")
            if expected is None:
                assert "Acceptable client certificate CA names" not in text, text[-800:]
            else:
                listed = text.split("Acceptable client certificate CA names", 1)[1]
                assert expected in listed.split("\n", 2)[1], text[-800:]
