"""ingress-nginx's access annotations and ConfigMap block lists -> RouteAccess
(waygate.resolver.ingress_nginx.access): what is honoured, and what refuses the
Ingress (fail closed). The proxy's side: tests/unit/proxy/test_access.py."""

from __future__ import annotations

import base64
from typing import Any

import bcrypt
import pytest

from tests.unit.resolver.test_ingress_nginx import P, by_ingress, ingress, objects, refusal, served
from waygate.core import digest
from waygate.resolver.gateway.translate import translate
from waygate.resolver.ingress_nginx.catalogue import Verdict
from waygate.resolver.ingress_nginx.config import ControllerConfig, IngressNginx, keeps_secret
from waygate.resolver.model import Route, RouteAccess

CONFIG = ("ingress-nginx", "controller")
SETTINGS = IngressNginx(configmap=CONFIG)


def configmap(**data: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": CONFIG[1], "namespace": CONFIG[0]},
        "data": data,
    }


def secret(name: str, data: dict[str, str], namespace: str = "default") -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": {"name": name, "namespace": namespace},
        "data": {k: base64.b64encode(v.encode()).decode() for k, v in data.items()},
    }


def routes(*items: dict[str, Any]) -> list[Route]:
    secrets = {
        (i["metadata"]["namespace"], i["metadata"]["name"]): i
        for i in items
        if i["kind"] == "Secret"
    }
    others = [i for i in items if i["kind"] != "Secret"]
    return translate(objects(*others, secrets=secrets), ingress_nginx=SETTINGS).routes


def access_of(found: list[Route], name: str) -> RouteAccess | None:
    [route] = by_ingress(found, name)
    assert route.ingress_refusal is None, route.ingress_refusal
    return route.access


def test_source_ranges_become_the_routes_access():
    found = routes(
        ingress(
            "ranges",
            {
                P + "whitelist-source-range": "192.168.0.0/16",
                P + "allowlist-source-range": "10.0.0.0/8, 172.16.0.0/12",
                P + "denylist-source-range": "10.1.0.0/16",
            },
        ),
        ingress("plain", host="plain.example.com"),
    )
    assert access_of(found, "ranges") == RouteAccess(
        deny=("10.1.0.0/16",), allow=("10.0.0.0/8", "172.16.0.0/12")
    )
    assert access_of(found, "plain") is None  # a route without them pays nothing
    [route] = by_ingress(found, "ranges")
    assert not any("source-range" in line for line in route.ingress_verdicts)


def test_use_forwarded_headers_trusts_proxy_real_ip_cidr():
    item = ingress("ranges", {P + "whitelist-source-range": "10.0.0.0/8"})
    found = routes(configmap(**{"use-forwarded-headers": "true"}), item)
    assert access_of(found, "ranges").trusted_proxies == ("0.0.0.0/0",)  # type: ignore[union-attr]
    found = routes(
        configmap(**{"use-forwarded-headers": "true", "proxy-real-ip-cidr": "10.0.0.0/8,::1"}),
        item,
    )
    assert access_of(found, "ranges").trusted_proxies == ("10.0.0.0/8", "::1")  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("data", "why"),
    [
        (
            {"use-forwarded-headers": "true", "forwarded-for-header": "X Client"},
            "is not a header name",
        ),
    ],
)
def test_a_client_address_the_proxy_cannot_find_refuses_source_ranges(data, why):
    found = routes(
        configmap(**data),
        ingress("ranges", {P + "denylist-source-range": "10.0.0.0/8"}),
        ingress("plain", host="plain.example.com"),
    )
    reason, message = refusal(found, "ranges")
    assert reason == "UnsupportedAnnotation" and why in message
    assert "denylist-source-range" in message
    assert served(found, "plain")


def test_forwarded_for_header_names_where_trusted_peers_give_the_client_address():
    # ingress-nginx's real_ip_header {{ $cfg.ForwardedForHeader }} (nginx.tmpl).
    data = {"use-forwarded-headers": "true", "forwarded-for-header": "CF-Connecting-IP"}
    found = routes(
        configmap(**data, **{"proxy-real-ip-cidr": "10.0.0.0/8"}),
        ingress("ranges", {P + "denylist-source-range": "192.0.2.0/24"}),
        ingress("plain", host="plain.example.com"),
    )
    for name in ("ranges", "plain"):
        [route] = by_ingress(found, name)
        assert route.ingress_refusal is None
        assert route.client_address_header == "cf-connecting-ip"
        assert route.access is not None and route.access.trusted_proxies == ("10.0.0.0/8",)
    assert access_of(found, "ranges").deny == ("192.0.2.0/24",)  # type: ignore[union-attr]
    # Without use-forwarded-headers the key changes nothing (nginx's real_ip is off).
    found = routes(
        configmap(**{"forwarded-for-header": "CF-Connecting-IP"}),
        ingress("plain", host="plain.example.com"),
    )
    [route] = by_ingress(found, "plain")
    assert route.client_address_header == "" and route.access is None


def _auth(**extra: str) -> dict[str, str]:
    return {
        P + "auth-type": "basic",
        P + "auth-secret": "htpasswd",
        P + "auth-realm": "staff",
        **extra,
    }


def test_basic_auth_reads_an_auth_file_and_an_auth_map():
    hashed = bcrypt.hashpw(b"bar", bcrypt.gensalt(4)).decode()
    found = routes(
        secret("htpasswd", {"auth": f"foo:{hashed}\n# ops\nann:{{PLAIN}}pw\n"}),
        ingress("file", _auth()),
    )
    access = access_of(found, "file")
    assert access == RouteAccess(
        auth_type="basic", auth_realm="staff", credentials=(f"foo:{hashed}", "ann:{PLAIN}pw")
    )
    found = routes(
        secret("htpasswd", {"foo": hashed}),
        ingress("map", _auth(**{P + "auth-secret-type": "auth-map"})),
    )
    assert access_of(found, "map").credentials == (f"foo:{hashed}",)  # type: ignore[union-attr]


def test_digest_auth_reads_htdigest_lines_from_a_file_and_a_map():
    # internal/ingress/annotations/auth: auth-file is the `auth` key; auth-map is a key
    # per user, its value the rest of the line ("realm:HA1" for digest).
    ha1 = digest.ha1("foo", "staff", "bar")
    found = routes(
        secret("htpasswd", {"auth": f"foo:staff:{ha1}\n# ops\nbad line\n"}),
        ingress("file", _auth(**{P + "auth-type": "digest"})),
    )
    [route] = by_ingress(found, "file")
    assert route.access == RouteAccess(
        auth_type="digest", auth_realm="staff", credentials=(f"foo:staff:{ha1}",)
    )
    # ingress-nginx clears the header towards the backend: proxy_set_header Authorization "".
    assert route.filters is not None and route.filters.request_headers is not None
    assert "Authorization" in route.filters.request_headers.remove
    verdicts = "\n".join(route.ingress_verdicts)
    assert "auth-type" in verdicts and "honoured-with-difference" in verdicts, verdicts
    found = routes(
        secret("htpasswd", {"foo": f"staff:{ha1}"}),
        ingress("map", _auth(**{P + "auth-type": "digest", P + "auth-secret-type": "auth-map"})),
    )
    assert access_of(found, "map").credentials == (f"foo:staff:{ha1}",)  # type: ignore[union-attr]


def test_basic_auth_clears_the_authorization_header_towards_the_backend():
    found = routes(secret("htpasswd", {"auth": "ann:{PLAIN}pw"}), ingress("b", _auth()))
    [route] = by_ingress(found, "b")
    assert route.filters is not None and route.filters.request_headers is not None
    assert route.filters.request_headers.remove == ("Authorization",)


def test_an_empty_hash_is_served_and_matches_nothing():
    # ingress-nginx e2e auth.go: a Secret "foo:" answers 401, not 503.
    found = routes(secret("htpasswd", {"auth": "foo:"}), ingress("empty", _auth()))
    assert access_of(found, "empty").credentials == ("foo:",)  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("items", "annotations", "why"),
    [
        ([], _auth(), "Secret default/htpasswd not found"),
        ([secret("htpasswd", {"users": "a:{PLAIN}b"})], _auth(), "has no key auth"),
        ([secret("htpasswd", {"auth": "a:abJnggxhB/yWI"})], _auth(), "cannot verify exactly"),
        ([secret("htpasswd", {"auth": "a:$6$s$x"})], _auth(), "user 'a'"),
        (
            [secret("htpasswd", {"auth": "a:{PLAIN}b"}, namespace="other")],
            _auth(**{P + "auth-secret": "other/htpasswd"}),
            "another namespace",
        ),
        (
            [secret("htpasswd", {"auth": "a:staff:" + "0" * 32})],
            _auth(**{P + "auth-type": "digest", P + "auth-realm": ""}),
            "no auth-realm",
        ),
        (
            [secret("htpasswd", {"auth": "a:{PLAIN}b"})],
            _auth(**{P + "auth-realm": "off"}),  # basic: `auth_basic "off"` turns it off
            "would be open",
        ),
        (
            [secret("htpasswd", {"auth": "a:staff:" + "0" * 32})],
            _auth(**{P + "auth-type": "digest", P + "auth-realm": "off"}),
            "would be open",
        ),
        (
            [secret("htpasswd", {"auth": "a:{PLAIN}b\nc:staff:xyz"})],
            _auth(**{P + "auth-type": "digest"}),
            "holds no user:realm:HA1 line",
        ),
    ],
)
def test_authentication_that_cannot_be_honoured_exactly_refuses_the_ingress(
    items, annotations, why
):
    found = routes(*items, ingress("guarded", annotations), ingress("plain", host="p.example.com"))
    reason, message = refusal(found, "guarded")
    assert reason == "UnsupportedAnnotation" and why in message, message
    assert served(found, "plain")


def test_satisfy_any_combines_ranges_and_credentials():
    found = routes(
        secret("htpasswd", {"auth": "a:{PLAIN}b"}),
        ingress(
            "either", _auth(**{P + "satisfy": "any", P + "whitelist-source-range": "10.0.0.0/8"})
        ),
    )
    access = access_of(found, "either")
    assert access is not None and access.satisfy_any and access.allow == ("10.0.0.0/8",)


def test_configmap_block_lists_reach_every_ingress_of_the_class():
    found = routes(
        configmap(
            **{
                "block-cidrs": "198.51.100.0/24",
                "block-user-agents": "~*curl,Exact Bot",
                "block-referers": "~^https://spam\\.",
            }
        ),
        ingress("a"),
        ingress("b", {P + "whitelist-source-range": "10.0.0.0/8"}, host="b.example.com"),
    )
    assert access_of(found, "a") == RouteAccess(
        block=("198.51.100.0/24",),
        block_user_agents=("~*curl", "Exact Bot"),
        block_referers=("~^https://spam\\.",),
    )
    assert access_of(found, "b").block == ("198.51.100.0/24",)  # type: ignore[union-attr]


@pytest.mark.parametrize(
    "data",
    [
        {"block-user-agents": "~*(unclosed"},
        {"block-referers": "~(?<=spam)\\.example"},  # lookbehind: RE2 cannot, refused
        {"block-cidrs": "not-a-cidr"},
    ],
)
def test_a_block_list_that_cannot_be_honoured_refuses_the_class(data):
    found = routes(configmap(**data), ingress("a"))
    assert refusal(found, "a")[0] == "UnsupportedConfiguration"


@pytest.mark.parametrize(
    ("data", "trusted"),
    [
        ({"use-proxy-protocol": "true"}, ()),
        # ingress-nginx's X-Forwarded-For-Proxy-Protocol rule: the header's address,
        # when within proxy-real-ip-cidr, lets X-Forwarded-For name the client.
        (
            {
                "use-proxy-protocol": "true",
                "use-forwarded-headers": "true",
                "proxy-real-ip-cidr": "10.0.0.0/8,192.168.0.1/32",
            },
            ("10.0.0.0/8", "192.168.0.1/32"),
        ),
    ],
)
def test_use_proxy_protocol_serves_source_ranges_and_block_lists(data, trusted):
    """The proxy started with --proxy-protocol makes the header's address the peer's:
    source ranges and block-cidrs are judged on it, so they are served (the key's own
    verdict, in the migration report, names the proxy setting)."""
    found = routes(
        configmap(**{**data, "block-cidrs": "198.51.100.0/24"}),
        ingress("ranges", {P + "whitelist-source-range": "192.168.0.0/16"}),
    )
    assert served(found, "ranges")
    access = access_of(found, "ranges")
    assert access == RouteAccess(
        block=("198.51.100.0/24",), allow=("192.168.0.0/16",), trusted_proxies=trusted
    )
    [route] = by_ingress(found, "ranges")
    assert not any("source-range" in line for line in route.ingress_verdicts)
    # The route says so, for a proxy without --proxy-protocol to report the mismatch.
    assert route.client_proxy_protocol
    [plain] = by_ingress(routes(configmap(), ingress("ranges")), "ranges")
    assert not plain.client_proxy_protocol


def test_use_proxy_protocol_verdicts():
    verdicts = {
        v.key: v
        for v in ControllerConfig(
            {"use-proxy-protocol": "true", "proxy-protocol-header-timeout": "10s"}
        ).verdicts()
    }
    assert verdicts["use-proxy-protocol"].verdict is Verdict.DIFFERENT
    assert "--proxy-protocol" in verdicts["use-proxy-protocol"].note
    assert verdicts["proxy-protocol-header-timeout"].verdict is Verdict.DIFFERENT
    assert "--proxy-protocol-timeout" in verdicts["proxy-protocol-header-timeout"].note
    [off] = ControllerConfig({"use-proxy-protocol": "false"}).verdicts()
    assert off.verdict is Verdict.HONOURED


def test_opaque_secrets_are_kept_only_with_ingress_nginx():
    opaque = secret("htpasswd", {"auth": "a:{PLAIN}b"})
    assert keeps_secret(opaque, SETTINGS) and not keeps_secret(opaque, None)
    assert keeps_secret({"type": "kubernetes.io/tls"}, None)
    assert not keeps_secret({"type": "kubernetes.io/service-account-token"}, SETTINGS)
