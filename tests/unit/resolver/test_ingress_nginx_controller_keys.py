"""The controller ConfigMap's server-tokens, ssl-protocols, ssl-ciphers and
forwarded-for-header -> route fields and key verdicts
(waygate.resolver.ingress_nginx.config). The proxy's side:
tests/integration/proxy/test_ingress_nginx_controller_keys.py."""

from __future__ import annotations

import dataclasses

import pytest
import yaml

from tests.support.gatewayapi import tls_secret
from tests.unit.resolver.test_ingress_nginx import P, ingress, objects
from tests.unit.resolver.test_ingress_nginx_access import CONFIG, SETTINGS, configmap
from waygate.core.errors import InvalidArgument
from waygate.resolver.gateway.translate import translate
from waygate.resolver.ingress_nginx.catalogue import Verdict
from waygate.resolver.ingress_nginx.config import config_from
from waygate.resolver.model import Route, TLSTermination
from waygate.resolver.validation import validate_route


def tls_routes(data: dict[str, str], annotations: dict[str, str] | None = None) -> list[Route]:
    secret = yaml.safe_load(tls_secret("default", "cert", "app.example.com"))
    found = objects(
        configmap(**data),
        ingress("tls", annotations or {}, tls=True),
        secrets={("default", "cert"): secret},
    )
    return translate(found, ingress_nginx=SETTINGS).routes


def verdict(data: dict[str, str], key: str) -> tuple[Verdict, str]:
    [found] = [v for v in config_from({"data": data}).verdicts() if v.key == key]
    return found.verdict, found.note


def test_server_tokens_off_by_default_clears_the_server_header():
    # nginx.tmpl: `server_tokens off; more_clear_headers Server;` unless server-tokens.
    for data in ({}, {"server-tokens": "false"}):
        for route in tls_routes(data):
            assert route.filters is not None and route.filters.response_headers is not None
            assert route.filters.response_headers.remove == ("Server",)
            assert route.filters.response_headers.set == ()
    assert verdict({"server-tokens": "false"}, "server-tokens") == (Verdict.HONOURED, "")


def test_server_tokens_on_replaces_the_backends_server_without_a_version():
    for route in tls_routes({"server-tokens": "true"}):
        assert route.filters is not None and route.filters.response_headers is not None
        assert route.filters.response_headers.set == (("Server", "waygate"),)
    found, note = verdict({"server-tokens": "true"}, "server-tokens")
    assert found is Verdict.DIFFERENT and "without a version" in note
    # allow-backend-server-header: nginx's proxy_pass_header Server.
    data = {"server-tokens": "true", "allow-backend-server-header": "true"}
    for route in tls_routes(data):
        headers = route.filters.response_headers if route.filters else None
        assert headers is None or not (headers.set or headers.remove)
    # A configuration-snippet's more_set_headers comes after the http-level clear.
    snippet = {P + "configuration-snippet": 'more_set_headers "Server: mine";'}
    allowed = {"allow-snippet-annotations": "true", "annotations-risk-level": "Critical"}
    for route in tls_routes(allowed, snippet):
        assert route.filters is not None and route.filters.response_headers is not None
        assert route.filters.response_headers.set == (("Server", "mine"),)


@pytest.mark.parametrize(
    ("value", "protocols", "expected", "words"),
    [
        ("TLSv1.2 TLSv1.3", (), Verdict.HONOURED, ""),
        ("TLSv1.3", ("TLSv1.3",), Verdict.HONOURED, ""),
        ("TLSv1 TLSv1.1 TLSv1.2 TLSv1.3", (), Verdict.DIFFERENT, "TLSv1 TLSv1.1 not served"),
        ("TLSv1.1 TLSv1.3", ("TLSv1.3",), Verdict.DIFFERENT, "TLSv1.1 not served"),
        ("TLSv1.2", (), Verdict.DIFFERENT, "offering TLS 1.3 gets it"),
        ("SSLv3 TLSv1", (), Verdict.NOT_HONOURED, "keep TLSv1.2 and TLSv1.3"),
        ("TLSv9", (), Verdict.NOT_HONOURED, "not a protocol"),
    ],
)
def test_ssl_protocols_narrow_the_hosts_versions_never_below_tls_1_2(
    value, protocols, expected, words
):
    data = {"ssl-protocols": value}
    secure = [r for r in tls_routes(data) if r.listener_port == 443]
    assert secure and all(r.tls is not None and r.tls.protocols == protocols for r in secure)
    assert all(r.ingress_refusal is None for r in secure)
    found, note = verdict(data, "ssl-protocols")
    assert found is expected and words in note


def test_ssl_ciphers_is_a_checked_openssl_list_for_tls_1_2():
    # ingress-nginx test/e2e/settings/tls.go "setting cipher suite".
    ciphers = "ECDHE-RSA-AES256-GCM-SHA384:ECDHE-RSA-AES256-SHA"
    secure = [r for r in tls_routes({"ssl-ciphers": ciphers}) if r.listener_port == 443]
    assert secure and secure[0].tls is not None and secure[0].tls.ciphers == ciphers
    assert verdict({"ssl-ciphers": ciphers}, "ssl-ciphers")[0] is Verdict.HONOURED
    plain = [r for r in tls_routes({"ssl-ciphers": ciphers}) if r.listener_port == 80]
    assert plain and all(r.tls is None for r in plain)
    # Configuration text, a cipher OpenSSL does not know, a list without TLS 1.2 suites.
    for bad in (
        "HIGH; ssl_protocols SSLv3",
        "NOT-A-CIPHER",
        "TLS_AES_128_GCM_SHA256",
        "ALL:@SECLEVEL=0",
    ):
        secure = [r for r in tls_routes({"ssl-ciphers": bad}) if r.listener_port == 443]
        assert secure and secure[0].tls is not None and secure[0].tls.ciphers == ""
        assert secure[0].ingress_refusal is None
        assert verdict({"ssl-ciphers": bad}, "ssl-ciphers")[0] is Verdict.NOT_HONOURED


def test_a_configmap_change_applies_to_the_next_translation():
    before = [r for r in tls_routes({}) if r.listener_port == 443]
    after = [r for r in tls_routes({"ssl-protocols": "TLSv1.3"}) if r.listener_port == 443]
    assert before[0].tls is not None and before[0].tls.protocols == ()
    assert after[0].tls is not None and after[0].tls.protocols == ("TLSv1.3",)


def test_forwarded_for_header_verdicts():
    data = {"use-forwarded-headers": "true", "forwarded-for-header": "X-Client-IP"}
    assert verdict(data, "forwarded-for-header") == (Verdict.HONOURED, "")
    bad = {"use-forwarded-headers": "true", "forwarded-for-header": "X Client;"}
    found, note = verdict(bad, "forwarded-for-header")
    assert found is Verdict.NOT_HONOURED and "not a header name" in note
    assert CONFIG  # (the ConfigMap the resolver reads: --ingress-nginx-configmap)


def test_route_validation_keeps_the_tls_policy_at_tls_1_2_and_above():
    # ApplyRoute and every source go through validate_route: the same checks as
    # the proxy's context builder (waygate.core.tls.policy_problem).
    [secure] = [r for r in tls_routes({}) if r.listener_port == 443]
    assert secure.tls is not None

    def with_tls(**fields: object) -> Route:
        assert secure.tls is not None
        tls = dataclasses.replace(secure.tls, **fields)
        return dataclasses.replace(secure, name="app", tls=tls, filters=None)

    assert validate_route(with_tls(protocols=("TLSv1.3",), ciphers=AES)).tls.protocols == (  # type: ignore[union-attr]
        "TLSv1.3",
    )
    for fields, where in (
        ({"protocols": ("TLSv1.1", "TLSv1.3")}, "tls.protocols"),
        ({"protocols": ("TLSv1.2",)}, "tls.protocols"),
        ({"ciphers": "HIGH;ssl_protocols SSLv3"}, "tls.ciphers"),
        ({"ciphers": "ALL:@SECLEVEL=0"}, "tls.ciphers"),
        (
            {
                "termination": TLSTermination.PASSTHROUGH,
                "ciphers": AES,
                "certificate": "",
                "key": "",
                "hsts": None,
            },
            "tls.ciphers",
        ),
    ):
        with pytest.raises(InvalidArgument, match=where):
            validate_route(with_tls(**fields))


AES = "ECDHE-ECDSA-AES256-GCM-SHA384"


def test_the_ssl_ciphers_annotation_is_the_hosts_list_over_the_configmaps():
    # nginx.tmpl's server-level `ssl_ciphers {{ $server.SSLCiphers }}`.
    data = {"ssl-ciphers": "ECDHE-ECDSA-AES128-GCM-SHA256"}
    secure = [r for r in tls_routes(data, {P + "ssl-ciphers": AES}) if r.listener_port == 443]
    assert secure[0].tls is not None and secure[0].tls.ciphers == AES
    [finding] = [f for f in secure[0].ingress_verdicts if f.startswith("ssl-ciphers")]
    assert "honoured-with-difference" in finding and "host-wide" in finding
    refused = [
        r for r in tls_routes(data, {P + "ssl-ciphers": "NOT-A-CIPHER"}) if r.listener_port == 443
    ]
    assert refused[0].tls is not None and refused[0].tls.ciphers == data["ssl-ciphers"]
    assert refused[0].ingress_refusal is None
