"""ingress-nginx's auth-tls-* annotations -> a route's RouteAccess.client_certificate
(waygate.resolver.ingress_nginx.access): ingress-nginx's defaults and parsing
(internal/ingress/annotations/authtls/main.go), the host-wide rule (the server
block's ssl_client_certificate), and what refuses the Ingress (fail closed). The
proxy's side: tests/integration/proxy/test_tls_client_cert_nginx.py."""

from __future__ import annotations

import base64
from datetime import UTC, datetime
from typing import Any

import pytest

from tests.support.pki import LocalCA
from tests.unit.resolver.test_ingress_nginx import P, by_ingress, ingress, refusal, served
from tests.unit.resolver.test_ingress_nginx_access import routes, secret
from waygate.resolver.model import ClientCertificate, Route

CA = LocalCA(name="Client CA")
SERVER = LocalCA(name="Server CA")


def tls_secret(name: str = "cert", host: str = "app.example.com") -> dict[str, Any]:
    cert, key = SERVER.issue(dns=[host])
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "kubernetes.io/tls",
        "metadata": {"name": name, "namespace": "default"},
        "data": {
            "tls.crt": base64.b64encode(cert).decode(),
            "tls.key": base64.b64encode(key).decode(),
        },
    }


def ca_secret(name: str = "ca", **extra: str) -> dict[str, Any]:
    return secret(name, {"ca.crt": CA.pem.decode(), **extra})


def rules_of(found: list[Route], name: str) -> dict[int, ClientCertificate | None]:
    """By listener port: the client-certificate rules of the Ingress's routes."""
    mine = by_ingress(found, name)
    assert mine and all(r.ingress_refusal is None for r in mine), [r.ingress_refusal for r in mine]
    return {
        r.listener_port: r.access.client_certificate if r.access is not None else None for r in mine
    }


def test_defaults_as_ingress_nginx():
    # authtls/main.go: verify-client "on", depth 1, no error page, no certificate to
    # the backend, no CN match; the Secret's ca.crt is the bundle.
    found = routes(
        tls_secret(), ca_secret(), ingress("mtls", {P + "auth-tls-secret": "default/ca"}, tls=True)
    )
    by_port = rules_of(found, "mtls")
    expected = ClientCertificate(ca_certificates=CA.pem.decode())
    assert by_port == {80: expected, 443: expected}
    [route] = [r for r in by_ingress(found, "mtls") if r.listener_port == 443]
    assert not any("auth-tls" in line for line in route.ingress_verdicts)


def test_every_option_and_a_revocation_list():
    crl = CA.revocation_list().decode()
    found = routes(
        tls_secret(),
        ca_secret(**{"ca.crl": crl}),
        ingress(
            "mtls",
            {
                P + "auth-tls-secret": "ca",  # the Ingress's namespace
                P + "auth-tls-verify-client": "optional_no_ca",
                P + "auth-tls-verify-depth": "0",  # 0 is the default, 1
                P + "auth-tls-error-page": "https://errors.example.com/cert",
                P + "auth-tls-pass-certificate-to-upstream": "true",
                P + "auth-tls-match-cn": "CN=(alice|bob)",
            },
            tls=True,
        ),
    )
    assert rules_of(found, "mtls")[443] == ClientCertificate(
        ca_certificates=CA.pem.decode(),
        revocation_lists=crl if crl.endswith("\n") else crl + "\n",
        verify="optional_no_ca",
        depth=1,
        error_page="https://errors.example.com/cert",
        pass_certificate=True,
        match_subject="CN=(alice|bob)",
    )


@pytest.mark.parametrize(
    ("annotations", "secrets", "why"),
    [
        ({P + "auth-tls-secret": "default/missing"}, [], "Secret default/missing not found"),
        ({P + "auth-tls-secret": "other/ca"}, [], "another namespace"),
        ({P + "auth-tls-secret": "ca"}, [secret("ca", {"tls.crt": "x"})], "no ca.crt"),
        (
            {P + "auth-tls-secret": "ca"},
            [secret("ca", {"ca.crt": "-----BEGIN CERTIFICATE-----\nnope\n"})],
            "no ca.crt",
        ),
        (
            {P + "auth-tls-secret": "ca"},
            [ca_secret(**{"ca.crl": "not a CRL"})],
            "ca.crl is not PEM revocation lists",
        ),
        (
            {P + "auth-tls-secret": "ca", P + "auth-tls-error-page": "/error"},
            [ca_secret()],
            "internal redirect",
        ),
        (
            {P + "auth-tls-secret": "ca", P + "auth-tls-verify-depth": "-1"},
            [ca_secret()],
            "between 1 and 100",
        ),
        (
            {P + "auth-tls-secret": "ca", P + "auth-tls-match-cn": "CN=a++"},
            [ca_secret()],
            "auth-tls-match-cn 'CN=a++'",
        ),
    ],
)
def test_what_cannot_be_honoured_refuses_the_ingress_alone(annotations, secrets, why):
    found = routes(
        tls_secret(),
        *secrets,
        ingress("mtls", annotations, tls=True),
        ingress("plain", host="plain.example.com"),
    )
    reason, message = refusal(found, "mtls")
    assert reason == "UnsupportedAnnotation" and why in message, message
    assert "auth-tls" in message
    assert served(found, "plain")


def test_a_host_without_a_certificate_is_refused():
    # No spec.tls: no HTTPS route to ask for a certificate on, and the plain HTTP one
    # would reach the backend unchecked. With verify-client off nothing is asked.
    found = routes(ca_secret(), ingress("bare", {P + "auth-tls-secret": "ca"}))
    _, message = refusal(found, "bare")
    assert "no TLS certificate" in message
    found = routes(
        ca_secret(),
        ingress("off", {P + "auth-tls-secret": "ca", P + "auth-tls-verify-client": "off"}),
    )
    assert rules_of(found, "off")[80] == ClientCertificate(CA.pem.decode(), verify="off")


def test_the_hosts_oldest_ingress_gives_every_path_its_rules():
    # ssl_client_certificate is the server block's: another Ingress's path on the host
    # is verified too (an unverified path on a verified host would be a way round).
    first = ingress("first", {P + "auth-tls-secret": "ca"}, tls=True)
    first["metadata"]["creationTimestamp"] = "2024-01-01T00:00:00Z"
    later = ingress(
        "later",
        {P + "auth-tls-secret": "ca", P + "auth-tls-verify-client": "optional"},
        tls=True,
        path="/later",
    )
    later["metadata"]["creationTimestamp"] = "2025-01-01T00:00:00Z"
    open_path = ingress("open", tls=True, path="/open")
    other_host = ingress("elsewhere", tls=True, host="other.example.com")
    found = routes(
        tls_secret(),
        ca_secret(),
        first,
        later,
        open_path,
        other_host,
    )
    expected = ClientCertificate(ca_certificates=CA.pem.decode())
    for name in ("first", "later", "open"):
        assert set(rules_of(found, name).values()) == {expected}, name
    assert set(rules_of(found, "elsewhere").values()) == {None}
    assert datetime(2024, 1, 1, tzinfo=UTC) == by_ingress(found, "first")[0].created


def test_a_refused_ingress_makes_its_host_refuse_every_request():
    # controller.go: an Ingress's AuthTLSError becomes the server's (`return 403` in
    # its server block): the host's other paths are never served unchecked.
    broken = ingress("broken", {P + "auth-tls-secret": "missing"}, tls=True)
    sibling = ingress("sibling", tls=True, path="/other")
    elsewhere = ingress("elsewhere", tls=True, host="other.example.com")
    found = routes(tls_secret(), broken, sibling, elsewhere)
    assert "Secret default/missing not found" in refusal(found, "broken")[1]
    by_port = rules_of(found, "sibling")
    assert set(by_port) == {80, 443}
    for rules in by_port.values():
        assert rules is not None and rules.refusal == (
            "host app.example.com: the client-certificate rules of Ingress default/broken "
            "are refused"
        )
    assert set(rules_of(found, "elsewhere").values()) == {None}
