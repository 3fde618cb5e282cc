"""ingress-nginx external auth through the request core, real sockets: the auth
service's Set-Cookie (add_header, and auth-always-set-cookie's `always`), a 401's
WWW-Authenticate, and an https:// auth service (TLS 1.2+, its certificate verified
against the system's trust store). HTTP/1.1 and HTTP/2 clients, HTTP/1.1 and
HTTP/2 backends alike (waygate.proxy.extauth, authstep, h2upstream).

Ported from kubernetes/ingress-nginx test/e2e/annotations/auth.go (v1.15.1),
Context "cookie set by external authentication server": its auth service
answers /cookies/set/alma/armud with `Set-Cookie: alma=armud`
(tests/support/authservice.AuthService here), its backend / with 200 and
/error with 503."""

from __future__ import annotations

import asyncio
import logging
import ssl
from pathlib import Path
from typing import Any

import pytest

from tests.integration.proxy.test_request_core import (
    HOST,
    PAIRS,
    Backends,
    built,
    core_route,
)
from tests.integration.proxy.test_request_core import (  # the fixtures: the real backends
    auth as auth,  # and the auth service
)
from tests.integration.proxy.test_request_core import (
    backends as backends,
)
from tests.support.authservice import AuthService
from tests.support.h2client import H2Client
from tests.support.pki import LocalCA
from tests.support.proxyharness import running_proxy
from waygate.proxy import authcheck, extauth
from waygate.resolver.model import Cors, ExternalAuth, Route

pytestmark = pytest.mark.asyncio


class Answer:
    """An answer with every Set-Cookie kept (`cookies`; the proxy's own sticky cookie,
    if any, left out) and the other fields by lower-case name."""

    def __init__(self, status: int, fields: list[tuple[str, str]]) -> None:
        self.status = status
        self.headers = {k: v for k, v in fields if k != "set-cookie"}
        self.cookies = [v for k, v in fields if k == "set-cookie" and "HttpOnly" not in v]


async def ask(
    client: str, port: int, path: str = "/", headers: list[tuple[str, str]] | None = None
) -> Answer:
    """One GET from a client of that protocol, on a new connection."""
    if client == "h2c":
        h2 = await H2Client.connect(port)
        try:
            response = await h2.request("GET", path, HOST, headers)
        finally:
            await h2.close()
        return Answer(response.status, [(k.decode(), v.decode()) for k, v in response.headers])
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    extra = "".join(f"{k}: {v}\r\n" for k, v in headers or [])
    writer.write(
        f"GET {path} HTTP/1.1\r\nHost: {HOST}\r\n{extra}Connection: close\r\n\r\n".encode()
    )
    data = await asyncio.wait_for(reader.read(-1), 10)
    writer.close()
    lines = data.partition(b"\r\n\r\n")[0].decode("latin-1").split("\r\n")
    fields = [line.split(": ", 1) for line in lines[1:]]
    return Answer(int(lines[0].split(" ")[1]), [(k.lower(), v) for k, v in fields])


def _authed(backend: str, url: str, **kw: Any) -> Route:
    return core_route(backend, external_auth=ExternalAuth(url, **kw))


def _backend_error(backends: Backends, backend: str) -> str:
    """The path the backend answers 503 on (auth.go's /error)."""
    if backend == "h2c":
        backends.h2.answer_fields = [(b":status", b"503")]
    return "/status/503"


@pytest.mark.parametrize(("client", "backend"), PAIRS)
async def test_the_auth_cookie_goes_with_a_2xx_not_with_an_error(backends, auth, client, backend):
    # auth.go: It("user retains cookie by default"), It("user does not retain cookie
    # if upstream returns error status code").
    table = built([_authed(backend, auth.url("/cookies/set/alma/armud"))], [backends.endpoint()])
    async with running_proxy(table) as (_, port):
        ok = await ask(client, port, "/?a=b&c=d")
        failed = await ask(client, port, _backend_error(backends, backend))
    assert ok.status == 200 and ok.cookies == ["alma=armud"]
    assert failed.status == 503 and failed.cookies == []


@pytest.mark.parametrize(("client", "backend"), PAIRS)
async def test_always_set_cookie_goes_with_every_answer(backends, auth, client, backend):
    # auth.go: It("user with annotated ingress retains cookie if upstream returns
    # error status code") -- auth-always-set-cookie: "true".
    set_url = auth.url("/cookies/set/alma/armud")
    deny_url = auth.url("/cookies/deny/alma/armud")
    routes = [_authed(backend, set_url, always_set_cookie=True)]
    table = built(routes, [backends.endpoint()])
    async with running_proxy(table) as (_, port):
        ok = await ask(client, port, "/")
        failed = await ask(client, port, _backend_error(backends, backend))
    assert ok.status == 200 and ok.cookies == ["alma=armud"]
    assert failed.status == 503 and failed.cookies == ["alma=armud"]
    # The proxy's own 401 (the auth service said 401) carries it too, with `always`.
    for always, expected in ((True, ["alma=armud"]), (False, [])):
        table = built([_authed(backend, deny_url, always_set_cookie=always)], [backends.endpoint()])
        async with running_proxy(table) as (_, port):
            denied = await ask(client, port, "/")
        assert denied.status == 401 and denied.cookies == expected


@pytest.mark.parametrize(("client", "backend"), PAIRS)
async def test_a_401_passes_the_auth_services_challenge_and_signin_gets_the_cookie(
    backends, auth, client, backend
):
    # nginx's auth_request copies a 401's WWW-Authenticate to the client; the sign-in
    # redirect (a 302, one of add_header's statuses) carries the Set-Cookie.
    table = built([_authed(backend, auth.url())], [backends.endpoint()])
    async with running_proxy(table) as (server, port):
        denied = await ask(client, port, "/")
        assert server.metrics.refused["external_auth"] == 1
    assert denied.status == 401 and denied.headers["www-authenticate"] == "Bearer"
    signin = "https://login.test/start"
    route = _authed(backend, auth.url("/cookies/deny/alma/armud"), signin=signin)
    async with running_proxy(built([route], [backends.endpoint()])) as (_, port):
        redirected = await ask(client, port, "/x")
    assert redirected.status == 302 and redirected.headers["location"].startswith(signin)
    assert redirected.cookies == ["alma=armud"]
    assert backends.requests(backend) == 0


async def test_an_answer_with_set_cookie_is_never_cached(backends, auth):
    # nginx's proxy_cache stores no answer carrying Set-Cookie: one user's cookie
    # must not be handed to the next.
    route = _authed(
        "http/1.1",
        auth.url("/cookies/set/alma/armud"),
        cache_key="$remote_addr",
        cache_durations=((200, 300.0),),
    )
    async with running_proxy(built([route], [backends.endpoint()])) as (_, port):
        for _ in range(2):
            assert (await ask("http/1.1", port, "/")).status == 200
    assert len(auth.requests) == 2


@pytest.fixture
def tls_auth_ca(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """A CA the system trust store holds for this test (OpenSSL's SSL_CERT_FILE, what
    ssl.create_default_context reads) and a server context for 127.0.0.1 it issued."""
    ca = LocalCA()
    cert, key = ca.issue(ips=["127.0.0.1"])
    (tmp_path / "cert.pem").write_bytes(cert)
    (tmp_path / "key.pem").write_bytes(key)
    (tmp_path / "ca.pem").write_bytes(ca.pem)
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server.load_cert_chain(tmp_path / "cert.pem", tmp_path / "key.pem")
    monkeypatch.setattr(extauth, "_tls_context", None)
    yield server, tmp_path / "ca.pem", monkeypatch
    extauth._tls_context = None


@pytest.mark.parametrize(("client", "backend"), PAIRS)
async def test_an_https_auth_service_verified_by_the_system_trust_store(
    backends, tls_auth_ca, client, backend, caplog
):
    server, ca_file, monkeypatch = tls_auth_ca
    monkeypatch.setattr(authcheck, "_logged", {})
    caplog.set_level(logging.WARNING, logger="waygate.proxy.authcheck")
    service = await AuthService(tls=server).start()
    try:
        url = service.url("/auth")
        assert url.startswith("https://")
        table = built([_authed(backend, url)], [backends.endpoint()])
        # Not trusted (the default store knows no test CA): no answer, 500, fail closed.
        async with running_proxy(table) as (_, port):
            refused = await ask(client, port, "/", [("authorization", "Bearer good")])
        assert refused.status == 500 and backends.requests(backend) == 0
        # Its clients see a 500; the log says why (once a minute per service).
        (record,) = [r for r in caplog.records if r.name == "waygate.proxy.authcheck"]
        assert "unable to get local issuer certificate" in record.getMessage()
        monkeypatch.setenv("SSL_CERT_FILE", str(ca_file))
        extauth._tls_context = None
        async with running_proxy(table) as (_, port):
            passed = await ask(client, port, "/", [("authorization", "Bearer good")])
            denied = await ask(client, port, "/")
        assert passed.status == 200 and backends.requests(backend) == 1
        assert denied.status == 401
        assert service.requests[-1]["target"] == "/auth"
        context = extauth.tls_context()
        assert context.minimum_version == ssl.TLSVersion.TLSv1_2
        assert context.check_hostname and context.verify_mode == ssl.CERT_REQUIRED
    finally:
        await service.stop()


@pytest.mark.parametrize(("client", "backend"), PAIRS)
async def test_a_cors_routes_auth_refusals_carry_the_cors_headers(backends, auth, client, backend):
    # ingress-nginx's CORS more_set_headers reach the auth_request's 401 and the
    # sign-in location's 302 (its template renders CORS there too).
    plain = core_route(backend, external_auth=ExternalAuth(auth.url()), cors=Cors())
    async with running_proxy(built([plain], [backends.endpoint()])) as (_, port):
        denied = await ask(client, port, "/")
    signin = ExternalAuth(auth.url(), signin="https://login.test/")
    async with running_proxy(
        built([core_route(backend, external_auth=signin, cors=Cors())], [backends.endpoint()])
    ) as (_, port):
        redirected = await ask(client, port, "/")
    assert denied.status == 401 and denied.headers["access-control-allow-origin"] == "*"
    assert denied.headers["www-authenticate"] == "Bearer"
    assert redirected.status == 302 and redirected.headers["access-control-allow-origin"] == "*"
