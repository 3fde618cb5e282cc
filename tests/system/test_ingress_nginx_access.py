"""ingress-nginx's access annotations (client certificates too) and ConfigMap block
lists through a real resolver (--manifests --ingress-nginx) and proxy, on mTLS
between them.

The resolver sends route credentials (htpasswd hashes) over Watch only where it
sends private keys: to a --route-readers identity on an mTLS listener. So this
suite runs the resolver with a serving certificate and a client CA, and the proxy
with a client certificate whose SPIFFE ID is the one route reader (tests/support/
pki.LocalCA; real TLS, real processes). The last test checks the other side: a
proxy on a plaintext connection gets no credentials and answers 503, never 200.

Each test ports the assertions of one of ingress-nginx's own end-to-end tests
(kubernetes/ingress-nginx test/e2e/annotations/{ipwhitelist,ipdenylist,auth,
satisfy,authtls}.go and test/e2e/settings/global_access_block.go), cited by file and
`It`. ingress-nginx's tests check the rendered nginx.conf (`deny 18.0.0.0/8;`);
Waygate renders none, so each asserts the behaviour that configuration has, from
127.0.0.1 (the test client). Differences are named where they apply.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import re
import ssl
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import bcrypt
import pytest
import pytest_asyncio
import yaml

from tests.support.gatewayapi import INFRA, Conformance, tls_client_context
from tests.support.pki import LocalCA
from tests.system.test_ingress_nginx import P, single_ingress

pytestmark = [pytest.mark.system, pytest.mark.asyncio(loop_scope="module")]

V1 = f"{INFRA}/infra-backend-v1"
PROXY_ID = "spiffe://waygate.test/proxy"
# ingress-nginx's buildSecret uses bcrypt cost 14 (about a second per check);
# cost 4 keeps the suite fast: the format and verification are the same.
HASH = bcrypt.hashpw(b"bar", b"$2b$04$" + b"waygateaccesstestsalt.").decode()


def controller(**data: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "ingress-nginx-controller", "namespace": "ingress-nginx"},
        "data": data,
    }


def opaque(name: str, data: dict[str, str]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": {"name": name, "namespace": INFRA},
        "data": {k: base64.b64encode(v.encode()).decode() for k, v in data.items()},
    }


def basic(user: str, password: str) -> dict[str, str]:
    token = base64.b64encode(f"{user}:{password}".encode()).decode()
    return {"Authorization": "Basic " + token}


def pki(directory: Path) -> tuple[list[str], list[str]]:
    """(resolver flags, proxy flags) for mTLS with the proxy as the route reader."""
    ca = LocalCA()
    resolver = ca.write_files(directory / "resolver", dns=["localhost"], ips=["127.0.0.1"])
    proxy = ca.write_files(directory / "proxy", uris=[PROXY_ID])
    return (
        [
            "--tls-cert-file", str(resolver.cert), "--tls-key-file", str(resolver.key),
            "--tls-client-ca-file", str(resolver.ca), "--route-readers", PROXY_ID,
        ],
        [
            "--tls-cert-file", str(proxy.cert), "--tls-key-file", str(proxy.key),
            "--tls-client-ca-file", str(proxy.ca),
        ],
    )  # fmt: skip


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def suite(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Conformance]:
    resolver_tls, proxy_tls = pki(tmp_path_factory.mktemp("pki"))
    conformance = Conformance(
        tmp_path_factory.mktemp("manifests"),
        resolver_args=(
            "--ingress-nginx",
            "--ingress-nginx-configmap",
            "ingress-nginx/ingress-nginx-controller",
            *resolver_tls,
        ),
    )
    await conformance.start(*proxy_tls)
    try:
        yield conformance
    finally:
        await conformance.stop()


async def apply(
    suite: Conformance, *objects: dict[str, Any], config: dict[str, str] | None = None
) -> None:
    await suite.apply(extra=yaml.safe_dump_all([controller(**(config or {})), *objects]))


async def test_ip_allowlist(suite: Conformance) -> None:
    # ipwhitelist.go: It("should set valid ip whitelist range") -- whitelist
    # "18.0.0.0/8, 56.0.0.0/8": a client outside it (127.0.0.1 here) is refused 403;
    # allowlist-source-range is the same annotation under its current name.
    outside = single_ingress(
        "ipwhitelist",
        "/",
        "ipwhitelist.foo.com",
        {P + "whitelist-source-range": "18.0.0.0/8, 56.0.0.0/8"},
    )
    inside = single_ingress(
        "ipallowlist", "/", "ipallowlist.foo.com", {P + "allowlist-source-range": "127.0.0.1/32"}
    )
    await apply(suite, outside, inside)
    response = await suite.request("/", host="ipwhitelist.foo.com")
    assert response.status == 403
    assert response.header("X-Waygate-Error") == "the client address is not allowed"
    await suite.eventually("/", host="ipallowlist.foo.com", backend=V1)


async def test_ip_denylist(suite: Conformance) -> None:
    # ipdenylist.go: It("should set valid ip denylist range when whitelist") and
    # It("... when whitelist is set"): deny first, then allow, then deny all.
    denied = single_ingress(
        "ipdenylist",
        "/",
        "ipdenylist.foo.com",
        {P + "denylist-source-range": "18.0.0.0/8, 127.0.0.0/8"},
    )
    both = single_ingress(
        "both",
        "/",
        "ipdenylist2.foo.com",
        {
            P + "denylist-source-range": "18.0.0.0/8, 56.0.0.0/8",
            P + "whitelist-source-range": "127.0.0.0/8",
        },
    )
    overlap = single_ingress(
        "overlap",
        "/",
        "ipdenylist3.foo.com",
        {P + "denylist-source-range": "127.0.0.1/32", P + "whitelist-source-range": "127.0.0.0/8"},
    )
    await apply(suite, denied, both, overlap)
    assert (await suite.request("/", host="ipdenylist.foo.com")).status == 403
    await suite.eventually("/", host="ipdenylist2.foo.com", backend=V1)
    assert (await suite.request("/", host="ipdenylist3.foo.com")).status == 403


async def test_the_client_address_from_x_forwarded_for(suite: Conformance) -> None:
    # settings/enable_real_ip.go and real_ip_recursive_search.go: with
    # use-forwarded-headers the client is the address X-Forwarded-For names through
    # trusted proxies (proxy-real-ip-cidr, 0.0.0.0/0 by default); without it the
    # header is the client's own claim and changes nothing.
    item = single_ingress("xff", "/", "xff.foo.com", {P + "whitelist-source-range": "18.0.0.0/8"})
    spoof = {"X-Forwarded-For": "18.1.2.3"}
    await apply(suite, item)
    assert (await suite.request("/", host="xff.foo.com", headers=spoof)).status == 403
    await apply(suite, item, config={"use-forwarded-headers": "true"})
    await suite.eventually("/", host="xff.foo.com", backend=V1, headers=spoof)
    # 127.0.0.1 is not a trusted proxy: its header is not believed.
    await apply(
        suite, item, config={"use-forwarded-headers": "true", "proxy-real-ip-cidr": "10.0.0.0/8"}
    )
    assert (await suite.request("/", host="xff.foo.com", headers=spoof)).status == 403


async def test_basic_auth(suite: Conformance) -> None:
    # auth.go: It("should return status code 401 when authentication is configured
    # but Authorization header is not configured"), It("... sent with invalid
    # credentials"), It("should return status code 200 when authentication is
    # configured and Authorization header is sent"), It("... with a map ..."),
    # It("should return status code 401 when authentication is configured with
    # invalid content and Authorization header is sent").
    auth = {P + "auth-type": "basic", P + "auth-secret": "test", P + "auth-realm": "test auth"}
    await apply(
        suite,
        opaque("test", {"auth": f"foo:{HASH}\n"}),
        opaque("map", {"foo": HASH}),
        opaque("invalid", {"auth": "foo:"}),
        single_ingress("auth", "/", "auth", auth),
        single_ingress(
            "map",
            "/",
            "auth-map",
            {**auth, P + "auth-secret": "map", P + "auth-secret-type": "auth-map"},
        ),
        single_ingress("invalid", "/", "auth-invalid", {**auth, P + "auth-secret": "invalid"}),
    )
    response = await suite.eventually("/", host="auth", status=401)
    assert b"401 Authorization Required" in response.body
    assert response.header("WWW-Authenticate") == 'Basic realm="test auth"'
    assert (await suite.request("/", host="auth", headers=basic("user", "pass"))).status == 401
    response = await suite.request("/", host="auth", headers=basic("foo", "bar"))
    assert response.status == 200 and response.backend == V1
    # The backend never sees the credentials: ingress-nginx renders
    # `proxy_set_header Authorization "";` with auth_basic (its nginx.tmpl).
    assert response.request_header("Authorization") is None
    assert (await suite.request("/", host="auth-map", headers=basic("foo", "bar"))).status == 200
    assert (
        await suite.request("/", host="auth-invalid", headers=basic("foo", "bar"))
    ).status == 401


async def test_basic_auth_401_with_cors_headers(suite: Conformance) -> None:
    # auth.go: It("should return status code 401 and cors headers when authentication
    # and cors is configured but Authorization header is not configured").
    auth = {
        P + "auth-type": "basic",
        P + "auth-secret": "test",
        P + "auth-realm": "test auth",
        P + "enable-cors": "true",
    }
    await apply(
        suite, opaque("test", {"auth": f"foo:{HASH}\n"}), single_ingress("auth", "/", "auth", auth)
    )
    response = await suite.request("/", host="auth")
    assert response.status == 401
    assert response.header("Access-Control-Allow-Origin") == "*"


def digest_get(port: int, host: str, user: str, password: str) -> tuple[int, bytes, str]:
    """A GET through Python's own Digest client (urllib's HTTPDigestAuthHandler: an
    independent RFC 2617 implementation), answering the proxy's challenge:
    (status, body, the last WWW-Authenticate)."""
    url = f"http://127.0.0.1:{port}/digest?x=1"
    passwords = urllib.request.HTTPPasswordMgrWithDefaultRealm()
    passwords.add_password(None, url, user, password)
    opener = urllib.request.build_opener(urllib.request.HTTPDigestAuthHandler(passwords))
    request = urllib.request.Request(url, headers={"Host": host})
    try:
        with opener.open(request, timeout=10) as answer:
            return answer.status, answer.read(), ""
    except urllib.error.HTTPError as error:
        return error.code, error.read(), error.headers.get("WWW-Authenticate", "")


async def test_digest_auth(suite: Conformance) -> None:
    # ingress-nginx's auth.go has no digest case ("TODO: test Digest Auth"); these are
    # nginx-http-auth-digest's rules (the module ingress-nginx builds in), asserted
    # with Python's own Digest client: the challenge, the right password (auth-file
    # and auth-map), a wrong one, and the credentials kept from the backend.
    realm = "test digest"
    ha1 = hashlib.md5(f"foo:{realm}:bar".encode()).hexdigest()
    auth = {P + "auth-type": "digest", P + "auth-secret": "htdigest", P + "auth-realm": realm}
    await apply(
        suite,
        opaque("htdigest", {"auth": f"foo:{realm}:{ha1}\n"}),
        opaque("htdigest-map", {"foo": f"{realm}:{ha1}"}),
        single_ingress("digest", "/", "digest", auth),
        single_ingress(
            "digest-map",
            "/",
            "digest-map",
            {**auth, P + "auth-secret": "htdigest-map", P + "auth-secret-type": "auth-map"},
        ),
        single_ingress("digest-open", "/", "digest-open", {**auth, P + "auth-realm": ""}),
    )
    challenged = await suite.eventually("/", host="digest", status=401)
    assert re.fullmatch(
        f'Digest algorithm="MD5", qop="auth", realm="{realm}", nonce="[0-9a-f]{{16}}"',
        challenged.header("WWW-Authenticate") or "",
    )
    for host in ("digest", "digest-map"):
        status, body, _ = await asyncio.to_thread(digest_get, suite.port, host, "foo", "bar")
        assert status == 200, (host, status, body)
        echo = json.loads(body)
        assert echo["target"] == "/digest?x=1"
        assert not [v for k, v in echo["headers"] if k.lower() == "authorization"]
    # A wrong password: challenged again; urllib's client retries it until the
    # module's evasion (5 failures within 300 s) holds this address off: a 401
    # without a challenge, the right password included (so this comes last).
    status, _, challenge = await asyncio.to_thread(digest_get, suite.port, "digest", "foo", "x")
    assert status == 401 and challenge == ""
    status, _, challenge = await asyncio.to_thread(digest_get, suite.port, "digest", "foo", "bar")
    assert status == 401 and challenge == ""
    held = await suite.request("/", host="digest-map")
    assert held.status == 401 and held.header("WWW-Authenticate") is None
    # Without auth-realm nginx's module would ask for nothing: not served at all.
    assert (await suite.request("/", host="digest-open")).status == 404


async def test_basic_auth_with_a_missing_secret_is_not_served(suite: Conformance) -> None:
    # auth.go: It("should return status code 503 when authentication is configured
    # with an invalid secret") -- ingress-nginx denies the location (503); Waygate
    # does not serve the Ingress at all (its routes Admitted False: no route, 404)
    # and keeps serving the others ("keeps processing new ingresses even if one of
    # the existing ingresses is misconfigured").
    auth = {P + "auth-type": "basic", P + "auth-secret": "something", P + "auth-realm": "test auth"}
    await apply(
        suite,
        single_ingress("auth", "/", "auth", auth),
        single_ingress("different", "/", "different"),
    )
    await suite.eventually("/", host="different", backend=V1)
    assert (await suite.request("/", host="auth")).status == 404


async def test_satisfy(suite: Conformance) -> None:
    # satisfy.go: It("should configure satisfy directive correctly") (all and any
    # both serve a request that passes), and It("should allow multiple auth with
    # satisfy any") with basic auth and a source range in place of auth-url
    # (external authentication is another rule): either suffices, 401 when both fail.
    await apply(
        suite,
        opaque("basic-secret", {"auth": f"uname:{HASH}"}),
        single_ingress("satisfy", "/", "satisfy", {P + "satisfy": "all"}),
        single_ingress(
            "any",
            "/",
            "any",
            {
                P + "auth-type": "basic",
                P + "auth-secret": "basic-secret",
                P + "auth-realm": "test basic auth",
                P + "whitelist-source-range": "18.0.0.0/8",
                P + "satisfy": "any",
            },
        ),
        single_ingress(
            "all",
            "/",
            "all",
            {
                P + "auth-type": "basic",
                P + "auth-secret": "basic-secret",
                P + "whitelist-source-range": "18.0.0.0/8",
            },
        ),
    )
    await suite.eventually("/", host="satisfy", backend=V1)
    assert (await suite.request("/", host="any", headers=basic("uname", "bar"))).status == 200
    assert (await suite.request("/", host="any")).status == 401
    # satisfy all (the default): the address refuses whatever the credentials.
    assert (await suite.request("/", host="all", headers=basic("uname", "bar"))).status == 403


async def test_global_access_block(suite: Conformance) -> None:
    # settings/global_access_block.go: It("should block CIDRs defined in the
    # ConfigMap"), It("should block User-Agents ..."), It("should block Referers ...").
    host = "global-access-block"
    item = single_ingress(host, "/", host)
    await apply(suite, item, config={"block-cidrs": "172.16.0.0/12,192.168.0.0/16,127.0.0.0/8"})
    assert (await suite.request("/", host=host)).status == 403
    await apply(
        suite,
        item,
        config={
            "block-user-agents": "~*chrome\\/68\\.0\\.3440\\.106\\ safari\\/537\\.36,AlphaBot",
            "block-referers": "~*example\\.com,qwerty",
        },
    )
    chrome = (
        "Mozilla/5.0 (Windows NT 10.0; Win64; x64) AppleWebKit/537.36 (KHTML, like Gecko) "
        "Chrome/68.0.3440.106 Safari/537.36"
    )
    iphone = (
        "Mozilla/5.0 (iPhone; CPU iPhone OS 11_4_1 like Mac OS X) AppleWebKit/605.1.15 "
        "(KHTML, like Gecko) Version/11.0 Mobile/15E148 Safari/604.1"
    )
    await suite.eventually("/", host=host, backend=V1, headers={"User-Agent": iphone})
    for headers in (
        {"User-Agent": chrome},
        {"User-Agent": "AlphaBot"},
        {"Referer": "example.com"},
        {"Referer": "qwerty"},
    ):
        assert (await suite.request("/", host=host, headers=headers)).status == 403, headers
    assert (await suite.request("/", host=host, headers={"Referer": "qwerty123"})).status == 200


# ---------------------------------------------------------------- auth-tls-*
# test/e2e/annotations/authtls.go, against the same resolver and proxy: the route's
# private key and client CA reach this proxy (a route reader over mTLS).

AUTHTLS_HOST = "authtls.foo.com"


class MutualAuth:
    """framework.CreateIngressMASecret: one Secret (tls.crt, tls.key, ca.crt) from one CA,
    and a client certificate from it (CN <host>-client)."""

    def __init__(self, directory: Path, host: str = AUTHTLS_HOST) -> None:
        self.ca = LocalCA(name=host + "-ca")
        self.server = self.ca.issue(dns=[host])
        cert, key = self.ca.issue(common_name=host + "-client", client_only=True)
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "client.pem").write_bytes(cert + key)
        self.client_file = directory / "client.pem"

    def secret(self, name: str = AUTHTLS_HOST) -> dict[str, Any]:
        data = {"tls.crt": self.server[0], "tls.key": self.server[1], "ca.crt": self.ca.pem}
        return {
            "apiVersion": "v1",
            "kind": "Secret",
            "type": "kubernetes.io/tls",
            "metadata": {"name": name, "namespace": INFRA},
            "data": {k: base64.b64encode(v).decode() for k, v in data.items()},
        }

    def client(self) -> ssl.SSLContext:
        """HTTPTestClientWithTLSConfig(clientConfig): InsecureSkipVerify, the client pair."""
        context = tls_client_context()
        context.load_cert_chain(self.client_file)
        return context


def tls_ingress(name: str, host: str, annotations: dict[str, str]) -> dict[str, Any]:
    """framework.NewSingleIngressWithTLS: the host's TLS from the Secret named after it."""
    ingress = single_ingress(name, "/", host, annotations)
    ingress["spec"]["tls"] = [{"hosts": [host], "secretName": host}]
    return ingress


async def https(suite: Conformance, host: str, client: ssl.SSLContext | None = None) -> Any:
    return await suite.request("/", host=host, tls=client or tls_client_context())


@pytest.fixture(scope="module")
def mutual(tmp_path_factory: pytest.TempPathFactory) -> MutualAuth:
    return MutualAuth(tmp_path_factory.mktemp("authtls"))


async def test_auth_tls_secret_verify_client_and_depth(
    suite: Conformance, mutual: MutualAuth
) -> None:
    # authtls.go: It("should set sslClientCertificate, sslVerifyClient and sslVerifyDepth
    # with auth-tls-secret"): without the annotation no certificate is asked for (200);
    # with it (verify "on", depth 1 by default) none is a 400 and the client's a 200.
    # It("should set valid auth-tls-secret, sslVerify to off, and sslVerifyDepth to 2"):
    # off, without a certificate: 200.
    off_host = "authtls-off.foo.com"
    off = MutualAuth(mutual.client_file.parent / "off", off_host)
    await apply(suite, mutual.secret(), tls_ingress("authtls", AUTHTLS_HOST, {}))
    assert (await https(suite, AUTHTLS_HOST)).status == 200
    secret = {P + "auth-tls-secret": f"{INFRA}/{AUTHTLS_HOST}"}
    off_annotations = {
        P + "auth-tls-secret": f"{INFRA}/{off_host}",
        P + "auth-tls-verify-client": "off",
        P + "auth-tls-verify-depth": "2",
    }
    await apply(
        suite,
        mutual.secret(),
        off.secret(off_host),
        tls_ingress("authtls", AUTHTLS_HOST, secret),
        tls_ingress("authtls-off", off_host, off_annotations),
    )
    missing = await https(suite, AUTHTLS_HOST)
    assert missing.status == 400
    assert missing.header("X-Waygate-Error") == "No required SSL certificate was sent"
    ok = await https(suite, AUTHTLS_HOST, mutual.client())
    assert ok.status == 200 and ok.backend == V1
    assert ok.request_header("ssl-client-verify") == "SUCCESS"
    assert ok.request_header("ssl-client-subject-dn") == f"CN={AUTHTLS_HOST}-client"
    assert ok.request_header("ssl-client-cert") is None  # pass-certificate is off
    assert (await https(suite, off_host)).status == 200


async def test_auth_tls_error_page_and_pass_certificate(
    suite: Conformance, mutual: MutualAuth
) -> None:
    # authtls.go: It("should 302 redirect to error page instead of 400 when
    # auth-tls-error-page is set") and It("should pass URL-encoded certificate to
    # upstream") (the echo's body there: "ssl-client-cert=-----BEGIN%20CERTIFICATE-----%0A").
    error_host = "authtls-error.foo.com"
    errors = MutualAuth(mutual.client_file.parent / "errors", error_host)
    error_page = f"http://127.0.0.1:{suite.port}/error"
    await apply(
        suite,
        mutual.secret(),
        errors.secret(error_host),
        tls_ingress(
            "authtls",
            AUTHTLS_HOST,
            {
                P + "auth-tls-secret": f"{INFRA}/{AUTHTLS_HOST}",
                P + "auth-tls-pass-certificate-to-upstream": "true",
            },
        ),
        tls_ingress(
            "authtls-error",
            error_host,
            {P + "auth-tls-secret": f"{INFRA}/{error_host}", P + "auth-tls-error-page": error_page},
        ),
    )
    redirected = await https(suite, error_host)
    assert redirected.status == 302 and redirected.header("Location") == error_page
    assert (await https(suite, error_host, errors.client())).status == 200
    assert (await https(suite, AUTHTLS_HOST)).status == 400
    passed = await https(suite, AUTHTLS_HOST, mutual.client())
    assert passed.status == 200
    assert passed.request_header("ssl-client-cert").startswith("-----BEGIN%20CERTIFICATE-----%0A")


async def test_auth_tls_verify_client_updated(suite: Conformance, mutual: MutualAuth) -> None:
    # authtls.go: It("should validate auth-tls-verify-client"): on (200 with the
    # certificate, 400 without), then the Ingress updated to off (200 both ways).
    on = {P + "auth-tls-secret": f"{INFRA}/{AUTHTLS_HOST}", P + "auth-tls-verify-client": "on"}
    await apply(suite, mutual.secret(), tls_ingress("authtls", AUTHTLS_HOST, on))
    assert (await https(suite, AUTHTLS_HOST, mutual.client())).status == 200
    assert (await https(suite, AUTHTLS_HOST)).status == 400
    off = {**on, P + "auth-tls-verify-client": "off"}
    await apply(suite, mutual.secret(), tls_ingress("authtls", AUTHTLS_HOST, off))
    assert (await https(suite, AUTHTLS_HOST, mutual.client())).status == 200
    assert (await https(suite, AUTHTLS_HOST)).status == 200


async def test_auth_tls_match_cn(suite: Conformance, mutual: MutualAuth) -> None:
    # authtls.go: It("should return 403 using auth-tls-match-cn with no matching CN from
    # client"), It("... with matching CN from client"), It("should reload the nginx
    # config when auth-tls-match-cn is updated") and It("... where atleast one of the
    # regex options matches CN from client").
    def annotations(match: str) -> dict[str, str]:
        return {
            P + "auth-tls-secret": f"{INFRA}/{AUTHTLS_HOST}",
            P + "auth-tls-verify-client": "on",
            P + "auth-tls-match-cn": match,
        }

    for match, status in (
        ("CN=notgonnamatch", 403),
        ("CN=authtls", 200),
        ("CN=(itwillmatch|withthenextoption|authtls)", 200),
        ("CN=notvalid", 403),
        ("CN=authtls", 200),  # the update: served at once, nothing to reload
    ):
        await apply(
            suite, mutual.secret(), tls_ingress("authtls", AUTHTLS_HOST, annotations(match))
        )
        response = await https(suite, AUTHTLS_HOST, mutual.client())
        assert response.status == status, (match, response.status, response.body[:200])
        if status == 403:
            assert response.header("X-Waygate-Error") == "client certificate unauthorized"


async def test_credentials_withheld_from_a_plaintext_proxy_fail_closed(tmp_path: Path) -> None:
    """A resolver without mTLS sends no credentials (as it sends no private keys):
    its proxy answers an authenticated route 503 with the reason, never 200."""
    plain = Conformance(tmp_path, resolver_args=("--ingress-nginx",))
    await plain.start()
    try:
        auth = {P + "auth-type": "basic", P + "auth-secret": "test"}
        await plain.apply(
            extra=yaml.safe_dump_all(
                [opaque("test", {"auth": f"foo:{HASH}"}), single_ingress("auth", "/", "auth", auth)]
            )
        )
        response = await plain.eventually("/", host="auth", status=503, headers=basic("foo", "bar"))
        assert (
            response.header("X-Waygate-Error")
            == "the route's credentials are withheld from this proxy"
        )
    finally:
        await plain.stop()
